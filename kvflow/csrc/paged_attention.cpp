// Paged decode attention for the CPU: one query token per sequence, K/V read in place
// through the block table (no gathered or padded copies).
//
// Built by kvflow/layers/cpu_kernels.py with the machine's compiler (-O3 -march=native
// -fopenmp) and called through ctypes with raw pointers, so it needs no PyTorch headers
// and compiles in about a second. OpenMP resolves to the libgomp PyTorch already loaded
// (same soname), so the kernel shares PyTorch's thread pool instead of fighting it.
//
// Layouts (all contiguous, row-major):
//   q, out        [num_seqs, num_heads, head_dim]
//   key_cache     [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache alike)
//   block_tables  [num_seqs, block_table_stride] int64
//   seq_lens      [num_seqs] int64: tokens in each sequence's context, the new one included
// Scores, softmax and the weighted sum of V are accumulated in float32 whatever the
// storage dtype, as the PyTorch path does.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "common.h"
#include "dpbf16.h"

namespace {

using kvflow::BF16;
using kvflow::F32;

constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxRows = 64;    // query heads one AVX-512 item may cover

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
using kvflow::exp512;
using kvflow::load16;

// Scores one key at a time: q.k as float32 FMAs and one horizontal sum per (key, query head).
template <typename T>
inline void scores_fp32(const __m512 (*qv)[kMaxHeadDim / 16], const T* key_cache, const int64_t* table, int64_t len,
                        int64_t num_item_heads, int64_t group, int64_t nv, int64_t head_dim, int64_t block_size,
                        int64_t token_stride, int64_t block_stride, float scale, float* scores) {
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    for (int64_t b = 0, t = 0; b < num_blocks; ++b) {
        const T* krow = key_cache + table[b] * block_stride;
        for (const int64_t end = std::min(len, t + block_size); t < end; ++t, krow += token_stride) {
            for (int64_t h = 0; h < num_item_heads; ++h) {
                __m512 kv[kMaxHeadDim / 16];
                for (int64_t j = 0; j < nv; ++j) kv[j] = load16(krow + h * head_dim + j * 16);
                for (int64_t r = h * group; r < (h + 1) * group; ++r) {
                    __m512 acc = _mm512_mul_ps(qv[r][0], kv[0]);
                    for (int64_t j = 1; j < nv; ++j) acc = _mm512_fmadd_ps(qv[r][j], kv[j], acc);
                    scores[r * len + t] = _mm512_reduce_add_ps(acc) * scale;
                }
            }
        }
    }
}

#if defined(__AVX512BF16__)
// bf16 scores 16 keys at a time: q.k straight from the bf16 rows with vdpbf16ps (products
// exact in float32, no conversion of K), and the 16 horizontal sums done as one transpose-add.
inline void scores_bf16_keys16(const uint16_t* q, const uint16_t* key_cache, const int64_t* table, int64_t len,
                               int64_t num_item_heads, int64_t group, int64_t head_dim, int64_t block_size,
                               int64_t token_stride, int64_t block_stride, float scale, float* scores) {
    const int64_t nq = head_dim / 32, rows = num_item_heads * group;
    __m512bh qb[kMaxRows][kMaxHeadDim / 32];
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < nq; ++j) qb[r][j] = (__m512bh)_mm512_loadu_si512(q + r * head_dim + j * 32);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t count = std::min<int64_t>(16, len - t0);
        const uint16_t* krows[16];
        if (block_size % 16 == 0) {  // the 16 keys share one block
            const uint16_t* base = key_cache + table[t0 / block_size] * block_stride + (t0 % block_size) * token_stride;
            for (int64_t i = 0; i < 16; ++i) krows[i] = base + (i < count ? i : 0) * token_stride;
        } else {
            for (int64_t i = 0; i < 16; ++i) {
                const int64_t t = t0 + (i < count ? i : 0);  // past the end: a repeat, never stored
                krows[i] = key_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
            }
        }
        const __mmask16 valid = kvflow::tail_mask(count);
        for (int64_t h = 0; h < num_item_heads; ++h) {
            for (int64_t r = h * group; r < (h + 1) * group; ++r) {
                __m512 acc[16];
                for (int64_t i = 0; i < 16; ++i) {
                    const uint16_t* k = krows[i] + h * head_dim;
                    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[r][0], (__m512bh)_mm512_loadu_si512(k));
                    for (int64_t j = 1; j < nq; ++j) a = _mm512_dpbf16_ps(a, qb[r][j], (__m512bh)_mm512_loadu_si512(k + j * 32));
                    acc[i] = a;
                }
                _mm512_mask_storeu_ps(scores + r * len + t0, valid, _mm512_mul_ps(kvflow::sum_lanes16(acc), vscale));
            }
        }
    }
}
#endif

