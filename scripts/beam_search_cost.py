"""What beam search costs next to parallel sampling of the same width.

One fresh 128-token prompt per run (random ids, so the prefix cache serves only what a search's
own beams share), 32 new tokens, EOS ignored; the default model in float32. Prints the wall time
and the tokens the model computed for `LLM.beam_search` and for `SamplingParams(n=width)`.

    .venv/bin/python scripts/beam_search_cost.py [--widths 1,4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvflow import LLM, BeamSearchParams, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    llm = LLM(dtype="float32", kv_cache_memory=512 << 20, max_model_len=2048)
    engine, rng = llm.engine, np.random.default_rng(7)

    def prompt() -> dict:
        return {"prompt_token_ids": rng.integers(1000, 40000, size=args.prompt_len).tolist()}

    def timed(fn) -> tuple[float, int]:
        before, start = engine.get_stats().computed_tokens, time.perf_counter()
        fn()
        return time.perf_counter() - start, engine.get_stats().computed_tokens - before

    llm.beam_search([prompt()], BeamSearchParams(beam_width=2, max_tokens=4))  # warm-up
    for width in (int(w) for w in args.widths.split(",")):
        for _ in range(args.repeat):
            beam_s, beam_tokens = timed(lambda: llm.beam_search(
                [prompt()], BeamSearchParams(beam_width=width, max_tokens=args.max_tokens, ignore_eos=True)))
            sample_s, sample_tokens = timed(lambda: llm.generate(
                [prompt()], SamplingParams(n=width, temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True),
                use_tqdm=False))
            print(f"width {width}: beam search {beam_s:.2f} s ({beam_tokens} tokens computed), "
                  f"n={width} sampling {sample_s:.2f} s ({sample_tokens}), ratio {beam_s / sample_s:.2f}")


if __name__ == "__main__":
    main()
