"""`kvflow bench embed`: embedding throughput (W-embed), optionally against transformers.

W-embed: 64 prompts, lengths `default_rng(4).integers(16, 257, 64)`, then request by
request `rng.integers(1000, 40000, size=len)` as token ids (4 is W-embed's seed; the warm-up
draws from another seed, so no timed prompt was ever seen and the prefix cache serves none).
All are submitted at once; wall time runs from submission to the last vector.

The baseline (`--baseline hf`) is what a transformers user writes: the base model
(`AutoModel`, no LM head), prompts sorted by length as sentence-transformers sorts them,
static batches right-padded with an attention mask, pooled as the engine's `--pooler-config`
says (by default the last real token's hidden state, L2-normalised). Both engines' vectors are
compared (cosine), so a fast wrong answer shows.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from typing import TYPE_CHECKING

import numpy as np

from kvflow.bench.datasets import WORKLOAD_TOKEN_RANGE, fit_token_range
from kvflow.bench.machine import machine_info
from kvflow.bench.results import numerics_label, peak_rss_mb
from kvflow.pooling.params import PoolerConfig

if TYPE_CHECKING:
    import torch


@dataclass
class EmbedResult:
    engine: str
    num_prompts: int
    prompt_tokens: int
    wall_s: float
    peak_rss_mb: float

    @property
    def prompts_per_s(self) -> float:
        return self.num_prompts / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.wall_s

    def summary(self) -> str:
        return (f"{self.engine}: {self.num_prompts} prompts, {self.prompt_tokens} tokens in {self.wall_s:.2f} s: "
                f"{self.prompts_per_s:.1f} prompts/s, {self.tokens_per_s:.0f} tokens/s, "
                f"peak RSS {self.peak_rss_mb:.0f} MB")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload (defaults: W-embed)")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--min-len", type=int, default=16)
    g.add_argument("--max-len", type=int, default=256)
    g.add_argument("--dataset-seed", type=int, default=4)
    g.add_argument("--warmup-seed", type=int, default=104)
    g.add_argument("--baseline", choices=["hf"], default=None, help="also run transformers on the same prompts")
    g.add_argument("--baseline-batch-size", type=int, default=16)
    g.add_argument("--text", action="store_true",
                   help="decode each draw to text and embed the text (what a text-only peer is given: "
                        "scripts/peer_baselines/run_openvino_embed.py); tokens are then counted after tokenizing")
    g.add_argument("--save-vectors", metavar="NPY", help="save kvflow's vectors (float32, draw order) here")
    g.add_argument("--output", help="write the results, ratios and vector agreement as JSON here")


def embed_prompts(n: int, min_len: int, max_len: int, seed: int, token_range: tuple[int, int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_len, max_len + 1, n)
    return [rng.integers(*token_range, size=int(k)).tolist() for k in lens]


def run_kvflow(engine, prompts: list[list[int]] | list[str]) -> tuple[list[torch.Tensor], float, int]:
    """Every prompt (token ids, or text the engine tokenizes) submitted at once, stepped until the
    last vector; (vectors in order, wall seconds, prompt tokens)."""
    from kvflow.pooling.params import PoolingParams

    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"e{i}", p if isinstance(p, str) else {"prompt_token_ids": p}, PoolingParams())
    vectors: dict[str, torch.Tensor] = {}
    cached = tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            vectors[out.request_id] = out.outputs.data
            cached += out.num_cached_tokens
            tokens += len(out.prompt_token_ids)
    wall = time.perf_counter() - start
    if cached:  # a fresh draw shares nothing; a hit would mean a timed prompt was seen before
        raise RuntimeError(f"the prefix cache served {cached} prompt tokens of a fresh draw")
    return [vectors[f"e{i}"] for i in range(len(prompts))], wall, tokens


def run_hf(model: torch.nn.Module, prompts: list[list[int]], batch_size: int,
           pooler: PoolerConfig) -> tuple[list[torch.Tensor], float]:
    """transformers, pooled as `pooler` says (the engine's --pooler-config), so the vectors compare."""
    import torch

    base = model.model  # the decoder stack without the LM head: what AutoModel loads
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    vectors: list[torch.Tensor | None] = [None] * len(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, len(order), batch_size):
            rows = order[lo:lo + batch_size]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, :len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, :len(prompts[i])] = 1
            hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
            for r, i in enumerate(rows):
                n = len(prompts[i])
                vector = hidden[r, n - 1].float() if pooler.pooling_type == "LAST" else hidden[r, :n].double().mean(0)
                vectors[i] = torch.nn.functional.normalize(vector.float(), dim=-1) if pooler.normalize else vector.float()
    return vectors, time.perf_counter() - start  # type: ignore[return-value]


def run(config, args: argparse.Namespace) -> dict:
    import torch

    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.loader import load_model_config, resolve_model_path

    path = resolve_model_path(config.model)
    token_range = fit_token_range(WORKLOAD_TOKEN_RANGE, load_model_config(path).vocab_size)

    def draw(seed: int) -> list[list[int]]:
        return embed_prompts(args.num_prompts, args.min_len, args.max_len, seed, token_range)

    timed, warm = draw(args.dataset_seed), draw(args.warmup_seed)
    engine = LLMEngine(config)
    if args.text:
        if args.baseline:
            raise ValueError("--text: the transformers baseline takes the token ids; leave --baseline out")
        timed, warm = ([engine.tokenizer.decode(p) for p in d] for d in (timed, warm))
    run_kvflow(engine, warm[:32])
    ours, wall, tokens = run_kvflow(engine, timed)
    if args.save_vectors:
        np.save(args.save_vectors, torch.stack(ours).numpy())
    results = {"kvflow": EmbedResult(f"kvflow ({numerics_label(engine)})", len(timed), tokens, wall, peak_rss_mb())}
    print(machine_info().describe())
    print(results["kvflow"].summary())
    report: dict = {"machine": asdict(machine_info()), "workload": vars(args).copy()}
    report["workload"].pop("func", None)
    if args.baseline == "hf":
        from kvflow.bench.hf_baseline import load_hf_model

        model = load_hf_model(path, engine.dtype, config.load_format)
        del engine
        run_hf(model, warm[:32], args.baseline_batch_size, config.pooler_config)
        theirs, hf_wall = run_hf(model, timed, args.baseline_batch_size, config.pooler_config)
        results["hf"] = EmbedResult(f"transformers ({engine_dtype_name(model)}, batches of "
                                    f"{args.baseline_batch_size}, sorted by length)", len(timed), tokens, hf_wall,
                                    peak_rss_mb())
        print(results["hf"].summary())
        cos = torch.stack([torch.nn.functional.cosine_similarity(a, b, dim=0) for a, b in zip(ours, theirs)])
        report["agreement"] = {"min_cosine": float(cos.min()), "mean_cosine": float(cos.mean())}
        report["kvflow_over_hf"] = results["hf"].wall_s / results["kvflow"].wall_s
        print(f"kvflow / transformers: {report['kvflow_over_hf']:.2f}x the prompts per second; "
              f"cosine of the vectors: min {cos.min():.5f}, mean {cos.mean():.5f}")
    report["results"] = {k: {**asdict(v), "prompts_per_s": v.prompts_per_s, "tokens_per_s": v.tokens_per_s}
                         for k, v in results.items()}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return report


def engine_dtype_name(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")
