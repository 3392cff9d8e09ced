// Weight-only quantized GEMM with bf16 activations on AMX tiles, for long groups (int8 per
// channel; any group of 256 inputs or more): quant_gemm_bf16.cpp's sums
//
//     y[m, n] = sum over groups g of  s[g, n] * A[m, g, n] + o'[g, n] * X[m, g]   (+ bias)
//
// with each group's integer-weight dot products A from TDPBF16PS over the group's k tiles (so
// groups of a multiple of 32 inputs; others run the vector kernel, a per-layer choice). The
// quants become bf16 B tiles (the integers exactly), unpacked a few k tiles ahead of the products
// (UnpackAhead): into a ring at 1-32 rows, into a whole column tile at more, which the row panel's
// later row tiles read from L1/L2 (Unpacked). The scale and offset FMAs are the vector kernel's,
// in its order, on accumulators held in registers. Shorter groups (int4's 32, GGUF's blocks) pay
// those FMAs every k tile or few, as much vector work as the tile products take: they multiply
// the dequantized weights instead (quant_gemm_amx_folded.h). As in gemm_amx.h, the tile unit's
// sums round otherwise than vdpbf16ps's chain, and a row's result depends on nothing but its own
// x row: batch- and thread-invariant (every blocking below runs the same chain of tile products
// and FMAs per row; tests/quantization/test_tiles.py checks rows alone against rows in a batch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gemm_amx.h"
#include "gemm_blocking.h"
#include "quant_tiles.h"
#include "quant_unpack.h"

#if defined(KVFLOW_AMX)
namespace kvflow {

// B tiles of one column tile unpacked from its quants kAhead k tiles before the tile unit needs
// them, into a ring of `ring` tiles, so the unpacking overlaps the tile products and the stream
// from memory. At one row, against unpacking whole column tiles first: int8 (per channel) 1.35x
// -> 0.93-1.07x the vector kernel's time.
template <int Bits>
struct UnpackAhead {
    static constexpr int64_t kAhead = 3;
    const uint8_t* q;
    int64_t k_tiles;
    uint16_t* slots;  // `ring` tiles: 4 at decode sizes, or every k tile for later row tiles to read
    int64_t ring;

