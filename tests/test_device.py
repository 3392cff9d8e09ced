"""Device selection and the CUDA backend's start-up refusals, each naming its setting."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM
from kvflow.config import EngineConfig
from kvflow.device import check_cuda_dtype, check_cuda_engine, resolve_device

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")


def test_auto_takes_the_gpu_only_when_there_is_one(monkeypatch):
    monkeypatch.delenv("KVFLOW_DEVICE", raising=False)
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("KVFLOW_DEVICE", "cpu")  # as tests/conftest.py pins it
    assert resolve_device("auto").type == "cpu"
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device: 'tpu' is not supported"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="device: 'gpu' is not supported"):
        EngineConfig(device="gpu")


@no_gpu
def test_cuda_without_a_gpu_is_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match=r"device='cuda' \(--device cuda\).*sees no CUDA GPU"):
        LLM(device="cuda")  # refused before any weight is read


@no_gpu
def test_cli_with_device_cuda_exits_with_the_setting_named(capsys):
    from kvflow.entrypoints.cli import main

    assert main(["plan", "--device", "cuda"]) != 0
    assert "--device cuda" in capsys.readouterr().err


def test_a_gpu_without_bf16_is_refused_for_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(ValueError, match=r"dtype=bfloat16 .*Tesla T4 \(compute capability 7.5\) has no bf16"):
        check_cuda_dtype(torch.device("cuda"), torch.bfloat16)
    check_cuda_dtype(torch.device("cuda"), torch.float16)  # fine


@pytest.mark.parametrize("setting,match", [
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8' runs on the CPU backend only"),
    (dict(quantization="int8"), "quantization='int8'"),
    (dict(memory_utilization=0.5), "memory_utilization is a share of host memory"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
])
def test_what_the_cuda_backend_does_not_do_yet_is_refused(monkeypatch, setting, match):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    with pytest.raises(ValueError, match=match):
        check_cuda_engine(EngineConfig(**setting), torch.device("cuda"), torch.bfloat16)
