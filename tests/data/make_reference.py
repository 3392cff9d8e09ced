"""Regenerate tests/data/smollm2_extra_reference.json with Hugging Face transformers (fp32).

    .venv/bin/python tests/data/make_reference.py

The engine tests compare against these stored outputs so that CI does not spend minutes in
transformers' generate(); one live comparison in tests/engine/test_reference_smollm2.py keeps
the stored file honest against the installed transformers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.conftest import hf_greedy, smollm2_path  # noqa: E402
from tests.engine.prompts import INVARIANCE_TOKENS, OWN_PROMPTS, OWN_TOKENS, invariance_prompts  # noqa: E402


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    directory, name = os.path.split(smollm2_path())
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, torch_dtype=torch.float32).eval()
    out = {"meta": {"reference": f"transformers {transformers.__version__}, torch {torch.__version__}, fp32",
                    "decoding": "greedy, EOS masked (min_new_tokens == max_new_tokens); gaps are top-2 raw logit gaps"},
           "own": [], "invariance": []}
    for prompt in OWN_PROMPTS:
        ids = tokenizer(prompt).input_ids
        tokens, gaps, _ = hf_greedy(model, ids, OWN_TOKENS)
        out["own"].append({"prompt": prompt, "prompt_token_ids": ids, "tokens": tokens, "gaps": gaps})
    for ids in invariance_prompts():
        tokens, gaps, _ = hf_greedy(model, ids, INVARIANCE_TOKENS)
        out["invariance"].append({"prompt_token_ids": ids, "tokens": tokens, "gaps": gaps})
    path = Path(__file__).parent / "smollm2_extra_reference.json"
    path.write_text(json.dumps(out))
    print(f"wrote {path}")


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main()
