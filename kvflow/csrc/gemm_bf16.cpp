// bf16 GEMM for every linear layer: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 accumulation.
//
// At the 1-32 rows of a decode step a linear layer is a stream over its weight, and
// PyTorch's oneDNN path leaves half the memory bandwidth unused there. This kernel reads
// a weight packed once at load time so that one 64-byte load feeds one AVX512-BF16
// `vdpbf16ps`: 16 output columns x 2 consecutive k, the layout the instruction consumes.
//
// Packed layout: [ceil(N/16)][K/2][16][2] bf16 (columns past N are zero). K must be even.
// Every output element is summed in the same order whatever M is, so results do not
// depend on how many rows share the step.

#include <cstdint>
#include <cstring>

#include <omp.h>

#include "dpbf16.h"
#include "kernels.h"

extern "C" {

// Packing is plain C++ and runs on every machine; only the product needs AVX512-BF16.
void kvflow_pack_bf16_weight(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
    const int64_t tiles = (n + 15) / 16, pairs = k / 2;
#pragma omp parallel for
    for (int64_t tile = 0; tile < tiles; ++tile) {
        uint16_t* dst = packed + tile * pairs * 32;
        for (int64_t p = 0; p < pairs; ++p)
            for (int64_t lane = 0; lane < 16; ++lane) {
                const int64_t col = tile * 16 + lane;
                dst[p * 32 + lane * 2] = col < n ? w[col * k + 2 * p] : 0;
                dst[p * 32 + lane * 2 + 1] = col < n ? w[col * k + 2 * p + 1] : 0;
            }
    }
}

#if defined(__AVX512BF16__)
int kvflow_has_gemm_bf16() { return 1; }
#else
int kvflow_has_gemm_bf16() { return 0; }
#endif

}  // extern "C"

#if defined(__AVX512BF16__)
namespace {

// Writes one 16-column accumulator of a row block: + bias, rounded to bf16, masked at N.
struct StoreBf16 {
    uint16_t* y;
    int64_t y_stride, n0, n;
    const uint16_t* bias;
    inline void operator()(int m, int j, __m512 acc) const {
        const int64_t col = n0 + j * 16;
        if (col >= n) return;
        const __mmask16 mask = kvflow::tail_mask(n - col);
        if (bias != nullptr) {
            const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + col);
            acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
        }
        _mm256_mask_storeu_epi16(y + m * y_stride + col, mask, (__m256i)_mm512_cvtneps_pbh(acc));
    }
};

}  // namespace
#endif

extern "C" int kvflow_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed,
                                int64_t n, const uint16_t* bias, uint16_t* y, int64_t y_stride) {
#if defined(__AVX512BF16__)
    if (k % 2 != 0) return -1;
    constexpr int kTileCols = 16, kNT = 2, kRowsPerBlock = kvflow::kMaxBlockRows;
    const int64_t pairs = k / 2, tile_stride = pairs * 32;
    const int64_t chunks = (n + kTileCols * kNT - 1) / (kTileCols * kNT);
    // Columns are split across threads; each chunk's weight slice (32 columns x K) stays in
    // cache while every row block of x passes over it.
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t n0 = c * kTileCols * kNT;
        const uint16_t* tile0 = packed + (n0 / kTileCols) * tile_stride;
        const int64_t tiles_left = (n - n0 + kTileCols - 1) / kTileCols;
        for (int64_t r = 0; r < m; r += kRowsPerBlock) {
            const int64_t rows = m - r < kRowsPerBlock ? m - r : kRowsPerBlock;
            StoreBf16 store{y + r * y_stride, y_stride, n0, n, bias};
            if (tiles_left >= kNT)
                kvflow::dpbf16_rows<kNT>(rows, x + r * x_stride, x_stride, tile0, tile_stride, pairs, store);
            else
                kvflow::dpbf16_rows<1>(rows, x + r * x_stride, x_stride, tile0, tile_stride, pairs, store);
        }
    }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)x_stride; (void)packed; (void)n; (void)bias; (void)y; (void)y_stride;
    return -2;
#endif
}
