// Paged decode attention for the CPU: one query token per sequence, K/V read in place
// through the block table (no gathered or padded copies).
//
// Built by kvflow/layers/cpu_kernels.py with the machine's compiler (-O3 -march=native
// -fopenmp) and called through ctypes with raw pointers, so it needs no PyTorch headers
// and compiles in a few seconds. OpenMP resolves to the libgomp PyTorch already loaded
// (same soname), so the kernel shares PyTorch's thread pool instead of fighting it.
//
// Layouts (row-major; contiguous unless said):
//   q             [num_seqs, num_heads, head_dim], rows `q_stride` elements apart (a view into a
//                 fused QKV output works as it is)
//   out           [num_seqs, num_heads, head_dim]
//   key_cache     [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache alike)
//   block_tables  [num_seqs, block_table_stride] int64
//   seq_lens      [num_seqs] int64: tokens in each sequence's context, the new one included
// Scores, softmax and the weighted sum of V are accumulated in float32 whatever the
// storage dtype, as the PyTorch path does; in bf16 the probabilities are rounded to bf16
// before p.V, as that path also does (there they meet V in a bf16 matmul).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "common.h"
#include "decode_pv.h"
#include "dpbf16.h"
#include "kernels.h"

namespace {

using kvflow::BF16;
using kvflow::F32;

constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxHeadDim = 256;

// Portable reference: any head_dim, any x86 or ARM compiler. The AVX-512 path below is the
// fast one; the tests run both against PyTorch.
template <typename Dt>
void decode_item_portable(const typename Dt::T* q, const typename Dt::T* key_cache, const typename Dt::T* value_cache,
                          const int64_t* table, int64_t len, typename Dt::T* out, int64_t group, int64_t head_dim,
                          int64_t block_size, int64_t token_stride, int64_t block_stride, float scale,
                          float* scores) {
    using T = typename Dt::T;
    float qf[kMaxGroup][kMaxHeadDim];
    for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d) qf[g][d] = Dt::load(q[g * head_dim + d]);
    for (int64_t t = 0; t < len; ++t) {
        const T* krow = key_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t g = 0; g < group; ++g) {
            float acc = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) acc += qf[g][d] * Dt::load(krow[d]);
            scores[g * len + t] = acc * scale;
        }
    }
    float inv_sum[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) {
        float* row = scores + g * len;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < len; ++t) mx = row[t] > mx ? row[t] : mx;
        for (int64_t t = 0; t < len; ++t) sum += (row[t] = std::exp(row[t] - mx));
        inv_sum[g] = 1.f / sum;
    }
    float acc[kMaxGroup][kMaxHeadDim] = {};
    for (int64_t t = 0; t < len; ++t) {
        const T* vrow = value_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t g = 0; g < group; ++g)
            for (int64_t d = 0; d < head_dim; ++d) acc[g][d] += scores[g * len + t] * Dt::load(vrow[d]);
    }
    for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = Dt::store(acc[g][d] * inv_sum[g]);
}

#if defined(__AVX512F__)
using kvflow::load16;
using namespace kvflow::decode;  // softmax and p.V (decode_pv.h)

// Registers blocked for one head_dim (NV = head_dim / 16 float32 vectors per row) so that the
// accumulators of the q.k and p.V products stay in registers; a runtime head_dim would keep
// them in memory and triple the kernel's time.

// The 16 keys starting at token t0 of one KV head: row pointers, repeating the last valid one
// past the end (read, never stored).
template <typename T>
inline void key_rows16(const T* cache, const int64_t* table, int64_t t0, int64_t count, int64_t block_size,
                       int64_t token_stride, int64_t block_stride, const T** rows) {
    if (block_size % 16 == 0) {  // the 16 keys share one block
        const T* base = cache + table[t0 / block_size] * block_stride + (t0 % block_size) * token_stride;
        for (int64_t i = 0; i < 16; ++i) rows[i] = base + (i < count ? i : count - 1) * token_stride;
        return;
    }
    for (int64_t i = 0; i < 16; ++i) {
        const int64_t t = t0 + (i < count ? i : count - 1);
        rows[i] = cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    }
}

