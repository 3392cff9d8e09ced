"""bench/machine.py: what a bench report says about the machine behind its figures."""

from __future__ import annotations

from kvflow.bench.machine import machine_info
from kvflow.layers import cpu_kernels

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 167
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16

processor\t: 1
cpu family\t: 99
model name\t: not the first processor
"""


def test_reads_the_first_processor(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = machine_info(str(path))
    assert (info.cpu, info.family, info.model) == ("Intel(R) Xeon(R) Processor", 6, 167)
    assert info.features == ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    assert "CPU family 6 model 167" in info.describe() and "amx_bf16" in info.describe()


def test_names_the_kernels_that_ran():
    kernels = cpu_kernels.load()
    info = machine_info()
    assert info.kernels == {"bf16_dot": kernels.bf16_dot, "amx": kernels.amx,
                            "attention_prefetch": kernels.attention_prefetch}
    assert ("AMX on" if kernels.amx else "AMX off") in info.describe()


def test_without_cpuinfo(tmp_path):
    info = machine_info(str(tmp_path / "missing"))
    assert info.family is None and info.model is None and info.cpu and info.features == []
    assert "CPU family" not in info.describe()
