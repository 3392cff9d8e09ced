// kvflow's attention numerics, written out plainly: one query row (or the `rows` query heads
// of one KV head that share it) against keys [0, len) read through the block table. This is
// the definition (docs/architecture.md, "Attention numerics"), on any CPU; the decode and
// prefill kernels run it wherever their AVX-512 paths do not, so that a row's bits never
// depend on which kernel ran it. The AVX-512 paths compute the same operations in the same
// order, many keys and rows at a time:
//   score[t] = (float32 chain over the head's dims in order: float32 one FMA per dim; bf16
//              one dim pair at a time, the odd dim's product added first, as vdpbf16ps does)
//              * scale
//   e[t]     = exp_ref(score[t] - max score); bf16: rounded to bf16 (denormals to zero, as
//              vcvtneps2bf16 does): p[t]
//   sum      = reduce16(16 float32 lanes, lane t % 16 summing p[t] in key order); inv = 1 / sum
//   acc[d]   = float32 chain over keys in order: float32 one FMA per key; bf16 keys in pairs
//              (t, t + 1), t even, the odd key's product added first (a last odd key pairs
//              with a zero)
//   out[d]   = acc[d] * inv, rounded to the storage dtype
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvflow::ref {

constexpr int64_t kMaxRefRows = 16;  // query heads per KV head (the decode kernel's kMaxGroup)
constexpr int64_t kRefPositions = 4;  // query positions prefill hands attend_rows at once

// exp512 (common.h) one lane at a time: the same clamp, range reduction and polynomial.
inline float exp_ref(float x) {
    x = std::fmin(std::fmax(x, -100.f), 88.f);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    float r = std::fma(-n, 0.693145751953125f, x);
    r = std::fma(-n, 1.428606765330187045e-06f, r);
    float p = 1.f / 5040;
    p = std::fma(p, r, 1.f / 720);
    p = std::fma(p, r, 1.f / 120);
    p = std::fma(p, r, 1.f / 24);
    p = std::fma(p, r, 1.f / 6);
    p = std::fma(p, r, 0.5f);
    p = std::fma(p, r, 1.f);
    p = std::fma(p, r, 1.f);
    return std::ldexp(p, static_cast<int>(n));
}

#if defined(__AVX2__) && defined(__FMA__)
#define KVFLOW_REF_AVX2 1
// exp_ref on 8 lanes: the same clamp, rounding, FMAs and scaling by 2^n, which is exact and so
// ldexp's result: the clamp keeps n >= -144, where 2^n is a float (denormal below -126) and one
// multiplication rounds p * 2^n once, as ldexp does. Softmax spends most of its time here; the
// scalar form with its libm calls made the portable attention paths exp-bound (W-offline on an
// AVX2 CPU: 40 % of decode steps). Compiled in the SIMDe build too, whose AVX-512 kernels
// (exp512) the tests compare it with.
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
#endif

// float -> bf16 as vcvtneps2bf16: round to nearest even, denormal inputs read as (signed) zero.
inline uint16_t to_bf16_daz(float x) {
    if (std::fabs(x) < FLT_MIN) x = std::signbit(x) ? -0.f : 0.f;
    return float_to_bf16(x);
}

// The sum of 16 lanes in reduce_add16's order (common.h): halves, then quarters, then pairs.
inline float reduce16(const float* lane) {
    float a[8], b[4];
    for (int i = 0; i < 8; ++i) a[i] = lane[i] + lane[i + 8];
    for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

// The scores' row stride for rows of `len` keys: whole tiles of 16, which scores_tile16 writes.
inline int64_t score_stride(int64_t len) { return (len + 15) / 16 * 16; }

// scores[r, 0:16] = scale * q[r] . k for up to four query rows and one tile of 16 keys whose
// dim group g lies at cells + g * block_size * G: the accumulators stay in registers across
// the dims (the rows' chains interleave; none is reordered). Scores past a row's keys are
// written too; the callers never read them.
template <typename Dt, typename QRow>
inline void scores_tile16(QRow q_row, int64_t r0, int64_t nr, const typename Dt::T* cells, int64_t block_size,
                          int64_t head_dim, float scale, float* scores, int64_t len) {
    using T = typename Dt::T;
    constexpr int64_t G = kKeyGroup<T>;
    const T* qr[4];
    for (int64_t i = 0; i < 4; ++i) qr[i] = q_row(r0 + std::min(i, nr - 1));
#if defined(KVFLOW_REF_AVX2)
    // The same chains on 8 lanes (keys 0-7, 8-15): a bf16 cell holds dim 2g in its low half and
    // 2g + 1 in its high half, so a mask and a shift widen both; FMAs round as the scalar
    // products-then-sums do because every product is exact.
    __m256 acc[4][2];
    for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < head_dim / G; ++g) {
        const T* c = cells + g * block_size * G;
        if constexpr (G == 2) {
            const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
            __m256 k0[2], k1[2];
            for (int h = 0; h < 2; ++h) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 16 * h));
                k1[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                k0[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            }
            for (int i = 0; i < 4; ++i) {
                const __m256 q0 = _mm256_set1_ps(Dt::load(qr[i][2 * g])), q1 = _mm256_set1_ps(Dt::load(qr[i][2 * g + 1]));
                for (int h = 0; h < 2; ++h) {
                    acc[i][h] = _mm256_fmadd_ps(q1, k1[h], acc[i][h]);
                    acc[i][h] = _mm256_fmadd_ps(q0, k0[h], acc[i][h]);
                }
            }
        } else {
            const __m256 k0[2] = {_mm256_loadu_ps(reinterpret_cast<const float*>(c)),
                                  _mm256_loadu_ps(reinterpret_cast<const float*>(c) + 8)};
            for (int i = 0; i < 4; ++i) {
                const __m256 q0 = _mm256_set1_ps(Dt::load(qr[i][g]));
                for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_fmadd_ps(q0, k0[h], acc[i][h]);
            }
        }
    }
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < nr; ++i)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(scores + (r0 + i) * len + 8 * h, _mm256_mul_ps(acc[i][h], scale8));
#else
    float a[4][16] = {};
    for (int64_t g = 0; g < head_dim / G; ++g) {
        const T* c = cells + g * block_size * G;
        float k0[16], k1[16];
        for (int t = 0; t < 16; ++t) {
            k0[t] = Dt::load(c[G * t]);
            if constexpr (G == 2) k1[t] = Dt::load(c[2 * t + 1]);
        }
        for (int i = 0; i < 4; ++i) {
            if constexpr (G == 2) {
                const float q0 = Dt::load(qr[i][2 * g]), q1 = Dt::load(qr[i][2 * g + 1]);
                for (int t = 0; t < 16; ++t) {
                    a[i][t] += q1 * k1[t];  // bf16 products are exact in float32
                    a[i][t] += q0 * k0[t];
                }
            } else {
                const float q0 = qr[i][g];
                for (int t = 0; t < 16; ++t) a[i][t] = std::fma(q0, k0[t], a[i][t]);
            }
        }
    }
    for (int64_t i = 0; i < nr; ++i)
        for (int t = 0; t < 16; ++t) scores[(r0 + i) * len + t] = a[i][t] * scale;
