// attention_ref.h's loops on 8 lanes, for CPUs with AVX2 and FMA: the same operations in the
// same order (so the same bits as the scalar definition and the AVX-512 kernels), for the
// machines that run the portable attention. Also compiled in the SIMDe build, whose emulated
// AVX-512 kernels the tests compare these with.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common.h"

#if defined(KVFLOW_REF_AVX2)  // isa.h
#include <immintrin.h>

namespace kvflow::ref {

// exp_ref on 8 lanes: the same clamp, rounding, FMAs and scaling by 2^n, which is exact and so
// ldexp's result: the clamp keeps n >= -144, where 2^n is a float (denormal below -126) and one
// multiplication rounds p * 2^n once, as ldexp does. Softmax spends most of its time here; the
// scalar form with its libm calls made the portable attention paths exp-bound (W-offline on an
// AVX2 CPU: 40 % of decode steps). common.h's exp512 is the same on 16 lanes.
inline __m256 exp_ref8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-100.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_cvtps_epi32(n);  // integral already: exact
    const __m256i normal = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23);
    const __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(1), _mm256_add_epi32(e, _mm256_set1_epi32(149)));
    const __m256i two_n = _mm256_blendv_epi8(normal, denormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(-126), e));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// to_bf16_daz then back to float, on 8 lanes (no NaN reaches it: softmax weights are in [0, 1]).
inline __m256 round_bf16_daz8(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), abs);  // |x| < FLT_MIN
    const __m256i flushed = _mm256_andnot_si256(tiny, bits);
    const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    const __m256i kept = _mm256_or_si256(flushed, _mm256_and_si256(tiny, sign));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(kept, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(kept, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// scores_tile16 on 8 lanes (keys 0-7, 8-15) for NR rows: a bf16 cell holds dim 2g in its low half
// and 2g + 1 in its high half, so a mask and a shift widen both; FMAs round as the scalar
// products-then-sums do because every product is exact. `next_cells` (or null): the next key
// block's cells for these rows' KV head, asked for one line per dim group (scattered pool
// blocks defeat the hardware prefetcher; at decode the keys come from memory).
template <typename Dt, int NR>
inline void scores_tile16_avx2(const typename Dt::T* const* qr, const typename Dt::T* cells, int64_t block_size,
                               int64_t head_dim, float scale, float* scores, int64_t len,
                               const typename Dt::T* next_cells) {
    using T = typename Dt::T;
    constexpr int64_t G = kKeyGroup<T>;
    __m256 acc[NR][2];
    for (int i = 0; i < NR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < head_dim / G; ++g) {
        const T* c = cells + g * block_size * G;
        if (next_cells != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next_cells + g * block_size * G), _MM_HINT_T0);
        if constexpr (G == 2) {
            const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
            __m256 k0[2], k1[2];
            for (int h = 0; h < 2; ++h) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 16 * h));
                k1[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                k0[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            }
            for (int i = 0; i < NR; ++i) {
                const __m256 q0 = _mm256_set1_ps(Dt::load(qr[i][2 * g])), q1 = _mm256_set1_ps(Dt::load(qr[i][2 * g + 1]));
                for (int h = 0; h < 2; ++h) {
                    acc[i][h] = _mm256_fmadd_ps(q1, k1[h], acc[i][h]);
                    acc[i][h] = _mm256_fmadd_ps(q0, k0[h], acc[i][h]);
                }
            }
        } else {
            const __m256 k0[2] = {_mm256_loadu_ps(c), _mm256_loadu_ps(c + 8)};
            for (int i = 0; i < NR; ++i) {
                const __m256 q0 = _mm256_set1_ps(qr[i][g]);
                for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_fmadd_ps(q0, k0[h], acc[i][h]);
            }
        }
    }
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int i = 0; i < NR; ++i)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(scores + i * len + 8 * h, _mm256_mul_ps(acc[i][h], scale8));
}

