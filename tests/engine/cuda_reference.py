"""The CPU float32 engine's greedy tokens and per-step top-2 logprob gaps, the reference the CUDA
backend's runs are matched against under the tie rule (tests/conftest.py: TIE_GAP)."""

from __future__ import annotations

from kvflow import LLM, SamplingParams


def greedy_reference(model: str, prompts: list[list[int]], max_tokens: int, **engine_args
                     ) -> list[tuple[list[int], list[float]]]:
    """(tokens, gaps) per prompt. A logprob gap is the logit gap: log-softmax only shifts a row."""
    llm = LLM(model, dtype="float32", device="cpu", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    refs = []
    for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        gaps = []
        for entry in out.outputs[0].logprobs:
            top = sorted((lp.logprob for lp in entry.values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        refs.append((out.outputs[0].token_ids, gaps))
    return refs
