// The register-blocked AVX-512 float32 product behind kvflow's float32 GEMM (the float32
// twin of dpbf16.h).
//
// out[m, j*16 + lane] = sum_k x[m, k] * W[j][k][lane]   (one FMA per k, in k order)
// x: MT rows of float32, rows `x_stride` apart, one broadcast per (row, k).
// W: NT tiles of a packed weight, each [k][16] float32, tiles `tile_stride` apart: one
// 64-byte load feeds MT FMAs. All MT x NT accumulators stay in registers;
// `store(m, j, acc)` receives each finished 16-column accumulator.
#pragma once

#include <cstdint>

#include "common.h"

#if defined(KVFLOW_AVX512F)
#include <immintrin.h>

namespace kvflow {

constexpr int64_t kPrefetchK = 16;  // 1 KiB ahead in each weight stream

template <int MT, int NT, typename Store>
inline void fma_f32_block(const float* x, int64_t x_stride, const float* tile0, int64_t tile_stride, int64_t k,
                          Store& store, const float* next = nullptr) {
    __m512 acc[MT][NT];
    for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
        __m512 w[NT];
        for (int j = 0; j < NT; ++j) {
            const float* src = tile0 + j * tile_stride + kk * 16;
            _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchK * 16), _MM_HINT_T0);
            if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + j * tile_stride + kk * 16), _MM_HINT_T1);
            w[j] = _mm512_loadu_ps(src);
        }
        for (int m = 0; m < MT; ++m) {
            const __m512 xb = _mm512_set1_ps(x[m * x_stride + kk]);
            for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_fmadd_ps(xb, w[j], acc[m][j]);
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NT; ++j) store(m, j, acc[m][j]);
}

}  // namespace kvflow
#endif
