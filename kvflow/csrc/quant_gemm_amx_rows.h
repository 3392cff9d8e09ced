// 4-bit weights with short groups on AMX, the weights as the A operand: the tile unit computes
// y^T = W x^T, the rows of an A tile being 16 output columns' 32 inputs each, x^T the B tiles.
//
// Why: dequantizing in the B (k-pair) layout of quant_gemm_amx_folded.h gives every vector lane
// its own column, and so its own scale: each weight costs a conversion to float32, a product, a
// sum and a share of the rounding to bf16 (~0.2 cycles a weight), which at one decode row
// nothing shares. A row of an A tile is one column and one group: its 32 weights take one of
// only 16 values, bf16(j * s + o) for j = 0..15. So two rows' tables are made at once (two
// products, two sums, one conversion: the same roundings as QuantizedWeight.dequantize), and each
// row is one permutation of its table by its nibbles (vpermw). At one row, 1,536 x 576 in cache,
// one thread: 80 -> 48 us.
//
// Bits: per output the same chain of TDPBF16PS over k tiles from zero as gemm_amx.h's, on the same
// bf16 weights; swapping the operands of a tile product swaps only the factors of each product
// (measured: 512,000 outputs, none differ). So a layer gives the bits of the bf16 layer of its
// dequantized weights, as the folded kernel does (tests/quantization/test_tiles.py).
//
// Layout (kvflow_pack_quant_tiles, layout 1): per column tile of 16 and k tile of 32, 8 row pairs
// of 32 bytes, byte i = column 2p's input i (low nibble) | column 2p + 1's (high nibble); scales
// and offsets as the pair layout's, [tiles][groups][16]. Layout 2, where every scale and offset is
// a float16 value (GGUF's, and quantize_int4's): per column tile and group, the 16 scales and 16
// offsets as float16, then the group's k tiles as in layout 1: a sixth fewer bytes at groups of
// 32, in one stream. The vector kernels cannot read either, so they are packed only where this
// kernel will run (kvflow_quant_tiles_layout).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_gemm_amx.h"

#if defined(KVFLOW_AMX)
namespace kvflow {

// One row panel of x^T as B tiles: for the panel's row tile t and k tile kt, 16 rows (k pairs) of
// `width` dwords, dword i of row p holding x[p0 + 16 t + i, 32 kt + 2p .. + 1]. width = m under 16
// rows (the tiles hold only the call's rows: less tile work at decode), else 16, the panel's last
// row tile padded with zeros. Held per panel (amx_panel_rows, about 1 MiB of x), not per call.
struct TransposedRows {
    uint32_t* t = nullptr;
    int64_t width = 0, k_tiles = 0;

    // Room for panels of up to `rows` rows. Returns 0, or -4 out of memory.
    int init(int64_t m, int64_t rows, int64_t k) {
        width = std::min<int64_t>(m, 16), k_tiles = k / 32;
        t = reinterpret_cast<uint32_t*>(scratch_floats<5>((rows + 15) / 16 * k_tiles * 16 * width));
        return t == nullptr ? -4 : 0;
    }
    uint32_t* tile(int64_t rt, int64_t kt) const { return t + (rt * k_tiles + kt) * 16 * width; }
    int64_t stride_bytes() const { return width * 4; }

    // Fills the tiles of rows [p0, p1) of x; a worksharing loop over them (call from every thread
    // of the region).
    void fill(const uint16_t* x, int64_t p0, int64_t p1, int64_t x_stride) const {
        const int64_t row_tiles = (p1 - p0 + 15) / 16;
#pragma omp for schedule(static)
        for (int64_t at = 0; at < row_tiles * k_tiles; ++at) {
            const int64_t rt = at / k_tiles, kt = at % k_tiles;
            uint32_t* dst = tile(rt, kt);
            if (width < 16) {  // a decode step's few rows
                for (int64_t i = 0; i < width; ++i) {
                    const uint32_t* src = reinterpret_cast<const uint32_t*>(x + (p0 + i) * x_stride + kt * 32);
                    for (int p = 0; p < 16; ++p) dst[p * width + i] = src[p];
                }
                continue;
            }
            __m512i r[16];
            for (int i = 0; i < 16; ++i) {
                const int64_t row = p0 + rt * 16 + i;
                r[i] = row < p1 ? _mm512_loadu_si512(x + row * x_stride + kt * 32) : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 16, r[p]);
        }
        tile_operands_stored();
    }

