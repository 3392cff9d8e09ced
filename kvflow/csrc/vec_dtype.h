// A storage dtype's round and store (common.h's Dt::round, Dt::store) on 16 lanes (AVX-512) or
// 8 lanes (AVX2 + FMA), the same bits as the scalar forms: the elementwise kernels and the MoE
// block's weighted sums round where the reference rounds, a vector at a time.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.h"  // and isa.h: KVFLOW_AVX512F, KVFLOW_REF_AVX2

namespace kvflow {

// The storage dtypes these know: bf16 rounds, float32 keeps every bit.
template <typename Dt>
constexpr bool kVecDtype = std::is_same_v<Dt, BF16> || std::is_same_v<Dt, F32>;

#if defined(KVFLOW_AVX512F)
// Dt::round and Dt::store on 16 lanes, the same bits (bf16_bits16 is float_to_bf16).
template <typename Dt>
inline __m512 round16(__m512 v) {
    static_assert(kVecDtype<Dt>);
    if constexpr (std::is_same_v<Dt, BF16>) return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
    return v;
}
template <typename Dt>
inline void store16(typename Dt::T* dst, __m512 v) {
    static_assert(kVecDtype<Dt>);
    if constexpr (std::is_same_v<Dt, BF16>)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(bf16_bits16(v)));
    else
        _mm512_storeu_ps(dst, v);
}
#elif defined(KVFLOW_REF_AVX2)
// The same on 8 lanes for CPUs with AVX2 and FMA: float_to_bf16's rounding (NaN kept quiet) as
// 32-bit lanes holding the bf16 bits, Dt::round and Dt::store (kvflow::load8 loads).
inline __m256i bf16_bits8(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}
template <typename Dt>
inline __m256 round8(__m256 v) {
    static_assert(kVecDtype<Dt>);
    if constexpr (std::is_same_v<Dt, BF16>) return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
    return v;
}
template <typename Dt>
inline void store8(typename Dt::T* dst, __m256 v) {
    static_assert(kVecDtype<Dt>);
    if constexpr (std::is_same_v<Dt, BF16>) {
        const __m256i b = bf16_bits8(v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                         _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    } else {
        _mm256_storeu_ps(dst, v);
    }
}
#endif

}  // namespace kvflow
