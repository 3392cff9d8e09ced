"""Hugging Face model directories: config.json plus one or many *.safetensors shards."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open


def read_hf_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: {model_dir!r} has no config.json; pass a Hugging Face model directory or a .gguf file")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {path} is not valid JSON ({e}); the file is corrupt") from e


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of every shard, one at a time, so peak memory stays near one tensor."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model: {model_dir!r} has no *.safetensors files (only safetensors and GGUF are loaded)")
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"model: cannot read {file}: {e}; the file is corrupt or truncated") from e
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
