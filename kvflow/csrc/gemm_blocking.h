// How the packed GEMMs split y[M, N] = x[M, K] @ W[N, K]^T across threads and registers, shared
// by the float GEMM (gemm.cpp) and the quantized one (quant_gemm_bf16.cpp), whose weights are
// packed in the same tiles of 16 columns.
//
// Columns are split across threads in chunks of kNT tiles; each chunk's weight slice
// (32 columns x K) stays in cache while every row block of x passes over it.
#pragma once

#include <cstdint>

#include <omp.h>

#include "common.h"
#include "microkernel.h"

namespace kvflow {

constexpr int kTileCols = 16, kNT = 2;

// chunk(n0, full) for every chunk of kNT tiles, split statically across the threads; `full`:
// all kNT tiles exist.
template <typename Chunk>
inline void for_each_chunk(int64_t n, Chunk chunk) {
    const int64_t chunks = (n + kTileCols * kNT - 1) / (kTileCols * kNT);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t n0 = c * kTileCols * kNT;
        chunk(n0, (n - n0 + kTileCols - 1) / kTileCols >= kNT);
    }
}

// block(r, rows) for the row blocks of M rows against one chunk. Rows in equal blocks (18 rows:
// 9 + 9, not 8 + 8 + 2): a short block does as many weight loads per k as a full one for fewer
// FMAs. At decode sizes blocks of up to 12 rows measured 3-10 % faster than 8 (fewer passes
// over the weight slice). Past 64 rows a block takes `prefill_rows`, the caller's register
// block at prefill sizes (Micro<Dt>::kPrefillRows); `max_rows` > 0 overrides both.
template <typename Block>
inline void for_each_row_block(int64_t m, Block block, int64_t max_rows = 0, int64_t prefill_rows = 8) {
    if (max_rows <= 0) max_rows = m <= 64 ? kMaxBlockRows : prefill_rows;
    const int64_t blocks = (m + max_rows - 1) / max_rows;
    for (int64_t b = 0, r = 0; b < blocks; ++b) {
        const int64_t rows = m / blocks + (b < m % blocks ? 1 : 0);
        block(r, rows);
        r += rows;
    }
}

#if defined(KVFLOW_AVX512F)
// Writes one 16-column float32 accumulator of a row block: + bias, masked at N, rounded to
// the output dtype.
template <typename Dt>
struct StoreRow {
    typename Dt::T* y;
    int64_t y_stride, n0, n;
    const typename Dt::T* bias;
    inline void operator()(int m, int j, __m512 acc) const {
        const int64_t col = n0 + j * kTileCols;
        if (col >= n) return;
        const __mmask16 mask = tail_mask(n - col);
        if (bias != nullptr) acc = _mm512_add_ps(acc, Micro<Dt>::load(bias + col, mask));
        Micro<Dt>::store(y + m * y_stride + col, acc, mask);
    }
};

// StoreRow<BF16>'s values (+ bias, rounded to bf16) written widened to float32: a bf16 LM head's
// logits as the sampler takes them (torch's .float() of the bf16 output, bit for bit), with no
// second pass over them. In the engine that pass read rows the other thread had just written:
// 0.67-1.0 ms of a 32-sequence step (AMX Xeon).
#if defined(KVFLOW_AVX512BF16)
struct StoreRowWidened {
    float* y;
    int64_t y_stride, n0, n;
    const uint16_t* bias;
    inline void operator()(int m, int j, __m512 acc) const {
        const int64_t col = n0 + j * kTileCols;
        if (col >= n) return;
        const __mmask16 mask = tail_mask(n - col);
        if (bias != nullptr) acc = _mm512_add_ps(acc, Micro<BF16>::load(bias + col, mask));
        _mm512_mask_storeu_ps(y + m * y_stride + col, mask, Micro<BF16>::round(acc));
    }
};
#endif

// The store of a GEMM in Dt whose output elements are Y: StoreRow<Dt>, or for a bf16 GEMM with
// a float32 output its rounded values widened.
template <typename Dt, typename Y>
struct StoreFor {
    using type = StoreRow<Dt>;
};
#if defined(KVFLOW_AVX512BF16)
template <>
struct StoreFor<BF16, float> {
    using type = StoreRowWidened;
};
#endif

#endif

}  // namespace kvflow