    UnpackAhead(const uint8_t* quants, int64_t tiles, uint16_t* dest, int64_t ring_tiles)
        : q(quants), k_tiles(tiles), slots(dest), ring(ring_tiles) {
        for (int64_t kt = 0; kt < std::min(kAhead, k_tiles); ++kt) unpack(kt);
    }
    void unpack(int64_t kt) {
        unpack_blocks<Bits>(q, kt * 8, kt * 8 + 8, slots + kt % ring * 512);
        tile_operands_stored();
    }
    static constexpr int64_t bytes = 64;  // a tile row
    const uint16_t* tile(int64_t kt) const { return slots + kt % ring * 512; }
    void loaded(int64_t kt) {
        if (kt + kAhead < k_tiles) unpack(kt + kAhead);
    }
};

// Tiles of one column tile made by the panel's first row tile, read by the others.
struct Unpacked {
    const uint16_t* tiles;
    static constexpr int64_t bytes = 64;
    const uint16_t* tile(int64_t kt) const { return tiles + kt * 512; }
    void loaded(int64_t) {}
};

// A row tile of x read in place as A tiles (AmxRows::at, rows `bytes` apart).
struct RowTiles {
    const uint16_t* rows;
    int64_t bytes;
    const uint16_t* tile(int64_t kt) const { return rows + kt * 32; }
    void loaded(int64_t) {}
};

// One row tile (rows of x `x_stride` apart) against one column tile over every group: four
// groups in flight in the four sum tiles (x and W tiles alternating), so each group's FMAs
// (`finish(g, sums[g % 4])`) wait on products finished long before.
template <typename Source, typename Finish>
inline void group_sums(const uint16_t* x, int64_t x_stride, Source& b, int64_t groups, int64_t tiles_per_group,
                       float (*sums)[16][16], Finish&& finish) {
    const int64_t a_bytes = x_stride * 2;
    // The tile intrinsics take literal tile numbers: one body per sum tile.
#define KVFLOW_AMX_GROUP(C, A, B)                                                      \
    [&](int64_t g) {                                                                   \
        _tile_zero(C);                                                                 \
        for (int64_t kt = g * tiles_per_group; kt < (g + 1) * tiles_per_group; ++kt) { \
            _tile_loadd(A, x + kt * 32, a_bytes);                                      \
            _tile_loadd(B, b.tile(kt), 64);                                            \
            _tile_dpbf16ps(C, A, B);                                                   \
            b.loaded(kt);                                                              \
        }                                                                              \
    }
    auto group0 = KVFLOW_AMX_GROUP(0, 4, 6);
    auto group1 = KVFLOW_AMX_GROUP(1, 5, 7);
    auto group2 = KVFLOW_AMX_GROUP(2, 4, 6);
    auto group3 = KVFLOW_AMX_GROUP(3, 5, 7);
#undef KVFLOW_AMX_GROUP
    auto done = [&](int64_t g) {  // group g's sums out of its tile, then its FMAs
        switch (g & 3) {
            case 0: _tile_stored(0, sums[0], 64); break;
            case 1: _tile_stored(1, sums[1], 64); break;
            case 2: _tile_stored(2, sums[2], 64); break;
            default: _tile_stored(3, sums[3], 64); break;
        }
        finish(g, sums[g & 3]);
    };
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

// Long groups from 17 rows, and made weight tiles at every size (quant_gemm_amx_folded.h, and
// quant_gemm_amx_rows.h with the operands swapped): MT A tiles against NT B tiles at once, each
// operand a source of tiles (RowTiles, or UnpackAhead, FoldAhead, LookupAhead: made a few k tiles
// ahead into a ring or a whole column, or Unpacked, rereading one). Each sum tile is a chain whose
// every product waits on the previous one's sums, so one chain at a time (a column tile after the
// other, as group_sums does) leaves the tile unit waiting; MT x NT chains keep up to four products
// in flight. Same products in the same order per sum tile: the same bits.
// sums[2i + j]: A tile i, B tile j, over k tiles [kt0, kt1). (gemm_amx.h's amx_block has the same
// loop over packed bf16 tiles; one template for both slowed the bf16 GEMM by 4-8 % at 1 and 128
// rows in an alternated run, so they stay two.)
template <int MT, int NT, typename A, typename B>
inline void ring_block(A& a0, A* a1, B& b0, B* b1, int64_t kt0, int64_t kt1, float (*sums)[16][16]) {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
    for (int64_t kt = kt0; kt < kt1; ++kt) {
        _tile_loadd(6, b0.tile(kt), b0.bytes);
        if constexpr (NT == 2) _tile_loadd(7, b1->tile(kt), b1->bytes);
        _tile_loadd(4, a0.tile(kt), a0.bytes);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
        if constexpr (MT == 2) {
            _tile_loadd(5, a1->tile(kt), a1->bytes);
            _tile_dpbf16ps(2, 5, 6);
            if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
        }
        a0.loaded(kt);
        if constexpr (MT == 2) a1->loaded(kt);
        b0.loaded(kt);
        if constexpr (NT == 2) b1->loaded(kt);
    }
    _tile_stored(0, sums[0], 64);
    if constexpr (NT == 2) _tile_stored(1, sums[1], 64);
    if constexpr (MT == 2) _tile_stored(2, sums[2], 64);
    if constexpr (MT == 2 && NT == 2) _tile_stored(3, sums[3], 64);
}

// Rows [r, r + rows) of x (up to two row tiles) against the chunk's nt column tiles over k tiles
// [kt0, kt1): ring_block at the shape they make, sums[2i + j] as there.
template <typename Source>
inline void pair_block(const AmxRows& a, int64_t r, int64_t rows, int nt, Source& b0, Source& b1, int64_t kt0,
                       int64_t kt1, float (*sums)[16][16]) {
    RowTiles x0{a.at(r), a.stride(r) * 2};
    RowTiles x1{rows > 16 ? a.at(r + 16) : nullptr, rows > 16 ? a.stride(r + 16) * 2 : 0};
    if (rows > 16 && nt == 2) ring_block<2, 2>(x0, &x1, b0, &b1, kt0, kt1, sums);
    else if (rows > 16) ring_block<2, 1>(x0, &x1, b0, &b1, kt0, kt1, sums);
    else if (nt == 2) ring_block<1, 2>(x0, &x1, b0, &b1, kt0, kt1, sums);
    else ring_block<1, 1>(x0, &x1, b0, &b1, kt0, kt1, sums);
}

// A row tile's outputs for one column tile, in registers across the groups: per group and row
// acc = sums * s + acc, then + X[row, g] * o' (the vector kernel's two FMAs, in its order).
// Held in memory they cost a load and a store per FMA pair: int4 at 32 rows ran 1.7x its time
// at 16.
template <bool Offsets>
struct RowAccumulators {
    __m512 acc[16];
    int rows;

    explicit RowAccumulators(int n_rows) : rows(n_rows) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    }
    // sum: the group's stored sums; xs: X[first row, g], the next row's `groups` further on;
    // o: the stored offsets (bits: integer_offset makes them o').
    inline void add(const float (*sum)[16], int bits, const float* s, const float* o, const float* xs, int64_t groups) {
        const __m512 sj = _mm512_loadu_ps(s);
        const __m512 oj = Offsets ? integer_offset(bits, sj, _mm512_loadu_ps(o)) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
            if (i >= rows) break;
            acc[i] = _mm512_fmadd_ps(_mm512_load_ps(sum[i]), sj, acc[i]);
            if constexpr (Offsets) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xs[i * groups]), oj, acc[i]);
        }
    }
    template <typename Store>
    inline void write(const Store& store, int j) const {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
            if (i >= rows) break;
            store(i, j, acc[i]);
        }
    }
};

