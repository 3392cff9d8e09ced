// Quantized weight tiles as bf16 operands, shared by the vector kernel (quant_gemm_bf16.cpp)
// and the AMX one (quant_gemm_amx.h); quant_gemm_bf16.cpp describes the packed layout.
#pragma once

#include <cstdint>

#include "common.h"

#if defined(KVFLOW_AVX512BF16)
#include <immintrin.h>

namespace kvflow {

// How far ahead in the quant stream to ask for it, into L2: measured at one row, single thread,
// 4-bit 3072 x 576 streamed from memory: 4 KiB into L1 (the bf16 GEMM's setting) 83-120 us,
// 8-32 KiB into L2 54-75 us (the bandwidth the bf16 GEMM gets). A quantized block is more work
// per byte than a bf16 step, so fewer lines are in flight without the hint.
constexpr int64_t kPrefetchBytes = 16384;

// Two k-pair steps (2b, 2b + 1) of one tile as vdpbf16ps operands; kBytes of quants.
template <int Bits>
struct Unpack;

template <>
struct Unpack<4> {
    static constexpr int64_t kBytes = 32;
    static inline void block(const uint8_t* src, __m512i& even, __m512i& odd) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
        even = _mm512_ternarylogic_epi32(bytes, _mm512_set1_epi16(0x000F), bf16_128, 0xEA);  // (a & b) | c
        odd = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), bf16_128);
    }
};

template <>
struct Unpack<8> {
    static constexpr int64_t kBytes = 64;
    static inline __m512i step(const __m128i* src) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // exact: |q| <= 128; lo's 16 values first
    }
    static inline void block(const uint8_t* src, __m512i& even, __m512i& odd) {
        even = step(reinterpret_cast<const __m128i*>(src));
        odd = step(reinterpret_cast<const __m128i*>(src + 32));
    }
};

// A tile's quants (K inputs) unpacked into bf16 operands in the bf16 GEMM's tile layout
// ([K/2][16][2]: v values, exact), for the row blocks of a prefill-sized call to read.
// Blocks [b0, b1) (4 inputs each) of a tile's quants into out[(b - b0) * 64 ...].
template <int Bits>
inline void unpack_blocks(const uint8_t* q, int64_t b0, int64_t b1, uint16_t* out) {
    for (int64_t b = b0; b < b1; ++b) {
        __m512i even, odd;
        if (Bits == 8 || (b & 1) == 0)
            _mm_prefetch(reinterpret_cast<const char*>(q + b * Unpack<Bits>::kBytes + kPrefetchBytes), _MM_HINT_T1);
        Unpack<Bits>::block(q + b * Unpack<Bits>::kBytes, even, odd);
        _mm512_storeu_si512(out + (b - b0) * 64, even);
        _mm512_storeu_si512(out + (b - b0) * 64 + 32, odd);
    }
}

template <int Bits>
void store_tile(const uint8_t* q, int64_t k, uint16_t* out) {
    unpack_blocks<Bits>(q, 0, k / 4, out);
}

// o' for the integers v the vector kernels multiply: o - 128 s for 4 bits (v = 128 + q), o for
// int8. One rounding (128 s is exact), so the same value whichever kernel forms it.
inline __m512 integer_offset(int bits, __m512 s, __m512 o) {
    return bits == 4 ? _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s, o) : o;
}

// X[m, g]: a group's inputs summed in float32, one fixed order for every caller.
inline float group_sum(const uint16_t* x, int64_t group) {
    __m512 v = _mm512_setzero_ps();
    for (int64_t i = 0; i < group; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail_mask(group - i), x + i));
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
    return reduce_add16(v);  // gcc's order for _mm512_reduce_add_ps, on every compiler
}

}  // namespace kvflow
#endif