constexpr int64_t kPvKeys = 16;  // keys whose V rows pv_avx2 widens at once (16 x head_dim floats)
constexpr int64_t kPvDims = 64;  // dims a row's sums hold in registers (8 of the 16)
constexpr int64_t kPvMaxHeadDim = 256;  // the attention kernels' limit (paged_attention.cpp)

// attend_rows' p.V on 8 lanes, the same chains: for each row and dim, keys in order (bf16: pairs,
// the odd key's product first; a row's last odd key after a 0 * 0), as FMAs, which round as the
// scalar products-then-sums do because every product is exact. Keys go in chunks of kPvKeys
// whose V rows are widened to float32 once (bf16), and each row's sums stay in registers over a
// chunk, 64 dims at a time: the scalar loop loaded, converted and stored every sum for every key.
template <typename Dt>
inline void pv_avx2(const float* scores, int64_t ld, int64_t rows, int64_t group, const int64_t* lens,
                    const typename Dt::T* const* vrows, int64_t len, int64_t head_dim, float* acc) {
    constexpr bool kBF16 = std::is_same_v<Dt, BF16>;
    alignas(32) float wide[kBF16 ? kPvKeys * kPvMaxHeadDim : 1];
    for (int64_t c0 = 0; c0 < len; c0 += kPvKeys) {
        const int64_t c1 = std::min(len, c0 + kPvKeys);
        const float* vf[kPvKeys];  // key c0 + i's V row as float32
        for (int64_t t = c0; t < c1; ++t) {
            if (t + kPvKeys < len)  // the next chunk's V row, one line per step (V rows lie scattered too)
                for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(vrows[0][0])); byte += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(vrows[t + kPvKeys]) + byte, _MM_HINT_T0);
            if constexpr (kBF16) {
                float* dst = wide + (t - c0) * head_dim;
                for (int64_t d = 0; d < head_dim; d += 8) _mm256_store_ps(dst + d, load8(vrows[t] + d));
                vf[t - c0] = dst;
            } else {
                vf[t - c0] = vrows[t];
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t end = std::min(c1, lens[r / group]);  // this row's keys in the chunk
            if (end <= c0) continue;
            const float* p = scores + r * ld;
            for (int64_t d0 = 0; d0 < head_dim; d0 += kPvDims) {
                with_block_rows<kPvDims / 8>(std::min(kPvDims, head_dim - d0) / 8, [&](auto vectors) {
                    constexpr int NV = decltype(vectors)::value;
                    float* a = acc + r * head_dim + d0;
                    __m256 sums[NV];
                    for (int j = 0; j < NV; ++j) sums[j] = _mm256_loadu_ps(a + 8 * j);
                    if constexpr (kBF16) {
                        for (int64_t t = c0; t < end; t += 2) {
                            const bool pair = t + 1 < end;  // else the row's last key, after a zero key
                            const float* v0 = vf[t - c0] + d0;
                            const float* v1 = pair ? vf[t + 1 - c0] + d0 : v0;
                            const __m256 p1 = _mm256_set1_ps(pair ? p[t + 1] : 0.f), p0 = _mm256_set1_ps(p[t]);
                            const __m256 keep = pair ? _mm256_castsi256_ps(_mm256_set1_epi32(-1)) : _mm256_setzero_ps();
                            for (int j = 0; j < NV; ++j) {
                                sums[j] = _mm256_fmadd_ps(p1, _mm256_and_ps(_mm256_load_ps(v1 + 8 * j), keep), sums[j]);
                                sums[j] = _mm256_fmadd_ps(p0, _mm256_load_ps(v0 + 8 * j), sums[j]);
                            }
                        }
                    } else {
                        for (int64_t t = c0; t < end; ++t) {
                            const float* v0 = vf[t - c0] + d0;
                            const __m256 p0 = _mm256_set1_ps(p[t]);
                            for (int j = 0; j < NV; ++j) sums[j] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * j), sums[j]);
                        }
                    }
                    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(a + 8 * j, sums[j]);
                });
            }
        }
    }
}

}  // namespace kvflow::ref
#endif
