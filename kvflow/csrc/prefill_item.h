// One work item of prefill attention (prefill_attention.cpp schedules them): query rows
// [q0, q1) of one sequence's chunk for the query heads of one KV head, over that head's keys and
// values packed once per sequence into the microkernels' layout (pack_kv). Scores in float32 up
// to each row block's causal limit, an exact softmax per row, then P V; in bf16 the
// probabilities are rounded to bf16 first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "microkernel.h"

#if defined(KVFLOW_AVX512F)
namespace kvflow::prefill {

constexpr int64_t kQueryBlock = 32;
constexpr int64_t kRowBlock = 8;  // query rows per microkernel call
constexpr int kKeyTiles = 4;  // 64 keys per scores call
// A probability row's 16 values, stored in the dtype p.V multiplies them in; returns what
// was stored, so that the row sum is over what is multiplied (bf16: the rounded values).
inline __m512 store_probs(float* p, __m512 e) {
    _mm512_storeu_ps(p, e);
    return e;
}
#if defined(KVFLOW_AVX512BF16)
inline __m512 store_probs(uint16_t* p, __m512 e) {
    kvflow::Micro<BF16>::store(p, e, 0xffff);
    return kvflow::Micro<BF16>::load(p, 0xffff);
}
#endif

struct Item {
    int64_t seq, head, q0, q1, cost;
};

struct StoreScores {  // float32 scores, scaled
    float* s;
    int64_t stride, col0;
    float scale;
    inline void operator()(int m, int j, __m512 acc) const {
        _mm512_storeu_ps(s + m * stride + col0 + j * 16, _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
    }
};

template <typename Dt>
struct StoreOut {  // out row = acc / row sum, in the storage dtype
    typename Dt::T* out;
    int64_t stride, col0;
    const float* inv_sum;
    inline void operator()(int m, int j, __m512 acc) const {
        kvflow::Micro<Dt>::store(out + m * stride + col0 + j * 16, _mm512_mul_ps(acc, _mm512_set1_ps(inv_sum[m])), 0xffff);
    }
};

// Exact softmax of each of `rows` score rows (`padded` floats apart, row r seeing its first
// first_len + r keys; zero probability beyond): the max, then each exp512(s - max) handed to
// `store(row, t, e)` for keys t .. t + 15 of `row`, which returns the values it kept (the sum adds
// those: bf16's are rounded); inv_sum[r] = 1 / sum.
template <typename StoreProbs>
inline void softmax_rows(float* scores, int64_t rows, int64_t padded, int64_t first_len, float* inv_sum,
                         StoreProbs&& store) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t len = first_len + r;
        float* row = scores + r * padded;
        const __m512 m = _mm512_set1_ps(kvflow::row_max(row, len));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < padded; t += 16) {
            const __mmask16 valid = kvflow::tail_mask(std::max<int64_t>(0, len - t));
            const __m512 e = _mm512_maskz_mov_ps(valid, kvflow::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, row + t), m)));
            sum = _mm512_add_ps(sum, store(row, t, e));
        }
        inv_sum[r] = 1.f / kvflow::reduce_add16(sum);
    }
}

template <typename T>
struct Scratch {
    std::vector<T> p;
    std::vector<float> s;
    std::vector<float> q;  // run_item_wide's queries
};

