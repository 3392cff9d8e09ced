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
#include <vector>

#include "attention_ref_avx2.h"
#include "common.h"

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
                          int64_t head_dim, float scale, float* scores, int64_t len,
                          [[maybe_unused]] const typename Dt::T* next_cells = nullptr) {
    using T = typename Dt::T;
    constexpr int64_t G = kKeyGroup<T>;
    const T* qr[4];
    for (int64_t i = 0; i < 4; ++i) qr[i] = q_row(r0 + std::min(i, nr - 1));
#if defined(KVFLOW_REF_AVX2)
    with_block_rows<4>(nr, [&](auto n_rows) {
        scores_tile16_avx2<Dt, decltype(n_rows)::value>(qr, cells, block_size, head_dim, scale, scores + r0 * len, len,
                                                        next_cells);
    });
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
    if (block_size % 16 == 0) {  // whole tiles of 16 keys, four rows at a time in registers
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
            const T* kblock = key_cache + table[t0 / block_size] * block_stride;  // cell (g, t) at (g * bs + t) * G
            const T* next = t0 + block_size < len ? key_cache + table[t0 / block_size + 1] * block_stride : nullptr;
            for (int64_t k0 = 0; k0 < std::min(block_size, len - t0); k0 += 16)
                for (int64_t r = 0; r < rows; r += 4)
                    scores_tile16<Dt>(q_row, r, std::min<int64_t>(4, rows - r), kblock + k0 * G, block_size,
                                      head_dim, scale, scores + t0 + k0, ld, k0 == 0 && r == 0 ? next : nullptr);
        }
    } else {
        // Other block sizes (1, 8, 24, ...): each run of 16 keys is copied from its blocks into one
        // tile laid out as a block of 16's, then scored the same way, so the chains are the same.
        // Scoring key by key, block by block, made a float32 engine run with block_size=1 4x as
        // slow as with 16 on AVX2 (34 prompts: 158 s against 37 s, 37 s now).
        thread_local std::vector<T> tile;
        tile.resize(static_cast<size_t>(head_dim * 16));
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
            for (int64_t j = 0; j < 16; ++j) {
                const int64_t t = t0 + std::min<int64_t>(j, len - 1 - t0);  // past len: the last key again
                const T* cell = key_cache + table[t / block_size] * block_stride + (t % block_size) * G;
                for (int64_t g = 0; g < head_dim / G; ++g)
                    std::memcpy(&tile[(g * 16 + j) * G], cell + g * block_size * G, G * sizeof(T));
            }
            for (int64_t r = 0; r < rows; r += 4)
                scores_tile16<Dt>(q_row, r, std::min<int64_t>(4, rows - r), tile.data(), 16, head_dim, scale,
                                  scores + t0, ld);
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