// One column chunk of a call: its first column tile and how many tiles it has (1 or 2).
struct AmxChunk {
    int64_t n0, tile0;
    int nt;
};

// The OpenMP region the AMX quantized kernels run: per thread the tile configuration
// (`configure()`), four sum tiles and, for calls of more than 32 rows, room for a chunk's unpacked
// column tiles; then row panels [p0, p1), each first `prologue(p0, p1)` (a worksharing loop over
// the panel's rows, whose barrier ends it, after a barrier so that no thread still reads the
// previous panel's), then the column chunks, statically split (the same chunks per thread in every
// panel, as in gemm_amx_bf16), each `body(chunk, p0, p1, tiles, sums)`. Returns 0, or -4 out of
// memory.
template <typename Configure, typename Prologue, typename Body>
int amx_quant_chunks(int64_t m, int64_t n, int64_t k, Configure&& configure, Prologue&& prologue, Body&& body) {
    const int64_t chunks = (n + kTileCols * kNT - 1) / (kTileCols * kNT), panel = amx_panel_rows(k);
    const size_t tile_bytes = static_cast<size_t>(kNT * k * kTileCols) * 2;
    int failed = 0;
#pragma omp parallel
    {
        auto* tiles = m <= 32 ? nullptr : static_cast<uint16_t*>(std::aligned_alloc(64, tile_bytes));
        if (m > 32 && tiles == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
        configure();
        alignas(64) float sums[4][16][16];
        for (int64_t p0 = 0; p0 < m; p0 += panel) {
            if (p0 > 0) {
#pragma omp barrier
            }
            prologue(p0, std::min(m, p0 + panel));
#pragma omp for schedule(static) nowait
            for (int64_t c = 0; c < chunks; ++c) {
                if (m > 32 && tiles == nullptr) continue;  // out of memory: `failed` is set
                const int64_t n0 = c * kTileCols * kNT;
                body(AmxChunk{n0, n0 / kTileCols, n - n0 > kTileCols ? 2 : 1}, p0, std::min(m, p0 + panel), tiles, sums);
            }
        }
        _tile_release();
        std::free(tiles);
    }
    return failed ? -4 : 0;
}

// One chunk's row panel [p0, p1) in a kernel that makes its weight tiles as it goes (the folded
// and the row-layout ones): the panel's first pair of row tiles makes the chunk's column tiles
// (`make(j, dest, ring, k_tiles)`, a FoldAhead or LookupAhead), into rings of 4 when it is the
// panel's only pair, else whole (`tiles`), for the later pairs to reread (Unpacked); each pair is
// `pair(r, rows, b0, b1)`.
template <typename Make, typename Pair>
inline void made_tiles_panel(const AmxChunk& chunk, int64_t p0, int64_t p1, uint16_t* tiles, int64_t k,
                             Make&& make, Pair&& pair) {
    const int64_t k_tiles = k / 32;
    const bool reread = p1 - p0 > 32;
    const int64_t ring = reread ? k_tiles : 4;
    alignas(64) uint16_t rings[2][4][512];
    uint16_t* col0 = reread ? tiles : rings[0][0];
    uint16_t* col1 = reread ? tiles + k * kTileCols : rings[1][0];
    auto first0 = make(0, col0, ring, k_tiles);
    auto first1 = make(chunk.nt - 1, col1, ring, chunk.nt == 2 ? k_tiles : 0);
    Unpacked again0{col0}, again1{col1};
    for (int64_t r = p0; r < p1; r += 32) {
        const int64_t rows = std::min<int64_t>(32, p1 - r);
        if (r == p0) pair(r, rows, first0, first1);
        else pair(r, rows, again0, again1);
    }
}

// Groups of fewer k tiles than this fold (quant_gemm_amx_folded.h): a group's scale and offset
// FMAs would take about as long as its tile products.
constexpr int64_t kBlockedGroupTiles = 8;

// Out: BF16 (bias bf16) or F32 (bias float32). Returns 0, or -4 out of memory.
template <typename Out, int Bits, bool Offsets>
int quant_gemm_amx(const uint16_t* x, int64_t m, int64_t x_stride, const QuantTileWeight& w, int64_t n,
                   const typename Out::T* bias, typename Out::T* y, int64_t y_stride) {
    const int64_t k = w.k, groups = w.groups(), tiles_per_group = w.group / 32, k_tiles = k / 32;
    const int64_t bytes = quant_tile_bytes(Bits, k);
    AmxRows a;
    if (a.init(x, m, k, x_stride) != 0) return -4;
    float* xsums = Offsets ? scratch_floats<4>(m * groups) : nullptr;
    if (Offsets && xsums == nullptr) return -4;
    auto group_sums_of_rows = [&](int64_t p0, int64_t p1) {
        if constexpr (Offsets) {
#pragma omp for schedule(static)
            for (int64_t r = p0; r < p1; ++r)
                for (int64_t g = 0; g < groups; ++g) xsums[r * groups + g] = group_sum(x + r * x_stride + g * w.group, w.group);
        }
    };
    // Each chunk is unpacked again per row panel: little against a panel's products.
    auto configure = [&] { configure_tiles(a.tile_rows); };
    return amx_quant_chunks(m, n, k, configure, group_sums_of_rows, [&](AmxChunk chunk, int64_t p0, int64_t p1,
                                                                        uint16_t* tiles, float(*sums)[16][16]) {
        const int64_t n0 = chunk.n0, tile0 = chunk.tile0;
        const int nt = chunk.nt;
        using Acc = RowAccumulators<Offsets>;
        // acc += group g's sums for column tile j, rows from `row`, scaled and offset.
        auto add = [&](Acc& acc, const float (*sum)[16], int j, int64_t g, int64_t row) {
            const int64_t at = ((tile0 + j) * groups + g) * kTileCols;
            acc.add(sum, Bits, w.scales + at, Offsets ? w.offsets + at : nullptr,
                    Offsets ? xsums + row * groups + g : nullptr, groups);
        };
        auto store = [&](const Acc& acc, int j, int64_t row) {
            acc.write(StoreRow<Out>{y + row * y_stride, y_stride, n0, n, bias}, j);
        };
        if (m <= 16) {  // one row tile, a column tile at a time, four groups in flight
            alignas(64) uint16_t ring[4][512];
            for (int j = 0; j < nt; ++j) {
                UnpackAhead<Bits> source(w.q + (tile0 + j) * bytes, k_tiles, ring[0], 4);
                Acc acc(static_cast<int>(m));
                group_sums(a.at(0), a.stride(0), source, groups, tiles_per_group, sums,
                           [&](int64_t g, const float(*sum)[16]) { add(acc, sum, j, g, 0); });
                store(acc, j, 0);
            }
            return;
        }
        // 17 rows and more: both row tiles of a pair against both column tiles at once
        // (ring_block: one load per product against 1.5, four chains in flight; int8 at 512 rows
        // 56 ms for the model's layers against 61 two row tiles at a time). The panel's first
        // pair unpacks the columns as it goes (made_tiles_panel).
        auto make = [&](int j, uint16_t* dest, int64_t ring, int64_t n_tiles) {
            return UnpackAhead<Bits>(w.q + (tile0 + j) * bytes, n_tiles, dest, ring);
        };
        made_tiles_panel(chunk, p0, p1, tiles, k, make, [&](int64_t r, int64_t rows, auto& b0, auto& b1) {
            const int m0 = static_cast<int>(std::min<int64_t>(16, rows)), m1 = static_cast<int>(rows) - m0;
            Acc acc[2][2] = {{Acc(m0), Acc(m0)}, {Acc(m1), Acc(m1)}};
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t kt0 = g * tiles_per_group, kt1 = kt0 + tiles_per_group;
                pair_block(a, r, rows, nt, b0, b1, kt0, kt1, sums);
                for (int i = 0; i < (m1 > 0 ? 2 : 1); ++i)
                    for (int j = 0; j < nt; ++j) add(acc[i][j], sums[2 * i + j], j, g, r + 16 * i);
            }
            for (int i = 0; i < (m1 > 0 ? 2 : 1); ++i)
                for (int j = 0; j < nt; ++j) store(acc[i][j], j, r + 16 * i);
        });
    });
}

}  // namespace kvflow
#endif
