// Weight-only quantized GEMM on AMX tiles for short groups (int4's 32, GGUF's blocks of 32, GPTQ's
// 128: fewer than kBlockedGroupTiles k tiles a group). The tile unit multiplies x by the
// dequantized weights themselves:
//
//     y[m, n] = sum_k x[m, k] * bf16(q[k, n] * s + o)   (+ bias)
//
// with q * s + o a product and a sum, each rounded in float32 (as gguf's, torch's and
// QuantizedWeight.dequantize compute it), then rounded to bf16: the weight the bf16 model loaded
// from the same checkpoint holds. The sums are gemm_amx.h's (one chain of TDPBF16PS over k, from
// zero, then + bias), so on AMX a quantized layer gives the bits of the bf16 layer of its
// dequantized weights (tests/quantization/test_tiles.py).
//
// Why not quant_gemm_amx.h's exact group sums: each group there ends with a tile store and two
// FMAs per row and 16 columns, as much vector work as the group's tile products take. At groups
// of 32 that made the model's layers at 128 rows 1.5x the bf16 GEMM's time (54 against 35 ms;
// folded 31-33). Folded, the scales cost one dequantization per weight per row panel, about 0.3
// vector operations a weight. The price is at one row, where nothing shares it: the layers 6.0-6.6
// -> 8.7 ms (bf16 11.5), int4 W-latency ITL 9.9-11.1 -> 12.2-12.7 ms against TTFT 78-94 -> 38-44
// ms (bf16 16.4 and 44-47 ms); docs/benchmarks.md has the sitting.
//
// 4-bit weights packed while AMX runs (kvflow_quant_tiles_layout) take quant_gemm_amx_rows.h
// instead: the same bits, with each weight a table lookup rather than this arithmetic (int4 ITL
// 11.7-12.2 -> 10.1-10.5 ms). Here stay 8-bit short groups (GGUF Q8_0) and 4-bit tiles packed in
// k pairs while AMX was off.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "quant_gemm_amx.h"

#if defined(KVFLOW_AMX)
namespace kvflow {

// B tiles of one column tile as bf16 weights, folded from the quants kAhead k tiles before the
// tile unit needs them, into a ring of `ring` tiles (4 at decode sizes; every k tile when later
// row tiles reread the column).
template <int Bits, bool Offsets>
struct FoldAhead {
    static constexpr int64_t kAhead = 3;
    const uint8_t* q;
    int64_t k_tiles;
    uint16_t* slots;
    int64_t ring;
    const float* s;  // this column tile's scales [groups][16]
    const float* o;  // and offsets, or null
    int64_t tiles_per_group;

