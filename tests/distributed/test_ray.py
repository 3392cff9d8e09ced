"""The Ray backend: two actors in a placement group on a local cluster started on demand give
the same greedy tokens as the mp backend (and transformers, under the tie rule)."""

from __future__ import annotations

import sys

import pytest

from kvflow import LLM
from tests.conftest import check_greedy_run
from tests.distributed.conftest import engine_kwargs
from tests.distributed.test_parallel_layouts import ARGMAX_PATH, LOGITS_PATH


def test_missing_ray_is_refused_with_the_setting_named(tiny_gqa, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    path = tiny_gqa[0]
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray': the ray package is not installed"):
        LLM(path, **engine_kwargs(path, 2, 1, backend="ray"))


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], LOGITS_PATH,
                                                         use_tqdm=False)]


def test_ray_tensor_parallel_2_matches_mp(tiny_gqa, monkeypatch):
    pytest.importorskip("ray", reason="the ray backend needs ray: pip install 'kvflow[ray]'")
    import ray

    path, prompts, refs = tiny_gqa
    monkeypatch.setenv("KVFLOW_WORKER_MULTIPROC_METHOD", "fork")
    mp_llm = LLM(path, **engine_kwargs(path, 2, 1, backend="mp"))
    mp_tokens = _tokens(mp_llm, prompts)
    mp_llm.shutdown()
    llm = LLM(path, **engine_kwargs(path, 2, 1, backend="ray"))
    try:
        assert _tokens(llm, prompts) == mp_tokens  # the same worker code and sums: the same bits
        check_greedy_run(llm, prompts, refs, ARGMAX_PATH, "ray T=2 argmax path")
    finally:
        llm.shutdown()
        ray.shutdown()
