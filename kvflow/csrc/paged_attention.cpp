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
//   value_cache   [num_blocks, block_size, num_kv_heads, head_dim]
//   key_cache     the same size, each block [num_kv_heads][head_dim / G][block_size][G]
//                 (dimension-major, G dims per 4-byte cell: common.h, kv_layout.py)
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
        const T* kblock = key_cache + table[t / block_size] * block_stride;  // this item's head
        for (int64_t g = 0; g < group; ++g) {
            float acc = 0.f;
            for (int64_t d = 0; d < head_dim; ++d)
                acc += qf[g][d] * Dt::load(kblock[kvflow::key_offset<T>(t % block_size, 0, d, head_dim, block_size)]);
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

// Where the 16 keys of a q.k step are: `kcell0` points at dim group 0 of the first of them,
// and the group g of key i is at kcell0 + g * block_size * G, plus, when the keys span blocks
// (block_size not a multiple of 16), byte offset i of `lo`/`hi` (lanes 0-7, 8-15).
template <typename T, bool kGather>
inline __m512i key_cells16(const T* kcell0, int64_t g, int64_t block_size, __m512i lo, __m512i hi) {
    const T* cells = kcell0 + g * block_size * kvflow::kKeyGroup<T>;
    if constexpr (!kGather) {
        (void)lo; (void)hi;
        return _mm512_loadu_si512(cells);
    } else {
        const __m256i a = _mm512_i64gather_epi32(lo, cells, 1), b = _mm512_i64gather_epi32(hi, cells, 1);
        return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    }
}

// scores[r, t0 + i] = scale * q[r] . k[t0 + i] for R query rows of one KV head and 16 keys
// (`valid` of them real). Keys are stored dimension-major, so one dim group of the 16 keys is
// one 64-byte vector: each q element (a dim pair in bf16, for vdpbf16ps) is broadcast and
// multiplied into 16 scores at once, with no horizontal sums (measured 11 % faster in float32
// and 15 % in bf16 than 16 token-major rows and a transpose-add, cold caches). P partial sums
// per row keep R x P FMA chains in flight. bf16 without AVX512-BF16 splits each pair into its
// two dims and takes float32 FMAs.
template <typename Dt, int NV, int R, bool kGather>
inline void scores16(const typename Dt::T* q, const typename Dt::T* kcell0, int64_t block_size, __m512i lo,
                     __m512i hi, __mmask16 valid, __m512 vscale, float* out, int64_t len) {
    using T = typename Dt::T;
    constexpr int64_t D = NV * 16, G = kvflow::kKeyGroup<T>, kGroups = D / G;
    constexpr int P = 4;
    static_assert(kGroups % P == 0, "head_dim / G must be a multiple of 4");
    __m512 acc[R][P];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < P; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < kGroups; g += P) {
        for (int i = 0; i < P; ++i) {
            const __m512i cells = key_cells16<T, kGather>(kcell0, g + i, block_size, lo, hi);
            if constexpr (std::is_same_v<Dt, BF16>) {
#if defined(__AVX512BF16__)
                for (int r = 0; r < R; ++r) {
                    int32_t pair;
                    std::memcpy(&pair, q + r * D + 2 * (g + i), sizeof(pair));
                    acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)cells);
                }
#else
                const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(cells, 16));
                const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(cells, _mm512_set1_epi32(int32_t(0xffff0000u))));
                for (int r = 0; r < R; ++r) {
                    const T* qp = q + r * D + 2 * (g + i);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(Dt::load(qp[0])), even, acc[r][i]);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(Dt::load(qp[1])), odd, acc[r][i]);
                }
#endif
            } else {
                const __m512 kv = _mm512_castsi512_ps(cells);
                for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + g + i]), kv, acc[r][i]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
        _mm512_mask_storeu_ps(out + r * len, valid, _mm512_mul_ps(sum, vscale));
    }
}

// One KV head's query rows [r, r_end) against 16 keys, R rows at a time.
template <typename Dt, int NV, bool kGather>
inline void head_scores16(const typename Dt::T* q, int64_t r, int64_t r_end, const typename Dt::T* kh,
                          int64_t block_size, __m512i lo, __m512i hi, __mmask16 valid, __m512 vscale, float* scores,
                          int64_t len) {
    constexpr int64_t D = NV * 16;
    for (; r + 4 <= r_end; r += 4)
        scores16<Dt, NV, 4, kGather>(q + r * D, kh, block_size, lo, hi, valid, vscale, scores + r * len, len);
    switch (r_end - r) {
        case 3: scores16<Dt, NV, 3, kGather>(q + r * D, kh, block_size, lo, hi, valid, vscale, scores + r * len, len); break;
        case 2: scores16<Dt, NV, 2, kGather>(q + r * D, kh, block_size, lo, hi, valid, vscale, scores + r * len, len); break;
        case 1: scores16<Dt, NV, 1, kGather>(q + r * D, kh, block_size, lo, hi, valid, vscale, scores + r * len, len); break;
        default: break;
    }
}