#endif
}

#if defined(KVFLOW_REF_AVX2)
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
            if constexpr (kBF16) {
                float* dst = wide + (t - c0) * head_dim;
                for (int64_t d = 0; d < head_dim; d += 8) {
                    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vrows[t] + d));
                    _mm256_store_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
                }
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
#endif

// The query rows of one KV head at `positions` consecutive positions of one sequence (prefill
// passes up to kRefPositions, decode one): row r = (position r / group, head r % group) is
// at q + (r / group) * q_stride + (r % group) * head_dim (out likewise) and sees keys
// [0, lens[r / group]). key_cache/value_cache point at this KV head's first element in block
// 0 (keys dimension-major, common.h). scores: rows x score_stride(max(lens)) floats of
// scratch; acc: rows x head_dim; vrows: max(lens) pointers. Rows at several positions share every key load; the loops run over keys (q.k)
// and dims (p.V) innermost, so a compiler vectorizes them without reordering any one sum.
// A row's keys past its own length are scored (harmlessly) but never enter its softmax or p.V.
template <typename Dt>
void attend_rows(const typename Dt::T* q, int64_t q_stride, int64_t positions, int64_t group, const int64_t* lens,
                 const typename Dt::T* key_cache, const typename Dt::T* value_cache, const int64_t* table,
                 typename Dt::T* out, int64_t out_stride, int64_t head_dim, int64_t block_size,
                 int64_t token_stride, int64_t block_stride, float scale, float* scores, float* acc,
                 const typename Dt::T** vrows) {
    using T = typename Dt::T;
    constexpr bool kBF16 = std::is_same_v<Dt, BF16>;
    constexpr int64_t G = kKeyGroup<T>;
    const int64_t rows = positions * group;
    int64_t len = 0;  // the keys any row sees
    for (int64_t i = 0; i < positions; ++i) len = std::max(len, lens[i]);
    const int64_t ld = score_stride(len);
    auto q_row = [&](int64_t r) { return q + (r / group) * q_stride + (r % group) * head_dim; };
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* kblock = key_cache + table[t0 / block_size] * block_stride;  // cell (g, t) at (g * bs + t) * G
        const int64_t n = std::min(block_size, len - t0);
        if (block_size % 16 == 0) {  // whole tiles of 16 keys, four rows at a time in registers
            for (int64_t k0 = 0; k0 < n; k0 += 16)
                for (int64_t r = 0; r < rows; r += 4)
                    scores_tile16<Dt>(q_row, r, std::min<int64_t>(4, rows - r), kblock + k0 * G, block_size,
                                      head_dim, scale, scores + t0 + k0, ld);
            continue;
        }
        for (int64_t r = 0; r < rows; ++r) {
            const T* qr = q_row(r);
            float* s = scores + r * ld + t0;
            for (int64_t t = 0; t < n; ++t) s[t] = 0.f;
            for (int64_t g = 0; g < head_dim / G; ++g) {
                const T* cells = kblock + g * block_size * G;
                if constexpr (kBF16) {
                    const float q0 = Dt::load(qr[2 * g]), q1 = Dt::load(qr[2 * g + 1]);
                    for (int64_t t = 0; t < n; ++t) {  // bf16 products are exact in float32
                        s[t] += q1 * Dt::load(cells[2 * t + 1]);
                        s[t] += q0 * Dt::load(cells[2 * t]);
                    }
                } else {
                    for (int64_t t = 0; t < n; ++t) s[t] = std::fma(qr[g], cells[t], s[t]);
                }
            }
            for (int64_t t = 0; t < n; ++t) s[t] *= scale;
        }
    }
    float inv_sum[kMaxRefRows * kRefPositions];
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t row_len = lens[r / group];
        float* p = scores + r * ld;
        float m = -INFINITY;
        for (int64_t t = 0; t < row_len; ++t) m = std::fmax(m, p[t]);
        float lane[16] = {};
        int64_t t = 0;
