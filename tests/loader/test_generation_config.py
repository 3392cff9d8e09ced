"""Sampling defaults from the model: generation_config.json, GGUF metadata, the bundled model's card."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from kvflow.loader.default_model import DEFAULT_MODEL_SAMPLING, default_model_path
from kvflow.loader.generation_config import load_sampling_defaults


def write_generation_config(folder, **values) -> None:
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **values}))


def test_bundled_model_gets_its_model_card_recommendation():
    defaults = load_sampling_defaults(default_model_path())
    assert DEFAULT_MODEL_SAMPLING == {"temperature": 0.2, "top_p": 0.9}
    assert defaults.values == DEFAULT_MODEL_SAMPLING
    assert "model card" in defaults.source and "temperature=0.2" in defaults.describe()
    assert load_sampling_defaults(default_model_path(), "vllm").values == {}


def test_hf_directory_reads_the_sampling_keys_vllm_reads(tmp_path):
    write_generation_config(tmp_path, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1,
                            max_new_tokens=128, do_sample=True, num_beams=1)
    defaults = load_sampling_defaults(str(tmp_path))
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                               "repetition_penalty": 1.1, "max_tokens": 128}
    assert load_sampling_defaults(str(tmp_path / "generation_config.json")).values == defaults.values
    assert load_sampling_defaults(str(tmp_path), "vllm").values == {}


def test_hf_directory_without_sampling_fields_has_no_defaults(tmp_path):
    assert load_sampling_defaults(str(tmp_path)).values == {}  # no generation_config.json at all
    write_generation_config(tmp_path)  # only token ids, as SmolLM2's own repository ships
    assert load_sampling_defaults(str(tmp_path)).values == {}


def test_explicit_path_overrides_the_model(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, temperature=0.7)
    assert load_sampling_defaults(default_model_path(), str(other)).values == {"temperature": 0.7}
    with pytest.raises(ValueError, match="generation_config"):
        load_sampling_defaults(default_model_path(), str(tmp_path / "missing"))


def test_invalid_defaults_fail_at_load(tmp_path):
    write_generation_config(tmp_path, top_p=1.5)
    with pytest.raises(ValueError, match="generation_config.*top_p"):
        load_sampling_defaults(str(tmp_path))


def test_gguf_sampling_metadata(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32(gguf.Keys.General.SAMPLING_TEMP, 0.5)
    writer.add_float32(gguf.Keys.General.SAMPLING_TOP_P, 0.8)
    writer.add_int32(gguf.Keys.General.SAMPLING_TOP_K, 40)
    writer.add_float32(gguf.Keys.General.SAMPLING_PENALTY_REPEAT, 1.05)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    defaults = load_sampling_defaults(str(path))
    assert defaults.values == pytest.approx({"temperature": 0.5, "top_p": 0.8, "top_k": 40,
                                             "repetition_penalty": 1.05})
    assert "tiny.gguf" in defaults.source
