"""`kvflow bench throughput --baseline hf`: the same requests through transformers' `generate()`.

A speed-up is only believable against a baseline run on the same machine, in the same
process, with the same request list, dtype and thread count. transformers has no
continuous batching, so it gets what a careful user would do by hand: static batches in
request order, left padding, greedy decoding. Each batch generates exactly its longest
requested output (`min_new_tokens == max_new_tokens`, which masks EOS like `ignore_eos`);
only each request's own requested tokens count as useful output, so the padding and the
tokens generated past a shorter request's length are the baseline's honest cost.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass

import torch

from kvflow.bench.datasets import BenchRequest
from kvflow.bench.results import ThroughputResult, peak_rss_mb


@dataclass
class BaselineSetup:
    """How the baseline was run, printed next to its numbers and stored in the JSON."""

    engine: str
    batch_size: int
    dtype: str
    num_threads: int
    padding: str = "left"
    decoding: str = ("greedy; each batch runs to its longest output_len with EOS masked "
                     "(min_new_tokens = max_new_tokens)")
    warmup: str = "one batch of the warm-up draw, outputs capped at 16 tokens"

    def describe(self) -> str:
        return (f"baseline: {self.engine}, static batches of {self.batch_size} in request order, {self.padding} "
                f"padding, {self.dtype}, {self.num_threads} torch threads, {self.decoding}; warm-up: {self.warmup}")


def require_accelerate() -> None:
    """transformers needs accelerate to load a GGUF checkpoint; say so instead of a deep traceback."""
    if importlib.util.find_spec("accelerate") is None:
        raise ValueError("--baseline hf on a .gguf model needs the accelerate package: pip install accelerate")


def _dtype_kwargs(dtype: torch.dtype) -> dict:
    """transformers 5 renamed `torch_dtype` to `dtype` (and warns on the old name)."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def load_hf_model(model_path: str, dtype: torch.dtype, load_format: str = "auto") -> torch.nn.Module:
    """The model as transformers loads it: a .gguf via its GGUF reader, a HF directory, or random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model_path
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        path = os.path.dirname(path) or "."
    extra: dict = {}
    if os.path.isfile(path) and path.endswith(".gguf"):
        require_accelerate()
        path, extra["gguf_file"] = os.path.split(path)
    if load_format == "dummy":
        config = AutoConfig.from_pretrained(path, local_files_only=True, **extra)
        model = AutoModelForCausalLM.from_config(config, **_dtype_kwargs(dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **_dtype_kwargs(dtype), **extra)
    return model.eval()


def static_batches(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    if batch_size < 1:
        raise ValueError(f"--baseline-batch-size must be at least 1, got {batch_size}")
    return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]


def pad_left(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every prompt's last token in the last column, where generation continues."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def pad_token_id(model: torch.nn.Module) -> int:
    for source in (getattr(model, "generation_config", None), model.config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    return 0


def _step_clock():
    """A pass-through logits processor that notes when each decoding step's logits arrive.

    Its first call comes right after the batch's prefill forward pass, so it gives each
    request's time to first token without instrumenting transformers.
    """
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    return StepClock()


@torch.inference_mode()
def generate_batch(model: torch.nn.Module, batch: list[BenchRequest], pad_id: int, max_new: int | None = None):
    """Run one static batch; returns (the step clock, tokens pushed through the model incl. padding)."""
    from transformers import LogitsProcessorList

    n = max_new or max(r.output_len for r in batch)
    ids, mask = pad_left([r.prompt_token_ids for r in batch], pad_id)
    clock = _step_clock()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
                         pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
    produced = out.shape[1] - ids.shape[1]
    if produced != n:
        raise RuntimeError(f"transformers generated {produced} tokens, expected exactly {n}")
    return clock, ids.numel() + len(batch) * (n - 1)


def run_hf(model: torch.nn.Module, requests: list[BenchRequest], batch_size: int, dtype: torch.dtype,
           use_tqdm: bool = False, label: str = "hf-transformers") -> ThroughputResult:
    """Time the whole request list (all 'submitted' at the start) in static batches."""
    batches = static_batches(requests, batch_size)
    pad_id = pad_token_id(model)
    bar = None
    if use_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(batches), desc="hf batches", dynamic_ncols=True)
    ttfts, computed = [], 0
    start = time.perf_counter()
    for batch in batches:
        clock, tokens = generate_batch(model, batch, pad_id)
        computed += tokens
        ttfts += [clock.times[0] - start] * len(batch)
        if bar is not None:
            bar.update(1)
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(r.output_len for r in requests)
    return ThroughputResult(
        engine=label, dtype=str(dtype).removeprefix("torch."), num_requests=len(requests), prompt_tokens=prompt,
        output_tokens=output, wall_s=wall, requests_per_s=len(requests) / wall,
        total_tokens_per_s=(prompt + output) / wall, output_tokens_per_s=output / wall, peak_rss_mb=peak_rss_mb(),
        computed_tokens=computed, mean_ttft_s=sum(ttfts) / max(len(ttfts), 1),
    )


def run_baseline(model_path: str, load_format: str, dtype: torch.dtype, requests: list[BenchRequest],
                 warmup: list[BenchRequest] | None, batch_size: int,
                 use_tqdm: bool = False) -> tuple[ThroughputResult, BaselineSetup]:
    """Load, warm up on the (different) warm-up draw, then time `requests`; threads are the caller's."""
    import transformers

    model = load_hf_model(model_path, dtype, load_format)
    setup = BaselineSetup(f"transformers {transformers.__version__} generate()", batch_size,
                          str(dtype).removeprefix("torch."), torch.get_num_threads())
    if warmup:
        first = warmup[:batch_size]
        generate_batch(model, first, pad_token_id(model), max_new=min(16, max(r.output_len for r in first)))
    else:
        setup.warmup = "none"
    return run_hf(model, requests, batch_size, dtype, use_tqdm), setup
