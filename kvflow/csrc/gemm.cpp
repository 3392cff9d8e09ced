// GEMM for every linear layer: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 accumulation,
// in bf16 (AVX512-BF16) and in float32 (AVX-512F).
//
// At the 1-32 rows of a decode step a linear layer is a stream over its weight, and
// PyTorch's oneDNN path leaves much of the memory bandwidth unused there. These kernels read
// a weight packed once at load time so that one 64-byte load feeds one instruction per row:
//   bf16:    [ceil(N/16)][K/2][16][2] bf16, for `vdpbf16ps` (16 columns x 2 consecutive k);
//            K must be even;
//   float32: [ceil(N/16)][K][16] float32, for `vfmadd` (16 columns x 1 k).
// Columns past N are zero. Every output element is summed in the same order whatever M is,
// so results do not depend on how many rows share the step.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <omp.h>

#include "gemm_blocking.h"
#include "kernels.h"
#include "microkernel.h"

namespace {

using kvflow::kNT;
using kvflow::kTileCols;

// Packing is plain C++ and runs on every machine. KGroup consecutive k share a lane: 2 for
// bf16 (the pairs vdpbf16ps takes), 1 for float32.
template <typename T, int KGroup>
void pack_weight(const T* w, int64_t n, int64_t k, T* packed) {
    const int64_t tiles = (n + kTileCols - 1) / kTileCols, groups = k / KGroup;
#pragma omp parallel for
    for (int64_t tile = 0; tile < tiles; ++tile) {
        T* dst = packed + tile * groups * kTileCols * KGroup;
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t lane = 0; lane < kTileCols; ++lane) {
                const int64_t col = tile * kTileCols + lane;
                for (int64_t e = 0; e < KGroup; ++e)
                    dst[(g * kTileCols + lane) * KGroup + e] = col < n ? w[col * k + KGroup * g + e] : T(0);
            }
    }
}

#if defined(KVFLOW_AVX512F)
// y = x @ W^T (+ bias) for a weight packed by pack_weight<T, Micro<Dt>::G>.
template <typename Dt>
int gemm(const typename Dt::T* x, int64_t m, int64_t k, int64_t x_stride, const typename Dt::T* packed, int64_t n,
         const typename Dt::T* bias, typename Dt::T* y, int64_t y_stride) {
    using M = kvflow::Micro<Dt>;
    if (k % M::G != 0) return -1;
    const int64_t tile_stride = k * kTileCols;
    kvflow::for_each_chunk(n, [&](int64_t n0, bool full) {
        const typename Dt::T* tile0 = packed + (n0 / kTileCols) * tile_stride;
        // Row blocks after the first find the chunk's weights in cache: they pull the next
        // chunk's into L2 meanwhile, so the weight stream overlaps the arithmetic.
        const bool next_full = n0 + 2 * kTileCols * kNT <= n;
        kvflow::for_each_row_block(m, [&](int64_t r, int64_t rows) {
            kvflow::StoreRow<Dt> store{y + r * y_stride, y_stride, n0, n, bias};
            const typename Dt::T* next = r > 0 && next_full ? tile0 + kNT * tile_stride : nullptr;
            if (full)
                M::template rows<kNT>(rows, x + r * x_stride, x_stride, tile0, tile_stride, k / M::G, store, next);
            else
                M::template rows<1>(rows, x + r * x_stride, x_stride, tile0, tile_stride, k / M::G, store);
        });
    });
    return 0;
}
#endif

}  // namespace

extern "C" {

void kvflow_pack_bf16_weight(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
    pack_weight<uint16_t, 2>(w, n, k, packed);
}

void kvflow_pack_f32_weight(const float* w, int64_t n, int64_t k, float* packed) {
    pack_weight<float, 1>(w, n, k, packed);
}

#if defined(KVFLOW_AVX512BF16)
int kvflow_has_gemm_bf16() { return 1; }
#else
int kvflow_has_gemm_bf16() { return 0; }
#endif

#if defined(KVFLOW_AVX512F)
int kvflow_has_gemm_f32() { return 1; }
#else
int kvflow_has_gemm_f32() { return 0; }
#endif

int kvflow_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed, int64_t n,
                     const uint16_t* bias, uint16_t* y, int64_t y_stride) {
#if defined(KVFLOW_AVX512BF16)
    return gemm<kvflow::BF16>(x, m, k, x_stride, packed, n, bias, y, y_stride);
#else
    (void)x; (void)m; (void)k; (void)x_stride; (void)packed; (void)n; (void)bias; (void)y; (void)y_stride;
    return -2;
#endif
}

int kvflow_gemm_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed, int64_t n,
                    const float* bias, float* y, int64_t y_stride) {
#if defined(KVFLOW_AVX512F)
    return gemm<kvflow::F32>(x, m, k, x_stride, packed, n, bias, y, y_stride);
#else
    (void)x; (void)m; (void)k; (void)x_stride; (void)packed; (void)n; (void)bias; (void)y; (void)y_stride;
    return -2;
#endif
}

}  // extern "C"
