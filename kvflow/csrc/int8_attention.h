// Attention over the int8 KV cache, reading int8 keys and values in place (kv_int8.cpp has
// the driver and the write). Two implementations of one numerics: the AVX-512 path below
// (int8 -> float32 in registers) and the portable one (any CPU, and the tests' reference).
//
// Numerics of the int8 mode, for the query rows of one KV head (q in float32, exact for a
// bf16 model's queries); kscale[t] / vscale[t] are key t's float16 scales as float32:
//   score[t] = ((float32 chain over the head's dims in order, one FMA per dim:
//                q[d] * float(k_int8[t][d])) * kscale[t]) * scale
//   e[t]     = exp_ref(score[t] - max score)         (attention_ref.h; exp512 is the same)
//   sum      = reduce16(16 float32 lanes, lane t % 16 summing e[t] in key order); inv = 1 / sum
//   w[t]     = e[t] * vscale[t]                       (the V scale folded into the weight)
//   acc[d]   = float32 chain over keys in order, one FMA per key: w[t] * float(v_int8[t][d])
//   out[d]   = acc[d] * inv, rounded to the output dtype
// The integer products are exact and every scale is applied once per key, not per element, so
// nothing is dequantized into memory. A row's bits depend only on its query and the stored
// keys/values up to its position: not on the batch, the chunking or the prefix cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_ref.h"
#include "common.h"

namespace kvflow::int8attn {

// The most query rows one call takes (Rows::rows): the driver hands over
// max(1, kMaxRows / group) positions at a time, so the scores stay in L1/L2.
constexpr int64_t kMaxRows = 16;

// Where one KV head's cache lies. Keys: per block [num_kv_heads][head_dim / 4][block_size][4]
// (common.h key_offset with 4 int8 dims per cell), `keys` pointing at this head's first cell
// of block 0; values: [block_size][num_kv_heads][head_dim], `values` at this head's row of
// slot 0 of block 0. block_stride: elements per block.
struct HeadCache {
    const int8_t* keys;
    const int8_t* values;
    const int64_t* table;
    int64_t head_dim, block_size, token_stride, block_stride;

    const int8_t* key_cells(int64_t t) const {  // dim group 0 of key t; group g at + g * block_size * 4
        return keys + table[t / block_size] * block_stride + (t % block_size) * 4;
    }
    const int8_t* value_row(int64_t t) const {
        return values + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    }
};

// Query rows of `positions` consecutive positions of one sequence, `group` heads each: row r is
// q + r * head_dim (position r / group) and sees keys [0, lens[r / group]). scores: rows x ld
// floats (ld >= max lens, a multiple of 16); ks / vs: the scales of keys [0, max lens) and zero
// up to ld; acc: rows x head_dim floats; out: rows x head_dim floats (acc * inv).
struct Rows {
    const float* q;
    int64_t rows, group;
    const int64_t* lens;
    const float* ks;
    const float* vs;
    float scale;
    float* scores;
    int64_t ld;
    float* acc;
    float* out;

    int64_t len(int64_t r) const { return lens[r / group]; }
    int64_t max_len() const { return lens[(rows - 1) / group]; }  // positions ascend
};

// The numerics above one row at a time, plainly (any CPU).
inline void attend_portable(const HeadCache& c, const Rows& x) {
    const int64_t D = c.head_dim;
    for (int64_t r = 0; r < x.rows; ++r) {
        const int64_t len = x.len(r);
        const float* q = x.q + r * D;
        float* s = x.scores + r * x.ld;
        for (int64_t t = 0; t < len; ++t) {
            const int8_t* cells = c.key_cells(t);
            float a = 0.f;
            for (int64_t d = 0; d < D; ++d)
                a = std::fma(q[d], static_cast<float>(cells[(d / 4) * c.block_size * 4 + d % 4]), a);
            s[t] = (a * x.ks[t]) * x.scale;
        }
        float m = -INFINITY;
        for (int64_t t = 0; t < len; ++t) m = std::fmax(m, s[t]);
        float lane[16] = {};
        for (int64_t t = 0; t < len; ++t) {
            const float e = ref::exp_ref(s[t] - m);
            lane[t % 16] += e;
            s[t] = e * x.vs[t];
        }
        const float inv = 1.f / ref::reduce16(lane);
        float* acc = x.acc + r * D;
        std::fill(acc, acc + D, 0.f);
        for (int64_t t = 0; t < len; ++t) {
            const int8_t* v = c.value_row(t);
            for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(s[t], static_cast<float>(v[d]), acc[d]);
        }
        for (int64_t d = 0; d < D; ++d) x.out[r * D + d] = acc[d] * inv;
    }
}

#if defined(KVFLOW_AVX512F)
constexpr int kTiles = 4;  // tiles of 16 keys per q.k pass

// Byte J of each 32-bit lane (dim 4g + J of 16 keys), sign-extended, as float32: exact.
template <int J>
inline __m512 key_dim(__m512i cells) {
    if constexpr (J == 3) {
        return _mm512_cvtepi32_ps(_mm512_srai_epi32(cells, 24));
    } else {
        return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(cells, 24 - 8 * J), 24));
    }
}

