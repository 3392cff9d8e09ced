// The packed GEMM (gemm.cpp) on CPUs with AVX2 and FMA but no AVX-512: the same packed weights,
// and every output summed in the same order as the AVX-512 kernels, so the bits are the same.
//
//   float32: out += x[m, k] * W[k][lane], one FMA per k, in k order (fma_f32.h's order);
//   bf16:    per k-pair, the odd k's product then the even k's, as FMAs under DAZ/FTZ: exactly
//            vdpbf16ps (dpbf16.h's FMA block, which tests/layers/test_bf16_dot.py checks).
//
// A 16-column tile is two 8-lane halves here. With 16 vector registers a block holds MT rows x 2
// halves of accumulators plus the tile's weight vectors: 6 rows in float32 (12 + 2 + 1) and 4 in
// bf16 (8 + 4 even/odd + 2; 5 rows left too few registers and ran 30 % slower). One or two rows
// take both tiles of a chunk at once. The driver (gemm.cpp) gives each thread chunks of kNT tiles
// whose weights stay in cache while every row block passes over them, as on AVX-512.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common.h"

#if defined(KVFLOW_AVX2_GEMM)
#include <immintrin.h>

namespace kvflow {

constexpr int kAvx2RowsF32 = 6, kAvx2RowsBF16 = 4, kAvx2WideRows = 2;
constexpr int64_t kAvx2WidenFrom = 16;  // bf16 rows from which gemm.cpp widens each chunk's weights
constexpr int64_t kAvx2PrefetchBytes = 4096;  // ahead in the weight stream, into L1

// vcvtneps2bf16 on one value: denormals read as signed zero, NaN kept quiet, else round to
// nearest even (isa.h's emulation of the instruction, which the AVX-512 path runs).
inline uint16_t avx2_round_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float avx2_out(float v, const float* bias, int64_t c) { return bias != nullptr ? v + bias[c] : v; }
inline uint16_t avx2_out(float v, const uint16_t* bias, int64_t c) {
    return avx2_round_bf16(bias != nullptr ? v + bf16_to_float(bias[c]) : v);
}

// rows x `cols` finished sums (`v`: rows of `width` floats) + bias, rounded to the output dtype.
// Out of line, and fed from memory: an accumulator still live at a call, or a vectorized rounding's
// constants hoisted above the k loop, made GCC keep accumulators on the stack through the loop.
template <typename T>
__attribute__((noinline)) void avx2_store_rows(const float* v, int64_t rows, int64_t width, const T* bias, T* y,
                                               int64_t y_stride, int64_t cols) {
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = 0; c < cols; ++c) y[m * y_stride + c] = avx2_out(v[m * width + c], bias, c);
}

// Each block stores its rows' columns [col0, col0 + NT * 16) clipped to `cols` (<= NT * 16).
template <int MT, int NT, typename T>
inline void avx2_store_block(const __m256 (&acc)[MT][2 * NT], const T* bias, T* y, int64_t y_stride, int64_t cols) {
    alignas(32) float v[MT][2 * NT][8];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
        for (int h = 0; h < 2 * NT; ++h) _mm256_store_ps(v[m][h], acc[m][h]);
    avx2_store_rows(&v[0][0][0], MT, 16 * NT, bias, y, y_stride, cols);
}

// y[0:MT, 0:cols] = x @ (NT packed float32 tiles [k][16], `tile_stride` apart) (+ bias).
// NT = 2 serves one or two rows: four accumulator chains instead of two hide the FMA latency.
// T: the output's dtype. Flush: the FMAs under DAZ/FTZ (bf16 products: avx2_bf16_block's
// rules, on weights avx2_widen_tiles made float32).
template <int MT, int NT, bool Flush = false, typename T = float>
inline void avx2_f32_block(const float* x, int64_t x_stride, const float* tile0, int64_t tile_stride, int64_t k,
                           const T* bias, T* y, int64_t y_stride, int64_t cols) {
    __m256 acc[MT][2 * NT];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
        for (int h = 0; h < 2 * NT; ++h) acc[m][h] = _mm256_setzero_ps();
    {
        struct NoFlush {};
        [[maybe_unused]] const std::conditional_t<Flush, FlushDenormals, NoFlush> flush;
        for (int64_t kk = 0; kk < k; ++kk) {
            __m256 w[2 * NT];
#pragma GCC unroll 4
            for (int j = 0; j < NT; ++j) {
                const float* src = tile0 + j * tile_stride + kk * 16;
                _mm_prefetch(reinterpret_cast<const char*>(src) + kAvx2PrefetchBytes, _MM_HINT_T0);
                w[2 * j] = _mm256_loadu_ps(src);
                w[2 * j + 1] = _mm256_loadu_ps(src + 8);
            }
#pragma GCC unroll 16
            for (int m = 0; m < MT; ++m) {
                const __m256 xb = _mm256_broadcast_ss(x + m * x_stride + kk);
#pragma GCC unroll 8
                for (int h = 0; h < 2 * NT; ++h) acc[m][h] = _mm256_fmadd_ps(xb, w[h], acc[m][h]);
            }
        }
    }
    avx2_store_block<MT, NT>(acc, bias, y, y_stride, cols);
}

