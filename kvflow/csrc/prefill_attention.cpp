// Paged causal attention for prefill chunks in bf16, K/V read through the block table.
//
// Each sequence contributes a chunk of new query tokens at positions context..context+n-1;
// its K/V (cached context and the chunk itself, already written to the pool) are read
// through its block table, so a first chunk and a chunk over cached context take the same
// path. Work items are (sequence, KV head, block of 32 query tokens): the item packs the
// keys it can see into the layout `dpbf16.h` consumes, computes float32 scores only up to
// each row block's causal limit, takes an exact (two-pass) softmax per row, rounds the
// probabilities to bf16 (as PyTorch's bf16 flash attention does) and multiplies by V.
//
// Layouts: q/out [tokens, num_heads, head_dim] with the given token strides; caches
// [num_blocks, block_size, num_kv_heads, head_dim]; query_start [num_seqs + 1];
// seq_lens [num_seqs] = context + chunk length. head_dim must be a multiple of 16.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "common.h"
#include "dpbf16.h"
#include "kernels.h"

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kQueryBlock = 32;
constexpr int kKeyTiles = 4;  // 64 keys per scores call

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

struct StoreOut {  // out row = acc / row sum, rounded to bf16
    uint16_t* out;
    int64_t stride, col0;
    const float* inv_sum;
    inline void operator()(int m, int j, __m512 acc) const {
        const __m512 v = _mm512_mul_ps(acc, _mm512_set1_ps(inv_sum[m]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * stride + col0 + j * 16), (__m256i)_mm512_cvtneps_pbh(v));
    }
};

struct Scratch {
    std::vector<uint16_t> kp, vp, p;
    std::vector<float> s;
};

void run_item(const Item& it, const uint16_t* q, int64_t q_stride, const uint16_t* key_cache,
              const uint16_t* value_cache, const int64_t* table, int64_t context, int64_t token0, uint16_t* out,
              int64_t out_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
              float scale, Scratch& sc) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t keys = context + it.q1;  // the last query of the item sees keys [0, keys)
    const int64_t padded = (keys + 15) / 16 * 16;
    const int64_t d_pairs = head_dim / 2, token_stride = num_kv_heads * head_dim;

    // K packed as [key tile][d pair][16 keys][2]; V as [d tile][key pair][16 dims][2].
    sc.kp.assign(static_cast<size_t>(padded * head_dim), 0);
    sc.vp.assign(static_cast<size_t>(padded * head_dim), 0);
    uint32_t* kp = reinterpret_cast<uint32_t*>(sc.kp.data());
    for (int64_t t = 0; t < keys; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const uint16_t* krow = key_cache + slot * token_stride + it.head * head_dim;
        const uint16_t* vrow = value_cache + slot * token_stride + it.head * head_dim;
        uint32_t pairs[128];
        std::memcpy(pairs, krow, static_cast<size_t>(head_dim) * sizeof(uint16_t));
        uint32_t* kdst = kp + (t / 16) * d_pairs * 16 + t % 16;
        for (int64_t p = 0; p < d_pairs; ++p) kdst[p * 16] = pairs[p];
        uint16_t* vdst = sc.vp.data() + (t / 2) * 32 + t % 2;
        for (int64_t d = 0; d < head_dim; ++d) vdst[(d / 16) * padded * 16 + (d % 16) * 2] = vrow[d];
    }
    const int64_t k_tile_stride = d_pairs * 32, v_tile_stride = padded * 16;

    const int64_t rows_total = it.q1 - it.q0;
    sc.s.resize(static_cast<size_t>(rows_total * padded));
    sc.p.resize(static_cast<size_t>(rows_total * padded));
    for (int64_t g = 0; g < group; ++g) {
        const int64_t head = it.head * group + g;
        // Scores, row block by row block, each only up to its own causal limit.
        for (int64_t r0 = 0; r0 < rows_total; r0 += kvflow::kMaxBlockRows) {
            const int64_t rows = std::min<int64_t>(kvflow::kMaxBlockRows, rows_total - r0);
            const int64_t limit = context + it.q0 + r0 + rows;  // keys visible to the block's last row
            const int64_t tiles = (limit + 15) / 16;
            const uint16_t* x = q + (token0 + it.q0 + r0) * q_stride + head * head_dim;
            int64_t tile = 0;
            for (; tile + kKeyTiles <= tiles; tile += kKeyTiles) {
                StoreScores st{sc.s.data() + r0 * padded, padded, tile * 16, scale};
                kvflow::dpbf16_rows<kKeyTiles>(rows, x, q_stride, sc.kp.data() + tile * k_tile_stride, k_tile_stride,
                                               d_pairs, st);
            }
            for (; tile < tiles; ++tile) {
                StoreScores st{sc.s.data() + r0 * padded, padded, tile * 16, scale};
                kvflow::dpbf16_rows<1>(rows, x, q_stride, sc.kp.data() + tile * k_tile_stride, k_tile_stride,
                                       d_pairs, st);
            }
        }
        // Exact softmax per row over its visible keys; probabilities rounded to bf16, zero beyond.
        float inv_sum[kQueryBlock];
        for (int64_t r = 0; r < rows_total; ++r) {
            const int64_t len = context + it.q0 + r + 1;
            float* row = sc.s.data() + r * padded;
            uint16_t* prow = sc.p.data() + r * padded;
            const __m512 m = _mm512_set1_ps(kvflow::row_max(row, len));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < padded; t += 16) {
                const __mmask16 valid = kvflow::tail_mask(std::max<int64_t>(0, len - t));
                const __m512 e = _mm512_maskz_mov_ps(valid, kvflow::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, row + t), m)));
                const __m256bh pb = _mm512_cvtneps_pbh(e);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + t), (__m256i)pb);
                // Sum what is multiplied: the bf16-rounded probabilities.
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)pb), 16)));
            }
            inv_sum[r] = 1.f / _mm512_reduce_add_ps(sum);
        }
        // out = P V, each row block only over its visible keys.
        for (int64_t r0 = 0; r0 < rows_total; r0 += kvflow::kMaxBlockRows) {
            const int64_t rows = std::min<int64_t>(kvflow::kMaxBlockRows, rows_total - r0);
            const int64_t limit = context + it.q0 + r0 + rows;
            const int64_t key_pairs = (limit + 1) / 2;
            uint16_t* orow = out + (token0 + it.q0 + r0) * out_stride + head * head_dim;
            for (int64_t dt = 0; dt < head_dim / 16; ++dt) {
                StoreOut st{orow, out_stride, dt * 16, inv_sum + r0};
                kvflow::dpbf16_rows<1>(rows, sc.p.data() + r0 * padded, padded, sc.vp.data() + dt * v_tile_stride,
                                       v_tile_stride, key_pairs, st);
            }
        }
    }
}

}  // namespace
#endif

