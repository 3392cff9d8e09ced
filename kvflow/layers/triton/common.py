"""What the kernels share: whether they run under Triton's interpreter."""

from __future__ import annotations

import os


def interpreted() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tensors, the tests without a GPU). Triton 3.9's
    interpreter multiplies bf16/fp16 tiles wrongly in tl.dot (garbage of order 1e10), so there
    the kernels widen 16-bit tiles to float32 just before each dot; on a GPU they stay 16-bit
    for the tensor cores. Everything else (loads, masks, softmax, rounding of p, stores) is the
    same code in both."""
    return os.environ.get("TRITON_INTERPRET") == "1"


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """a @ b with float32 accumulation; DOT_F32 widens the tiles first (the interpreter, above)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
