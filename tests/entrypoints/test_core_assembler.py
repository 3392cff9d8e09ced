"""The split server's API side: token ids from the core in, the in-process engine's outputs out.

The core's token deltas are built here from a real greedy run (no stop strings, as the core runs
it), cut into steps of several tokens (as speculative decoding delivers them), sent through
msgpack, and assembled; text, token ids, logprobs, finish and stop reasons must equal what the
in-process engine gives for the same request with its stop strings.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvflow.entrypoints.core import wire
from kvflow.entrypoints.core.assembler import OutputAssembler
from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvflow.sampling.params import SamplingParams

PROMPT = "The capital of France is"


def core_steps(rid: str, runs: list[CompletionOutput], step: int, reasons: list[str | None]) -> list[list]:
    """Wire entries for completions `runs` delivered `step` tokens at a time, each ending with its reason."""
    deltas, entries = wire.OutputDeltas(), []
    longest = max(len(r.token_ids) for r in runs)
    for end in range(step, longest + step, step):
        comps = []
        for i, r in enumerate(runs):
            n = min(end, len(r.token_ids))
            done = n == len(r.token_ids)
            comps.append(CompletionOutput(i, "", r.token_ids[:n], None, None if r.logprobs is None else r.logprobs[:n],
                                          reasons[i] if done else None))
        finished = all(c.finish_reason is not None for c in comps)
        out = RequestOutput(rid, PROMPT, [1], comps, finished, RequestMetrics(0.0))
        entries.append(wire.unpack(wire.pack(tuple(deltas.encode(out)))))
    return entries


def assemble(tokenizer, prompt_ids, params, entries):
    assembler = OutputAssembler(tokenizer)
    assembler.start("r", PROMPT, prompt_ids, params)
    results = []
    for entry in entries:
        got = assembler.decode(entry)
        if got is None:  # finished here already: later entries are the core's overrun
            break
        results.append(got)
    return results


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_like_the_engine(offline_llm, include):
    tok = offline_llm.engine.tokenizer
    free = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, logprobs=2), use_tqdm=False)[0]
    run = free.outputs[0]
    stop = run.text[len(run.text) // 2:][:3]  # a stop string in the middle, split over tokens or not
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, stop=[stop, "never seen"],
                            include_stop_str_in_output=include)
    ref = offline_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop" and ref.stop_reason == stop
    for step in (1, 3):
        results = assemble(tok, free.prompt_token_ids, params, core_steps("r", [run], step, ["length"]))
        last = results[-1]
        got = last.output.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            ref.text, ref.token_ids, ref.finish_reason, ref.stop_reason)
        assert got.logprobs == ref.logprobs and got.cumulative_logprob == ref.cumulative_logprob
        assert last.output.finished and last.abort_request  # the core still runs it: abort it there
        assert sum(len(r.output.new_token_ids) for r in results) == len(ref.token_ids)


def test_core_finish_reasons_win_on_their_token(offline_llm):
    """EOS / stop token on the token that also completes a stop string: the engine checks those first."""
    tok = offline_llm.engine.tokenizer
    free = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    run = free.outputs[0]
    tail = tok.decode(run.token_ids[-1:])
    assert tail.strip()
    params = SamplingParams(temperature=0, max_tokens=12, stop=[tail.strip()])
    eos = assemble(tok, free.prompt_token_ids, params, core_steps("r", [run], 4, ["stop"]))[-1]
    # The core's stop token adds no text (vLLM's rule), so the stop string never completes.
    assert run.text.endswith(tail)
    assert eos.output.outputs[0].text == run.text[:-len(tail)] and eos.output.outputs[0].stop_reason is None
    assert not eos.abort_request  # the core finished it itself
    kept = dataclasses.replace(params, include_stop_str_in_output=True)
    assert assemble(tok, free.prompt_token_ids, kept, core_steps("r", [run], 4, ["stop"]))[-1].output.outputs[0].text \
        == run.text
    # A "length" finish on that token yields to the stop string (checked before max_tokens).
    length = assemble(tok, free.prompt_token_ids, params, core_steps("r", [run], 4, ["length"]))[-1]
    assert length.output.outputs[0].finish_reason == "stop" and not length.abort_request
    assert length.output.outputs[0].text == run.text[:run.text.rindex(tail.strip())]


def test_n_samples_stop_one_at_a_time(offline_llm):
    tok = offline_llm.engine.tokenizer
    runs = [offline_llm.generate([p], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
            for p in (PROMPT, PROMPT + " a")]
    stop = runs[1].text[3:6]
    assert stop not in runs[0].text
    params = SamplingParams(n=2, temperature=0, max_tokens=10, stop=[stop])
    ids = tok(PROMPT).input_ids
    results = assemble(tok, ids, params, core_steps("r", [dataclasses.replace(r, logprobs=None) for r in runs],
                                                    2, ["length", "length"]))
    sample_aborts = [i for r in results for i in r.abort_samples]
    assert sample_aborts == [1]  # sample 1 stopped by its stop string while sample 0 went on
    final = results[-1]
    assert final.output.finished and not final.abort_request
    assert [c.finish_reason for c in final.output.outputs] == ["length", "stop"]
    assert final.output.new_token_ids == [] and final.output.new_text == ""  # per-sample notions with n > 1
