// The softmax and p.V half of paged decode attention (paged_attention.cpp has the q.k half
// and the driver), AVX-512 only. One item's score rows [rows, len] become probabilities in
// place, then each pool block's V rows are folded into float32 accumulators that live in
// registers for the block and in a small L1 buffer between blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__AVX512F__)
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
        inv_sum[r] = 1.f / _mm512_reduce_add_ps(sum);
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

#if defined(__AVX512BF16__)
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
        inv_sum[r] = 1.f / _mm512_reduce_add_ps(sum);
    }
}

// acc[r] += sum over tokens [t_begin, t_end) of p[r, t] V[t] for R rows of one KV head, keys
// taken in pairs: unpacklo/hi_epi16 interleave two V rows into the (key, key + 1) pairs that
// vdpbf16ps multiplies by the broadcast pair (p[t], p[t + 1]). Accumulator lane 4L + i of
// vector 2j + h holds dim 32j + 8L + 4h + i (unpack works within 128-bit lanes); `acc` keeps
// that order between blocks and the caller restores the real one at the end.
template <int NV, int R>
void pv_block_rows_pairs(const uint16_t* p, int64_t p_stride, const uint16_t* vrow, int64_t t_begin, int64_t t_end,
                         int64_t token_stride, float* acc) {
    __m512 a[R][NV];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc + (r * NV + j) * 16);
    int64_t t = t_begin;
    for (; t < t_end; t += 2, vrow += 2 * token_stride) {
        const bool single = t + 1 == t_end;  // an odd tail: pair the last key with zeros
        __m512i w[NV];
        for (int j = 0; j < NV / 2; ++j) {
            const __m512i x0 = _mm512_loadu_si512(vrow + j * 32);
            const __m512i x1 = single ? _mm512_setzero_si512() : _mm512_loadu_si512(vrow + token_stride + j * 32);
            w[2 * j] = _mm512_unpacklo_epi16(x0, x1);
            w[2 * j + 1] = _mm512_unpackhi_epi16(x0, x1);
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

template <int NV, int R = kPVRows<NV>>
void pv_block_pairs(const uint16_t* p, int64_t p_stride, int64_t rows, const uint16_t* vrow, int64_t t_begin,
                    int64_t t_end, int64_t token_stride, float* acc) {
    if constexpr (R > 0) {
        for (; rows >= R; rows -= R, p += R * p_stride, acc += R * NV * 16)
            pv_block_rows_pairs<NV, R>(p, p_stride, vrow, t_begin, t_end, token_stride, acc);
        if (rows > 0)
            pv_block_pairs<NV, R - 1>(p, p_stride, rows, vrow, t_begin, t_end, token_stride, acc);
    }
}

// The position in a pair-path accumulator row of dim d (see pv_block_rows_pairs).
inline int64_t pair_lane_of_dim(int64_t d) {
    const int64_t j = d / 32, L = (d % 32) / 8, h = (d % 8) / 4, i = d % 4;
    return (2 * j + h) * 16 + 4 * L + i;
}
#endif

}  // namespace kvflow::decode
#endif
