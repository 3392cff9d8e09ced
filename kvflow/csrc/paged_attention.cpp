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
// Numerics: kvflow's attention numerics (docs/architecture.md), the same operations in the
// same order as the prefill kernel and attention_ref.h, so that a query row gets the same
// bits whichever kernel computes it; the AVX-512 path below, attention_ref.h elsewhere.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "attention_ref.h"
#include "common.h"
#include "decode_pv.h"
#include "decode_qk.h"
#include "dpbf16.h"
#include "kernels.h"

namespace {

using kvflow::BF16;
using kvflow::F32;

constexpr int kMaxGroup = static_cast<int>(kvflow::ref::kMaxRefRows);  // query heads per KV head
constexpr int kMaxHeadDim = 256;

#if defined(KVFLOW_AVX512F)
using kvflow::load16;
using namespace kvflow::decode;  // q.k (decode_qk.h), softmax and p.V (decode_pv.h)

// The item a thread computes after this one: its keys are asked for during this one's p.V.
template <typename T>
struct NextItem {
    const T* key_cache = nullptr;  // its first KV head's keys; null: none
    const int64_t* table = nullptr;
    int64_t len = 0;
};

// One sequence's query rows for `num_item_heads` adjacent KV heads. work: rows x (head_dim + 1)
// floats of scratch (the output accumulators and each row's 1 / sum).
template <typename Dt, int NV>
void decode_item_avx512(const typename Dt::T* q, const typename Dt::T* key_cache, const typename Dt::T* value_cache,
                        const int64_t* table, int64_t len, typename Dt::T* out, int64_t num_item_heads, int64_t group,
                        int64_t block_size, int64_t token_stride, int64_t block_stride, float scale, float* scores,
                        float* work, const NextItem<typename Dt::T>& next) {
    using T = typename Dt::T;
    constexpr int64_t head_dim = NV * 16;
    const int64_t rows = num_item_heads * group;
    float* acc = work;
    float* inv_sum = work + rows * head_dim;
    // V rows of one block for this item's heads: from its first head's row to its last head's end.
    const int64_t item_v_bytes = ((block_size - 1) * token_stride + num_item_heads * head_dim) * static_cast<int64_t>(sizeof(T));
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    constexpr int64_t kPrefetchBlocks = 2;  // V blocks asked for ahead of p.V
    item_scores<Dt, NV>(q, key_cache, table, len, num_item_heads, group, block_size, block_stride, scale, scores,
                        value_cache, item_v_bytes, kPrefetchBlocks);
    const int64_t item_k_bytes = num_item_heads * head_dim * block_size * static_cast<int64_t>(sizeof(T));
    // The next item's blocks that its first q.k group reads (decode_qk.h asks for later ones itself).
    const int64_t next_blocks = next.key_cache == nullptr ? 0
        : std::min((next.len + block_size - 1) / block_size, (16 * kKeyTiles + block_size - 1) / block_size);
    std::fill(acc, acc + rows * head_dim, 0.f);
#if defined(KVFLOW_AVX512BF16)
    if constexpr (std::is_same_v<Dt, BF16>) {
        softmax_rows_bf16(scores, rows, len, inv_sum);
        const uint16_t* p = reinterpret_cast<const uint16_t*>(scores);
        // Blocks of an even size hold whole pairs: block by block, all heads of a block before
        // the next. An odd size (rare) splits pairs across blocks: each key's row via the table.
        if (block_size % 2 == 0) {
            for (int64_t b = 0; b < num_blocks; ++b) {
                const int64_t t_begin = b * block_size, t_end = std::min(len, t_begin + block_size);
                // While this block's p.V runs: a later V block, or near the end the next item's keys.
                kvflow::PrefetchStream pf;
                if (b + kPrefetchBlocks < num_blocks) {
                    pf.reset(item_v_bytes);
                    pf.add(value_cache + table[b + kPrefetchBlocks] * block_stride);
                } else if (b + kPrefetchBlocks == num_blocks || (b == 0 && num_blocks < kPrefetchBlocks)) {
                    pf.reset(item_k_bytes);
                    for (int64_t nb = 0; nb < next_blocks; ++nb) pf.add(next.key_cache + next.table[nb] * block_stride);
                }
                pf.spread(num_item_heads * ((group + kPVRows<NV> - 1) / kPVRows<NV>) * ((t_end - t_begin + 1) / 2));
                for (int64_t h = 0; h < num_item_heads; ++h) {
                    const T* vrow0 = value_cache + table[b] * block_stride + h * head_dim;
                    pv_pairs<NV>(p + h * group * 2 * len, 2 * len, group, t_begin, t_end,
                                 [=](int64_t t) { return vrow0 + (t - t_begin) * token_stride; },
                                 acc + h * group * head_dim, &pf);
                }
                pf.drain();
            }
        } else {
            for (int64_t h = 0; h < num_item_heads; ++h)
                pv_pairs<NV>(p + h * group * 2 * len, 2 * len, group, 0, len, [=](int64_t t) {
                    return value_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride +
                           h * head_dim;
                }, acc + h * group * head_dim);
        }
        for (int64_t r = 0; r < rows; ++r) store_pair_row<NV>(acc + r * head_dim, inv_sum[r], out + r * head_dim);
        return;
    }
#endif
    softmax_rows(scores, rows, len, inv_sum);
    for (int64_t b = 0; b < num_blocks; ++b) {
        const T* vblock = value_cache + table[b] * block_stride;
        const int64_t t_begin = b * block_size, t_end = std::min(len, t_begin + block_size);
        if (b + kPrefetchBlocks < num_blocks)
            kvflow::prefetch_l2(value_cache + table[b + kPrefetchBlocks] * block_stride, item_v_bytes);
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

// The AVX-512 item function for a head_dim, or null (then attention_ref.h runs): it needs
// head_dim a multiple of 16, for its register blocks, and in bf16 AVX512-BF16 (the numerics
// pair keys as vdpbf16ps does); any block size.
template <typename Dt>
DecodeItemFn<Dt> fast_item(int64_t head_dim) {
#if !defined(KVFLOW_AVX512BF16)
    if constexpr (std::is_same_v<Dt, BF16>) return nullptr;
    else
#endif
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
#if defined(KVFLOW_AVX512F)
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
        std::vector<const typename Dt::T*> vrows;  // the portable path's V row of each key
        // item; `after`: the item this thread computes next (num_items: none)
        auto run = [&](int64_t item, int64_t after) {
            const int64_t s = by_length[item / items_per_seq], h = (item % items_per_seq) * item_heads;
            const int64_t len = seq_lens[s];
            scores.resize(static_cast<size_t>(item_heads * group * kvflow::ref::score_stride(len)));
            if (portable) vrows.resize(static_cast<size_t>(len));
            const int64_t q_offset = s * q_stride + h * group * head_dim;
            const int64_t out_offset = (s * num_heads + h * group) * head_dim;
            const int64_t* table = block_tables + s * block_table_stride;
#if defined(KVFLOW_AVX512F)
            if (!portable) {
                NextItem<typename Dt::T> next;
                if (after < num_items) {
                    const int64_t s_next = by_length[after / items_per_seq];
                    next.key_cache = key_cache + (after % items_per_seq) * item_heads * head_dim * block_size;
                    next.table = block_tables + s_next * block_table_stride;
                    next.len = seq_lens[s_next];
                }
                fast(q + q_offset, key_cache + h * head_dim * block_size, value_cache + h * head_dim, table, len, out + out_offset,
                     item_heads, group, block_size, token_stride, block_stride, scale, scores.data(), work.data(), next);
                return;
            }
#endif
            kvflow::ref::attend_rows<Dt>(q + q_offset, 0, 1, group, &len, key_cache + h * head_dim * block_size,
                                         value_cache + h * head_dim, table, out + out_offset, 0, head_dim,
                                         block_size, token_stride, block_stride, scale, scores.data(), work.data(),
                                         vrows.data());
        };
        if (item_heads == num_kv_heads) {
            // Whole sequences go round-robin in length order (not taken dynamically), so each
            // thread knows its next item and asks for its first keys while it finishes this one:
            // a cold start per item cost ~10 % (32 sequences, two threads: 32.4 -> 28.2 ns per
            // key and layer with the prefetch streams). Per-head items (few sequences) stay
            // dynamic: there the lookahead measured 5-10 % slower.
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
            for (int64_t item = tid; item < num_items; item += nt) run(item, item + nt);
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < num_items; ++item) run(item, num_items);
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
#if defined(KVFLOW_AVX512F)
    return (dtype == 0 ? fast_item<F32>(head_dim) != nullptr : fast_item<BF16>(head_dim) != nullptr) ? 1 : 0;
#else
    (void)dtype; (void)head_dim;
    return 0;
#endif
}

// Where decode attention's prefetch streams ask for lines (common.h, PrefetchStream): 0 L1, 1 L2,
// -1 by CPU vendor (L2 on Intel, else L1). Returns the setting in force (-2 without the AVX-512
// decode kernel, which is all that streams). Results are the same either way.
int kvflow_set_stream_prefetch(int choice) {
#if defined(KVFLOW_AVX512F)
    kvflow::stream_prefetch_l2() = choice < 0 ? __builtin_cpu_is("intel") != 0 : choice != 0;
    return kvflow::stream_prefetch_l2() ? 1 : 0;
#else
    (void)choice;
    return -2;
#endif
}

int kvflow_max_group() { return kMaxGroup; }
int kvflow_max_head_dim() { return kMaxHeadDim; }

// dtype: 0 = float32, 1 = bfloat16. portable != 0 forces attention_ref.h (for tests).
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