// head_dim a multiple of 16: registers hold 16 lanes of a row; accumulation in float32.
// One item covers `num_item_heads` adjacent KV heads of one sequence, so each token's K and V
// rows are read as one contiguous run (heads are adjacent within a slot).
template <typename Dt>
void decode_item_avx512(const typename Dt::T* q, const typename Dt::T* key_cache, const typename Dt::T* value_cache,
                        const int64_t* table, int64_t len, typename Dt::T* out, int64_t num_item_heads, int64_t group,
                        int64_t head_dim, int64_t block_size, int64_t token_stride, int64_t block_stride, float scale,
                        float* scores) {
    using T = typename Dt::T;
    const int64_t nv = head_dim / 16, rows = num_item_heads * group;
    __m512 qv[kMaxRows][kMaxHeadDim / 16];
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < nv; ++j) qv[r][j] = load16(q + r * head_dim + j * 16);

    const int64_t num_blocks = (len + block_size - 1) / block_size;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<Dt, BF16>) {
        if (head_dim % 32 == 0) {
            scores_bf16_keys16(q, key_cache, table, len, num_item_heads, group, head_dim, block_size, token_stride,
                               block_stride, scale, scores);
        } else {
            scores_fp32(qv, key_cache, table, len, num_item_heads, group, nv, head_dim, block_size, token_stride, block_stride, scale, scores);
        }
    } else
#endif
    {
        scores_fp32(qv, key_cache, table, len, num_item_heads, group, nv, head_dim, block_size, token_stride, block_stride, scale, scores);
    }

    float inv_sum[kMaxRows];
    for (int64_t r = 0; r < rows; ++r) {
        float* row = scores + r * len;
        const __m512 m = _mm512_set1_ps(kvflow::row_max(row, len));
        __m512 sum = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), m));
            _mm512_storeu_ps(row + t, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + t), m));
        _mm512_mask_storeu_ps(row + t, tail, e);
        sum = _mm512_mask_add_ps(sum, tail, sum, e);
        inv_sum[r] = 1.f / _mm512_reduce_add_ps(sum);
    }

    __m512 acc[kMaxRows][kMaxHeadDim / 16];
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < nv; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0, t = 0; b < num_blocks; ++b) {
        const T* vrow = value_cache + table[b] * block_stride;
        for (const int64_t end = std::min(len, t + block_size); t < end; ++t, vrow += token_stride) {
            for (int64_t h = 0; h < num_item_heads; ++h) {
                __m512 vv[kMaxHeadDim / 16];
                for (int64_t j = 0; j < nv; ++j) vv[j] = load16(vrow + h * head_dim + j * 16);
                for (int64_t r = h * group; r < (h + 1) * group; ++r) {
                    const __m512 p = _mm512_set1_ps(scores[r * len + t]);
                    for (int64_t j = 0; j < nv; ++j) acc[r][j] = _mm512_fmadd_ps(p, vv[j], acc[r][j]);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        alignas(64) float row[kMaxHeadDim];
        const __m512 inv = _mm512_set1_ps(inv_sum[r]);
        for (int64_t j = 0; j < nv; ++j) _mm512_store_ps(row + j * 16, _mm512_mul_ps(acc[r][j], inv));
        for (int64_t d = 0; d < head_dim; ++d) out[r * head_dim + d] = Dt::store(row[d]);
    }
}
#endif

template <typename Dt>
void decode(const typename Dt::T* q, const typename Dt::T* key_cache, const typename Dt::T* value_cache,
            const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
            typename Dt::T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, float scale, bool portable) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
#if defined(__AVX512F__)
    portable = portable || head_dim % 16 != 0;
#else
    portable = true;
#endif
    // Whole sequences per item when there are enough of them to keep every thread busy
    // (contiguous reads); otherwise one KV head per item, so a single sequence still uses all cores.
    int64_t item_heads = 1;
    if (!portable && num_heads <= kMaxRows && num_seqs >= 4 * omp_get_max_threads()) item_heads = num_kv_heads;
    const int64_t items_per_seq = num_kv_heads / item_heads;
    const int64_t num_items = num_seqs * items_per_seq;

#pragma omp parallel
    {
        std::vector<float> scores;  // [item_heads * group, seq_len], reused across this thread's items
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const int64_t s = item / items_per_seq, h = (item % items_per_seq) * item_heads;
            const int64_t len = seq_lens[s];
            scores.resize(static_cast<size_t>(item_heads * group * len));
            const int64_t q_offset = (s * num_heads + h * group) * head_dim;
            const int64_t* table = block_tables + s * block_table_stride;
#if defined(__AVX512F__)
            if (!portable) {
                decode_item_avx512<Dt>(q + q_offset, key_cache + h * head_dim, value_cache + h * head_dim, table, len,
                                       out + q_offset, item_heads, group, head_dim, block_size, token_stride,
                                       block_stride, scale, scores.data());
                continue;
            }
#endif
            decode_item_portable<Dt>(q + q_offset, key_cache + h * head_dim, value_cache + h * head_dim, table, len,
                                     out + q_offset, group, head_dim, block_size, token_stride, block_stride, scale,
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
int kvflow_paged_decode_attention(int dtype, const void* q, const void* key_cache, const void* value_cache,
                                  const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                                  void* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, float scale, int portable) {
    if (num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kMaxGroup || head_dim > kMaxHeadDim) return -1;
    if (dtype == 0) {
        decode<F32>(static_cast<const float*>(q), static_cast<const float*>(key_cache),
                    static_cast<const float*>(value_cache), block_tables, block_table_stride, seq_lens,
                    static_cast<float*>(out), num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, portable != 0);
    } else if (dtype == 1) {
        decode<BF16>(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(key_cache),
                     static_cast<const uint16_t*>(value_cache), block_tables, block_table_stride, seq_lens,
                     static_cast<uint16_t*>(out), num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, portable != 0);
    } else {
        return -2;
    }
    return 0;
}

}  // extern "C"