    // r[i] (16 dwords) -> r[p] holding dword p of every r[i]: 64 shuffles.
    static inline void transpose16(__m512i (&r)[16]) {
        __m512i t[16];
        for (int i = 0; i < 16; i += 2) {  // lanes [a0 b0 a1 b1], [a2 b2 a3 b3]
            t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
            t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) {  // r[i + c]'s lane l: dword 4l + c of rows i .. i + 3
            r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
            r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
            r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
            r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
        }
        for (int h = 0; h < 2; ++h)  // rows 8h .. 8h + 7: dwords 4l + c in lanes 0/2 (t[c]) and 1/3 (t[4 + c])
            for (int c = 0; c < 4; ++c) {
                t[8 * h + c] = _mm512_shuffle_i32x4(r[8 * h + c], r[8 * h + 4 + c], 0x88);
                t[8 * h + 4 + c] = _mm512_shuffle_i32x4(r[8 * h + c], r[8 * h + 4 + c], 0xDD);
            }
        for (int c = 0; c < 8; ++c) {  // dword c and c + 8 of all 16 rows
            r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
            r[c + 8] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
        }
    }
};

// A tiles of one column tile, dequantized from the nibbles kAhead k tiles before the tile unit
// needs them, into a ring of `ring` tiles (4 at decode sizes; every k tile when later row tiles
// reread the column): FoldAhead's schedule, with table lookups for its arithmetic. Half: the
// layout kQuantAmxRowsHalf, whose group blocks carry float16 scales and offsets before their quants.
template <bool Half>
struct LookupAhead {
    static constexpr int64_t kAhead = 3;
    static constexpr int64_t kScalesAhead = 1024;  // floats, as FoldAhead asks
    const uint8_t* q;  // this column tile's quants (Half: its group blocks)
    int64_t k_tiles;
    uint16_t* slots;
    int64_t ring;
    const float* s;  // this column tile's scales [groups][16] (Half: null)
    const float* o;  // and offsets
    int64_t tiles_per_group;
    alignas(64) float group_scales[16];  // Half: the current group's, widened to float32
    alignas(64) float group_offsets[16];
    alignas(64) uint16_t made[8][32];  // groups of 2+ k tiles: the group's tables, made at its first

    LookupAhead(const uint8_t* quants, int64_t tiles, uint16_t* dest, int64_t ring_tiles, const float* scales,
                const float* offsets, int64_t group_tiles)
        : q(quants), k_tiles(tiles), slots(dest), ring(ring_tiles), s(scales), o(offsets), tiles_per_group(group_tiles) {
        for (int64_t kt = 0; kt < std::min(kAhead, k_tiles); ++kt) unpack(kt);
    }
    // bf16(j * s + o) for j = 0..15, as FoldAhead::dequantize rounds it: the product and the sum
    // each rounded in float32. With float32 scales these are the explicit-rounding forms, never
    // contracted into an FMA. A float16 scale has 11 significant bits and j at most 4, so j * s is
    // exact in float32 and one FMA rounds as the two operations do.
    static inline __m512 table(float scale, float offset) {
        constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512 j = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        if constexpr (Half) return _mm512_fmadd_ps(j, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
        return _mm512_add_round_ps(_mm512_mul_round_ps(j, _mm512_set1_ps(scale), kNearest), _mm512_set1_ps(offset),
                                   kNearest);
    }
    // Words 0-15: column 2p's table, 16-31: column 2p + 1's.
    static inline __m512i tables(const float* sg, const float* og, int p) {
        return (__m512i)_mm512_cvtne2ps_pbh(table(sg[2 * p + 1], og[2 * p + 1]), table(sg[2 * p], og[2 * p]));
    }
    void unpack(int64_t kt) {
        const int64_t g = kt / tiles_per_group;
        const bool first = kt % tiles_per_group == 0;
        const float *sg = group_scales, *og = group_offsets;
        const uint8_t* src;
        if constexpr (Half) {  // one stream: the prefetches of the quants below take the scales along
            const uint8_t* block = q + g * half_rows_group_bytes(tiles_per_group * 32);
            if (first) {
                _mm512_store_ps(group_scales, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block))));
                _mm512_store_ps(group_offsets,
                                _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32))));
            }
            src = block + 64 + kt % tiles_per_group * 256;
        } else {
            sg = s + g * 16, og = o + g * 16, src = q + kt * 256;
            if (first) {
                _mm_prefetch(reinterpret_cast<const char*>(sg + kScalesAhead), _MM_HINT_T1);
                _mm_prefetch(reinterpret_cast<const char*>(og + kScalesAhead), _MM_HINT_T1);
            }
        }
        // k tiles are unpacked in order, so a longer group's tables are made once, at its first
        // (GPTQ's 128 inputs: a quarter of the tables' work).
        const bool reuse = tiles_per_group > 1;
        if (reuse && first)
            for (int p = 0; p < 8; ++p) _mm512_store_si512(made[p], tables(sg, og, p));
        const __m512i nibble = _mm512_set1_epi16(0x0F), high_table = _mm512_set1_epi16(16);
        uint16_t* out = slots + kt % ring * 512;
        for (int p = 0; p < 8; ++p, src += 32, out += 64) {
            if ((p & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T1);
            const __m512i pair_tables = reuse ? _mm512_load_si512(made[p]) : tables(sg, og, p);
            const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
            const __m512i low = _mm512_and_si512(bytes, nibble);
            const __m512i high = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), high_table);
            _mm512_store_si512(out, _mm512_permutexvar_epi16(low, pair_tables));
            _mm512_store_si512(out + 32, _mm512_permutexvar_epi16(high, pair_tables));
        }
        tile_operands_stored();
    }
    static constexpr int64_t bytes = 64;  // a tile row
    const uint16_t* tile(int64_t kt) const { return slots + kt % ring * 512; }
    void loaded(int64_t kt) {
        if (kt + kAhead < k_tiles) unpack(kt + kAhead);
    }
};

