// 4-bit weights with bf16 activations on AVX512-BF16, with no weight rounded to bf16:
//
//     y[m, n] = sum over groups g of  s[g, n] * A[m, g, n] + o'[g, n] * X[m, g]   (+ bias)
//     A[m, g, n] = sum_{k in g} x[m, k] * (128 + q[k, n])    vdpbf16ps chains, float32
//     X[m, g]    = sum_{k in g} x[m, k]                       float32 (group_sum)
//     o'[g, n]   = o[g, n] - 128 * s[g, n]                    made once, at pack time
//
// which is sum_k x[m, k] * (q[k, n] * s + o) in float32, group by group. Why this form: for
// q in 0..15, 128 + q is the bf16 whose bits are 0x4300 | q, so a 4-bit weight becomes
// vdpbf16ps's operand in one bitwise operation. Dequantizing each weight in float32 and
// rounding it to bf16 (what 8-bit tiles do, quant_gemm_bf16.cpp) takes about 11 vector
// operations per 32 weights, which made a 4-bit decode step compute-bound at the speed of a
// bf16 one; here it is 2. The weights are exact rather than rounded to bf16; the price is the
// per-group scale and offset (two FMAs per 16 columns and group) and a result that equals the
// bf16 GEMM on bf16(dequantize()) only up to that rounding.
//
// Every row's result is the same chain of operations whatever M is and whichever path (quants
// unpacked in registers for decode rows, or a stored tile for prefill) runs it: batch-invariant.
//
// Layout (kvflow_pack_quant_tiles, bits 4): per tile of 16 columns, 32 bytes per two k-pair
// steps; byte e of block b holds element e of step 2b in its low nibble and of step 2b + 1 in
// its high one (element e = 2 * column + (k & 1), vdpbf16ps's pairing).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "common.h"
#include "gemm_blocking.h"

#if defined(KVFLOW_AVX512BF16)
#include <immintrin.h>

namespace kvflow::int4 {

constexpr int64_t kBlockBytes = 32;       // two k-pair steps of one tile
// How far ahead in the quant stream to ask for it, into L2: measured at one row, single thread,
// 3072 x 576, streamed from memory: 4 KiB into L1 (the bf16 GEMM's setting) 83-120 us, 8-32 KiB
// into L2 54-75 us (the bandwidth the bf16 GEMM gets). A 4-bit block is more work per byte than
// a bf16 step, so fewer lines are in flight without the hint.
constexpr int64_t kPrefetchBytes = 16384;
constexpr int64_t kRegisterRows = 8;      // up to this many rows unpack the quants in registers

// Steps 2b and 2b + 1 of one tile as vdpbf16ps operands: 32 bf16 values 128 + q each.
inline void unpack_block(const uint8_t* src, __m512i& even, __m512i& odd) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
    even = _mm512_ternarylogic_epi32(bytes, _mm512_set1_epi16(0x000F), bf16_128, 0xEA);  // (a & b) | c
    odd = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), bf16_128);
}

// Where a block's operands come from: the packed quants (decode rows) ...
struct PackedQuants {
    const uint8_t* q;  // the chunk's first tile
    int64_t tile_bytes;
    inline void block(int j, int64_t b, __m512i& even, __m512i& odd) const {
        const uint8_t* src = q + j * tile_bytes + b * kBlockBytes;
        // One stream over the whole weight: ask for it 4 KiB ahead, or each block waits on its load.
        if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T1);
        unpack_block(src, even, odd);
    }
};

// ... or a tile unpacked once per call into memory (prefill rows; `store_tile`).
struct StoredTile {
    const uint16_t* tile;
    int64_t tile_stride;  // uint16 elements between tiles
    inline void block(int j, int64_t b, __m512i& even, __m512i& odd) const {
        const uint16_t* src = tile + j * tile_stride + b * 64;
        even = _mm512_loadu_si512(src);
        odd = _mm512_loadu_si512(src + 32);
    }
};

inline void store_tile(const uint8_t* q, int64_t k, uint16_t* out) {
    for (int64_t b = 0; b < k / 4; ++b) {
        __m512i even, odd;
        unpack_block(q + b * kBlockBytes, even, odd);
        _mm512_storeu_si512(out + b * 64, even);
        _mm512_storeu_si512(out + b * 64 + 32, odd);
    }
}

// X[m, g]: a group's inputs summed in float32, one fixed order for every caller.
inline float group_sum(const uint16_t* x, int64_t group) {
    __m512 v = _mm512_setzero_ps();
    for (int64_t i = 0; i < group; i += 16) v = _mm512_add_ps(v, load16(x + i));
    return _mm512_reduce_add_ps(v);
}

struct Weight {
    const uint8_t* q;
    const float* scales;   // [tiles][groups][16]
    const float* offsets;  // o' = o - 128 s, same shape
    int64_t group, k;
    int64_t groups() const { return k / group; }
    int64_t tile_bytes() const { return k * 8; }  // 16 columns x k x half a byte
};

