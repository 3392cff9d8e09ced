// Paged causal attention for prefill chunks, K/V read through the block table; bf16
// (AVX512-BF16) and float32 (AVX-512F).
//
// Each sequence contributes a chunk of new query tokens at positions context..context+n-1;
// its K/V (cached context and the chunk itself, already written to the pool) are read
// through its block table, so a first chunk and a chunk over cached context take the same
// path. Each (sequence, KV head)'s keys and values are first packed, once, into the layout
// the GEMM microkernels consume (microkernel.h). Work items are (sequence, KV head, block of
// 32 query tokens), computed by prefill_item.h: float32 scores only up to each row block's
// causal limit, an exact (two-pass) softmax per row, then P V. In bf16 the probabilities are
// rounded to bf16 first, as PyTorch's bf16 flash attention does; in float32 nothing is rounded.
//
// Layouts: q/out [tokens, num_heads, head_dim] with the given token strides; value cache
// [num_blocks, block_size, num_kv_heads, head_dim], key cache dimension-major (common.h);
// query_start [num_seqs + 1]; seq_lens [num_seqs] = context + chunk length. head_dim must be a multiple of 16.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>

#include "attention_ref.h"
#include "common.h"
#include "kernels.h"
#include "microkernel.h"
#include "prefill_item.h"

#if defined(KVFLOW_AVX512F)
namespace {

using kvflow::BF16;
using kvflow::F32;

// Bytes of packed K/V at a time (kvflow_prefill_pack_budget changes it, for tests).
int64_t g_pack_budget = int64_t(64) << 20;

using namespace kvflow::prefill;

template <typename Dt>
int prefill(const typename Dt::T* q, int64_t q_stride, const typename Dt::T* key_cache,
             const typename Dt::T* value_cache, const int64_t* block_tables, int64_t block_table_stride,
             const int64_t* query_start, const int64_t* seq_lens, typename Dt::T* out, int64_t out_stride,
             int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
             float scale) {
    using T = typename Dt::T;
    // K/V are packed once per (sequence, KV head) pair, then the items run over them. Pairs
    // go in rounds whose packed K/V fit the pack budget (at least one pair a round), so a long
    // context does not need all its heads packed at once.
    const int64_t num_pairs = num_seqs * num_kv_heads;
    auto padded_of = [&](int64_t s) { return (seq_lens[s] + 15) / 16 * 16; };
    std::vector<int64_t> round_start{0}, pair_offset(static_cast<size_t>(num_pairs));
    int64_t filled = 0, biggest = 0;
    for (int64_t i = 0; i < num_pairs; ++i) {
        const int64_t size = 2 * padded_of(i / num_kv_heads) * head_dim;
        if (filled > 0 && (filled + size) * static_cast<int64_t>(sizeof(T)) > g_pack_budget) {
            round_start.push_back(i);
            biggest = std::max(biggest, filled);
            filled = 0;
        }
        pair_offset[i] = filled;
        filled += size;
    }
    round_start.push_back(num_pairs);
    biggest = std::max(biggest, filled);
    std::unique_ptr<T[]> packed(new (std::nothrow) T[static_cast<size_t>(biggest)]);
    if (!packed) return -4;  // no exception may cross into ctypes
    auto kv_of = [&](int64_t pair) {
        T* kp = packed.get() + pair_offset[pair];
        return std::make_pair(kp, kp + padded_of(pair / num_kv_heads) * head_dim);
    };

    std::vector<Item> items;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t n = query_start[s + 1] - query_start[s], context = seq_lens[s] - n;
        for (int64_t q0 = 0; q0 < n; q0 += kQueryBlock) {
            const int64_t q1 = std::min(n, q0 + kQueryBlock);
            for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({s, h, q0, q1, (q1 - q0) * (context + q1)});
        }
    }
    // By round, then longest first, taken dynamically: the causal triangle makes items very unequal.
    auto round_of = [&](const Item& it) {
        return std::upper_bound(round_start.begin(), round_start.end(), it.seq * num_kv_heads + it.head) -
               round_start.begin();
    };
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
        const auto ra = round_of(a), rb = round_of(b);
        return ra != rb ? ra < rb : a.cost > b.cost;
    });
    int64_t first_item = 0;
    for (size_t r = 0; r + 1 < round_start.size(); ++r) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t pair = round_start[r]; pair < round_start[r + 1]; ++pair) {
            const int64_t s = pair / num_kv_heads;
            const auto [kp, vp] = kv_of(pair);
            pack_kv<Dt>(key_cache, value_cache, block_tables + s * block_table_stride, seq_lens[s], padded_of(s),
                        pair % num_kv_heads, num_kv_heads, head_dim, block_size, kp, vp);
        }
        int64_t end_item = first_item;
        while (end_item < static_cast<int64_t>(items.size()) &&
               items[end_item].seq * num_kv_heads + items[end_item].head < round_start[r + 1])
            ++end_item;
