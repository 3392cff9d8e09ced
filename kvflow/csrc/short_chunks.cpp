// Prefill attention's entry point: short chunks as decode rows, the rest through the packed kernel.
//
// The packed prefill kernel (prefill_attention.cpp) first copies each (sequence, KV head)'s
// whole context into the GEMM microkernels' layout. For a long chunk that copy is paid back
// many times over; for a chunk of a few tokens over a long context it is most of the work:
// a speculative verify (the last token plus k drafts) or a draft model's catch-up over ~400
// cached tokens cost 1.6x a one-token decode step, all of the difference in this copy (about
// 0.17 ms a layer for SmolLM2 at 400 keys, docs/benchmarks.md).
//
// So a chunk of at most kvflow_prefill_short_chunk() tokens runs through the decode kernel
// instead, one decode row per token, each row with its own causal length (row i of a chunk
// at context c sees keys 0..c+i) and all rows reading the sequence's one block table (a
// table stride of 0). The K/V of the chunk is already in the pool, so this is exactly the
// causal chunk. The bits do not change: both kernels compute docs/architecture.md's one
// attention numerics (tests/layers/test_attention_numerics.py), and a chunk is routed only
// where both take the same kind of path (AVX-512, or both the portable reference), since the
// bf16 reference may differ from vdpbf16ps in its last bit.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace {

// Chunks of up to this many tokens take the decode kernel (0: none). 8 covers a verify of up
// to 7 drafts; set by kvflow_prefill_short_chunk (tests force 0 to compare the two paths).
int64_t g_short_chunk = 8;

}  // namespace

extern "C" {

int64_t kvflow_prefill_short_chunk(int64_t tokens) {
    const int64_t previous = g_short_chunk;
    if (tokens >= 0) g_short_chunk = tokens;
    return previous;
}

int kvflow_paged_prefill_attention(int dtype, const void* q, int64_t q_stride, const void* key_cache,
                                   const void* value_cache, const int64_t* block_tables, int64_t block_table_stride,
                                   const int64_t* query_start, const int64_t* seq_lens, void* out, int64_t out_stride,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    const int64_t elem = dtype == 0 ? 4 : dtype == 1 ? 2 : 0;
    const bool routable = elem != 0 && g_short_chunk > 0 && out_stride == num_heads * head_dim &&
                          num_heads / num_kv_heads <= kvflow_max_group() && head_dim <= kvflow_max_head_dim() &&
                          kvflow_decode_fast_path(dtype, head_dim) == kvflow_prefill_fast_path(dtype, head_dim);
    auto packed = [&](int64_t first, int64_t count) {  // sequences [first, first + count) as packed chunks
        return kvflow_packed_prefill_attention(dtype, q, q_stride, key_cache, value_cache,
                                               block_tables + first * block_table_stride, block_table_stride,
                                               query_start + first, seq_lens + first, out, out_stride, count,
                                               num_heads, num_kv_heads, head_dim, block_size, scale);
    };
    if (!routable) return packed(0, num_seqs);
    const char* qb = static_cast<const char*>(q);
    char* ob = static_cast<char*>(out);
    std::vector<int64_t> lens;
    int64_t run = 0;  // first sequence of the current run of long chunks
    for (int64_t s = 0; s <= num_seqs; ++s) {
        const int64_t n = s < num_seqs ? query_start[s + 1] - query_start[s] : 0;
        const bool short_chunk = s < num_seqs && n > 0 && n <= g_short_chunk;
        if (!short_chunk && s < num_seqs) continue;
        if (s > run) {
            const int rc = packed(run, s - run);
            if (rc != 0) return rc;
        }
        run = s + 1;
        if (s == num_seqs) break;
        const int64_t context = seq_lens[s] - n;
        lens.resize(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) lens[i] = context + i + 1;
        const int64_t row = query_start[s];
        const int rc = kvflow_paged_decode_attention(dtype, qb + row * q_stride * elem, q_stride, key_cache,
                                                     value_cache, block_tables + s * block_table_stride, 0,
                                                     lens.data(), ob + row * out_stride * elem, n, num_heads,
                                                     num_kv_heads, head_dim, block_size, scale, 0);
        if (rc != 0) return rc;
    }
    return 0;
}

}  // extern "C"