// MT rows x NT tiles. `out` accumulates across groups in memory (L1) so that the group's
// MT x NT vdpbf16ps accumulators keep the registers.
template <int MT, int NT, typename Source, typename Store>
inline void grouped_block(const uint16_t* x, int64_t x_stride, const float* xsums, const Weight& w, int64_t tile0,
                          const Source& src, Store& store) {
    const int64_t groups = w.groups(), blocks_per_group = w.group / 4;
    const float* s = w.scales + tile0 * groups * 16;
    const float* o = w.offsets + tile0 * groups * 16;
    alignas(64) float out[MT][NT][16] = {};
    for (int64_t g = 0; g < groups; ++g) {
        __m512 acc[MT][NT];
        for (int m = 0; m < MT; ++m)
            for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
        for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
            __m512i even[NT], odd[NT];
            for (int j = 0; j < NT; ++j) src.block(j, b, even[j], odd[j]);
            for (int m = 0; m < MT; ++m) {
                int32_t pair0, pair1;  // two 4-byte loads: each becomes a broadcast from memory
                std::memcpy(&pair0, x + m * x_stride + 4 * b, sizeof(pair0));
                std::memcpy(&pair1, x + m * x_stride + 4 * b + 2, sizeof(pair1));
                const __m512bh x0 = (__m512bh)_mm512_set1_epi32(pair0), x1 = (__m512bh)_mm512_set1_epi32(pair1);
                for (int j = 0; j < NT; ++j) {
                    acc[m][j] = _mm512_dpbf16_ps(acc[m][j], x0, (__m512bh)even[j]);
                    acc[m][j] = _mm512_dpbf16_ps(acc[m][j], x1, (__m512bh)odd[j]);
                }
            }
        }
        for (int j = 0; j < NT; ++j) {
            const __m512 sj = _mm512_loadu_ps(s + (j * groups + g) * 16), oj = _mm512_loadu_ps(o + (j * groups + g) * 16);
            for (int m = 0; m < MT; ++m) {
                __m512 v = _mm512_fmadd_ps(acc[m][j], sj, _mm512_load_ps(out[m][j]));
                v = _mm512_fmadd_ps(_mm512_set1_ps(xsums[m * groups + g]), oj, v);
                _mm512_store_ps(out[m][j], v);
            }
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NT; ++j) store(m, j, _mm512_load_ps(out[m][j]));
}

template <int NT, typename Source, typename Store>
inline void rows(int64_t rows, const uint16_t* x, int64_t x_stride, const float* xsums, const Weight& w, int64_t tile0,
                 const Source& src, Store& store) {
    with_block_rows(rows, [&](auto mt) {
        grouped_block<decltype(mt)::value, NT>(x, x_stride, xsums, w, tile0, src, store);
    });
}

// Out: bf16 (bias bf16) or float32 (bias float32): StoreRow<BF16> / StoreRow<F32>.
template <typename Out>
int gemm(const uint16_t* x, int64_t m, int64_t x_stride, const Weight& w, int64_t n, const typename Out::T* bias,
         typename Out::T* y, int64_t y_stride) {
    const int64_t groups = w.groups(), tile_stride = w.k * kTileCols;
    std::unique_ptr<float[]> xsums(new (std::nothrow) float[static_cast<size_t>(m * groups)]);
    if (!xsums) return -3;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t g = 0; g < groups; ++g) xsums[r * groups + g] = group_sum(x + r * x_stride + g * w.group, w.group);
        // (the loop's barrier: every row's sums are in place before any chunk reads them)
        uint16_t* tiles = m <= kRegisterRows
                              ? nullptr
                              : static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(kNT * tile_stride) * 2));
        if (m > kRegisterRows && tiles == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
        const int64_t chunks = (n + kTileCols * kNT - 1) / (kTileCols * kNT);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t n0 = c * kTileCols * kNT, tile0 = n0 / kTileCols;
            const bool full = (n - n0 + kTileCols - 1) / kTileCols >= kNT;
            if (m <= kRegisterRows) {
                const PackedQuants src{w.q + tile0 * w.tile_bytes(), w.tile_bytes()};
                StoreRow<Out> store{y, y_stride, n0, n, bias};
                if (full)
                    rows<kNT>(m, x, x_stride, xsums.get(), w, tile0, src, store);
                else
                    rows<1>(m, x, x_stride, xsums.get(), w, tile0, src, store);
                continue;
            }
            if (tiles == nullptr) continue;  // out of memory: `failed` is set
            for (int64_t t = 0; t < (full ? kNT : 1); ++t)
                store_tile(w.q + (tile0 + t) * w.tile_bytes(), w.k, tiles + t * tile_stride);
            const StoredTile src{tiles, tile_stride};
            for_each_row_block(m, [&](int64_t r, int64_t block_rows) {
                StoreRow<Out> store{y + r * y_stride, y_stride, n0, n, bias};
                if (full)
                    rows<kNT>(block_rows, x + r * x_stride, x_stride, xsums.get() + r * groups, w, tile0, src, store);
                else
                    rows<1>(block_rows, x + r * x_stride, x_stride, xsums.get() + r * groups, w, tile0, src, store);
            });
        }
        std::free(tiles);
    }
    return failed ? -3 : 0;
}

}  // namespace kvflow::int4
#endif