#pragma omp parallel
        {
            Scratch<T> scratch;
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = first_item; i < end_item; ++i) {
                const Item& it = items[i];
                const int64_t n = query_start[it.seq + 1] - query_start[it.seq];
                const auto [kp, vp] = kv_of(it.seq * num_kv_heads + it.head);
#if defined(KVFLOW_AVX512BF16) && !defined(KVFLOW_SIMDE)
                if constexpr (std::is_same_v<Dt, BF16>)
                    if (kvflow::bf16_dot_with_fma()) {
                        run_item_wide(it, q, q_stride, kp, vp, padded_of(it.seq), seq_lens[it.seq] - n,
                                      query_start[it.seq], out, out_stride, num_heads, num_kv_heads, head_dim, scale,
                                      scratch);
                        continue;
                    }
#endif
                run_item<Dt>(it, q, q_stride, kp, vp, padded_of(it.seq), seq_lens[it.seq] - n, query_start[it.seq],
                             out, out_stride, num_heads, num_kv_heads, head_dim, scale, scratch);
            }
        }
        first_item = end_item;
    }
    return 0;
}

}  // namespace
#endif

namespace {

// Prefill attention with attention_ref.h, one query position (all query heads of a KV head)
// at a time: where the AVX-512 path does not run (another CPU, a head_dim that is not a
// multiple of 16), so that a chunk's rows keep the bits a decode of the same row gives.
template <typename Dt>
int prefill_portable(const typename Dt::T* q, int64_t q_stride, const typename Dt::T* key_cache,
                     const typename Dt::T* value_cache, const int64_t* block_tables, int64_t block_table_stride,
                     const int64_t* query_start, const int64_t* seq_lens, typename Dt::T* out, int64_t out_stride,
                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     float scale) {
    using T = typename Dt::T;
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    if (group > kvflow::ref::kMaxRefRows) return -1;
    // Items: up to kRefPositions consecutive query positions of one sequence, for one KV head.
    struct Tile {
        int64_t seq, row, positions;  // row: the first position's row in q/out
    };
    std::vector<Tile> tiles;
    for (int64_t s = 0; s < num_seqs; ++s)
        for (int64_t row = query_start[s]; row < query_start[s + 1]; row += kvflow::ref::kRefPositions)
            tiles.push_back({s, row, std::min(kvflow::ref::kRefPositions, query_start[s + 1] - row)});
    const int64_t num_items = static_cast<int64_t>(tiles.size()) * num_kv_heads;
#pragma omp parallel
    {
        std::vector<float> scores, acc(static_cast<size_t>(kvflow::ref::kRefPositions * group * head_dim));
        std::vector<const T*> vrows;
#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < num_items; ++item) {
            const Tile& tile = tiles[item / num_kv_heads];
            const int64_t h = item % num_kv_heads, s = tile.seq;
            const int64_t context = seq_lens[s] - (query_start[s + 1] - query_start[s]);
            int64_t lens[kvflow::ref::kRefPositions];  // keys each position sees
            for (int64_t i = 0; i < tile.positions; ++i) lens[i] = context + (tile.row - query_start[s]) + i + 1;
            scores.resize(static_cast<size_t>(tile.positions * group * kvflow::ref::score_stride(lens[tile.positions - 1])));
            vrows.resize(static_cast<size_t>(lens[tile.positions - 1]));
            kvflow::ref::attend_rows<Dt>(q + tile.row * q_stride + h * group * head_dim, q_stride, tile.positions,
                                         group, lens, key_cache + h * head_dim * block_size,
                                         value_cache + h * head_dim, block_tables + s * block_table_stride,
                                         out + tile.row * out_stride + h * group * head_dim, out_stride, head_dim,
                                         block_size, token_stride, block_stride, scale, scores.data(), acc.data(), vrows.data());
        }
    }
    return 0;
}

}  // namespace

