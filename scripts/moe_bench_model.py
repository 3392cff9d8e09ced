"""Write the random-weight Qwen3-MoE checkpoint the MoE benchmarks run on (docs/benchmarks.md,
"mixtures of experts"): a real safetensors directory, so transformers can be the baseline.

    .venv/bin/python scripts/moe_bench_model.py /work/moe/qwen3moe-0.4b

374 M parameters (748 MB in bf16): 8 layers of 32 experts (top 4, 384 wide) under Qwen3's
attention (16 heads, 4 KV heads of 64), a 49,152-token vocabulary tied to the LM head. A token
reads 109 M of them (218 MB): about SmolLM2-135M's share, spread over 3.4x the bytes.
transformers' own initialisation (seed 0): the router then spreads tokens near-evenly, as a
trained model's balanced layers do. No tokenizer: the benchmarks send token ids."""

from __future__ import annotations

import sys

import torch
import transformers


def main(out: str) -> None:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "moe-bench-model")