// Tiles 0-3: sums (16 columns x `width` rows); 4-5: the weights; 6-7: x^T.
inline void configure_transposed_tiles(int64_t width) {
    const auto w = static_cast<uint16_t>(width * 4);
    load_tile_shapes({16, 16, 16, 16, 16, 16, 16, 16}, {w, w, w, w, 64, 64, w, w});
}

// One row tile of x^T as B tiles, for ring_block.
struct TransposedTiles {
    const TransposedRows& xt;
    int64_t rt, bytes;
    const uint16_t* tile(int64_t kt) const { return reinterpret_cast<const uint16_t*>(xt.tile(rt, kt)); }
    void loaded(int64_t) {}
};

// Out: BF16 (bias bf16) or F32 (bias float32); w packed in layout 1 (offsets present, zeros for
// none) or, Half, in layout 2. Returns 0, or -4 out of memory.
template <typename Out, bool Half>
int quant_gemm_amx_rows(const uint16_t* x, int64_t m, int64_t x_stride, const QuantTileWeight& w, int64_t n,
                        const typename Out::T* bias, typename Out::T* y, int64_t y_stride) {
    const int64_t k = w.k, groups = w.groups(), bytes = quant_tile_bytes(4, k, w.layout, w.group);
    TransposedRows xt;
    if (xt.init(m, std::min(m, amx_panel_rows(k)), k) != 0) return -4;
    // a column of the sums (one output row), as the bf16 GEMM's store takes it
    const __m512i columns = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    auto configure = [&] { configure_transposed_tiles(xt.width); };
    auto fill = [&](int64_t p0, int64_t p1) { xt.fill(x, p0, p1, x_stride); };
    return amx_quant_chunks(m, n, k, configure, fill, [&](AmxChunk chunk, int64_t p0, int64_t p1, uint16_t* tiles,
                                                         float(*sums)[16][16]) {
        const int64_t tile0 = chunk.tile0;
        const int nt = chunk.nt;
        auto make = [&](int j, uint16_t* dest, int64_t ring, int64_t n_tiles) {
            const int64_t at = (tile0 + j) * groups * kTileCols;
            return LookupAhead<Half>(w.q + (tile0 + j) * bytes, n_tiles, dest, ring, Half ? nullptr : w.scales + at,
                                     Half ? nullptr : w.offsets + at, w.group / 32);
        };
        made_tiles_panel(chunk, p0, p1, tiles, k, make, [&](int64_t r, int64_t rows, auto& w0, auto& w1) {
            // the weights' column tiles as A, the row tiles of x^T as B: sums[2j + i], column
            // tile j, row tile i, holding [column][row]
            const int64_t rt = (r - p0) / 16;  // within the panel
            TransposedTiles x0{xt, rt, xt.stride_bytes()}, x1{xt, rt + 1, xt.stride_bytes()};
            if (rows > 16 && nt == 2) ring_block<2, 2>(w0, &w1, x0, &x1, 0, xt.k_tiles, sums);
            else if (rows > 16) ring_block<1, 2>(w0, &w1, x0, &x1, 0, xt.k_tiles, sums);
            else if (nt == 2) ring_block<2, 1>(w0, &w1, x0, &x1, 0, xt.k_tiles, sums);
            else ring_block<1, 1>(w0, &w1, x0, &x1, 0, xt.k_tiles, sums);
            // + bias, rounded to bf16, masked at N: the bf16 GEMM's store.
            const StoreRow<Out> store{y + r * y_stride, y_stride, chunk.n0, n, bias};
            for (int64_t i = 0; i < rows; ++i)
                for (int j = 0; j < nt; ++j)
                    store(static_cast<int>(i), j, _mm512_i32gather_ps(columns, &sums[2 * j + i / 16][0][i % 16], 4));
        });
    });
}

}  // namespace kvflow
#endif
