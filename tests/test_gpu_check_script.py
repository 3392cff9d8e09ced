"""scripts/gpu_check, checked where it can be without a GPU: its options, and a dry run of every
benchmark part on the CPU with tiny shapes writing the same JSON."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check"


def _load():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_options_and_test_list():
    gpu_check = _load()
    args = gpu_check.parse_args([])
    assert (args.decode_batch, args.prefill_seqs, args.prefill_len) == (64, 8, 2048)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--decode-batch", "0"])
    root = SCRIPT.parent.parent
    assert all((root / t).exists() for t in gpu_check.CUDA_TESTS)


def test_dry_run_writes_every_part(tmp_path):
    gpu_check = _load()
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dry_run"] and "tests" not in report  # the tests are the GPU's
    assert report["roofline"]["hbm_gb_per_s"] > 0
    bench = report["llama3_8b"]
    assert bench["prefill"]["all_in_one_step"] and bench["decode"]["batch"] == 4 and bench["all_blocks_free_after"]
    assert report["w_offline"]["output_tokens"] == 12


def test_time_limit_stops_the_running_part_and_still_writes(tmp_path):
    gpu_check = _load()
    out = tmp_path / "partial.json"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--time-limit", "0.5"]) == 1
    report = json.loads(out.read_text())
    assert report["out_of_time"] and "time-limit" in json.dumps(report)
