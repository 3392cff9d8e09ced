// The softmax and p.V half of paged decode attention (paged_attention.cpp has the q.k half
// and the driver), AVX-512 only. One item's score rows [rows, len] become probabilities in
// place, then each pool block's V rows are folded into float32 accumulators that live in
// registers for the block and in a small L1 buffer between blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(KVFLOW_AVX512F)
namespace kvflow::decode {

// Each score row -> e^(s - max), returning 1 / sum.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float* inv_sum) {
    for (int64_t r = 0; r < rows; ++r) {
        float* row = scores + r * len;
        const __m512 m = _mm512_set1_ps(row_max(row, len));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 valid = tail_mask(len - t);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, row + t), m));
            _mm512_mask_storeu_ps(row + t, valid, e);
            sum = _mm512_mask_add_ps(sum, valid, sum, e);
        }
        inv_sum[r] = 1.f / reduce_add16(sum);
    }
}

// acc[r] += sum over tokens [t_begin, t_end) of p[r, t] V[t], for R query rows of one KV head:
// the R x NV accumulators live in registers for the block and in `acc` (float32, in L1)
// between blocks. vrow: the head's V row of token t_begin.
template <typename Dt, int NV, int R>
void pv_block_rows(const float* p, int64_t len, const typename Dt::T* vrow, int64_t t_begin, int64_t t_end,
                   int64_t token_stride, float* acc) {
    __m512 a[R][NV];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc + (r * NV + j) * 16);
    for (int64_t t = t_begin; t < t_end; ++t, vrow += token_stride) {
        __m512 vv[NV];
        for (int j = 0; j < NV; ++j) vv[j] = load16(vrow + j * 16);
        for (int r = 0; r < R; ++r) {
            const __m512 pr = _mm512_set1_ps(p[r * len + t]);
            for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(pr, vv[j], a[r][j]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (r * NV + j) * 16, a[r][j]);
}

// As many rows per pass over a block as the registers hold (R x NV accumulators plus one V row).
template <int NV>
constexpr int kPVRows = std::max(1, std::min(8, (28 - NV) / NV));

template <typename Dt, int NV, int R = kPVRows<NV>>
void pv_block(const float* p, int64_t rows, int64_t len, const typename Dt::T* vrow, int64_t t_begin, int64_t t_end,
              int64_t token_stride, float* acc) {
    if constexpr (R > 0) {
        for (; rows >= R; rows -= R, p += R * len, acc += R * NV * 16)
            pv_block_rows<Dt, NV, R>(p, len, vrow, t_begin, t_end, token_stride, acc);
        if (rows > 0)  // fewer left than a full pass: the next smaller register block
            pv_block<Dt, NV, R - 1>(p, rows, len, vrow, t_begin, t_end, token_stride, acc);
    }
}

#if defined(KVFLOW_AVX512BF16)
// bf16 p.V with vdpbf16ps, two keys per instruction. The softmax rounds each e^(s - max) to
// bf16 in place (row r's bf16 values at the start of its float row) and sums the rounded
// values, so the weights multiplied are the weights normalised by: as the reference path,
// which rounds its probabilities to the cache dtype before p.V.
inline void softmax_rows_bf16(float* scores, int64_t rows, int64_t len, float* inv_sum) {
    for (int64_t r = 0; r < rows; ++r) {
        float* row = scores + r * len;
        uint16_t* prow = reinterpret_cast<uint16_t*>(row);  // written behind the reads: safe in place
        const __m512 m = _mm512_set1_ps(row_max(row, len));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 valid = tail_mask(len - t);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, row + t), m));
            const __m256i pb = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(valid, e));
            _mm256_mask_storeu_epi16(prow + t, valid, pb);
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
        }
        inv_sum[r] = 1.f / reduce_add16(sum);
    }
}

