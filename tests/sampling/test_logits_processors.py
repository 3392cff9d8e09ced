"""A request's own logit edits: logit_bias, allowed_token_ids, bad_words (and min_tokens beside them)."""

from __future__ import annotations

import pytest
import torch

from kvflow.sampling.logits_processors import LogitsEdits, bad_words_token_ids
from kvflow.sampling.params import SamplingParams
from kvflow.sampling.sampler import Sampler, SamplingMetadata, generator_for

EOS = 2
V = 12


def _meta(params, outputs=None, bad_words=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[1]] * n, outputs or [[] for _ in range(n)],
                                  [generator_for(p) for p in params], [EOS], V, bad_words_token_ids=bad_words)


def _logits(n: int) -> torch.Tensor:
    """Row r prefers token 3 most, then 4, 5, ...: the argmax of every row is 3."""
    base = -torch.arange(V, dtype=torch.float32).roll(3)
    base[3] = 10.0
    return base.repeat(n, 1)


def test_plain_requests_build_no_edits():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=0)]
    assert LogitsEdits.build(params, [[], []], [EOS], V) is None
    assert _meta(params).all_greedy


def test_logit_bias_moves_only_its_own_rows_argmax():
    params = [SamplingParams(temperature=0, logit_bias={7: 100}), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={3: -100.0, 11: 0.5})]
    meta = _meta(params)
    assert not meta.all_greedy
    assert Sampler()(_logits(3), meta).token_ids == [7, 3, 4]


def test_logit_bias_is_added_before_logprobs_and_penalties():
    params = [SamplingParams(temperature=0, logprobs=1, logit_bias={4: 2.5})]
    logits = _logits(1)
    out = Sampler()(logits, _meta(params))
    want = torch.log_softmax(logits[0] + torch.nn.functional.one_hot(torch.tensor(4), V) * 2.5, dim=-1)
    assert out.logprobs[0][3].logprob == pytest.approx(float(want[3]))
    assert logits[0, 4] == -1.0, "the step's logits must not be edited in place"


def test_allowed_token_ids_confine_greedy_and_random_rows():
    allowed = [5, 9, 11]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=5.0, seed=0, allowed_token_ids=allowed),
              SamplingParams(temperature=0)]
    sampler = Sampler()
    seen = set()
    meta = _meta(params)
    for _ in range(200):
        tokens = sampler(_logits(3), meta).token_ids
        assert tokens[0] == 5 and tokens[2] == 3
        seen.add(tokens[1])
    assert seen == set(allowed), "a hot random row should reach every allowed token and nothing else"


def test_allowed_token_ids_past_the_vocab_are_refused_by_the_engine_check():
    SamplingParams(allowed_token_ids=[0, V - 1]).check_token_ids(V)
    with pytest.raises(ValueError, match=rf"^allowed_token_ids token ids must be in \[0, {V}\).*\[{V}\]"):
        SamplingParams(allowed_token_ids=[1, V]).check_token_ids(V)
    with pytest.raises(ValueError, match=r"^logit_bias token ids"):
        SamplingParams(logit_bias={V + 3: 1}).check_token_ids(V)


@pytest.mark.parametrize(("output", "banned"), [
    ([], {6}),  # the one-token word always; the two-token word's tail not yet
    ([1, 8], {6, 9}),  # ends with 8: the word (8, 9) would complete now
    ([8, 1], {6}),
    ([4, 5], {6, 10}),  # (4, 5, 10): its head is the output's tail
    ([5], {6}),
])
def test_bad_words_ban_a_words_last_token_after_its_others(output, banned):
    words = [[6], [8, 9], [4, 5, 10]]
    params = [SamplingParams(temperature=0, bad_words=["x"])]
    edits = LogitsEdits.build(params, [output], [EOS], V, [words])
    rows, cols = edits.banned
    assert rows.tolist() == [0] * len(banned) and set(cols.tolist()) == banned
    edited = edits.apply(torch.zeros(1, V))
    assert {i for i in range(V) if edited[0, i] == float("-inf")} == banned


def test_min_tokens_and_bad_words_ban_together():
    params = [SamplingParams(temperature=0, min_tokens=2, max_tokens=4, bad_words=["x"])]
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 6] = 5.0, 4.0
    out = Sampler()(logits, _meta(params, outputs=[[1]], bad_words=[[[6]]]))
    assert out.token_ids[0] not in (EOS, 6)


class _WordTokenizer:
    """Spells a word as one token at the start of the text and as two after a space."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [100 + len(text)] if not text.startswith(" ") else [99, 100 + len(text) - 1]


def test_bad_words_are_spelled_both_at_the_start_and_after_a_space():
    assert bad_words_token_ids(_WordTokenizer(), ["cat", "  dog"]) == [[103], [99, 103]]
    assert bad_words_token_ids(_WordTokenizer(), None) == []
    with pytest.raises(ValueError, match="^bad_words: this model has no tokenizer"):
        bad_words_token_ids(None, ["cat"])


def test_allowed_token_ids_that_leave_no_token_are_refused():
    from kvflow.structured_output.params import StructuredOutputsParams

    with pytest.raises(ValueError, match="^allowed_token_ids cannot be combined with structured_outputs"):
        SamplingParams(allowed_token_ids=[5], structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(ValueError, match="^allowed_token_ids are all stop or EOS tokens"):
        SamplingParams(allowed_token_ids=[EOS, 7], stop_token_ids=[7], min_tokens=2).check_token_ids(V, [EOS])
    SamplingParams(allowed_token_ids=[EOS, 7], stop_token_ids=[7], min_tokens=2, ignore_eos=True).check_token_ids(V, [EOS])
    SamplingParams(allowed_token_ids=[EOS], min_tokens=0).check_token_ids(V, [EOS])
