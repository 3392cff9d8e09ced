// The bf16 GEMM on AMX tiles (Intel Xeon from Sapphire Rapids on): y[M, N] = x[M, K] @ W^T.
//
// One TDPBF16PS multiplies a 16 x 32 bf16 tile of x by a 32 x 16 tile of W into 16 x 16 float32
// sums: 8,192 multiply-adds, against vdpbf16ps's 32. On the Intel Xeon measured (CPU family 6
// model 167, 2 vCPUs) torch's AMX matmul ran at 0.8-3.4 TFLOP/s where kvflow's AVX-512 blocks
// reached 60-90 GFLOP/s: prefill there was bound by the vector units (docs/benchmarks.md).
//
// The weight needs no new layout: gemm.cpp's bf16 packing ([N/16][K/2][16][2]) is already a
// column of B tiles, each 16 k-pairs x 16 columns x 2 = 1 KiB contiguous, rows 64 bytes apart.
// Rows of x are A tiles read in place (`x_stride` apart); a last partial tile of rows is copied
// into a zero-padded buffer so no tile load reads past x.
//
// Numerics. The tile unit does not add the products one FMA at a time as vdpbf16ps does: its
// sums come out differently (measured: neither order of a pair, nor one rounding of the exact
// 32-product sum), so a model run with AMX has other bf16 bits than the AVX-512 blocks give,
// not worse ones (tests/layers/test_gemm.py bounds the error in both modes). What kvflow needs is kept:
// each row of y depends only on that row of x and the weight (a tile's rows are independent),
// every output is the same chain of K/32 instructions whatever M is, and a column chunk is one
// thread's work, so results do not depend on the batch or the thread count. K must be a
// multiple of 32 (every tile full in k); other K run the AVX-512 blocks, decided per layer
// shape, never per batch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

#if defined(KVFLOW_AVX512BF16) && !defined(KVFLOW_SIMDE) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVFLOW_AMX 1
#include <cpuid.h>
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
        // CPUID leaf 0x1D: the tile palettes; a VM may list AMX and offer none, where the first
        // LDTILECFG would fault.
        unsigned max_palette = 0, ebx = 0, ecx = 0, edx = 0;
        if (!__builtin_cpu_supports("amx-bf16") || !__get_cpuid_count(0x1D, 0, &max_palette, &ebx, &ecx, &edx) ||
            max_palette < 1)
            return false;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return permitted;
}

// GCC's _tile_loadd is an asm statement that does not say it reads memory: after plain stores
// that a tile load will read (a padded tail, unpacked quants), this keeps them in memory and in
// order.
inline void tile_operands_stored() { __asm__ __volatile__("" ::: "memory"); }

// Whether bf16 GEMMs, plain and quantized, run on the tiles: kvflow_set_amx (gemm.cpp) sets it.
inline bool& amx_enabled() {
    static bool on = false;
    return on;
}

// LDTILECFG, palette 1: tile t holds rows[t] rows of colsb[t] bytes.
//
// Not GCC's _tile_loadconfig: up to GCC 13 its asm names only the first 8 bytes of the config as
// read, so the optimiser may drop the stores of `colsb` and `rows` as dead (GCC 12 did, once
// this function's callers passed constants: the instruction then read stale stack bytes and
// faulted). Here the asm's operand is the whole 64-byte block.
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

inline void load_tile_shapes(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) config.rows[t] = rows[t], config.colsb[t] = colsb[t];
    __asm__ __volatile__("ldtilecfg %0" ::"m"(config));
}

// Tiles 0-3: float32 sums (row tile i, column tile j at 2i + j); 4-5: x; 6-7: W. Rows of 64
// bytes; x and sum tiles hold `rows` rows (fewer than 16 for a decode step's few rows, so the
// tile unit and the loads do that much less work: int8 W-latency ITL 12.9 -> 10.8 ms against
// padded 16-row tiles, bf16 unchanged), W tiles always 16 k-pairs.
inline void configure_tiles(int rows) {
    const auto r = static_cast<uint8_t>(rows);
    load_tile_shapes({r, r, r, r, r, r, 16, 16}, {64, 64, 64, 64, 64, 64, 64, 64});
}

// MT (1-2) tiles of 16 rows of x against NT (1-2) column tiles of W (bf16 tiles [K/2][16][2],
// `tile_stride` elements apart), over k tiles [kt0, kt1) of 32: sums[2i + j]. `stream`: W comes
// from memory (all of K: kt0 = 0), asked for kPrefetchTiles ahead (the vector GEMM's 4 KiB), one
// hint per line, running on into the next chunk's tiles at the end.
constexpr int64_t kPrefetchTiles = 4;

