"""Which machine a figure came from: CPU model and family, the instructions that matter, and
which of kvflow's kernels ran.

Machines that `lscpu` names alike differ: AMD EPYC family 25 and 26 about 2x in bf16 matmul
speed, an Intel Xeon with AMX runs kvflow's linears on its tile unit (other bf16 bits, several
times the rate) where one without runs them on AVX-512. A bench report records this next to its
numbers, so a figure is never compared across machine types by mistake.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

from kvflow.layers import cpu_kernels

FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the flags kvflow's kernels choose by


@dataclass
class MachineInfo:
    cpu: str  # the model name /proc/cpuinfo gives (platform's processor elsewhere)
    family: int | None  # CPU family (None where /proc/cpuinfo is missing)
    model: int | None
    cores: int  # logical CPUs
    features: list[str] = field(default_factory=list)  # those of FEATURES this CPU has
    kernels: dict[str, object] = field(default_factory=dict)  # bf16_dot, amx, attention_prefetch; empty: off

    def describe(self) -> str:
        family = f", CPU family {self.family} model {self.model}" if self.family is not None else ""
        kernels = (f"kernels: bf16 blocks {self.kernels['bf16_dot']}, AMX {'on' if self.kernels['amx'] else 'off'}, "
                   f"attention prefetch {self.kernels.get('attention_prefetch', '?')}"
                   if self.kernels else "kernels: off (PyTorch path)")
        return f"{self.cpu}{family}, {self.cores} CPUs; {' '.join(self.features) or 'no AVX2'}; {kernels}"


def _cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields, or {} where there is no such file."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def machine_info(cpuinfo_path: str = "/proc/cpuinfo") -> MachineInfo:
    info = _cpuinfo(cpuinfo_path)
    flags = set(info.get("flags", "").split())
    kernels = cpu_kernels.load()
    chosen = {} if kernels is None else {"bf16_dot": kernels.bf16_dot, "amx": kernels.amx,
                                         "attention_prefetch": kernels.attention_prefetch}
    return MachineInfo(
        cpu=info.get("model name") or platform.processor() or platform.machine(),
        family=int(info["cpu family"]) if info.get("cpu family", "").isdigit() else None,
        model=int(info["model"]) if info.get("model", "").isdigit() else None,
        cores=os.cpu_count() or 1,
        features=[f for f in FEATURES if f in flags],
        kernels=chosen,
    )