// scores[r, t0 + 16i + lane] for R rows and NK tiles: tile i's dim group g at
// cells[i] + g * gstride. Each score is one chain over the dims in order (the rows and tiles
// interleave, no chain is split).
template <int NV, int R, int NK>
inline void score_tiles(const float* q, const int8_t* const* cells, int64_t gstride, const float* ks, __m512 vscale,
                        float* scores, int64_t ld, int64_t t0) {
    constexpr int D = NV * 16;
    __m512 acc[R][NK];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < NK; ++i) acc[r][i] = _mm512_setzero_ps();
    auto step = [&](auto j, const __m512i* c, int g) {
        constexpr int J = decltype(j)::value;
        __m512 k[NK];
        for (int i = 0; i < NK; ++i) k[i] = key_dim<J>(c[i]);
        for (int r = 0; r < R; ++r) {
            const __m512 qb = _mm512_set1_ps(q[r * D + 4 * g + J]);
            for (int i = 0; i < NK; ++i) acc[r][i] = _mm512_fmadd_ps(qb, k[i], acc[r][i]);
        }
    };
    for (int g = 0; g < D / 4; ++g) {
        __m512i c[NK];
        for (int i = 0; i < NK; ++i) c[i] = _mm512_loadu_si512(cells[i] + g * gstride);
        step(std::integral_constant<int, 0>{}, c, g);
        step(std::integral_constant<int, 1>{}, c, g);
        step(std::integral_constant<int, 2>{}, c, g);
        step(std::integral_constant<int, 3>{}, c, g);
    }
    for (int i = 0; i < NK; ++i) {
        const __m512 kscale = _mm512_loadu_ps(ks + t0 + 16 * i);
        for (int r = 0; r < R; ++r)
            _mm512_storeu_ps(scores + r * ld + t0 + 16 * i, _mm512_mul_ps(_mm512_mul_ps(acc[r][i], kscale), vscale));
    }
}

template <int NV, int NK>
inline void score_rows(const Rows& x, const int8_t* const* cells, int64_t gstride, int64_t t0) {
    const __m512 vscale = _mm512_set1_ps(x.scale);
    constexpr int64_t D = NV * 16;
    int64_t r = 0;
    for (; r + 4 <= x.rows; r += 4)
        score_tiles<NV, 4, NK>(x.q + r * D, cells, gstride, x.ks, vscale, x.scores + r * x.ld, x.ld, t0);
    switch (x.rows - r) {
        case 3: score_tiles<NV, 3, NK>(x.q + r * D, cells, gstride, x.ks, vscale, x.scores + r * x.ld, x.ld, t0); break;
        case 2: score_tiles<NV, 2, NK>(x.q + r * D, cells, gstride, x.ks, vscale, x.scores + r * x.ld, x.ld, t0); break;
        case 1: score_tiles<NV, 1, NK>(x.q + r * D, cells, gstride, x.ks, vscale, x.scores + r * x.ld, x.ld, t0); break;
        default: break;
    }
}

// q.k for every row over keys [0, max len), tiles of 16 keys. With block_size a multiple of 16
// a tile is 16 consecutive slots of one block, read in place; otherwise its cells are first
// copied into `gather` (tiles x head_dim / 4 x 64 bytes) in that layout.
template <int NV>
void scores_avx512(const HeadCache& c, const Rows& x, int8_t* gather) {
    constexpr int64_t D = NV * 16;
    const int64_t len = x.max_len(), bs = c.block_size;
    const bool contiguous = bs % 16 == 0;
    const int64_t head_block_bytes = D * bs;  // one head's keys in a block
    for (int64_t t0 = 0; t0 < len; t0 += 16 * kTiles) {
        const int64_t nk = std::min<int64_t>(kTiles, (len - t0 + 15) / 16);
        if (contiguous && t0 + 16 * kTiles < len)  // the next pass's blocks, while this one computes
            for (int64_t t = t0 + 16 * kTiles; t < std::min(len, t0 + 32 * kTiles); t += bs)
                prefetch_l2(c.key_cells(t - t % bs), head_block_bytes);
        const int8_t* cells[kTiles];
        int64_t gstride = bs * 4;
        for (int64_t i = 0; i < nk; ++i) {
            const int64_t t = t0 + 16 * i;
            if (contiguous) {
                cells[i] = c.key_cells(t);
                continue;
            }
            int8_t* tile = gather + i * (D / 4) * 64;
            for (int64_t j = 0; j < 16; ++j) {
                const int8_t* src = c.key_cells(std::min(t + j, len - 1));  // past the end: a repeat (ignored)
                for (int64_t g = 0; g < D / 4; ++g) std::memcpy(tile + g * 64 + 4 * j, src + g * bs * 4, 4);
            }
            cells[i] = tile;
        }
        if (!contiguous) gstride = 64;
        if (nk == kTiles) {
            score_rows<NV, kTiles>(x, cells, gstride, t0);
        } else {
            for (int64_t i = 0; i < nk; ++i) score_rows<NV, 1>(x, cells + i, gstride, t0 + 16 * i);
        }
    }
}