// The same with NT packed bf16 tiles [k/2][16][2], `wide`: the MT rows of x widened to float32,
// `wide_stride` apart. Each 32-byte half of a k-pair's 64 bytes holds 8 columns as
// (odd k) << 16 | (even k): a mask and a shift make the two float32 operands.
template <int MT, int NT>
inline void avx2_bf16_block(const float* wide, int64_t wide_stride, const uint16_t* tile0, int64_t tile_stride,
                            int64_t pairs, const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t cols) {
    __m256 acc[MT][2 * NT];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
        for (int h = 0; h < 2 * NT; ++h) acc[m][h] = _mm256_setzero_ps();
    {
        const FlushDenormals flush;
        const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
        for (int64_t p = 0; p < pairs; ++p) {
            __m256 odd[2 * NT], even[2 * NT];
#pragma GCC unroll 8
            for (int h = 0; h < 2 * NT; ++h) {
                const uint16_t* src = tile0 + (h / 2) * tile_stride + p * 32 + (h % 2) * 16;
                if (h % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(src) + kAvx2PrefetchBytes, _MM_HINT_T0);
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
                odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            }
#pragma GCC unroll 16
            for (int m = 0; m < MT; ++m) {
                const float* xk = wide + m * wide_stride + 2 * p;
                const __m256 xo = _mm256_broadcast_ss(xk + 1), xe = _mm256_broadcast_ss(xk);
#pragma GCC unroll 8
                for (int h = 0; h < 2 * NT; ++h) acc[m][h] = _mm256_fmadd_ps(xo, odd[h], acc[m][h]);
#pragma GCC unroll 8
                for (int h = 0; h < 2 * NT; ++h) acc[m][h] = _mm256_fmadd_ps(xe, even[h], acc[m][h]);
            }
        }
    }
    // The bias is added outside DAZ/FTZ, as on AVX-512, where the store follows the block.
    avx2_store_block<MT, NT>(acc, bias, y, y_stride, cols);
}

// For products of many rows, where the arithmetic sets the pace: `tiles` packed bf16 tiles
// (`tile_stride` apart) as float32 tiles [k][16] into `out` (k * 16 floats each), each k-pair's
// odd k first. With x widened in the same order (avx2_widen_rows' `odd_first`), the float32
// block's one FMA per k in order is exactly avx2_bf16_block's sequence (under DAZ/FTZ), without
// the mask and shift per weight load on every row block: these run once per chunk instead.
inline void avx2_widen_tiles(const uint16_t* tile0, int64_t tile_stride, int64_t tiles, int64_t pairs, float* out) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t j = 0; j < tiles; ++j)
        for (int64_t p = 0; p < pairs; ++p) {
            const uint16_t* src = tile0 + j * tile_stride + p * 32;
            float* dst = out + (j * pairs * 2 + 2 * p) * 16;
            for (int h = 0; h < 2; ++h) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * h));
                _mm256_storeu_ps(dst + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(v, high)));     // odd k
                _mm256_storeu_ps(dst + 16 + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));  // even k
            }
        }
}

// Rows [0, rows) of bf16 x as float32 into `wide` (rows x k, dense): exact. `odd_first`: each
// pair (x[2p], x[2p + 1]) stored as (x[2p + 1], x[2p]), the order of avx2_widen_tiles.
inline void avx2_widen_rows(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k, float* wide,
                            bool odd_first = false) {
    for (int64_t m = 0; m < rows; ++m) {
        const uint16_t* src = x + m * x_stride;
        float* dst = wide + m * k;
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) {
            __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
            if (odd_first) v = _mm256_shuffle_epi32(v, 0xB1);  // swap the lanes of each pair
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
        for (; i < k; ++i) dst[odd_first ? i ^ 1 : i] = bf16_to_float(src[i]);
    }
}

}  // namespace kvflow
#endif
