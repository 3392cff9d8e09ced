"""kvflow's own CPU kernels (kvflow/csrc), compiled with the machine's compiler on first use.

The kernels are plain C++ with OpenMP and no PyTorch headers, called through ctypes with raw
data pointers; `cpu_build` compiles them (once per source, flags, compiler and CPU) and `make`
does so at install time (`python -m kvflow.layers.cpu_kernels`). Without a compiler, or with KVFLOW_CPU_KERNELS=0,
`load()` returns None and callers use their PyTorch path: slower, never different in meaning.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from kvflow.layers.cpu_build import build
from kvflow.layers.cpu_choices import KernelChoices

logger = logging.getLogger("kvflow")

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the dtype argument of the C entry points


class CPUKernels(KernelChoices):
    """Typed entry points into the compiled library."""

    def __init__(self, path: Path, amx: str | None = None) -> None:
        """`amx`: the AMX choice (`set_amx`), by default KVFLOW_AMX's (else "auto")."""
        # torch loaded its libgomp first; the library's libgomp.so.1 resolves to that same copy.
        self.lib = ctypes.CDLL(str(path))
        self.path = path
        fn = self.lib.kvflow_paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._decode = fn
        self.lib.kvflow_write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64]
        self.lib.kvflow_write_kv.restype = ctypes.c_int
        self.lib.kvflow_decode_fast_path.argtypes = [ctypes.c_int, i64]
        self.lib.kvflow_prefill_pack_budget.argtypes = [i64]
        self.lib.kvflow_prefill_pack_budget.restype = i64
        # Chunks of up to this many tokens run through the decode kernel (csrc/short_chunks.cpp).
        self.lib.kvflow_prefill_short_chunk.argtypes = [i64]
        self.lib.kvflow_prefill_short_chunk.restype = i64
        self.max_group = self.lib.kvflow_max_group()
        self.max_head_dim = self.lib.kvflow_max_head_dim()
        self.lib.kvflow_pack_bf16_weight.argtypes = [ptr, i64, i64, ptr]
        self.lib.kvflow_pack_bf16_weight.restype = None
        self.lib.kvflow_gemm_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
        self.lib.kvflow_gemm_bf16.restype = ctypes.c_int
        self._gemm = self.lib.kvflow_gemm_bf16
        self.lib.kvflow_gemm_bf16_widened.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
        self.lib.kvflow_gemm_bf16_widened.restype = ctypes.c_int
        self.has_gemm_bf16 = bool(self.lib.kvflow_has_gemm_bf16())
        self.lib.kvflow_pack_f32_weight.argtypes = [ptr, i64, i64, ptr]
        self.lib.kvflow_pack_f32_weight.restype = None
        self.lib.kvflow_gemm_f32.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
        self.lib.kvflow_gemm_f32.restype = ctypes.c_int
        self.has_gemm_f32 = bool(self.lib.kvflow_has_gemm_f32())
        # What the fast paths were built for: the GEMMs run on AVX2 + FMA too (csrc/gemm_avx2.h),
        # attention's and the quantized tiles' fast paths need AVX-512 (and AVX512-BF16 for bf16).
        isa = self.lib.kvflow_isa()
        self.avx512f, self.avx512_bf16 = bool(isa & 1), bool(isa & 2)
        self.has_amx = bool(isa & 8)  # AMX tiles granted here (`amx` says whether they run the GEMMs)
        self.avx2_f16c = bool(isa & 16)  # the AVX2 quantized tiles read float16 scales (tiles.PAIRS_HALF)
        self.lib.kvflow_add_rms_norm.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
        self.lib.kvflow_silu_and_mul.argtypes = [ctypes.c_int, ptr, ptr, i64, i64]
        self.lib.kvflow_rotary.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64]
        self.lib.kvflow_paged_prefill_attention.argtypes = [
            ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float]
        for fn in (self.lib.kvflow_add_rms_norm, self.lib.kvflow_silu_and_mul, self.lib.kvflow_rotary,
                   self.lib.kvflow_paged_prefill_attention):
            fn.restype = ctypes.c_int
        self.lib.kvflow_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr]
        self.lib.kvflow_argmax_rows.restype = ctypes.c_int
        self.lib.kvflow_gather_packed_rows.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr]
        self.lib.kvflow_gather_packed_rows.restype = ctypes.c_int
        self.init_choices(amx)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in DTYPE_CODES

    def decode_fast_path(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether decode attention runs its AVX-512 path (else the portable reference) for this shape."""
        return bool(self.lib.kvflow_decode_fast_path(DTYPE_CODES[dtype], head_dim))

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (
            dtype in DTYPE_CODES
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= self.max_group
            and head_dim <= self.max_head_dim
        )

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """key_cache/value_cache[slot_mapping[t]] = k[t], v[t] (keys in the pool's dimension-major
        layout, layers/kv_layout.py); k/v [T, kv_heads, head_dim] may be row-strided views."""
        tokens, num_kv_heads, head_dim = k.shape
        for t in (k, v):
            if not heads_contiguous(t) or t.dtype != key_cache.dtype:
                raise ValueError("write_kv: k/v need contiguous heads in the cache's dtype")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or slot_mapping.dtype != torch.int64:
            raise ValueError("write_kv: contiguous caches and int64 slot_mapping expected")
        if key_cache.shape[-2:] != (num_kv_heads, head_dim) or v.shape != k.shape:
            raise ValueError("write_kv: k and v must share one shape matching the cache's heads")
        if slot_mapping.shape != (tokens,):
            raise ValueError(f"write_kv: slot_mapping needs one slot per token ({tokens}), got {tuple(slot_mapping.shape)}")
        slot_mapping = slot_mapping.contiguous()
        size = k.element_size()
        if size > 4 or (head_dim * size) % 4:
            raise ValueError(f"write_kv: keys are stored in 4-byte cells (kv_layout); {k.dtype} heads of {head_dim} "
                             "do not fill whole cells")
        check_rc(self.lib.kvflow_write_kv(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size,
                                          key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(), tokens,
                                          num_kv_heads, head_dim, key_cache.shape[1], size), "write_kv")

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], heads contiguous (rows may be strided)
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous (kv_layout)
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, >= max blocks] int64, contiguous
        seq_lens: torch.Tensor,  # [num_seqs] int64
        scale: float,
        portable: bool = False,
    ) -> torch.Tensor:
        """`portable` forces the portable reference (csrc/attention_ref.h) instead of the AVX-512 path
        (tests check that both give the same bits)."""
        num_seqs, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        if not heads_contiguous(q):
            raise ValueError("paged_decode_attention: q needs contiguous heads (rows may be strided)")
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache),
                        ("block_tables", block_tables), ("seq_lens", seq_lens)):
            if not t.is_contiguous():
                raise ValueError(f"paged_decode_attention: {name} must be contiguous")
        if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise ValueError("paged_decode_attention: block_tables and seq_lens must be int64")
        if q.dtype not in DTYPE_CODES or key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
            raise ValueError(f"paged_decode_attention: q and the cache must share one of {list(DTYPE_CODES)}")
        # Block ids and lengths are trusted (they come from the block manager): the kernel
        # reads exactly seq_lens[i] slots through each table row.
        out = torch.empty(q.shape, dtype=q.dtype)
        rc = self._decode(
            DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, int(portable),
        )
        if rc != 0:
            raise ValueError(f"paged_decode_attention: unsupported shape (code {rc})")
        return out

    def supports_prefill(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """The prefill kernel takes what the decode kernel takes (the same numerics): its AVX-512
        path where the dtype's GEMM microkernels run (bf16: AVX512-BF16, float32: AVX-512F) and
        head_dim is a multiple of 16, the portable reference (`csrc/attention_ref.h`) elsewhere."""
        return self.supports(dtype, num_heads, num_kv_heads, head_dim)

    def paged_prefill_attention(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim] bf16 or float32, heads contiguous (rows may be strided)
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], chunk K/V already written
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, >= max blocks] int64, contiguous
        query_start: torch.Tensor,  # [num_seqs + 1] int64: each chunk's first row in q and out
        seq_lens: torch.Tensor,  # [num_seqs] int64: context + chunk length
        out: torch.Tensor,  # [T, num_heads, head_dim] q's dtype, contiguous; rows of these chunks are written
        scale: float,
    ) -> None:
        """Causal attention of each sequence's chunk over all its keys so far, in place into `out`."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
        if not heads_contiguous(q) or not out.is_contiguous():
            raise ValueError("paged_prefill_attention: q needs contiguous heads and out must be contiguous")
        if not (q.dtype == key_cache.dtype == value_cache.dtype == out.dtype) or q.dtype not in DTYPE_CODES:
            raise ValueError(f"paged_prefill_attention: q, the caches and out must share one dtype of {list(DTYPE_CODES)}; "
                             f"got q {q.dtype}, caches {key_cache.dtype}/{value_cache.dtype}, out {out.dtype}")
        for name, t in (("block_tables", block_tables), ("query_start", query_start), ("seq_lens", seq_lens)):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError(f"paged_prefill_attention: {name} must be contiguous int64")
        check_rc(self.lib.kvflow_paged_prefill_attention(
            DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), query_start.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), out.stride(0),
            seq_lens.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale), "paged_prefill_attention")

    # Packed GEMMs (csrc/gemm.cpp): y = x @ W^T (+ bias) in bf16 or float32, W packed once.

    @staticmethod
    def packed_weight_shape(dtype: torch.dtype, n: int, k: int) -> tuple[int, ...]:
        """The layout `gemm` streams for an [N, K] weight: [ceil(N/16), K/2, 16, 2] in bf16 (K
        must be even), [ceil(N/16), K, 16] in float32."""
        if dtype == torch.bfloat16 and k % 2 == 0:
            return ((n + 15) // 16, k // 2, 16, 2)
        if dtype == torch.float32:
            return ((n + 15) // 16, k, 16)
        raise ValueError(f"pack_weight: needs a bf16 [N, K] weight with K even or a float32 one, got {dtype} "
                         f"[{n}, {k}]")

    def pack_weight(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] -> the layout `gemm` streams (`packed_weight_shape`), into `out` when given (a
        contiguous tensor of that shape and the weight's dtype, e.g. a slice of one buffer)."""
        n, k = weight.shape
        shape = self.packed_weight_shape(weight.dtype, n, k)
        if out is None:
            out = torch.empty(shape, dtype=weight.dtype)
        elif tuple(out.shape) != shape or out.dtype != weight.dtype or not out.is_contiguous():
            raise ValueError(f"pack_weight: out must be a contiguous {weight.dtype} {shape}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        weight = weight.contiguous()
        pack = self.lib.kvflow_pack_bf16_weight if weight.dtype == torch.bfloat16 else self.lib.kvflow_pack_f32_weight
        pack(weight.data_ptr(), n, k, out.data_ptr())
        return out

    def has_gemm(self, dtype: torch.dtype) -> bool:
        return (dtype == torch.bfloat16 and self.has_gemm_bf16) or (dtype == torch.float32 and self.has_gemm_f32)

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ W^T (+ bias) for a weight packed by `pack_weight`; [M, N] in x's dtype."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        dtype = x.dtype
        if dtype not in (torch.bfloat16, torch.float32) or packed.dtype != dtype or (
                bias is not None and bias.dtype != dtype):
            raise ValueError(f"gemm: x, the packed weight and the bias must share one dtype (bf16 or float32), got "
                             f"{dtype}, {packed.dtype}, {None if bias is None else bias.dtype}")
        k = packed.shape[1] * packed.shape[3] if packed.dim() == 4 else packed.shape[1]
        if x.dim() != 2 or x.shape[1] != k or n > packed.shape[0] * 16:
            raise ValueError(f"gemm: x {tuple(x.shape)} does not fit packed weight {tuple(packed.shape)} for N={n}")
        if bias is not None:
            bias = bias.contiguous()  # kept alive by this name until the kernel returns
        return self.gemm_prevalidated(x, packed=packed, n=n, bias=bias)

    def gemm_prevalidated(self, x: torch.Tensor, *, packed: torch.Tensor, n: int,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """`gemm` without the checks, for a caller that validated its operands once (`Linear`
        binds its packed weight and contiguous bias at pack time): x must be an [M, K] matrix
        of the packed weight's dtype with unit column stride and K matching it."""
        m, k = x.shape
        y = torch.empty((m, n), dtype=x.dtype)
        fn = self._gemm if x.dtype == torch.bfloat16 else self.lib.kvflow_gemm_f32
        rc = fn(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n,
                None if bias is None else bias.data_ptr(), y.data_ptr(), n)
        if rc != 0:
            raise RuntimeError(f"gemm failed (code {rc})")
        return y

    # Fused elementwise ops (csrc/elementwise.cpp). Each takes contiguous rows of a supported dtype.

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """RMSNorm of x, or of (residual += x) when a residual is given; residual is updated in place."""
        hidden = x.shape[-1]
        out = torch.empty_like(x)
        res_ptr = None if residual is None else residual.data_ptr()
        check_rc(self.lib.kvflow_add_rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), res_ptr, weight.data_ptr(),
                                            out.data_ptr(), x.numel() // hidden, hidden, eps), "add_rms_norm")
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 * inter] -> [..., inter]: silu(gate) * up."""
        inter = gate_up.shape[-1] // 2
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
        check_rc(self.lib.kvflow_silu_and_mul(DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(),
                                            gate_up.numel() // (2 * inter), inter), "silu_and_mul")
        return out

    def gather_packed_rows(self, packed: torch.Tensor, rows: int, cells: int, cell: torch.dtype,
                           ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (integers [n]) of a weight of `rows` rows packed in tiles of 16 columns whose
        rows are `cells` cells of dtype `cell` (pack_weight's bf16 pairs or float32 values as
        int32, an 8-bit tile's k pairs as int16): [n, cells] of `cell`. IndexError for an id
        outside [0, rows)."""
        out = torch.empty(ids.numel(), cells, dtype=cell)
        ids = ids.to(torch.int64).contiguous()
        rc = self.lib.kvflow_gather_packed_rows(packed.data_ptr(), rows, out.element_size(), cells, ids.data_ptr(),
                                                ids.numel(), out.data_ptr())
        if rc == ROW_OUT_OF_RANGE:
            raise IndexError(f"gather_packed_rows: an id is out of range for a weight of {rows} rows")
        check_rc(rc, "gather_packed_rows")
        return out

    def gemm_bf16_widened(self, x: torch.Tensor, *, packed: torch.Tensor, n: int,
                          bias: torch.Tensor | None) -> torch.Tensor | None:
        """`gemm_prevalidated` for bf16 with its output widened to float32 as it is stored (a bf16
        LM head's logits, equal to `.float()` of the bf16 result); None where only the AVX2 GEMM
        runs, which has no such store."""
        m, k = x.shape
        y = torch.empty((m, n), dtype=torch.float32)
        rc = self.lib.kvflow_gemm_bf16_widened(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n,
                                               None if bias is None else bias.data_ptr(), y.data_ptr(), n)
        if rc == -2:
            return None
        if rc != 0:
            raise RuntimeError(f"gemm failed (code {rc})")
        return y

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: each row's first maximum (its first NaN where it has one), as
        `logits.max(dim=-1).indices`, for float32 [rows, n] logits with unit column stride."""
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        check_rc(self.lib.kvflow_argmax_rows(logits.data_ptr(), rows, n, logits.stride(0), out.data_ptr()),
                 "argmax_rows")
        return out

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
        """Rotate q [T, Hq, D] and k [T, Hk, D] in place; each may be a row-strided view (fused QKV).

        cos/sin are the float32 [max_position, D] tables; they are rounded to q's dtype as the
        reference does.
        """
        tokens, q_heads, head_dim = q.shape
        for t in (q, k):
            if not heads_contiguous(t) or t.dtype != q.dtype:
                raise ValueError("rotary_: q and k need contiguous heads of one dtype (rows may be strided)")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32 or positions.dtype != torch.int64:
            raise ValueError("rotary_: float32 cos/sin tables and int64 positions expected")
        if cos.shape != sin.shape or cos.shape[1] != head_dim or positions.shape != (tokens,):
            raise ValueError("rotary_: tables must be [max_position, head_dim] and positions one per token")
        rc = self.lib.kvflow_rotary(DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q_heads, k.data_ptr(),
                                    k.stride(0), k.shape[1], positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                    tokens, head_dim, cos.shape[0])
        check_rc(rc, "rotary_", max_position=cos.shape[0])


POSITION_OUT_OF_RANGE = -3  # kvflow_rotary (and the fused stack through it)
OUT_OF_MEMORY = -4  # the fused stack's scratch allocation
TILES_NEED_AMX = -5  # quantized tiles packed in the AMX row layout, run with AMX off
ROW_OUT_OF_RANGE = -6  # kvflow_gather_packed_rows: an id outside the weight's rows


def check_rc(rc: int, name: str, max_position: int | None = None) -> None:
    """A kernel's return code as the Python error it stands for."""
    if rc == 0:
        return
    if rc == POSITION_OUT_OF_RANGE:
        raise IndexError(f"{name}: a position is outside the rotary table's {max_position} positions")
    if rc == OUT_OF_MEMORY:
        raise MemoryError(f"{name}: no memory for the step's scratch buffers")
    if rc == TILES_NEED_AMX:
        raise RuntimeError(f"{name}: quantized tiles packed for AMX (weights as A tiles) while AMX is now off; "
                           "load the model under the AMX setting it runs with (KVFLOW_AMX), and do not switch AMX "
                           "off (set_amx, vector_units) around a model loaded with it on")
    raise ValueError(f"{name}: unsupported input (code {rc})")




def heads_contiguous(x: torch.Tensor) -> bool:
    """[T, heads, head_dim] with each token's heads back to back: what the attention, rotary
    and KV-write kernels take (rows may be strided, as in views of a fused QKV output)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def for_tensors(*tensors: torch.Tensor) -> CPUKernels | None:
    """The kernels when they can take these tensors as they are (CPU, one supported dtype,
    contiguous), else None: the caller's PyTorch path handles everything else."""
    kernels = load()
    if kernels is None:
        return None
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
            return None
    return kernels


@functools.cache
def load() -> CPUKernels | None:
    """The compiled kernels, or None (logged once) when they are disabled or cannot be built."""
    if os.environ.get("KVFLOW_CPU_KERNELS", "1") == "0":
        return None
    try:
        return CPUKernels(build())
    except (RuntimeError, OSError) as exc:
        logger.warning("kvflow CPU kernels unavailable, using the PyTorch path: %s", exc)
        return None


@functools.cache
def load_emulated_avx512() -> CPUKernels:
    """The test-only build whose AVX-512 paths are emulated (see `build`)."""
    return CPUKernels(build(emulate_avx512=True), amx="off")  # never has tiles


if __name__ == "__main__":
    print(build(verbose=True))
