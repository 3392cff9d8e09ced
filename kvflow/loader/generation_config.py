"""The model's own sampling defaults, as vLLM's `--generation-config auto|vllm|PATH` finds them.

A request's sampling fields always win; these only fill the ones it leaves unset:

  "auto"  (the default) the model's own: a Hugging Face directory's generation_config.json
          (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens,
          where set), a GGUF file's `general.sampling.*` metadata, and for the bundled
          SmolLM2-135M-Instruct, which ships neither, its model card's recommendation
          (`DEFAULT_MODEL_SAMPLING` in default_model.py) under any that the file has;
  "vllm"  none: `SamplingParams`' own vLLM defaults (temperature 1.0, top_p 1.0, ...);
  a path  a folder holding generation_config.json, or that file itself.

As in vLLM, `do_sample` is not read: a config that sets a temperature means it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from kvflow.sampling.params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (the keys vLLM reads).
_HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF general.sampling.* key (llama.cpp's names) -> SamplingParams field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """Field values that replace `SamplingParams`' defaults where a request leaves them unset."""

    values: dict[str, Any] = field(default_factory=dict)
    source: str = "vllm"  # where they came from, for logs and /v1/models

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items()) or "none (vLLM's: temperature=1.0, top_p=1.0)"
        return f"sampling defaults: {shown} [{self.source}]"


def load_sampling_defaults(model_path: str, generation_config: str = "auto") -> SamplingDefaults:
    """The defaults `generation_config` ("auto", "vllm" or a path) selects for the model at `model_path`."""
    if generation_config == "vllm":
        return SamplingDefaults({}, "vllm")
    if generation_config == "auto":
        defaults = _from_model(model_path)
    else:
        path = os.path.expanduser(generation_config)
        if os.path.isdir(path):
            path = os.path.join(path, GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"generation_config: {generation_config!r} is not 'auto', 'vllm', or a folder holding "
                f"{GENERATION_CONFIG_FILE} (or that file)"
            )
        defaults = SamplingDefaults(_read_hf(path), path)
    try:
        SamplingParams(**defaults.values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"generation_config: the defaults from {defaults.source} are invalid: {exc}") from exc
    return defaults


def _from_model(model_path: str) -> SamplingDefaults:
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        from kvflow.loader.default_model import (
            DEFAULT_MODEL_SAMPLING,
            DEFAULT_MODEL_SAMPLING_SOURCE,
            is_default_model,
        )
        from kvflow.loader.gguf_loader import read_gguf_metadata

        meta = read_gguf_metadata(model_path)
        own = {name: meta[key] for key, name in _GGUF_KEYS.items() if meta.get(key) is not None}
        if is_default_model(model_path):
            source = DEFAULT_MODEL_SAMPLING_SOURCE + (" + GGUF metadata" if own else "")
            return SamplingDefaults({**DEFAULT_MODEL_SAMPLING, **own}, source)
        return SamplingDefaults(own, f"{os.path.basename(model_path)} metadata" if own else "model (none set)")
    directory = os.path.dirname(model_path) if os.path.isfile(model_path) else model_path
    path = os.path.join(directory, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return SamplingDefaults({}, "model (no generation_config.json)")
    values = _read_hf(path)
    return SamplingDefaults(values, path if values else f"{path} (no sampling fields)")


def _read_hf(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    return {name: cfg[key] for key, name in _HF_KEYS.items() if cfg.get(key) is not None}
