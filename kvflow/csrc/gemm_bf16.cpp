// Few-row bf16 GEMM for decoding: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 accumulation.
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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>

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

constexpr int64_t kPrefetchPairs = 16;  // 1 KiB ahead in each weight stream

// MT rows x (NT x 16) columns; all accumulators stay in registers (MT * NT <= 24).
template <int MT, int NT>
inline void micro_kernel(const uint16_t* x, int64_t x_stride, const uint16_t* packed_tile0, int64_t tile_stride,
                         int64_t pairs, int64_t n0, int64_t n, const uint16_t* bias, uint16_t* y, int64_t y_stride) {
    __m512 acc[MT][NT];
    for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh w[NT];
        for (int j = 0; j < NT; ++j) {
            const uint16_t* src = packed_tile0 + j * tile_stride + p * 32;
            _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchPairs * 32), _MM_HINT_T0);
            w[j] = (__m512bh)_mm512_loadu_si512(src);
        }
        for (int m = 0; m < MT; ++m) {
            int32_t pair;
            std::memcpy(&pair, x + m * x_stride + 2 * p, sizeof(pair));
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, w[j]);
        }
    }
    for (int j = 0; j < NT; ++j) {
        const int64_t col = n0 + j * 16;
        if (col >= n) break;
        const int64_t left = n - col;
        const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias != nullptr) {
            const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + col);
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        }
        for (int m = 0; m < MT; ++m) {
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b));
            _mm256_mask_storeu_epi16(y + m * y_stride + col, mask, (__m256i)out);
        }
    }
}

template <int NT>
void rows_block(int64_t rows, const uint16_t* x, int64_t x_stride, const uint16_t* tile0, int64_t tile_stride,
                int64_t pairs, int64_t n0, int64_t n, const uint16_t* bias, uint16_t* y, int64_t y_stride) {
    switch (rows) {
#define KVFLOW_ROWS(R) \
    case R: micro_kernel<R, NT>(x, x_stride, tile0, tile_stride, pairs, n0, n, bias, y, y_stride); break;
        KVFLOW_ROWS(1) KVFLOW_ROWS(2) KVFLOW_ROWS(3) KVFLOW_ROWS(4)
        KVFLOW_ROWS(5) KVFLOW_ROWS(6) KVFLOW_ROWS(7) KVFLOW_ROWS(8)
#undef KVFLOW_ROWS
    }
}

}  // namespace
#endif

extern "C" int kvflow_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed,
                                int64_t n, const uint16_t* bias, uint16_t* y, int64_t y_stride) {
#if defined(__AVX512BF16__)
    if (k % 2 != 0) return -1;
    constexpr int kTileCols = 16, kNT = 2, kRowsPerBlock = 8;
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
            if (tiles_left >= kNT)
                rows_block<kNT>(rows, x + r * x_stride, x_stride, tile0, tile_stride, pairs, n0, n, bias, y + r * y_stride, y_stride);
            else
                rows_block<1>(rows, x + r * x_stride, x_stride, tile0, tile_stride, pairs, n0, n, bias, y + r * y_stride, y_stride);
        }
    }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)x_stride; (void)packed; (void)n; (void)bias; (void)y; (void)y_stride;
    return -2;
#endif
}