#if defined(KVFLOW_REF_AVX2)
        // 16 keys at a time: lanes 0-7 and 8-15 of the sums, each still in key order.
        __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
        const __m256 max8 = _mm256_set1_ps(m);
        for (; t + 16 <= row_len; t += 16) {
            __m256 lo = exp_ref8(_mm256_sub_ps(_mm256_loadu_ps(p + t), max8));
            __m256 hi = exp_ref8(_mm256_sub_ps(_mm256_loadu_ps(p + t + 8), max8));
            if constexpr (kBF16) {
                lo = round_bf16_daz8(lo);
                hi = round_bf16_daz8(hi);
            }
            _mm256_storeu_ps(p + t, lo);
            _mm256_storeu_ps(p + t + 8, hi);
            sum_lo = _mm256_add_ps(sum_lo, lo);
            sum_hi = _mm256_add_ps(sum_hi, hi);
        }
        _mm256_storeu_ps(lane, sum_lo);
        _mm256_storeu_ps(lane + 8, sum_hi);
#endif
        for (; t < row_len; ++t) {
            const float e = exp_ref(p[t] - m);
            p[t] = kBF16 ? bf16_to_float(to_bf16_daz(e)) : e;
            lane[t % 16] += p[t];
        }
        inv_sum[r] = 1.f / reduce16(lane);
    }
    // p.V key by key, every row's sums advanced while the key's V row is in L1.
    for (int64_t t = 0; t < len; ++t)
        vrows[t] = value_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t i = 0; i < rows * head_dim; ++i) acc[i] = 0.f;
#if defined(KVFLOW_REF_AVX2)
    if (head_dim % 8 == 0 && head_dim <= kPvMaxHeadDim) {
        pv_avx2<Dt>(scores, ld, rows, group, lens, vrows, len, head_dim, acc);
    } else
#endif
    for (int64_t t = 0; t < len; t += kBF16 ? 2 : 1) {
        const T* v0 = vrows[t];
        const T* v1 = kBF16 && t + 1 < len ? vrows[t + 1] : v0;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row_len = lens[r / group];
            if (t >= row_len) continue;
            const float p0 = scores[r * ld + t];
            float* a = acc + r * head_dim;
            if constexpr (kBF16) {
                if (t + 1 < row_len) {
                    const float p1 = scores[r * ld + t + 1];
                    for (int64_t d = 0; d < head_dim; ++d) {
                        a[d] += p1 * Dt::load(v1[d]);
                        a[d] += p0 * Dt::load(v0[d]);
                    }
                } else {  // the row's last key alone: paired with a zero key of zero weight
                    for (int64_t d = 0; d < head_dim; ++d) {
                        a[d] += 0.f * 0.f;
                        a[d] += p0 * Dt::load(v0[d]);
                    }
                }
            } else {
                for (int64_t d = 0; d < head_dim; ++d) a[d] = std::fma(p0, v0[d], a[d]);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        T* o = out + (r / group) * out_stride + (r % group) * head_dim;
        const float* a = acc + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
            if constexpr (kBF16) {
                o[d] = to_bf16_daz(a[d] * inv_sum[r]);
            } else {
                o[d] = a[d] * inv_sum[r];
            }
        }
    }
}

}  // namespace kvflow::ref
