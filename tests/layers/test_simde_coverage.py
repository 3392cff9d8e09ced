"""The SIMDe-emulated build (csrc/isa.h, `cpu_kernels.load_emulated_avx512`) must compile wherever
it is used, i.e. on CPUs without AVX-512, but CI often runs on CPUs that have it and never build
it. So this check runs everywhere, in milliseconds: every AVX-512 intrinsic the kernels name
needs either a SIMDe alias or a shim of isa.h's own. (An intrinsic with neither compiled on
AVX-512 hosts and broke every AVX2-only one: `_mm512_cvtepi32_epi16`, `_mm512_cvtepi32_epi8`.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvflow

CSRC = Path(kvflow.__file__).parent / "csrc"
# AVX-512 forms: 512-bit ones, masked and bf16 ones at any width (AVX-512VL / AVX512-BF16).
AVX512_INTRINSIC = re.compile(r"\b_mm(?:512_\w+|(?:256)?_mask[z]?_\w+|(?:256)?_(?:cvtneps_pbh|cvtne2ps_pbh|dpbf16_ps))\b")
# Files the SIMDe build compiles without these paths: AMX tiles need the real instructions.
NATIVE_ONLY = re.compile(r"amx")


def _used_intrinsics() -> dict[str, str]:
    used: dict[str, str] = {}
    for path in sorted(CSRC.glob("*.[ch]*")):
        if NATIVE_ONLY.search(path.name):
            continue
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)  # names in comments are not calls
        for name in AVX512_INTRINSIC.findall(code):
            used.setdefault(name, path.name)
    return used


def _simde_aliases(include: Path) -> set[str]:
    aliases: set[str] = set()
    for header in (include / "simde" / "x86").rglob("*.h"):
        aliases.update(re.findall(r"#\s*define\s+(_mm\w+)\b", header.read_text(errors="replace")))
    return aliases


def test_every_avx512_intrinsic_has_a_simde_alias_or_a_shim():
    simde_py = pytest.importorskip("simde_py", reason="simde-py (a test dependency) is not installed")
    shims = set(re.findall(r"#define\s+(_mm\w+)\s+kvflow::simde_shim::", (CSRC / "isa.h").read_text()))
    available = _simde_aliases(Path(simde_py.get_include())) | shims
    used = _used_intrinsics()
    assert len(used) > 20, "the pattern no longer finds the kernels' intrinsics"
    missing = {name: where for name, where in used.items() if name not in available}
    assert not missing, (f"the SIMDe build (CPUs without AVX-512) cannot compile these intrinsics: {missing}; "
                         "add a shim to csrc/isa.h, spelled out as Intel documents the instruction")
