// Which AVX-512 code paths the kernels compile, and with what.
//
// Natively: KVFLOW_AVX512F where the compiler targets AVX-512F (-march=native on such a CPU)
// and KVFLOW_AVX512BF16 where it also targets AVX512-BF16.
//
// KVFLOW_SIMDE (test builds only, cpu_kernels.build(emulate_avx512=True)): both paths on any
// x86-64 CPU, every AVX-512 intrinsic emulated by the SIMDe headers (the `simde-py` package).
// Slow, but the same operations in the same order, so CI machines without AVX-512 still check
// the AVX-512 kernels' numerics against the portable reference (attention_ref.h). The
// instructions SIMDe lacks or gets differently (masked memory access, the bf16 dot product) are
// spelled out here as Intel documents them.
#pragma once

#if defined(KVFLOW_SIMDE)
#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#define KVFLOW_AVX512F 1
#define KVFLOW_AVX512BF16 1

namespace kvflow::simde_shim {

inline float flush_denormal(float x) {  // DAZ / FTZ: a denormal reads (or is written) as signed zero
    return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x;
}

inline float bf16_bits_to_float(uint16_t b) {
    const uint32_t bits = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

// vcvtneps2bf16: round to nearest even, denormal inputs read as zero, NaN kept quiet.
inline __m256i cvtneps_pbh(__m512 x) {
    alignas(64) float in[16];
    alignas(32) uint16_t out[16];
    _mm512_store_ps(in, x);
    for (int i = 0; i < 16; ++i) {
        uint32_t bits;
        const float f = flush_denormal(in[i]);
        std::memcpy(&bits, &f, sizeof(bits));
        out[i] = (bits & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((bits >> 16) | 0x40)
                                                     : static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(out));
}

// vcvtne2ps2bf16: b's 16 values, then a's, each rounded as above.
inline __m512i cvtne2ps_pbh(__m512 a, __m512 b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(cvtneps_pbh(b)), cvtneps_pbh(a), 1);
}
// vdpbf16ps as Intel's pseudo-code has it: per lane, the odd pair's product is added to the
// accumulator, then the even pair's, each an FMA with denormal inputs and results flushed.
// (SIMDe adds the two products together first, which rounds differently.)
inline __m512 dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
    alignas(64) float s[16];
    alignas(64) uint16_t x[32], y[32];
    _mm512_store_ps(s, acc);
    std::memcpy(x, &a, sizeof(x));
    std::memcpy(y, &b, sizeof(y));
    for (int i = 0; i < 16; ++i) {
        float r = flush_denormal(s[i]);
        for (int j : {2 * i + 1, 2 * i}) {
            const float u = flush_denormal(bf16_bits_to_float(x[j])), v = flush_denormal(bf16_bits_to_float(y[j]));
            r = flush_denormal(std::fma(u, v, r));
        }
        s[i] = r;
    }
    return _mm512_load_ps(s);
}

// Masked loads and stores touch only the lanes in the mask, as the instructions do (SIMDe's
// read and write all 64 bytes, past the end of a row and over its neighbours).
inline void mask_storeu_ps(void* p, __mmask16 k, __m512 v) {
    alignas(64) float lane[16];
    _mm512_store_ps(lane, v);
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) std::memcpy(static_cast<float*>(p) + i, &lane[i], sizeof(float));
}

inline void mask_storeu_epi16(void* p, __mmask16 k, __m256i v) {
    alignas(32) uint16_t lane[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane), v);
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) std::memcpy(static_cast<uint16_t*>(p) + i, &lane[i], sizeof(uint16_t));
}

inline __m512 maskz_loadu_ps(__mmask16 k, const void* p) {
    alignas(64) float lane[16] = {};
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) std::memcpy(&lane[i], static_cast<const float*>(p) + i, sizeof(float));
    return _mm512_load_ps(lane);
}

inline __m256i maskz_loadu_epi16(__mmask16 k, const void* p) {
    alignas(32) uint16_t lane[16] = {};
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) std::memcpy(&lane[i], static_cast<const uint16_t*>(p) + i, sizeof(uint16_t));
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(lane));
}

// vpmovzxbw (zmm): 32 bytes zero-extended to 32 words; this SIMDe has only the signed form.
inline __m512i cvtepu8_epi16(__m256i a) {
    alignas(32) uint8_t in[32];
    alignas(64) uint16_t out[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(in), a);
    for (int i = 0; i < 32; ++i) out[i] = in[i];
    return _mm512_load_si512(out);
}

// vpmovsxbd (zmm): 16 bytes sign-extended to 16 doublewords, also missing from this SIMDe.
inline __m512i cvtepi8_epi32(__m128i a) {
    alignas(16) int8_t in[16];
    alignas(64) int32_t out[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(in), a);
    for (int i = 0; i < 16; ++i) out[i] = in[i];
    return _mm512_load_si512(out);
}

// vpmovdw and vpmovdb (zmm): each doubleword truncated to its low word or byte, also missing.
template <typename Lane, typename Vec>
inline Vec truncate_dwords(__m512i a) {
    alignas(64) uint32_t in[16];
    Lane out[16];
    static_assert(sizeof(out) == sizeof(Vec), "16 lanes fill the result");
    _mm512_store_si512(in, a);
    for (int i = 0; i < 16; ++i) out[i] = static_cast<Lane>(in[i]);  // unsigned: the low bits
    Vec v;
    std::memcpy(&v, out, sizeof(v));
    return v;
}
inline __m256i cvtepi32_epi16(__m512i a) { return truncate_dwords<uint16_t, __m256i>(a); }
inline __m128i cvtepi32_epi8(__m512i a) { return truncate_dwords<uint8_t, __m128i>(a); }

}  // namespace kvflow::simde_shim

#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps kvflow::simde_shim::dpbf16_ps
#define _mm512_cvtneps_pbh kvflow::simde_shim::cvtneps_pbh
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh kvflow::simde_shim::cvtne2ps_pbh
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps kvflow::simde_shim::mask_storeu_ps
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 kvflow::simde_shim::mask_storeu_epi16
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps kvflow::simde_shim::maskz_loadu_ps
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 kvflow::simde_shim::maskz_loadu_epi16
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16 kvflow::simde_shim::cvtepu8_epi16
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 kvflow::simde_shim::cvtepi8_epi32
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 kvflow::simde_shim::cvtepi32_epi16
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8 kvflow::simde_shim::cvtepi32_epi8

#elif defined(__AVX512F__)
#include <immintrin.h>
#define KVFLOW_AVX512F 1
#if defined(__AVX512BF16__)
#define KVFLOW_AVX512BF16 1
#endif
#endif

// KVFLOW_AVX2_GEMM: the packed GEMM's AVX2 + FMA blocks (gemm_avx2.h), for whichever of its
// dtypes the CPU has no AVX-512 path for (not in the SIMDe build, which checks the AVX-512 ones).
#if !defined(KVFLOW_SIMDE) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVFLOW_AVX2_GEMM 1
// With F16C (every AVX2 CPU so far) its quantized tiles also read float16 scales and offsets.
#if defined(__F16C__)
#define KVFLOW_AVX2_F16C 1
#endif
#endif

// The 8-lane loops for CPUs with AVX2 and FMA (attention_ref_avx2.h, vec_dtype.h and the
// elementwise kernels): the same operations in the same order as the scalar definitions.
#if defined(__AVX2__) && defined(__FMA__)
#define KVFLOW_REF_AVX2 1
#endif