// One (sequence, KV head)'s keys and values in the layouts of the microkernel, packed once
// and shared by all of the sequence's query blocks (per block, the packing measured a
// quarter of float32 prefill attention's time and 40 % of bf16's). Element (key t, dim d) of
// K goes to [key tile][d / G][16 keys][G], of V to [d tile][t / G][16 dims][G]: one 64-byte
// row per k step. `padded` keys (a multiple of 16); zeros past the sequence's keys.
template <typename Dt>
void pack_kv(const typename Dt::T* key_cache, const typename Dt::T* value_cache, const int64_t* table, int64_t keys,
             int64_t padded, int64_t head, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
             typename Dt::T* kp, typename Dt::T* vp) {
    using T = typename Dt::T;
    constexpr int64_t G = kvflow::Micro<Dt>::G;
    static_assert(G == kvflow::kKeyGroup<T>, "the pool's key cells are the microkernel's k groups");
    const int64_t token_stride = num_kv_heads * head_dim;
    std::fill(kp, kp + padded * head_dim, T(0));
    std::fill(vp, vp + padded * head_dim, T(0));
    const int64_t groups = head_dim / G, block_stride = block_size * token_stride;
    for (int64_t t = 0; t < keys; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        // K is dimension-major in the pool, in the same G-dim cells as here: cell g of key t.
        const T* kcell = key_cache + table[t / block_size] * block_stride +
                         kvflow::key_offset<T>(t % block_size, head, 0, head_dim, block_size);
        T* kdst = kp + (t / 16) * head_dim * 16 + (t % 16) * G;
        for (int64_t g = 0; g < groups; ++g) std::memcpy(kdst + g * 16 * G, kcell + g * block_size * G, 4);
        const T* vrow = value_cache + slot * token_stride + head * head_dim;
        T* vdst = vp + (t / G) * 16 * G + t % G;
        for (int64_t d = 0; d < head_dim; ++d) vdst[(d / 16) * padded * 16 + (d % 16) * G] = vrow[d];
    }
}

