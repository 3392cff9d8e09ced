"""Hugging Face model directories: config.json plus one or many *.safetensors shards."""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from kvflow.quantization.compressed_tensors import CompressedTensorsConfig
    from kvflow.quantization.gptq import GPTQConfig


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


def compressed_tensors_config(hf_config: dict[str, Any]):
    """The checkpoint's compressed-tensors quantization (parsed, unsupported settings refused),
    or None when config.json has no such quantization_config."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    from kvflow.quantization.compressed_tensors import CompressedTensorsConfig

    return CompressedTensorsConfig.from_hf(qc)


class _PendingLayers:
    """Each quantized layer's tensors (separate names, possibly in different shards), held until
    the layer is complete, then made one (`<module>.weight`, QuantizedWeight), or its float32
    dequantization where `keep_quantized` refuses that name (--quantization none)."""

    def __init__(self, keep_quantized: Callable[[str], bool] | None) -> None:
        self.keep_quantized = keep_quantized
        self.layers: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, module: str, part: str, tensor: torch.Tensor, required: Iterable[str],
            convert: Callable[[str, dict[str, torch.Tensor]], Any]) -> tuple[str, Any] | None:
        parts = self.layers.setdefault(module, {})
        parts[part] = tensor
        if not all(p in parts for p in required):
            return None
        weight, name = convert(module, self.layers.pop(module)), f"{module}.weight"
        keep = self.keep_quantized is not None and self.keep_quantized(name)
        return name, weight if keep else weight.dequantize()

    def check_complete(self, kind: str, expected: Iterable[str] | None = None) -> None:
        if self.layers:
            module, parts = next(iter(self.layers.items()))
            of = f" of {', '.join(expected)}" if expected is not None else ""
            raise ValueError(f"checkpoint is incomplete: {kind} {module} has only {', '.join(sorted(parts))}{of} "
                             f"({len(self.layers)} such layer(s))")


def iter_compressed_tensors_weights(model_dir: str, config: CompressedTensorsConfig,
                                    keep_quantized: Callable[[str], bool] | None = None
                                    ) -> Iterator[tuple[str, Any]]:
    """`iter_safetensors_weights`, with each quantized linear's tensors (weight_packed,
    weight_scale, ... arrive as separate names, possibly in different shards) buffered until
    the layer is complete and yielded as one (`<module>.weight`, QuantizedWeight) where
    `keep_quantized` accepts that name, else as its float32 dequantization (--quantization none)."""
    from kvflow.quantization.compressed_tensors import PARTS, required_parts, to_quantized_weight

    pending = _PendingLayers(keep_quantized)
    for name, tensor in iter_safetensors_weights(model_dir):
        module, _, part = name.rpartition(".")
        is_int_weight = part == "weight" and not tensor.dtype.is_floating_point
        if part not in PARTS and not is_int_weight:
            yield name, tensor
            continue
        scheme = config.scheme_for(module)
        if scheme is None:
            raise ValueError(f"checkpoint tensor {name!r} is quantized, but quantization_config's targets and "
                             "ignore list say its layer is not")
        if part == "weight_zero_point" and scheme.symmetric:
            continue  # some producers also ship a symmetric layer's (all-zero) zero points
        done = pending.add(module, part, tensor, required_parts(scheme),
                           lambda m, parts, scheme=scheme: to_quantized_weight(m, parts, scheme))
        if done is not None:
            yield done
    pending.check_complete("quantized layer")


def gptq_config(hf_config: dict[str, Any]):
    """The checkpoint's GPTQ quantization (parsed, unsupported settings refused), or None when
    config.json has no quantization_config with quant_method "gptq"."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "gptq":
        return None
    from kvflow.quantization.gptq import GPTQConfig

    return GPTQConfig.from_hf(qc)


def iter_gptq_weights(model_dir: str, config: GPTQConfig, keep_quantized: Callable[[str], bool] | None = None
                      ) -> Iterator[tuple[str, Any]]:
    """`iter_safetensors_weights`, with each quantized linear's qweight, qzeros, scales and g_idx
    (separate names, possibly in different shards) buffered until the layer is complete and
    yielded as one (`<module>.weight`, QuantizedWeight) where `keep_quantized` accepts that name,
    else as its float32 dequantization (--quantization none)."""
    from kvflow.quantization.gptq import PARTS, to_quantized_weight

    pending = _PendingLayers(keep_quantized)
    for name, tensor in iter_safetensors_weights(model_dir):
        module, _, part = name.rpartition(".")
        if part not in PARTS:
            yield name, tensor
            continue
        done = pending.add(module, part, tensor, PARTS, lambda m, parts: to_quantized_weight(m, parts, config))
        if done is not None:
            yield done
    pending.check_complete("GPTQ layer", PARTS)
