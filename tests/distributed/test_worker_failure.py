"""A worker that dies or hangs fails the requests in flight within seconds, with every KV block
back in the pool; a worker that cannot start says why."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from kvflow import LLM, SamplingParams
from kvflow.distributed.executor import WorkerFailedError
from tests.distributed.conftest import engine_kwargs

PARAMS = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)


@pytest.fixture
def _forked(monkeypatch):
    monkeypatch.setenv("KVFLOW_WORKER_MULTIPROC_METHOD", "fork")


def _engine_with_requests_in_flight(path: str, prompts, tp: int = 2, pp: int = 1) -> LLM:
    llm = LLM(path, **engine_kwargs(path, tp, pp))
    for i, p in enumerate(prompts[:4]):
        llm.engine.add_request(f"r{i}", {"prompt_token_ids": p}, PARAMS)
    llm.engine.step()
    return llm


def _assert_failed_cleanly(llm: LLM, prompts, started: float, match: str) -> None:
    with pytest.raises(WorkerFailedError, match=match):
        llm.generate([{"prompt_token_ids": p} for p in prompts[4:6]], PARAMS, use_tqdm=False)
    assert time.monotonic() - started < 15, "the failure took too long to detect"
    for i in range(4):  # the requests added before: abort frees them (the server does this for each)
        llm.engine.abort_request(f"r{i}")
    kv = llm.engine.kv_cache_manager
    llm.engine.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(WorkerFailedError, match="executor is down"):  # at once, not after a timeout
        llm.generate([{"prompt_token_ids": prompts[0]}], PARAMS, use_tqdm=False)


@pytest.mark.parametrize("tp, pp, rank", [(2, 1, 1), (1, 2, 0)], ids=["T=2", "P=2-first-stage"])
def test_killed_worker_fails_requests_in_flight(tiny_gqa, _forked, tp, pp, rank):
    """P=2: stage 0 dies while a batch is in flight behind the one being answered."""
    path, prompts, _ = tiny_gqa
    llm = _engine_with_requests_in_flight(path, prompts, tp, pp)
    if pp > 1:
        assert llm.engine.batch_queue.num_in_flight == 1 and llm.engine.batch_queue.peak_in_flight == 2
    pids = llm.engine.distributed.executor.worker_pids
    started = time.monotonic()
    os.kill(pids[rank], signal.SIGKILL)
    _assert_failed_cleanly(llm, prompts, started, rf"rank {rank} \(pid \d+\) (died|is gone)")
    time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                   for pid in pids), "workers outlived the failure"


def test_hung_worker_is_detected_by_its_heartbeat(tiny_gqa, _forked):
    path, prompts, _ = tiny_gqa
    llm = _engine_with_requests_in_flight(path, prompts)
    started = time.monotonic()
    os.kill(llm.engine.distributed.executor.worker_pids[0], signal.SIGSTOP)
    _assert_failed_cleanly(llm, prompts, started, r"rank 0 .* stopped answering \(no heartbeat")


def test_worker_that_cannot_start_says_why(tiny_gqa, tmp_path):
    """Spawned (the default start method): the worker's own traceback reaches the driver."""
    path, _, _ = tiny_gqa
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match=r"worker rank 0 failed to start: .*"):
        LLM(str(broken), **engine_kwargs(str(broken), 1, 1, backend="mp"))


def test_server_engine_stops_and_reports_the_worker(tiny_gqa, _forked):
    """Behind the server: the streams in flight end with the worker's failure, the engine stops
    (so /health answers 503 and `kvflow serve` exits 1), and its blocks are all free."""
    import asyncio

    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.config import EngineConfig
    from kvflow.entrypoints.async_engine import AsyncEngine, EngineDeadError

    path, prompts, _ = tiny_gqa
    engine = AsyncEngine(LLMEngine(EngineConfig(model=path, **engine_kwargs(path, 2, 1))))

    async def scenario() -> list:
        streams = [await engine.add_request(f"s{i}", {"prompt_token_ids": p}, PARAMS) for i, p in enumerate(prompts[:3])]
        await streams[0].next()  # the batch is running
        os.kill(engine.engine.distributed.executor.worker_pids[1], signal.SIGKILL)
        errors = []
        for stream in streams:
            with pytest.raises(EngineDeadError) as info:
                while await stream.next() is not None:
                    pass
            errors.append(str(info.value))
        return errors

    started = time.monotonic()
    errors = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert time.monotonic() - started < 15
    assert all("worker rank 1" in e and "died" in e for e in errors), errors
    assert not engine.is_running
    kv = engine.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    engine.shutdown()