// acc[r] += sum over keys [t_begin, t_end) of p[r, t] V[t] for R rows of one KV head, keys
// taken in pairs (t, t + 1) with t even, wherever the two keys lie in the pool (`vrow(t)`: the
// head's V row of key t), so the pairs are those of the prefill kernel whatever the block
// size. unpacklo/hi_epi16 interleave two V rows into the (key, key + 1) pairs that vdpbf16ps
// multiplies by the broadcast pair (p[t], p[t + 1]): accumulator lane 4L + i of vector 2j + h
// holds dim 32j + 8L + 4h + i (unpack works within 128-bit lanes). With an odd NV the last 16
// dims are paired by one permute and stay in dim order. `acc` keeps that order between calls;
// store_pair_row restores the real one. `pf` (optional) steps once per key pair.
template <int NV, int R, typename VRow>
void pv_rows_pairs(const uint16_t* p, int64_t p_stride, int64_t t_begin, int64_t t_end, VRow vrow, float* acc,
                   PrefetchStream* pf) {
    constexpr int kPaired = NV / 2;  // 32-dim pieces interleaved by unpack
    __m512 a[R][NV];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc + (r * NV + j) * 16);
    for (int64_t t = t_begin; t < t_end; t += 2) {
        const bool single = t + 1 == t_end;  // an odd tail: pair the last key with zeros
        if (pf) pf->step();
        const uint16_t* v0 = vrow(t);
        const uint16_t* v1 = single ? nullptr : vrow(t + 1);
        __m512i w[NV];
        for (int j = 0; j < kPaired; ++j) {
            const __m512i x0 = _mm512_loadu_si512(v0 + j * 32);
            const __m512i x1 = single ? _mm512_setzero_si512() : _mm512_loadu_si512(v1 + j * 32);
            w[2 * j] = _mm512_unpacklo_epi16(x0, x1);
            w[2 * j + 1] = _mm512_unpackhi_epi16(x0, x1);
        }
        if constexpr (NV % 2 == 1) {
            const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + kPaired * 32));
            const __m256i y1 = single ? _mm256_setzero_si256()
                                      : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + kPaired * 32));
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(y0), y1, 1);
            alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                                     21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                                     11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
            w[NV - 1] = _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both);
        }
        for (int r = 0; r < R; ++r) {
            uint32_t pair;
            std::memcpy(&pair, p + r * p_stride + t, sizeof(pair));
            if (single) pair &= 0xffffu;
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
            for (int j = 0; j < NV; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], pp, (__m512bh)w[j]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (r * NV + j) * 16, a[r][j]);
}

template <int NV, int R = kPVRows<NV>, typename VRow>
void pv_pairs(const uint16_t* p, int64_t p_stride, int64_t rows, int64_t t_begin, int64_t t_end, VRow vrow,
              float* acc, PrefetchStream* pf = nullptr) {
    if constexpr (R > 0) {
        for (; rows >= R; rows -= R, p += R * p_stride, acc += R * NV * 16)
            pv_rows_pairs<NV, R>(p, p_stride, t_begin, t_end, vrow, acc, pf);
        if (rows > 0)
            pv_pairs<NV, R - 1>(p, p_stride, rows, t_begin, t_end, vrow, acc, pf);
    }
}

// out[d] = bf16(acc * inv_sum) for one pair-path accumulator row (see pv_rows_pairs for where
// dim d lies in it), rounded by vcvtneps2bf16 as the prefill kernel rounds its output.
template <int NV>
inline void store_pair_row(const float* acc, float inv_sum, uint16_t* out) {
    alignas(64) float row[NV * 16];
    for (int j = 0; j < NV / 2; ++j)
        for (int h = 0; h < 2; ++h)
            for (int L = 0; L < 4; ++L)
                for (int i = 0; i < 4; ++i) row[32 * j + 8 * L + 4 * h + i] = acc[(2 * j + h) * 16 + 4 * L + i];
    for (int d = NV / 2 * 32; d < NV * 16; ++d) row[d] = acc[d];  // an odd tail, in dim order
    for (int j = 0; j < NV; ++j) {
        const __m512 x = _mm512_mul_ps(_mm512_load_ps(row + j * 16), _mm512_set1_ps(inv_sum));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 16), (__m256i)_mm512_cvtneps_pbh(x));
    }
}
#endif

}  // namespace kvflow::decode
#endif