// q.k of one query row with one key row, as a 16-lane partial sum (lanes summed later).
// bf16 with head_dim % 32 == 0: vdpbf16ps straight from the bf16 rows (products exact in
// float32); otherwise float32 FMAs.
template <typename Dt, int NV>
struct QKDot {
    using T = typename Dt::T;
    static constexpr bool kPairs = std::is_same_v<Dt, BF16> && NV % 2 == 0
#if !defined(__AVX512BF16__)
                                   && false
#endif
        ;
    __m512 qv[NV];
#if defined(__AVX512BF16__)
    __m512bh qb[NV / 2 > 0 ? NV / 2 : 1];
#endif
    explicit QKDot(const T* q) {
#if defined(__AVX512BF16__)
        if constexpr (kPairs) {
            for (int j = 0; j < NV / 2; ++j) qb[j] = (__m512bh)_mm512_loadu_si512(q + j * 32);
            return;
        }
#endif
        for (int j = 0; j < NV; ++j) qv[j] = load16(q + j * 16);
    }
    inline __m512 operator()(const T* k) const {
#if defined(__AVX512BF16__)
        if constexpr (kPairs) {
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[0], (__m512bh)_mm512_loadu_si512(k));
            for (int j = 1; j < NV / 2; ++j) a = _mm512_dpbf16_ps(a, qb[j], (__m512bh)_mm512_loadu_si512(k + j * 32));
            return a;
        }
#endif
        __m512 a = _mm512_mul_ps(qv[0], load16(k));
        for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(qv[j], load16(k + j * 16), a);
        return a;
    }
};

// scores[r, t] = scale * q[r] . k[t] for the item's rows (its KV heads x group), 16 keys at a
// time with the 16 horizontal sums done as one transpose-add. All heads of a key row are
// used before moving on, so each block of the pool is read once, front to back: blocks sit
// anywhere in the pool, and a pass per head (three jumps per block instead of one) measured
// 1.4x slower on a shuffled block table.
template <typename Dt, int NV>
void item_scores(const typename Dt::T* q, const typename Dt::T* key_cache, const int64_t* table, int64_t len,
                 int64_t num_item_heads, int64_t group, int64_t block_size, int64_t token_stride,
                 int64_t block_stride, float scale, float* scores) {
    using T = typename Dt::T;
    constexpr int64_t head_dim = NV * 16;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t count = std::min<int64_t>(16, len - t0);
        const T* krows[16];
        key_rows16(key_cache, table, t0, count, block_size, token_stride, block_stride, krows);
        const __mmask16 valid = kvflow::tail_mask(count);
        for (int64_t h = 0; h < num_item_heads; ++h) {
            for (int64_t r = h * group; r < (h + 1) * group; ++r) {
                const QKDot<Dt, NV> dot(q + r * head_dim);
                __m512 acc[16];
                for (int i = 0; i < 16; ++i) acc[i] = dot(krows[i] + h * head_dim);
                _mm512_mask_storeu_ps(scores + r * len + t0, valid, _mm512_mul_ps(kvflow::sum_lanes16(acc), vscale));
            }
        }
    }
}


// One sequence's query rows for `num_item_heads` adjacent KV heads. work: rows x (head_dim + 1)
// floats of scratch (the output accumulators and each row's 1 / sum).
template <typename Dt, int NV>
void decode_item_avx512(const typename Dt::T* q, const typename Dt::T* key_cache, const typename Dt::T* value_cache,
                        const int64_t* table, int64_t len, typename Dt::T* out, int64_t num_item_heads, int64_t group,
                        int64_t block_size, int64_t token_stride, int64_t block_stride, float scale, float* scores,
                        float* work) {
    using T = typename Dt::T;
    constexpr int64_t head_dim = NV * 16;
    const int64_t rows = num_item_heads * group;
    float* acc = work;
    float* inv_sum = work + rows * head_dim;
    item_scores<Dt, NV>(q, key_cache, table, len, num_item_heads, group, block_size, token_stride, block_stride, scale,
                        scores);
    std::fill(acc, acc + rows * head_dim, 0.f);
    const int64_t num_blocks = (len + block_size - 1) / block_size;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<Dt, BF16> && NV % 2 == 0) {
        softmax_rows_bf16(scores, rows, len, inv_sum);
        const uint16_t* p = reinterpret_cast<const uint16_t*>(scores);
        for (int64_t b = 0; b < num_blocks; ++b) {
            const T* vblock = value_cache + table[b] * block_stride;
            const int64_t t_begin = b * block_size, t_end = std::min(len, t_begin + block_size);
            for (int64_t h = 0; h < num_item_heads; ++h)
                pv_block_pairs<NV>(p + h * group * 2 * len, 2 * len, group, vblock + h * head_dim, t_begin, t_end,
                                   token_stride, acc + h * group * head_dim);
        }
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t d = 0; d < head_dim; ++d)
                out[r * head_dim + d] = Dt::store(acc[r * head_dim + pair_lane_of_dim(d)] * inv_sum[r]);
        return;
    }
#endif
    softmax_rows(scores, rows, len, inv_sum);
    for (int64_t b = 0; b < num_blocks; ++b) {
        const T* vblock = value_cache + table[b] * block_stride;
        const int64_t t_begin = b * block_size, t_end = std::min(len, t_begin + block_size);
        for (int64_t h = 0; h < num_item_heads; ++h)
            pv_block<Dt, NV>(scores + h * group * len, group, len, vblock + h * head_dim, t_begin, t_end, token_stride,
                             acc + h * group * head_dim);
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] = Dt::store(acc[r * head_dim + d] * inv_sum[r]);
}

