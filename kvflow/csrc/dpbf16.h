// The register-blocked AVX512-BF16 product at the heart of kvflow's bf16 kernels.
//
// out[m, j*16 + lane] = sum_p x[m, 2p:2p+2] . W[j][p][lane][0:2]   (float32 accumulation)
// x: MT rows of bf16, rows `x_stride` apart, read as k-pairs (one 32-bit broadcast per pair).
// W: NT tiles of a packed weight, each [pairs][16][2] bf16, tiles `tile_stride` apart: one
// 64-byte load feeds one vdpbf16ps (16 output columns x 2 k). All MT x NT accumulators stay
// in registers; `store(m, j, acc)` receives each finished 16-column accumulator.
// `next` (optional): NT tiles laid out like tile0's, pulled into L2 one line per weight load,
// so a block that reads cached weights streams the next block's from memory meanwhile.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(KVFLOW_AVX512BF16)
#include <immintrin.h>

namespace kvflow {

constexpr int64_t kPrefetchPairs = 64;  // 4 KiB ahead in each weight stream

// k-pair p of tile j (64 bytes: 16 columns x 2 k), asking for its stream 4 KiB ahead into L1
// and, with `next`, for the same place of the next chunk's tiles into L2.
inline __m512i load_pair(const uint16_t* tile0, int64_t tile_stride, int j, int64_t p, const uint16_t* next) {
    const uint16_t* src = tile0 + j * tile_stride + p * 32;
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * 32), _MM_HINT_T0);
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + j * tile_stride + p * 32), _MM_HINT_T1);
    return _mm512_loadu_si512(src);
}

template <int MT, int NT, typename Store>
inline void dpbf16_block(const uint16_t* x, int64_t x_stride, const uint16_t* tile0, int64_t tile_stride,
                         int64_t pairs, Store& store, const uint16_t* next = nullptr) {
    __m512 acc[MT][NT];
    for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh w[NT];
        for (int j = 0; j < NT; ++j) w[j] = (__m512bh)load_pair(tile0, tile_stride, j, p, next);
        for (int m = 0; m < MT; ++m) {
            int32_t pair;
            std::memcpy(&pair, x + m * x_stride + 2 * p, sizeof(pair));
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, w[j]);
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NT; ++j) store(m, j, acc[m][j]);
}

#if !defined(KVFLOW_SIMDE)
// vdpbf16ps done as float32 FMAs, for CPUs where it issues at a quarter of their FMA rate (an
// Intel Xeon in a VM, CPU family 6 model 207: ~1.4 G vdpbf16ps/s per core against ~4.9 G
// FMA/s; in cache, 4-12 rows x 2 tiles, the FMA block below does 1.4-1.6x the MACs/s). The same
// bits: vdpbf16ps is, per lane, an FMA of the odd pair's product into the accumulator and then one
// of the even pair's, denormal inputs and results flushed (isa.h spells it out); bf16 -> float32
// is exact, so running exactly those FMAs under DAZ and FTZ gives its results.

// Rows [0, rows) of x (bf16, k values each, `x_stride` apart) as float32 in a per-thread buffer
// (common.h's scratch_floats), or null out of memory: each k then costs a broadcast load, not an
// ALU operation.
inline float* widen_rows(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k) {
    float* const wide = scratch_floats(rows * k);
    if (wide == nullptr) return nullptr;
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t i = 0; i < k; i += 16) {
            const __mmask16 mask = tail_mask(k - i);
            const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x + m * x_stride + i));
            _mm512_mask_storeu_ps(wide + m * k + i, mask, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        }
    return wide;
}

// One vdpbf16ps operand (16 lanes of a k-pair, each lane (odd k) << 16 | (even k)) as float32.
inline __m512 even_k(__m512i pair) { return _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)); }
inline __m512 odd_k(__m512i pair) {
    return _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// acc = vdpbf16ps(acc, (x[k], x[k + 1]), (even, odd)) with `wide` x in float32.
inline __m512 fma_pair(__m512 acc, const float* wide_k, __m512 even, __m512 odd) {
    acc = _mm512_fmadd_ps(_mm512_set1_ps(wide_k[1]), odd, acc);
    return _mm512_fmadd_ps(_mm512_set1_ps(wide_k[0]), even, acc);
}

// fma_bf16_block on rows already widened: row m's float32 k values at wide + m * wide_stride
// (prefill attention widens its queries once per head, and keeps its probabilities in float32).
template <int MT, int NT, typename Store>
inline void fma_bf16_block_wide(const float* wide, int64_t wide_stride, const uint16_t* tile0, int64_t tile_stride,
                                int64_t pairs, Store& store, const uint16_t* next = nullptr) {
    // Loops unrolled by request: left to itself, GCC 12 kept the accumulators of an 8 x 2 block
    // on the stack (a load and a store around every FMA): 1.2-1.6x the time.
    __m512 acc[MT][NT];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
    {
        const FlushDenormals flush;
        for (int64_t p = 0; p < pairs; ++p) {
            __m512 even[NT], odd[NT];
#pragma GCC unroll 4
            for (int j = 0; j < NT; ++j) {
                const __m512i w = load_pair(tile0, tile_stride, j, p, next);
                even[j] = even_k(w);
                odd[j] = odd_k(w);
            }
#pragma GCC unroll 16
            for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
                for (int j = 0; j < NT; ++j) acc[m][j] = fma_pair(acc[m][j], wide + m * wide_stride + 2 * p, even[j], odd[j]);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) store(m, j, acc[m][j]);
}

template <int MT, int NT, typename Store>
inline void fma_bf16_block(const uint16_t* x, int64_t x_stride, const uint16_t* tile0, int64_t tile_stride,
                           int64_t pairs, Store& store, const uint16_t* next = nullptr) {
    const float* const wide = widen_rows(x, x_stride, MT, 2 * pairs);
    if (wide == nullptr)  // out of memory: the instruction gives the same bits
        return dpbf16_block<MT, NT>(x, x_stride, tile0, tile_stride, pairs, store, next);
    fma_bf16_block_wide<MT, NT>(wide, 2 * pairs, tile0, tile_stride, pairs, store, next);
}
#endif

// Whether GEMM blocks of kMinFmaRows rows or more run the FMA block, and prefill attention its
// FMA path (prefill_item.h, blocks of every size), both giving vdpbf16ps's bits: set once by
// kvflow_set_bf16_dot (layers/cpu_choices.py picks the faster on this CPU at load). GEMM blocks
// of fewer rows stay on vdpbf16ps: there the weight stream, not the arithmetic, sets the pace,
// and the FMA block's two extra operations per weight load measured 15 % slower at 1-2 rows.
constexpr int kMinFmaRows = 4;

inline bool& bf16_dot_with_fma() {
    static bool with_fma = false;
    return with_fma;
}

template <int MT, int NT, typename Store>
inline void bf16_block(const uint16_t* x, int64_t x_stride, const uint16_t* tile0, int64_t tile_stride,
                       int64_t pairs, Store& store, const uint16_t* next = nullptr) {
#if !defined(KVFLOW_SIMDE)
    if (MT >= kMinFmaRows && bf16_dot_with_fma())
        return fma_bf16_block<MT, NT>(x, x_stride, tile0, tile_stride, pairs, store, next);
#endif
    dpbf16_block<MT, NT>(x, x_stride, tile0, tile_stride, pairs, store, next);
}

}  // namespace kvflow
#endif
