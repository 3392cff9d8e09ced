"""Make GPTQ checkpoints with gptqmodel itself, and its own dequantization of them, for test_gptq.py.

Run as `python -m tests.quantization.gptq_producer OUT_DIR` in a child process: gptqmodel patches
transformers and safetensors when imported and sets process-wide environment variables, which
must not leak into the test session. For every setting in SETTINGS it

1. saves a tiny random Llama (conftest's) with a word-level tokenizer (gptqmodel requires one),
2. quantizes it with `GPTQModel.load(...).quantize(...)` on random calibration tokens (real GPTQ:
   Hessians, error feedback, the producer's own packing) and `save`s it to OUT_DIR/<name>,
3. loads the saved checkpoint back with `GPTQModel.load(backend=TORCH)` (the producer's reader,
   with its v1 -> v2 zero-point conversion) and writes every quantized linear's
   `dequantize_weight()`, scales widened from float16 to float32 first (exact) so that
   scale * (q - zero) is computed in float32, as [out, in], to OUT_DIR/<name>.reference.safetensors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# name -> (bits, group_size, sym, desc_act, format); "desc_act" exists only to be refused
SETTINGS = {
    "w4_g32_asym_v1": (4, 32, False, False, "gptq"),
    "w4_g32_sym_v1": (4, 32, True, False, "gptq"),
    "w4_g32_asym_v2": (4, 32, False, False, "gptq_v2"),
    "w4_channel_sym_v1": (4, -1, True, False, "gptq"),
    "w8_g32_asym_v1": (8, 32, False, False, "gptq"),
    "w4_g32_desc_act": (4, 32, False, True, "gptq"),
}
NO_REFERENCE = ("w4_g32_desc_act",)


def _save_float_model(directory: Path) -> str:
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import _tiny_config, save_random_model

    path, _ = save_random_model(_tiny_config("llama"), directory)
    vocab = {f"t{i}": i for i in range(320)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)
    return path


def main(out: Path) -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its default on 2 cores (1) is below its own minimum
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from safetensors.torch import save_file

    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear

    out.mkdir(parents=True, exist_ok=True)
    float_path = _save_float_model(out / "float")
    generator = torch.Generator().manual_seed(0)
    calibration = [{"input_ids": torch.randint(3, 320, (1, 48), generator=generator),
                    "attention_mask": torch.ones(1, 48, dtype=torch.long)} for _ in range(8)]
    for name, (bits, group_size, sym, desc_act, fmt) in SETTINGS.items():
        config = QuantizeConfig(bits=bits, group_size=group_size, sym=sym, desc_act=desc_act, format=fmt,
                                offload_to_disk=False,
                                act_group_aware=False if group_size == -1 else None)  # it needs groups
        model = GPTQModel.load(float_path, config, device="cpu", dtype=torch.float32)
        model.quantize(calibration, backend=BACKEND.TORCH)
        model.save(str(out / name))
        del model
        if name in NO_REFERENCE:
            continue
        loaded = GPTQModel.load(str(out / name), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
        reference = {}
        with torch.no_grad():
            for module_name, module in loaded.model.named_modules():
                if isinstance(module, PackableQuantLinear):
                    # its float16 scales widened (exactly) so that scale * (q - zero) is not rounded to
                    # float16; the base class's eager dequantization, not the compiled/cached fast path
                    module.scales.data = module.scales.data.float()
                    weight = PackableQuantLinear.dequantize_weight(module)
                    reference[f"{module_name}.weight"] = weight.float().t().contiguous()
        save_file(reference, str(out / f"{name}.reference.safetensors"))
        del loaded
    for bits in (4, 8):
        _pack_extremes(out / f"packed_w{bits}.safetensors", bits)
    (out / "settings.json").write_text(json.dumps(SETTINGS))


def _pack_extremes(file: Path, bits: int) -> None:
    """Known q, zero points and float16 scales, packed by gptqmodel's own `pack` and serialized
    as v1 by its own v2 -> v1 conversion, with zero points of 0 and 2^bits - 1 in every group
    row: a zero of 0 stored minus one borrows from the next field of its word, the case that
    decides how a reader must undo v1's offset. Writes the packed tensors and the known values."""
    import torch
    from safetensors.torch import save_file
    from torch import nn

    from gptqmodel import QuantizeConfig
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module

    n, k, group = 64, 128, 32
    maxq = (1 << bits) - 1
    generator = torch.Generator().manual_seed(bits)
    q = torch.randint(0, maxq + 1, (n, k), generator=generator)
    zero = torch.randint(0, maxq + 1, (n, k // group), generator=generator)
    zero[::2, :] = 0  # every other output row: zero point 0 in every group (each packed word has some)
    zero[1::4, :] = maxq
    scale = (torch.rand(n, k // group, generator=generator) * 0.01 + 1e-3).half()
    weight = (q - zero.repeat_interleave(group, 1)).float() * scale.float().repeat_interleave(group, 1)
    linear = nn.Linear(k, n, bias=False)
    linear.weight.data = weight
    module = TorchLinear(bits=bits, group_size=group, sym=False, desc_act=False, in_features=k, out_features=n,
                         bias=False, pack_dtype=torch.int32)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    module.pack(linear, scale.float(), zero.float(), g_idx)
    convert_gptq_v2_to_v1_format_module(module, QuantizeConfig(bits=bits, group_size=group, sym=False,
                                                                offload_to_disk=False))
    save_file({"qweight": module.qweight, "qzeros": module.qzeros, "scales": module.scales.half(),
               "g_idx": module.g_idx.to(torch.int32), "q": q.to(torch.int32), "zero": zero.to(torch.int32),
               "scale": scale}, str(file))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
