"""PEFT adapters made by PEFT itself over the tiny random Llama: the producer is the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import save_tiny_llama

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model, directory: Path, seed: int, **lora_kwargs):
    """A PEFT LoRA adapter with random A and B (init_lora_weights=False: a fresh adapter's B is zero,
    which would leave the model unchanged) saved to `directory`; returns the PEFT model."""
    peft = pytest.importorskip("peft", reason="peft makes the adapters (pip install -e '.[test]')")
    import copy

    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora_kwargs)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config).eval()
    with torch.no_grad():  # sharper deltas than PEFT's small random init, so the adapters change greedy output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory) -> dict:
    """The base model's path and HF model, and three adapters: every projection at rank 8; q/v only
    at rank 4 with rsLoRA and a per-module alpha; MLP only at rank 16."""
    root = tmp_path_factory.mktemp("lora")
    path, hf = save_tiny_llama(root / "base")
    adapters = {
        "all": make_adapter(hf, root / "all", 1, r=8, lora_alpha=16, target_modules=ALL),
        "qv": make_adapter(hf, root / "qv", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           use_rslora=True, alpha_pattern={"v_proj": 2}),
        "mlp": make_adapter(hf, root / "mlp", 3, r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj",
                                                                                        "down_proj"]),
    }
    return {"path": path, "hf": hf, "root": root, "peft": adapters}


def edit_adapter_config(source: Path, target: Path, **changes) -> Path:
    """A copy of an adapter folder with adapter_config.json fields changed."""
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config.update(changes)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target