// Each score row -> w[t] = e^(s - max) * vscale[t] in place, zero from the row's length up to
// the longest row's; returns 1 / sum of e in inv[r].
inline void softmax_avx512(const Rows& x, float* inv) {
    const int64_t len_max = x.max_len();
    for (int64_t r = 0; r < x.rows; ++r) {
        const int64_t len = x.len(r);
        float* row = x.scores + r * x.ld;
        const __m512 m = _mm512_set1_ps(row_max(row, len));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < len_max; t += 16) {
            const __mmask16 valid = t < len ? tail_mask(len - t) : static_cast<__mmask16>(0);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, row + t), m));
            sum = _mm512_mask_add_ps(sum, valid, sum, e);
            const __m512 w = _mm512_maskz_mul_ps(valid, e, _mm512_loadu_ps(x.vs + t));
            _mm512_mask_storeu_ps(row + t, tail_mask(len_max - t), w);
        }
        inv[r] = 1.f / reduce_add16(sum);
    }
}

// acc[r] = sum over keys [0, max len) of w[r, t] V[t] for R rows, in key order (w is zero past
// a row's own length, which adds exact zeros: the chain is the row's own).
template <int NV, int R>
inline void pv_rows(const HeadCache& c, const float* w, int64_t ld, int64_t len, float* acc) {
    __m512 a[R][NV];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_setzero_ps();
    const int64_t bs = c.block_size, num_blocks = (len + bs - 1) / bs;
    for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t t0 = b * bs, n = std::min(bs, len - t0);
        const int8_t* v = c.value_row(t0);
        // The head's rows two blocks ahead, one line per 64 dims (blocks lie scattered).
        const int8_t* ahead = b + 2 < num_blocks ? c.value_row(t0 + 2 * bs) : nullptr;
        const float* wt = w + t0;
        for (int64_t i = 0; i < n; ++i) {
            const int8_t* vi = v + i * c.token_stride;
            if (ahead != nullptr)
                for (int j = 0; j < NV; j += 4) _mm_prefetch(reinterpret_cast<const char*>(ahead + i * c.token_stride + 16 * j), _MM_HINT_T1);
            __m512 vv[NV];
            for (int j = 0; j < NV; ++j)
                vv[j] = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vi + 16 * j))));
            for (int r = 0; r < R; ++r) {
                const __m512 wr = _mm512_set1_ps(wt[r * ld + i]);
                for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(wr, vv[j], a[r][j]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (r * NV + j) * 16, a[r][j]);
}

template <int NV>
constexpr int kPVRows = std::max(1, std::min(8, (28 - NV) / NV));

template <int NV, int R = kPVRows<NV>>
void pv_avx512(const HeadCache& c, const float* w, int64_t rows, int64_t ld, int64_t len, float* acc) {
    if constexpr (R > 0) {
        for (; rows >= R; rows -= R, w += R * ld, acc += R * NV * 16) pv_rows<NV, R>(c, w, ld, len, acc);
        if (rows > 0) pv_avx512<NV, R - 1>(c, w, rows, ld, len, acc);
    }
}

template <int NV>
void attend_avx512(const HeadCache& c, const Rows& x, int8_t* gather) {
    constexpr int64_t D = NV * 16;
    float inv[kMaxRows];
    scores_avx512<NV>(c, x, gather);
    for (int64_t t = 0; t < std::min(x.max_len(), 2 * c.block_size); ++t)  // p.V's first rows, during the softmax
        for (int j = 0; j < NV; j += 4) _mm_prefetch(reinterpret_cast<const char*>(c.value_row(t) + 16 * j), _MM_HINT_T1);
    softmax_avx512(x, inv);
    pv_avx512<NV>(c, x.scores, x.rows, x.ld, x.max_len(), x.acc);
    for (int64_t r = 0; r < x.rows; ++r)
        for (int j = 0; j < NV; ++j)
            _mm512_storeu_ps(x.out + r * D + 16 * j,
                             _mm512_mul_ps(_mm512_loadu_ps(x.acc + r * D + 16 * j), _mm512_set1_ps(inv[r])));
}

using AttendFn = void (*)(const HeadCache&, const Rows&, int8_t*);

template <int NV = 1>
AttendFn attend_for(int64_t nv) {
    if constexpr (NV > 16) {
        return nullptr;
    } else {
        return nv == NV ? &attend_avx512<NV> : attend_for<NV + 1>(nv);
    }
}
#endif


}  // namespace kvflow::int8attn
