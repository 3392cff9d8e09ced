"""The engine's order of stop checks, one appended token at a time (engine/stop_checker.py)."""

from __future__ import annotations

import pytest

from kvflow.engine.request_state import RequestState
from kvflow.engine.sequence import Sequence, SequenceStatus
from kvflow.engine.stop_checker import check_stop
from kvflow.sampling.detokenizer import CompletionText
from kvflow.sampling.params import SamplingParams

EOS = 0
MAX_MODEL_LEN = 64


class CharTokenizer:
    """Token i is the character chr(ord('a') + i - 1); 0 is EOS (special, decodes to "")."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        return "".join("" if t == EOS and skip_special_tokens else "<eos>" if t == EOS else chr(96 + t) for t in ids)


def run(tokens: list[int], prompt_len: int = 2, **params: object) -> tuple[SequenceStatus | None, int, RequestState]:
    """Append `tokens` until one stops the sequence: (status, tokens appended, request)."""
    p = SamplingParams(temperature=0, **params)
    seq = Sequence("r", list(range(1, prompt_len + 1)), p)
    req = RequestState(seq, CompletionText(CharTokenizer(), seq.prompt_token_ids, p.skip_special_tokens, p.stop,
                                           p.include_stop_str_in_output))
    for n, tid in enumerate(tokens, start=1):
        seq.output_token_ids.append(tid)
        status = check_stop(req, tid, [EOS], MAX_MODEL_LEN)
        if status is not None:
            return status, n, req
    return None, len(tokens), req


def test_eos_stops_and_adds_no_text():
    status, n, req = run([1, 2, EOS, 3])
    assert (status, n, req.output.text) == (SequenceStatus.FINISHED_STOPPED, 3, "ab")
    assert req.seq.stop_reason is None  # EOS is no stop token: vLLM reports stop_reason None for it


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings():
    status, n, _ = run([EOS, 2, EOS], min_tokens=3)
    assert (status, n) == (SequenceStatus.FINISHED_STOPPED, 3)
    assert run([5, 5, 6], min_tokens=3, stop_token_ids=[5])[:2] == (None, 3)
    status, n, req = run([2, 3, 2, 3], min_tokens=3, stop=["bc"])
    assert (status, n, req.seq.stop_reason, req.output.text) == (SequenceStatus.FINISHED_STOPPED, 4, "bc", "bc")


def test_ignore_eos_runs_on_and_a_stop_token_names_itself():
    assert run([EOS, 1], ignore_eos=True, max_tokens=5)[:2] == (None, 2)
    status, n, req = run([1, 7, 2], stop_token_ids=[7])
    assert (status, n, req.seq.stop_reason, req.output.text) == (SequenceStatus.FINISHED_STOPPED, 2, 7, "a")
    kept = run([1, 7], stop_token_ids=[7], include_stop_str_in_output=True)[2]
    assert kept.output.text == "ag"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_cuts_the_text(include):
    status, n, req = run([1, 2, 3, 4], stop=["bc"], include_stop_str_in_output=include)
    assert (status, n, req.seq.stop_reason) == (SequenceStatus.FINISHED_STOPPED, 3, "bc")
    assert req.output.text == ("abc" if include else "a")


def test_eos_wins_over_max_tokens_and_a_stop_string_over_max_tokens():
    assert run([1, EOS], max_tokens=2)[0] == SequenceStatus.FINISHED_STOPPED
    status, _, req = run([1, 2], max_tokens=2, stop=["b"])
    assert (status, req.seq.stop_reason) == (SequenceStatus.FINISHED_STOPPED, "b")
    assert run([1, 2], max_tokens=2)[:2] == (SequenceStatus.FINISHED_LENGTH, 2)


def test_max_model_len_ends_with_length():
    status, n, _ = run([1] * 10, prompt_len=MAX_MODEL_LEN - 4, max_tokens=None)
    assert (status, n) == (SequenceStatus.FINISHED_LENGTH, 4)
