// The bf16 GEMM on AMX tiles (Intel Xeon from Sapphire Rapids on): y[M, N] = x[M, K] @ W^T.
//
// One TDPBF16PS multiplies a 16 x 32 bf16 tile of x by a 32 x 16 tile of W into 16 x 16 float32
// sums: 8,192 multiply-adds, against vdpbf16ps's 32. On the Intel Xeon measured (CPU family 6,
// 2 vCPUs) torch's AMX matmul ran at 0.8-1.4 TFLOP/s where kvflow's AVX-512 blocks reached ~180
// GFLOP/s: prefill there was bound by vdpbf16ps (docs/benchmarks.md).
//
// The weight needs no new layout: gemm.cpp's bf16 packing ([N/16][K/2][16][2]) is already a
// column of B tiles, each 16 k-pairs x 16 columns x 2 = 1 KiB contiguous, rows 64 bytes apart.
// Rows of x are A tiles read in place (`x_stride` apart); a last partial tile of rows is copied
// into a zero-padded buffer so no tile load reads past x.
//
// Numerics. The tile unit does not add the products one FMA at a time as vdpbf16ps does: its
// sums come out differently (measured: neither order of a pair, nor one rounding of the exact
// 32-product sum), so a model run with AMX has other bf16 bits than the AVX-512 blocks give,
// not worse ones (tests/layers/test_gemm_amx.py bounds the error). What kvflow needs is kept:
// each row of y depends only on that row of x and the weight (a tile's rows are independent),
// every output is the same chain of K/32 instructions whatever M is, and a column chunk is one
// thread's work, so results do not depend on the batch or the thread count. K must be a
// multiple of 32 (every tile full in k); other K run the AVX-512 blocks, decided per layer
// shape, never per batch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(KVFLOW_AVX512BF16) && !defined(KVFLOW_SIMDE) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVFLOW_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gemm_blocking.h"

namespace kvflow {

// Linux hands the tile registers to a process only on request (their 8 KiB of state is saved
// on context switches), and a hypervisor may refuse even where CPUID lists AMX.
inline bool amx_permitted() {
    static const bool permitted = [] {
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return permitted;
}

// Tiles 0-3: float32 sums (row block m, column tile j at 2m + j); 4-5: x; 6-7: W. All 16 rows
// of 64 bytes.
inline void configure_tiles() {
    struct alignas(64) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}

// MT (1-2) tiles of 16 rows of x against NT (1-2) column tiles of W, over all K: sums[2m + j].
template <int MT, int NT>
inline void amx_block(const uint16_t* a0, const uint16_t* a1, int64_t a_stride, const uint16_t* tile0,
                      int64_t tile_stride, int64_t k_tiles, float (*sums)[16][16]) {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
    const int64_t a_bytes = a_stride * 2;
    for (int64_t kt = 0; kt < k_tiles; ++kt) {
        _tile_loadd(6, tile0 + kt * 512, 64);
        if constexpr (NT == 2) _tile_loadd(7, tile0 + tile_stride + kt * 512, 64);
        _tile_loadd(4, a0 + kt * 32, a_bytes);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
        if constexpr (MT == 2) {
            _tile_loadd(5, a1 + kt * 32, a_bytes);
            _tile_dpbf16ps(2, 5, 6);
            if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0], 64);
    if constexpr (NT == 2) _tile_stored(1, sums[1], 64);
    if constexpr (MT == 2) _tile_stored(2, sums[2], 64);
    if constexpr (MT == 2 && NT == 2) _tile_stored(3, sums[3], 64);
}

// y = x @ W^T (+ bias) in bf16 for a weight packed by gemm.cpp's pack_weight<uint16_t, 2>.
// Returns 0, -1 when K is not a multiple of 32, -4 out of memory.
inline int gemm_amx_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed, int64_t n,
                         const uint16_t* bias, uint16_t* y, int64_t y_stride) {
    if (k % 32 != 0) return -1;
    // Rows past the last whole tile of 16, zero-padded to one tile (read by every thread).
    const int64_t whole = m / 16 * 16;
    uint16_t* tail = nullptr;
    if (whole < m) {
        tail = reinterpret_cast<uint16_t*>(scratch_floats<3>(8 * k));
        if (tail == nullptr) return -4;
        std::memset(tail, 0, 16 * k * sizeof(uint16_t));
        for (int64_t r = whole; r < m; ++r) std::memcpy(tail + (r - whole) * k, x + r * x_stride, k * sizeof(uint16_t));
    }
    auto rows_at = [&](int64_t r) { return r < whole ? x + r * x_stride : tail; };
    auto stride_at = [&](int64_t r) { return r < whole ? x_stride : k; };
    const int64_t tile_stride = k * kTileCols, k_tiles = k / 32;
    const int64_t chunks = (n + kTileCols * kNT - 1) / (kTileCols * kNT);
#pragma omp parallel
    {
        configure_tiles();
        alignas(64) float sums[4][16][16];
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t n0 = c * kTileCols * kNT;
            const bool two_tiles = n - n0 > kTileCols;
            const uint16_t* tile0 = packed + (n0 / kTileCols) * tile_stride;
            for (int64_t r = 0; r < m; r += 32) {
                const int64_t rows = std::min<int64_t>(32, m - r);
                // Both row tiles share one stride unless the second is the padded tail.
                const uint16_t* a0 = rows_at(r);
                const uint16_t* a1 = rows > 16 ? rows_at(r + 16) : nullptr;
                if (rows > 16 && stride_at(r) != stride_at(r + 16)) {
                    // x then the tail: run them as two single-tile blocks.
                    if (two_tiles) {
                        amx_block<1, 2>(a0, nullptr, stride_at(r), tile0, tile_stride, k_tiles, sums);
                        amx_block<1, 2>(a1, nullptr, stride_at(r + 16), tile0, tile_stride, k_tiles, sums + 2);
                    } else {
                        amx_block<1, 1>(a0, nullptr, stride_at(r), tile0, tile_stride, k_tiles, sums);
                        amx_block<1, 1>(a1, nullptr, stride_at(r + 16), tile0, tile_stride, k_tiles, sums + 2);
                    }
                } else if (rows > 16) {
                    if (two_tiles) amx_block<2, 2>(a0, a1, stride_at(r), tile0, tile_stride, k_tiles, sums);
                    else amx_block<2, 1>(a0, a1, stride_at(r), tile0, tile_stride, k_tiles, sums);
                } else {
                    if (two_tiles) amx_block<1, 2>(a0, nullptr, stride_at(r), tile0, tile_stride, k_tiles, sums);
                    else amx_block<1, 1>(a0, nullptr, stride_at(r), tile0, tile_stride, k_tiles, sums);
                }
                // + bias, rounded to bf16 (nearest even), masked at N.
                for (int64_t i = 0; i < rows; ++i)
                    for (int j = 0; j < (two_tiles ? 2 : 1); ++j) {
                        const int64_t col = n0 + j * kTileCols;
                        const __mmask16 mask = tail_mask(n - col);
                        __m512 acc = _mm512_load_ps(sums[(i / 16) * 2 + j][i % 16]);
                        if (bias != nullptr)
                            acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                                                         _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + col)), 16)));
                        _mm256_mask_storeu_epi16(y + (r + i) * y_stride + col, mask, (__m256i)_mm512_cvtneps_pbh(acc));
                    }
            }
        }
        _tile_release();
    }
    return 0;
}

}  // namespace kvflow
#endif