#if defined(KVFLOW_AVX512BF16) && !defined(KVFLOW_SIMDE)
// run_item in bf16 where vdpbf16ps runs as float32 FMAs (dpbf16.h's fma_bf16_block, the same
// bits): the FMA block would widen its bf16 rows at every call (a row block's queries for each
// 64 keys, its probabilities for each 16 dims of V), so here the queries are widened once per
// head and the probabilities, rounded to bf16, stay float32, in place of their scores. Blocks of
// two tiles: four would need 40 registers.
inline void run_item_wide(const Item& it, const uint16_t* q, int64_t q_stride, const uint16_t* kp, const uint16_t* vp,
                   int64_t seq_padded, int64_t context, int64_t token0, uint16_t* out, int64_t out_stride,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, Scratch<uint16_t>& sc) {
    constexpr int kTiles = 2;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t keys = context + it.q1, padded = (keys + 15) / 16 * 16, pairs = head_dim / 2;
    const int64_t k_tile_stride = head_dim * 16, v_tile_stride = seq_padded * 16;
    const int64_t rows_total = it.q1 - it.q0;
    sc.s.resize(static_cast<size_t>(rows_total * padded));
    sc.q.resize(static_cast<size_t>(rows_total * head_dim));
    float* const qw = sc.q.data();
    // Each call: up to kTiles tiles of 16 from `first`, the rest one at a time.
    auto tiles_of = [](int64_t first, int64_t end, auto&& call) {
        int64_t t = first;
        for (; t + kTiles <= end; t += kTiles) call(t, std::integral_constant<int, kTiles>{});
        for (; t < end; ++t) call(t, std::integral_constant<int, 1>{});
    };
    for (int64_t g = 0; g < group; ++g) {
        const int64_t head = it.head * group + g;
        for (int64_t r = 0; r < rows_total; ++r)
            for (int64_t d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(qw + r * head_dim + d,
                                 kvflow::Micro<BF16>::load(q + (token0 + it.q0 + r) * q_stride + head * head_dim + d, 0xffff));
        for (int64_t r0 = 0; r0 < rows_total; r0 += kRowBlock) {
            const int64_t rows = std::min<int64_t>(kRowBlock, rows_total - r0);
            const int64_t tiles = (context + it.q0 + r0 + rows + 15) / 16;  // to the block's causal limit
            kvflow::with_block_rows<kRowBlock>(rows, [&](auto mt) {
                tiles_of(0, tiles, [&](int64_t tile, auto nt) {
                    StoreScores st{sc.s.data() + r0 * padded, padded, tile * 16, scale};
                    kvflow::fma_bf16_block_wide<decltype(mt)::value, decltype(nt)::value>(
                        qw + r0 * head_dim, head_dim, kp + tile * k_tile_stride, k_tile_stride, pairs, st);
                });
            });
        }
        float inv_sum[kQueryBlock];
        softmax_rows(sc.s.data(), rows_total, padded, context + it.q0 + 1, inv_sum, [&](float* row, int64_t t, __m512 e) {
            const __m512 p = kvflow::Micro<BF16>::round(e);  // over its own score
            _mm512_storeu_ps(row + t, p);
            return p;
        });
        for (int64_t r0 = 0; r0 < rows_total; r0 += kRowBlock) {
            const int64_t rows = std::min<int64_t>(kRowBlock, rows_total - r0);
            const int64_t key_steps = (context + it.q0 + r0 + rows + 1) / 2;
            uint16_t* orow = out + (token0 + it.q0 + r0) * out_stride + head * head_dim;
            kvflow::with_block_rows<kRowBlock>(rows, [&](auto mt) {
                tiles_of(0, head_dim / 16, [&](int64_t dt, auto nt) {
                    StoreOut<BF16> st{orow, out_stride, dt * 16, inv_sum + r0};
                    kvflow::fma_bf16_block_wide<decltype(mt)::value, decltype(nt)::value>(
                        sc.s.data() + r0 * padded, padded, vp + dt * v_tile_stride, v_tile_stride, key_steps, st);
                });
            });
        }
    }
}
#endif

// One item: query rows [q0, q1) of one sequence's chunk for the query heads of one KV head,
// over that head's packed K/V (`seq_padded` keys, from pack_kv).
template <typename Dt>
void run_item(const Item& it, const typename Dt::T* q, int64_t q_stride, const typename Dt::T* kp,
              const typename Dt::T* vp, int64_t seq_padded, int64_t context, int64_t token0, typename Dt::T* out,
              int64_t out_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
              Scratch<typename Dt::T>& sc) {
    using T = typename Dt::T;
    using M = kvflow::Micro<Dt>;
    constexpr int64_t G = M::G;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t keys = context + it.q1;  // the last query of the item sees keys [0, keys)
    const int64_t padded = (keys + 15) / 16 * 16;
    const int64_t k_tile_stride = head_dim * 16, v_tile_stride = seq_padded * 16;

    const int64_t rows_total = it.q1 - it.q0;
    sc.s.resize(static_cast<size_t>(rows_total * padded));
    sc.p.resize(static_cast<size_t>(rows_total * padded));
    for (int64_t g = 0; g < group; ++g) {
        const int64_t head = it.head * group + g;
        // Scores, row block by row block, each only up to its own causal limit.
        for (int64_t r0 = 0; r0 < rows_total; r0 += kRowBlock) {
            const int64_t rows = std::min<int64_t>(kRowBlock, rows_total - r0);
            const int64_t limit = context + it.q0 + r0 + rows;  // keys visible to the block's last row
            const int64_t tiles = (limit + 15) / 16;
            const T* x = q + (token0 + it.q0 + r0) * q_stride + head * head_dim;
            int64_t tile = 0;
            for (; tile + kKeyTiles <= tiles; tile += kKeyTiles) {
                StoreScores st{sc.s.data() + r0 * padded, padded, tile * 16, scale};
                M::template rows<kKeyTiles>(rows, x, q_stride, kp + tile * k_tile_stride, k_tile_stride,
                                            head_dim / G, st);
            }
            for (; tile < tiles; ++tile) {
                StoreScores st{sc.s.data() + r0 * padded, padded, tile * 16, scale};
                M::template rows<1>(rows, x, q_stride, kp + tile * k_tile_stride, k_tile_stride,
                                    head_dim / G, st);
            }
        }
        float inv_sum[kQueryBlock];
        softmax_rows(sc.s.data(), rows_total, padded, context + it.q0 + 1, inv_sum, [&](float* row, int64_t t, __m512 e) {
            return store_probs(sc.p.data() + (row - sc.s.data()) + t, e);
        });
        // out = P V, each row block only over its visible keys.
        for (int64_t r0 = 0; r0 < rows_total; r0 += kRowBlock) {
            const int64_t rows = std::min<int64_t>(kRowBlock, rows_total - r0);
            const int64_t limit = context + it.q0 + r0 + rows;
            const int64_t key_steps = (limit + G - 1) / G;
            T* orow = out + (token0 + it.q0 + r0) * out_stride + head * head_dim;
            for (int64_t dt = 0; dt < head_dim / 16; ++dt) {
                StoreOut<Dt> st{orow, out_stride, dt * 16, inv_sum + r0};
                M::template rows<1>(rows, sc.p.data() + r0 * padded, padded, vp + dt * v_tile_stride,
                                    v_tile_stride, key_steps, st);
            }
        }
    }
}

}  // namespace kvflow::prefill
#endif
