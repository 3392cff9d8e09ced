// One storage dtype's side of the GEMM microkernels, behind one name for the code that runs
// them in either dtype (gemm.cpp, prefill_attention.cpp): G consecutive k per lane of a
// packed operand (vdpbf16ps takes bf16 k in pairs), the register-blocked product for any
// row count up to kMaxBlockRows (the blocks of dpbf16.h, fma_f32.h), and masked loads and
// stores between float32 vectors and T.
#pragma once

#include <cstdint>

#include "common.h"
#include "dpbf16.h"
#include "fma_f32.h"

#if defined(KVFLOW_AVX512F)
#include <immintrin.h>

namespace kvflow {

template <typename Dt>
struct Micro;

#if defined(KVFLOW_AVX512BF16)
template <>
struct Micro<BF16> {
    static constexpr int64_t G = 2;
    // Rows per register block past 64 rows (gemm_blocking.h): as at decode sizes. On CPU family
    // 26, 8-row blocks ran the quantized tiles (which share this blocking) at 128-2,048 rows at
    // half the speed of 12-row ones; the bf16 GEMM within noise either way.
    static constexpr int64_t kPrefillRows = kMaxBlockRows;
    template <int NT, typename Store>
    static void rows(int64_t rows, const uint16_t* x, int64_t x_stride, const uint16_t* tile0, int64_t tile_stride,
                     int64_t steps, Store& store, const uint16_t* next = nullptr) {
        with_block_rows(rows, [&](auto mt) {
            bf16_block<decltype(mt)::value, NT>(x, x_stride, tile0, tile_stride, steps, store, next);
        });
    }
    static inline __m512 load(const uint16_t* p, __mmask16 mask) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
    }
    static inline void store(uint16_t* p, __m512 v, __mmask16 mask) {  // rounded to nearest even
        _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
    static inline __m512 round(__m512 v) {  // what load gives after store
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
    }
};
#endif

template <>
struct Micro<F32> {
    static constexpr int64_t G = 1;
    static constexpr int64_t kPrefillRows = 8;  // 12-row blocks measured 3-6 % slower (CPU family 25)
    template <int NT, typename Store>
    static void rows(int64_t rows, const float* x, int64_t x_stride, const float* tile0, int64_t tile_stride,
                     int64_t steps, Store& store, const float* next = nullptr) {
        with_block_rows(rows, [&](auto mt) {
            fma_f32_block<decltype(mt)::value, NT>(x, x_stride, tile0, tile_stride, steps, store, next);
        });
    }
    static inline __m512 load(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
    static inline void store(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
};

}  // namespace kvflow
#endif