template <typename Dt>
using DecodeItemFn = decltype(&decode_item_avx512<Dt, 1>);

// head_dim / 16 -> the instantiation for it (head_dim a multiple of 16, at most kMaxHeadDim).
template <typename Dt, int NV = 1>
DecodeItemFn<Dt> decode_item_for(int64_t nv) {
    if constexpr (NV > kMaxHeadDim / 16) {
        return nullptr;
    } else {
        return nv == NV ? &decode_item_avx512<Dt, NV> : decode_item_for<Dt, NV + 1>(nv);
    }
}
#endif

template <typename Dt>
void decode(const typename Dt::T* q, int64_t q_stride, const typename Dt::T* key_cache, const typename Dt::T* value_cache,
            const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
            typename Dt::T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, float scale, bool portable) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
#if defined(__AVX512F__)
    const DecodeItemFn<Dt> fast = portable || head_dim % 16 != 0 ? nullptr : decode_item_for<Dt>(head_dim / 16);
    portable = fast == nullptr;
#else
    portable = true;
#endif
    // Whole sequences per item when there are enough of them to keep every thread busy
    // (contiguous reads); otherwise one KV head per item, so a single sequence still uses all cores.
    int64_t item_heads = 1;
    if (!portable && num_seqs >= 4 * omp_get_max_threads()) item_heads = num_kv_heads;
    const int64_t items_per_seq = num_kv_heads / item_heads;
    const int64_t num_items = num_seqs * items_per_seq;

#pragma omp parallel
    {
        std::vector<float> scores;  // [item rows, seq_len], reused across this thread's items
        std::vector<float> work(static_cast<size_t>(item_heads * group * (head_dim + 1)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const int64_t s = item / items_per_seq, h = (item % items_per_seq) * item_heads;
            const int64_t len = seq_lens[s];
            scores.resize(static_cast<size_t>(item_heads * group * len));
            const int64_t q_offset = s * q_stride + h * group * head_dim;
            const int64_t out_offset = (s * num_heads + h * group) * head_dim;
            const int64_t* table = block_tables + s * block_table_stride;
#if defined(__AVX512F__)
            if (!portable) {
                fast(q + q_offset, key_cache + h * head_dim, value_cache + h * head_dim, table, len, out + out_offset,
                     item_heads, group, block_size, token_stride, block_stride, scale, scores.data(), work.data());
                continue;
            }
#endif
            decode_item_portable<Dt>(q + q_offset, key_cache + h * head_dim, value_cache + h * head_dim, table, len,
                                     out + out_offset, group, head_dim, block_size, token_stride, block_stride, scale,
                                     scores.data());
        }
    }
}

}  // namespace

extern "C" {

// key_cache/value_cache slot `slot_mapping[t]` <- row t of k / v ([tokens, row_bytes] with the
// given row strides in bytes: k and v may be views into the fused QKV output).
void kvflow_write_kv(const void* k, int64_t k_row_stride, const void* v, int64_t v_row_stride, void* key_cache,
                     void* value_cache, const int64_t* slot_mapping, int64_t tokens, int64_t row_bytes) {
    const char* ks = static_cast<const char*>(k);
    const char* vs = static_cast<const char*>(v);
    char* kd = static_cast<char*>(key_cache);
    char* vd = static_cast<char*>(value_cache);
#pragma omp parallel for if (tokens * row_bytes >= (1 << 18))
    for (int64_t t = 0; t < tokens; ++t) {
        std::memcpy(kd + slot_mapping[t] * row_bytes, ks + t * k_row_stride, static_cast<size_t>(row_bytes));
        std::memcpy(vd + slot_mapping[t] * row_bytes, vs + t * v_row_stride, static_cast<size_t>(row_bytes));
    }
}

int kvflow_max_group() { return kMaxGroup; }
int kvflow_max_head_dim() { return kMaxHeadDim; }

// dtype: 0 = float32, 1 = bfloat16. portable != 0 forces the portable loops (for tests).
int kvflow_paged_decode_attention(int dtype, const void* q, int64_t q_stride, const void* key_cache, const void* value_cache,
                                  const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                                  void* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, float scale, int portable) {
    if (num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kMaxGroup || head_dim > kMaxHeadDim) return -1;
    if (dtype == 0) {
        decode<F32>(static_cast<const float*>(q), q_stride, static_cast<const float*>(key_cache),
                    static_cast<const float*>(value_cache), block_tables, block_table_stride, seq_lens,
                    static_cast<float*>(out), num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, portable != 0);
    } else if (dtype == 1) {
        decode<BF16>(static_cast<const uint16_t*>(q), q_stride, static_cast<const uint16_t*>(key_cache),
                     static_cast<const uint16_t*>(value_cache), block_tables, block_table_stride, seq_lens,
                     static_cast<uint16_t*>(out), num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, portable != 0);
    } else {
        return -2;
    }
    return 0;
}

}  // extern "C"
