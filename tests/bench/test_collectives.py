"""`kvflow bench collectives`: both all-reduce paths and the pipeline send are timed, per size."""

from __future__ import annotations

import json

from kvflow.distributed.shm_all_reduce import shm_all_reduce_supported
from kvflow.entrypoints.cli import main


def test_collectives_times_gloo_and_shared_memory(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "collectives", "--iters", "3", "--tokens", "1,4", "--hidden-size", "64",
                 "--dtype", "float32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["tokens"] for r in rows] == [1, 4] and [r["bytes"] for r in rows] == [256, 1024]
    for r in rows:
        assert r["all_reduce_us"] > 0 and r["send_recv_us"] > 0
        assert (r["shm_all_reduce_us"] is not None and r["shm_all_reduce_us"] > 0) == shm_all_reduce_supported()
    assert "shm µs" in capsys.readouterr().out