template <int MT, int NT>
inline void amx_block(const uint16_t* a0, const uint16_t* a1, int64_t a_stride, const uint16_t* tile0,
                      int64_t tile_stride, int64_t kt0, int64_t kt1, float (*sums)[16][16], bool stream) {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
    const int64_t a_bytes = a_stride * 2;
    for (int64_t kt = kt0; kt < kt1; ++kt) {
        if (stream)  // past the chunk's end: the same place in the next chunk's tiles (this thread's next)
            for (int j = 0; j < NT; ++j) {
                const int64_t ahead = kt + kPrefetchTiles;
                const uint16_t* p = ahead < kt1 ? tile0 + j * tile_stride + ahead * 512
                                                : tile0 + (NT + j) * tile_stride + (ahead - kt1) * 512;
                for (int line = 0; line < 16; ++line) _mm_prefetch(reinterpret_cast<const char*>(p + line * 32), _MM_HINT_T0);
            }
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

// The rows of x as A tiles: fewer than 16 rows are one tile of that many rows (tile_rows);
// otherwise whole tiles of 16 rows are read in place and the rows after the last one from a
// zero-padded copy (so no tile load reads past x), made once per call and read by every thread.
struct AmxRows {
    const uint16_t* x;
    int64_t x_stride, k, whole;
    int tile_rows;
    uint16_t* tail;

    // Returns 0, or -4 out of memory.
    int init(const uint16_t* rows, int64_t m, int64_t row_k, int64_t stride) {
        x = rows, x_stride = stride, k = row_k, tail = nullptr;
        tile_rows = m < 16 ? static_cast<int>(m) : 16;
        whole = m < 16 ? m : m / 16 * 16;
        if (whole == m) return 0;
        tail = reinterpret_cast<uint16_t*>(scratch_floats<3>(8 * k));
        if (tail == nullptr) return -4;
        std::memset(tail, 0, 16 * k * sizeof(uint16_t));
        for (int64_t r = whole; r < m; ++r) std::memcpy(tail + (r - whole) * k, x + r * x_stride, k * sizeof(uint16_t));
        tile_operands_stored();
        return 0;
    }
    const uint16_t* at(int64_t r) const { return r < whole ? x + r * x_stride : tail; }
    int64_t stride(int64_t r) const { return r < whole ? x_stride : k; }

    // sums for rows [r, r + rows) (rows <= 32: one or two row tiles) against one or two column
    // tiles, over k tiles [kt0, kt1).
    void block(int64_t r, int64_t rows, bool two_tiles, const uint16_t* tile0, int64_t tile_stride, int64_t kt0,
               int64_t kt1, float (*sums)[16][16], bool stream = false) const {
        auto run = [&](auto mt, auto nt, const uint16_t* a0, const uint16_t* a1, int64_t a_stride, float(*out)[16][16]) {
            amx_block<decltype(mt)::value, decltype(nt)::value>(a0, a1, a_stride, tile0, tile_stride, kt0, kt1, out,
                                                                stream);
        };
        using One = std::integral_constant<int, 1>;
        using Two = std::integral_constant<int, 2>;
        const uint16_t* a0 = at(r);
        if (rows <= 16 || stride(r) != stride(r + 16)) {  // one row tile, or two of unequal strides: one at a time
            two_tiles ? run(One{}, Two{}, a0, nullptr, stride(r), sums) : run(One{}, One{}, a0, nullptr, stride(r), sums);
            if (rows > 16) {
                const uint16_t* a1 = at(r + 16);
                two_tiles ? run(One{}, Two{}, a1, nullptr, stride(r + 16), sums + 2)
                          : run(One{}, One{}, a1, nullptr, stride(r + 16), sums + 2);
            }
        } else {
            two_tiles ? run(Two{}, Two{}, a0, at(r + 16), stride(r), sums)
                      : run(Two{}, One{}, a0, at(r + 16), stride(r), sums);
        }
    }
};

// Rows in panels of about 1 MiB of x, each panel passing over every column chunk: the same
// thread takes the same chunks in every panel (a static schedule), so its share of W stays in
// its L2 while the panel does too. One pass of all M rows per chunk ran 2,048 x 1,536 x 576 at
// 1.3 TFLOP/s against torch's 2.2-2.5 (x re-read from beyond L2 for every chunk); panels 1.7-2.0.
inline int64_t amx_panel_rows(int64_t k) { return std::max<int64_t>(32, (int64_t{1} << 20) / (2 * k) / 32 * 32); }

// y = x @ W^T (+ bias) in bf16 for a weight packed by gemm.cpp's pack_weight<uint16_t, 2>; a
// float32 y takes the same bf16 values widened (StoreFor). Returns 0, -1 when K is not a multiple
// of 32, -4 out of memory.
template <typename Y = uint16_t>
inline int gemm_amx_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed, int64_t n,
                         const uint16_t* bias, Y* y, int64_t y_stride) {
    if (k % 32 != 0) return -1;
    if (m == 0) return 0;  // (a tile of 0 rows is an invalid configuration)
    AmxRows a;
    if (a.init(x, m, k, x_stride) != 0) return -4;
    const int64_t tile_stride = k * kTileCols, k_tiles = k / 32;
    const int64_t chunks = (n + kTileCols * kNT - 1) / (kTileCols * kNT);
    const int64_t panel = amx_panel_rows(k);
#pragma omp parallel
    {
        configure_tiles(a.tile_rows);
        alignas(64) float sums[4][16][16];
        for (int64_t p0 = 0; p0 < m; p0 += panel) {
#pragma omp for schedule(static) nowait
            for (int64_t c = 0; c < chunks; ++c) {
                const int64_t n0 = c * kTileCols * kNT;
                const bool two_tiles = n - n0 > kTileCols;
                const uint16_t* tile0 = packed + (n0 / kTileCols) * tile_stride;
                for (int64_t r = p0; r < std::min(m, p0 + panel); r += 32) {
                    const int64_t rows = std::min<int64_t>(32, m - r);
                    a.block(r, rows, two_tiles, tile0, tile_stride, 0, k_tiles, sums, /*stream=*/r == 0);
                    // + bias, rounded to bf16, masked at N: the vector GEMM's store.
                    const typename StoreFor<BF16, Y>::type store{y + r * y_stride, y_stride, n0, n, bias};
                    for (int64_t i = 0; i < rows; ++i)
                        for (int j = 0; j < (two_tiles ? 2 : 1); ++j)
                            store(static_cast<int>(i), j, _mm512_load_ps(sums[(i / 16) * 2 + j][i % 16]));
                }
            }
        }
        _tile_release();
    }
    return 0;
}

}  // namespace kvflow
#endif