extern "C" int kvflow_paged_prefill_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* key_cache,
                                                   const uint16_t* value_cache, const int64_t* block_tables,
                                                   int64_t block_table_stride, const int64_t* query_start,
                                                   const int64_t* seq_lens, uint16_t* out, int64_t out_stride,
                                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                                   int64_t head_dim, int64_t block_size, float scale) {
#if defined(__AVX512BF16__)
    if (head_dim % 16 != 0 || head_dim > 256 || num_heads % num_kv_heads != 0) return -1;
    std::vector<Item> items;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t n = query_start[s + 1] - query_start[s], context = seq_lens[s] - n;
        for (int64_t q0 = 0; q0 < n; q0 += kQueryBlock) {
            const int64_t q1 = std::min(n, q0 + kQueryBlock);
            for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({s, h, q0, q1, (q1 - q0) * (context + q1)});
        }
    }
    // Longest first, taken dynamically: the causal triangle makes items very unequal.
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
    const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel
    {
        Scratch scratch;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; ++i) {
            const Item& it = items[i];
            const int64_t n = query_start[it.seq + 1] - query_start[it.seq];
            run_item(it, q, q_stride, key_cache, value_cache, block_tables + it.seq * block_table_stride,
                     seq_lens[it.seq] - n, query_start[it.seq], out, out_stride, num_heads, num_kv_heads, head_dim,
                     block_size, scale, scratch);
        }
    }
    return 0;
#else
    (void)q; (void)q_stride; (void)key_cache; (void)value_cache; (void)block_tables; (void)block_table_stride;
    (void)query_start; (void)seq_lens; (void)out; (void)out_stride; (void)num_seqs; (void)num_heads;
    (void)num_kv_heads; (void)head_dim; (void)block_size; (void)scale;
    return -2;
#endif
}