    FoldAhead(const uint8_t* quants, int64_t tiles, uint16_t* dest, int64_t ring_tiles, const float* scales,
              const float* offsets, int64_t group_tiles)
        : q(quants), k_tiles(tiles), slots(dest), ring(ring_tiles), s(scales), o(offsets), tiles_per_group(group_tiles) {
        for (int64_t kt = 0; kt < std::min(kAhead, k_tiles); ++kt) unpack(kt);
    }
    // q * s + o, two roundings: the explicit-rounding forms, which no compiler contracts into an FMA.
    static inline __m512 dequantize(__m512 v, __m512 scale, __m512 offset) {
        constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512 product = _mm512_mul_round_ps(v, scale, kNearest);
        return Offsets ? _mm512_add_round_ps(product, offset, kNearest) : product;
    }
    // The scales and offsets are two more streams, a line each per group and column tile: asked
    // for 4 KiB ahead (1 KiB: int4 layers at one row 10.0-10.6 ms against 8.0-9.5, alternated).
    static constexpr int64_t kScalesAhead = 1024;  // floats
    void unpack(int64_t kt) {
        const int64_t g = kt / tiles_per_group;
        _mm_prefetch(reinterpret_cast<const char*>(s + g * 16 + kScalesAhead), _MM_HINT_T1);
        if (Offsets) _mm_prefetch(reinterpret_cast<const char*>(o + g * 16 + kScalesAhead), _MM_HINT_T1);
        // A k-pair step's elements 0-15 are columns 0-7 (two inputs each), 16-31 columns 8-15.
        const __m512i lo_cols = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
        const __m512 s16 = _mm512_loadu_ps(s + g * 16);
        const __m512 s_lo = _mm512_permutexvar_ps(lo_cols, s16), s_hi = _mm512_permutexvar_ps(hi_cols, s16);
        const __m512 o16 = Offsets ? _mm512_loadu_ps(o + g * 16) : _mm512_setzero_ps();
        const __m512 o_lo = _mm512_permutexvar_ps(lo_cols, o16), o_hi = _mm512_permutexvar_ps(hi_cols, o16);
        uint16_t* out = slots + kt % ring * 512;
        const uint8_t* src = q + kt * 8 * Unpack<Bits>::kBytes;
        for (int64_t b = 0; b < 8; ++b, src += Unpack<Bits>::kBytes, out += 64) {
            if (Bits == 8 || (b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T1);
            __m512 even_lo, even_hi, odd_lo, odd_hi;  // the quants as float32 (exact)
            if constexpr (Bits == 4) {  // byte e: step 2b's element e in its low nibble, step 2b + 1's high
                const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
                const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
                const __m512i nibble = _mm512_set1_epi32(0x0F);
                even_lo = _mm512_cvtepi32_ps(_mm512_and_si512(lo, nibble));
                even_hi = _mm512_cvtepi32_ps(_mm512_and_si512(hi, nibble));
                odd_lo = _mm512_cvtepi32_ps(_mm512_srli_epi32(lo, 4));
                odd_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(hi, 4));
            } else {
                auto ints = [&](int at) {
                    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at))));
                };
                even_lo = ints(0), even_hi = ints(16), odd_lo = ints(32), odd_hi = ints(48);
            }
            const __m512bh even = _mm512_cvtne2ps_pbh(dequantize(even_hi, s_hi, o_hi), dequantize(even_lo, s_lo, o_lo));
            const __m512bh odd = _mm512_cvtne2ps_pbh(dequantize(odd_hi, s_hi, o_hi), dequantize(odd_lo, s_lo, o_lo));
            _mm512_store_si512(out, (__m512i)even);
            _mm512_store_si512(out + 32, (__m512i)odd);
        }
        tile_operands_stored();
    }
    static constexpr int64_t bytes = 64;  // a tile row
    const uint16_t* tile(int64_t kt) const { return slots + kt % ring * 512; }
    void loaded(int64_t kt) {
        if (kt + kAhead < k_tiles) unpack(kt + kAhead);
    }
};

// gemm_amx_bf16's loop on folded B tiles: 32 rows at a time against both column tiles of a chunk
// (pair_block), the row panel's first pair folding the columns as it goes, into rings when it is
// the panel's only pair, else whole, for the later pairs to reread.
// Out: BF16 (bias bf16) or F32 (bias float32). Returns 0, or -4 out of memory.
template <typename Out, int Bits, bool Offsets>
int quant_gemm_amx_folded(const uint16_t* x, int64_t m, int64_t x_stride, const QuantTileWeight& w, int64_t n,
                          const typename Out::T* bias, typename Out::T* y, int64_t y_stride) {
    const int64_t k = w.k, groups = w.groups(), tiles_per_group = w.group / 32, k_tiles = k / 32;
    const int64_t bytes = quant_tile_bytes(Bits, k);
    AmxRows a;
    if (a.init(x, m, k, x_stride) != 0) return -4;
    auto configure = [&] { configure_tiles(a.tile_rows); };
    return amx_quant_chunks(m, n, k, configure, [](int64_t, int64_t) {}, [&](AmxChunk chunk, int64_t p0, int64_t p1, uint16_t* tiles,
                                                          float(*sums)[16][16]) {
        const int64_t tile0 = chunk.tile0;
        auto make = [&](int j, uint16_t* dest, int64_t ring, int64_t n_tiles) {
            const int64_t at = (tile0 + j) * groups * kTileCols;
            return FoldAhead<Bits, Offsets>(w.q + (tile0 + j) * bytes, n_tiles, dest, ring, w.scales + at,
                                            Offsets ? w.offsets + at : nullptr, tiles_per_group);
        };
        made_tiles_panel(chunk, p0, p1, tiles, k, make, [&](int64_t r, int64_t rows, auto& b0, auto& b1) {
            pair_block(a, r, rows, chunk.nt, b0, b1, 0, k_tiles, sums);
            // + bias, rounded to bf16, masked at N: the bf16 GEMM's store.
            const StoreRow<Out> store{y + r * y_stride, y_stride, chunk.n0, n, bias};
            for (int64_t i = 0; i < rows; ++i)
                for (int j = 0; j < chunk.nt; ++j)
                    store(static_cast<int>(i), j, _mm512_load_ps(sums[(i / 16) * 2 + j][i % 16]));
        });
    });
}

}  // namespace kvflow
#endif
