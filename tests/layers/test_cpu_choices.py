"""The kernels' process-wide choices (layers/cpu_choices.py) that no other test flips: where decode
attention prefetches. (tests/layers/test_bf16_dot.py holds vdpbf16ps against FMAs, and
tests/layers/test_gemm.py the AMX setting.)
"""

from __future__ import annotations

import pytest
import torch

from tests.layers.test_cpu_kernels import batch_lens, make_paged_case


def test_attention_prefetch_is_a_choice_of_cache_not_of_result(kernels):
    """Decode attention's prefetch streams fill L1 or L2, by vendor under "auto" (L2 on Intel):
    each setting is in force when chosen, the outputs are the same bits, and a bad value is
    refused with the variable's name."""
    before = kernels.attention_prefetch
    if not kernels.avx512f:
        assert before == kernels.set_attention_prefetch("l2") == "none"
        return
    with open("/proc/cpuinfo") as f:
        intel = "GenuineIntel" in f.read()
    # float32: its decode kernel streams wherever AVX-512F is (bf16's also needs AVX512-BF16)
    q, kc, vc, tables, seq_lens = make_paged_case(batch_lens("many", 16, seed=3), 9, 3, 64, 16, torch.float32, seed=3)
    try:
        assert kernels.set_attention_prefetch("auto") == ("l2" if intel else "l1")
        outs = {}
        for choice in ("l1", "l2"):
            assert kernels.set_attention_prefetch(choice) == kernels.attention_prefetch == choice
            outs[choice] = kernels.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
        assert torch.equal(outs["l1"], outs["l2"])
        with pytest.raises(ValueError, match="KVFLOW_ATTENTION_PREFETCH"):
            kernels.set_attention_prefetch("l3")
    finally:
        kernels.set_attention_prefetch(before)