// The fast path's q.k for an item's KV heads. All heads of a block are used before moving on,
// so each block of the pool is read once, front to back. With block_size a multiple of 16 the
// 16 keys of a step share one block and are one load per dim group; otherwise they are
// gathered from the blocks they span.
template <typename Dt, int NV>
void item_scores(const typename Dt::T* q, const typename Dt::T* key_cache, const int64_t* table, int64_t len,
                 int64_t num_item_heads, int64_t group, int64_t block_size, int64_t block_stride, float scale,
                 float* scores) {
    using T = typename Dt::T;
    constexpr int64_t D = NV * 16, G = kvflow::kKeyGroup<T>;
    const __m512 vscale = _mm512_set1_ps(scale);
    const bool contiguous = block_size % 16 == 0;
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const __mmask16 valid = kvflow::tail_mask(len - t0);
        if (contiguous) {
            const T* kb = key_cache + table[t0 / block_size] * block_stride + (t0 % block_size) * G;
            for (int64_t h = 0; h < num_item_heads; ++h)
                head_scores16<Dt, NV, false>(q, h * group, (h + 1) * group, kb + h * D * block_size, block_size,
                                             _mm512_setzero_si512(), _mm512_setzero_si512(), valid, vscale,
                                             scores + t0, len);
            continue;
        }
        alignas(64) int64_t offset[16];  // bytes from the cache to each key's first cell
        for (int64_t i = 0; i < 16; ++i) {
            const int64_t t = std::min(t0 + i, len - 1);  // past the end: re-read the last key (masked)
            offset[i] = (table[t / block_size] * block_stride + (t % block_size) * G) * static_cast<int64_t>(sizeof(T));
        }
        const __m512i lo = _mm512_load_si512(offset), hi = _mm512_load_si512(offset + 8);
        for (int64_t h = 0; h < num_item_heads; ++h)
            head_scores16<Dt, NV, true>(q, h * group, (h + 1) * group, key_cache + h * D * block_size, block_size, lo,
                                        hi, valid, vscale, scores + t0, len);
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
    item_scores<Dt, NV>(q, key_cache, table, len, num_item_heads, group, block_size, block_stride, scale, scores);
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

// The AVX-512 item function for a head_dim, or null (then the portable loops run): it needs
// head_dim a multiple of 16, for its register blocks; any block size.
template <typename Dt>
DecodeItemFn<Dt> fast_item(int64_t head_dim) {
    return head_dim % 16 == 0 && head_dim <= kMaxHeadDim ? decode_item_for<Dt>(head_dim / 16) : nullptr;
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
    const DecodeItemFn<Dt> fast = portable ? nullptr : fast_item<Dt>(head_dim);
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
    // Longest sequences first, taken dynamically: the threads then finish within about one
    // short item of each other instead of one arbitrary one.
    std::vector<int64_t> by_length(static_cast<size_t>(num_seqs));
    for (int64_t s = 0; s < num_seqs; ++s) by_length[s] = s;
    std::stable_sort(by_length.begin(), by_length.end(),
                     [seq_lens](int64_t a, int64_t b) { return seq_lens[a] > seq_lens[b]; });

#pragma omp parallel
    {
        std::vector<float> scores;  // [item rows, seq_len], reused across this thread's items
        std::vector<float> work(static_cast<size_t>(item_heads * group * (head_dim + 1)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const int64_t s = by_length[item / items_per_seq], h = (item % items_per_seq) * item_heads;
            const int64_t len = seq_lens[s];
            scores.resize(static_cast<size_t>(item_heads * group * len));
            const int64_t q_offset = s * q_stride + h * group * head_dim;
            const int64_t out_offset = (s * num_heads + h * group) * head_dim;
            const int64_t* table = block_tables + s * block_table_stride;
#if defined(__AVX512F__)
            if (!portable) {
                fast(q + q_offset, key_cache + h * head_dim * block_size, value_cache + h * head_dim, table, len, out + out_offset,
                     item_heads, group, block_size, token_stride, block_stride, scale, scores.data(), work.data());
                continue;
            }
#endif
            decode_item_portable<Dt>(q + q_offset, key_cache + h * head_dim * block_size, value_cache + h * head_dim, table, len,
                                     out + out_offset, group, head_dim, block_size, token_stride, block_stride, scale,
                                     scores.data());
        }
    }
}

}  // namespace

extern "C" {

// Token t of k / v ([tokens, num_kv_heads * head_dim] with the given row strides in bytes: k
// and v may be views into the fused QKV output) -> slot `slot_mapping[t]` of the caches: V as
// a row, K scattered into its block's dimension-major 4-byte cells (common.h, key_offset).
// Returns -1 for elements wider than a cell or a key head that is not a whole number of cells.
int kvflow_write_kv(const void* k, int64_t k_row_stride, const void* v, int64_t v_row_stride, void* key_cache,
                    void* value_cache, const int64_t* slot_mapping, int64_t tokens, int64_t num_kv_heads,
                    int64_t head_dim, int64_t block_size, int64_t elem_bytes) {
    const int64_t row_bytes = num_kv_heads * head_dim * elem_bytes;
    if (elem_bytes > 4 || (head_dim * elem_bytes) % 4 != 0) return -1;
    const int64_t cells = row_bytes / 4;  // per token; cell c of a token goes to [c][t] of its block
    const char* ks = static_cast<const char*>(k);
    const char* vs = static_cast<const char*>(v);
    uint32_t* kd = static_cast<uint32_t*>(key_cache);
    char* vd = static_cast<char*>(value_cache);
#pragma omp parallel for if (tokens * row_bytes >= (1 << 18))
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        uint32_t* block = kd + (slot / block_size) * block_size * cells + slot % block_size;
        const char* src = ks + t * k_row_stride;
        for (int64_t c = 0; c < cells; ++c) std::memcpy(block + c * block_size, src + 4 * c, 4);
        std::memcpy(vd + slot * row_bytes, vs + t * v_row_stride, static_cast<size_t>(row_bytes));
    }
    return 0;
}

// 1 when decode attention in this dtype (0 float32, 1 bf16) runs its AVX-512 path for this head_dim.
int kvflow_decode_fast_path(int dtype, int64_t head_dim) {
#if defined(__AVX512F__)
    return (dtype == 0 ? fast_item<F32>(head_dim) != nullptr : fast_item<BF16>(head_dim) != nullptr) ? 1 : 0;
#else
    (void)dtype; (void)head_dim;
    return 0;
#endif
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
