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

template <int MT, int NT, typename Store>
inline void dpbf16_block(const uint16_t* x, int64_t x_stride, const uint16_t* tile0, int64_t tile_stride,
                         int64_t pairs, Store& store, const uint16_t* next = nullptr) {
    __m512 acc[MT][NT];
    for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh w[NT];
        for (int j = 0; j < NT; ++j) {
            const uint16_t* src = tile0 + j * tile_stride + p * 32;
            _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * 32), _MM_HINT_T0);
            if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + j * tile_stride + p * 32), _MM_HINT_T1);
            w[j] = (__m512bh)_mm512_loadu_si512(src);
        }
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

}  // namespace kvflow
#endif
