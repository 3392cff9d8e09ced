// Weight-only quantized GEMM with bf16 activations on AMX tiles: quant_gemm_bf16.cpp's sums
//
//     y[m, n] = sum over groups g of  s[g, n] * A[m, g, n] + o'[g, n] * X[m, g]   (+ bias)
//
// with each group's integer-weight dot products A from TDPBF16PS over the group's k tiles (so
// groups of a multiple of 32 inputs; others run the vector kernel, a per-layer choice). The
// quants become bf16 B tiles (the integers exactly): at 1-16 rows one k tile at a time just
// ahead of the products (decode_rows_tile), at more a chunk at a time per row panel
// (store_tile), which the panel's row blocks read from L1/L2. The scale and offset FMAs are the
// vector kernel's, in its order. As in gemm_amx.h, the tile unit's sums round otherwise
// than vdpbf16ps's chain, and a row's result depends on nothing but its own x row: batch- and
// thread-invariant. On the Intel Xeon measured, a prefill-sized int8 or int4 call was bound by
// vdpbf16ps as the bf16 GEMM was.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gemm_amx.h"
#include "gemm_blocking.h"
#include "quant_gemm_avx2.h"
#include "quant_unpack.h"

#if defined(KVFLOW_AMX)
namespace kvflow {

// One row tile (a decode step's 1-16 rows) against one column tile, the quants unpacked one k
// tile at a time kAhead k tiles before the tile unit needs them, so the unpacking overlaps the
// tile products and the stream from memory; four groups are in flight in the four sum tiles (x
// and W tiles alternating), so each group's scale FMAs (`finish(g, sum_tile)`) wait on products
// finished long before. The model's layers at one row, against the vector kernel's time:
// unpacking whole chunks first cost int4 (groups of 32) 1.95x and int8 (per channel) 1.35x;
// this 1.4x and 0.93-1.07x. What is left for int4 is per group: its tile loads, zeroing and
// store (~1.7 ms of the 4.2 for the layers) and the unpacking stores (~1.8 ms, stream included).
template <int Bits, typename Finish>
inline void decode_rows_tile(const uint16_t* x, int64_t x_stride, const uint8_t* q, int64_t groups,
                             int64_t tiles_per_group, float (*sums)[16][16], Finish& finish) {
    constexpr int64_t kAhead = 3, kSlots = 4;
    alignas(64) uint16_t slots[kSlots][512];
    const int64_t a_bytes = x_stride * 2, k_tiles = groups * tiles_per_group;
    auto unpack = [&](int64_t kt) {
        unpack_blocks<Bits>(q, kt * 8, kt * 8 + 8, slots[kt % kSlots]);
        tile_operands_stored();
    };
    // The tile intrinsics take literal tile numbers: one body per sum tile.
#define KVFLOW_AMX_GROUP(C, A, B)                                                      \
    [&](int64_t g) {                                                                   \
        _tile_zero(C);                                                                 \
        for (int64_t kt = g * tiles_per_group; kt < (g + 1) * tiles_per_group; ++kt) { \
            _tile_loadd(A, x + kt * 32, a_bytes);                                      \
            _tile_loadd(B, slots[kt % kSlots], 64);                                    \
            _tile_dpbf16ps(C, A, B);                                                   \
            if (kt + kAhead < k_tiles) unpack(kt + kAhead);                            \
        }                                                                              \
    }
    auto group0 = KVFLOW_AMX_GROUP(0, 4, 6);
    auto group1 = KVFLOW_AMX_GROUP(1, 5, 7);
    auto group2 = KVFLOW_AMX_GROUP(2, 4, 6);
    auto group3 = KVFLOW_AMX_GROUP(3, 5, 7);
#undef KVFLOW_AMX_GROUP
    auto done = [&](int64_t g) {  // group g's sums out of its tile, then its scale FMAs
        switch (g & 3) {
            case 0: _tile_stored(0, sums[0], 64); break;
            case 1: _tile_stored(1, sums[1], 64); break;
            case 2: _tile_stored(2, sums[2], 64); break;
            default: _tile_stored(3, sums[3], 64); break;
        }
        finish(g, static_cast<int>(g & 3));
    };
    for (int64_t kt = 0; kt < std::min(kAhead, k_tiles); ++kt) unpack(kt);
    for (int64_t g = 0; g < groups; ++g) {
        switch (g & 3) {
            case 0: group0(g); break;
            case 1: group1(g); break;
            case 2: group2(g); break;
            default: group3(g); break;
        }
        if (g >= 3) done(g - 3);
    }
    for (int64_t g = std::max<int64_t>(0, groups - 3); g < groups; ++g) done(g);
}

// Out: BF16 (bias bf16) or F32 (bias float32). Returns 0, or -4 out of memory.
template <typename Out, int Bits, bool Offsets>
int quant_gemm_amx(const uint16_t* x, int64_t m, int64_t x_stride, const QuantTileWeight& w, int64_t n,
                   const typename Out::T* bias, typename Out::T* y, int64_t y_stride) {
    const int64_t k = w.k, groups = w.groups(), tiles_per_group = w.group / 32, tile_stride = k * kTileCols;
    const int64_t bytes = quant_tile_bytes(Bits, k), chunks = (n + kTileCols * kNT - 1) / (kTileCols * kNT);
    const int64_t panel = amx_panel_rows(k);
    AmxRows a;
    if (a.init(x, m, k, x_stride) != 0) return -4;
    float* xsums = Offsets ? scratch_floats<4>(m * groups) : nullptr;
    if (Offsets && xsums == nullptr) return -4;
    int failed = 0;
#pragma omp parallel
    {
        if constexpr (Offsets) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; ++r)
                for (int64_t g = 0; g < groups; ++g) xsums[r * groups + g] = group_sum(x + r * x_stride + g * w.group, w.group);
            // (the loop's barrier: every row's sums are in place before any chunk reads them)
        }
        // The chunk's unpacked tiles, for calls of more than one row tile.
        auto* tiles = m <= 16 ? nullptr : static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(kNT * tile_stride) * 2));
        if (m > 16 && tiles == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
        configure_tiles(a.tile_rows);
        alignas(64) float sums[4][16][16];
        alignas(64) float out[32][kNT * kTileCols];
        // Row panels as in gemm_amx_bf16 (each chunk unpacked again per panel: little against
        // a panel's products); one panel at decode sizes.
        for (int64_t p0 = 0; p0 < m; p0 += panel) {
#pragma omp for schedule(static) nowait
            for (int64_t c = 0; c < chunks; ++c) {
                if (m > 16 && tiles == nullptr) continue;  // out of memory: `failed` is set
                const int64_t n0 = c * kTileCols * kNT, tile0 = n0 / kTileCols;
                const int nt = n - n0 > kTileCols ? 2 : 1;
                const float* s = w.scales + tile0 * groups * kTileCols;  // tile j, group g at (j * groups + g) * 16
                const float* o = Offsets ? w.offsets + tile0 * groups * kTileCols : nullptr;
                // out[i] (column tiles j0 .. j1) += group g's sums (sums[first + 2 * (i / 16) + j - j0])
                // scaled, + offset x X[r + i, g].
                auto add_group = [&](int64_t r, int64_t rows, int64_t g, int j0, int j1, int first) {
                    for (int j = j0; j < j1; ++j) {
                        const __m512 sj = _mm512_loadu_ps(s + (j * groups + g) * kTileCols);
                        const __m512 oj = Offsets ? _mm512_loadu_ps(o + (j * groups + g) * kTileCols) : _mm512_setzero_ps();
                        for (int64_t i = 0; i < rows; ++i) {
                            float* acc = out[i] + j * kTileCols;
                            __m512 v = _mm512_fmadd_ps(_mm512_load_ps(sums[first + (i / 16) * 2 + j - j0][i % 16]), sj, _mm512_load_ps(acc));
                            if constexpr (Offsets) v = _mm512_fmadd_ps(_mm512_set1_ps(xsums[(r + i) * groups + g]), oj, v);
                            _mm512_store_ps(acc, v);
                        }
                    }
                };
                auto write = [&](int64_t r, int64_t rows) {
                    const StoreRow<Out> store{y + r * y_stride, y_stride, n0, n, bias};
                    for (int64_t i = 0; i < rows; ++i)
                        for (int j = 0; j < nt; ++j) store(static_cast<int>(i), j, _mm512_load_ps(out[i] + j * kTileCols));
                };
                if (m <= 16) {
                    std::memset(out, 0, sizeof(out));
                    for (int j = 0; j < nt; ++j) {
                        auto finish = [&](int64_t g, int sum_tile) { add_group(0, m, g, j, j + 1, sum_tile); };
                        decode_rows_tile<Bits>(x, x_stride, w.q + (tile0 + j) * bytes, groups, tiles_per_group, sums, finish);
                    }
                    write(0, m);
                    continue;
                }
                for (int t = 0; t < nt; ++t) store_tile<Bits>(w.q + (tile0 + t) * bytes, k, tiles + t * tile_stride);
                tile_operands_stored();
                for (int64_t r = p0; r < std::min(m, p0 + panel); r += 32) {
                    const int64_t rows = std::min<int64_t>(32, m - r);
                    std::memset(out, 0, sizeof(out));
                    for (int64_t g = 0; g < groups; ++g) {
                        a.block(r, rows, nt == 2, tiles, tile_stride, g * tiles_per_group, (g + 1) * tiles_per_group, sums);
                        add_group(r, rows, g, 0, nt, 0);
                    }
                    write(r, rows);
                }
            }
        }
        _tile_release();
        std::free(tiles);
    }
    return failed ? -4 : 0;
}

}  // namespace kvflow
#endif