// Sets the bytes of packed K/V prefill attention holds at a time (a long context is packed in
// rounds within it); returns the previous value. Process-wide; the tests use it to force rounds.
extern "C" int64_t kvflow_prefill_pack_budget(int64_t bytes) {
#if defined(KVFLOW_AVX512F)
    const int64_t previous = g_pack_budget;
    g_pack_budget = bytes;
    return previous;
#else
    (void)bytes;
    return 0;
#endif
}

// 1 when prefill attention in this dtype runs its AVX-512 path for this head_dim, else 0
// (attention_ref.h); short_chunks.cpp sends a chunk to the decode kernel only where both
// kernels take the same kind of path.
extern "C" int kvflow_prefill_fast_path(int dtype, int64_t head_dim) {
    [[maybe_unused]] const bool avx512_shape = head_dim % 16 == 0 && head_dim <= 256;
#if defined(KVFLOW_AVX512F)
    if (dtype == 0) return avx512_shape ? 1 : 0;
#endif
#if defined(KVFLOW_AVX512F) && defined(KVFLOW_AVX512BF16)
    if (dtype == 1) return avx512_shape ? 1 : 0;
#endif
    return 0;
}

// The packed-K/V kernel for every chunk of the batch, whatever its length; callers go through
// kvflow_paged_prefill_attention (short_chunks.cpp), which sends short chunks to the decode kernel.
// dtype: 0 = float32 (needs AVX-512F), 1 = bfloat16 (needs AVX512-BF16); -2 when the CPU
// lacks what the dtype needs.
extern "C" int kvflow_packed_prefill_attention(int dtype, const void* q, int64_t q_stride, const void* key_cache,
                                              const void* value_cache, const int64_t* block_tables,
                                              int64_t block_table_stride, const int64_t* query_start,
                                              const int64_t* seq_lens, void* out, int64_t out_stride,
                                              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                              int64_t head_dim, int64_t block_size, float scale) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    [[maybe_unused]] const bool avx512_shape = head_dim % 16 == 0 && head_dim <= 256;
    if (dtype == 0) {
#if defined(KVFLOW_AVX512F)
        if (avx512_shape)
            return prefill<F32>(static_cast<const float*>(q), q_stride, static_cast<const float*>(key_cache),
                                static_cast<const float*>(value_cache), block_tables, block_table_stride, query_start,
                                seq_lens, static_cast<float*>(out), out_stride, num_seqs, num_heads, num_kv_heads,
                                head_dim, block_size, scale);
#endif
        return prefill_portable<kvflow::F32>(static_cast<const float*>(q), q_stride,
                                             static_cast<const float*>(key_cache),
                                             static_cast<const float*>(value_cache), block_tables, block_table_stride,
                                             query_start, seq_lens, static_cast<float*>(out), out_stride, num_seqs,
                                             num_heads, num_kv_heads, head_dim, block_size, scale);
    }
    if (dtype == 1) {
#if defined(KVFLOW_AVX512F) && defined(KVFLOW_AVX512BF16)
        if (avx512_shape)
            return prefill<BF16>(static_cast<const uint16_t*>(q), q_stride, static_cast<const uint16_t*>(key_cache),
                                 static_cast<const uint16_t*>(value_cache), block_tables, block_table_stride,
                                 query_start, seq_lens, static_cast<uint16_t*>(out), out_stride, num_seqs, num_heads,
                                 num_kv_heads, head_dim, block_size, scale);
#endif
        return prefill_portable<kvflow::BF16>(static_cast<const uint16_t*>(q), q_stride,
                                              static_cast<const uint16_t*>(key_cache),
                                              static_cast<const uint16_t*>(value_cache), block_tables,
                                              block_table_stride, query_start, seq_lens, static_cast<uint16_t*>(out),
                                              out_stride, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                              scale);
    }
    return -2;
}
