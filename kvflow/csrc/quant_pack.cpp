// Packing a quantized weight into the tiles the vector and AMX kernels read (quant_gemm_bf16.cpp
// describes the layouts), and which layout a weight gets on this machine. Plain C++: packing runs
// on every machine, whatever the kernels built.
#include <cstdint>
#include <cstring>

#include "gemm_blocking.h"
#include "quant_gemm_amx.h"
#include "quant_tiles.h"

namespace {

using kvflow::kTileCols;
using kvflow::quant_tile_bytes;

// f's IEEE float16 bits if f is a float16 value (zero, normal or subnormal), else -1. Plain
// integer work: the packing runs on every machine.
int32_t float16_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const int32_t sign = static_cast<int32_t>(u >> 16 & 0x8000), exponent = static_cast<int32_t>(u >> 23 & 0xFF) - 127;
    const uint32_t significand = u & 0x7FFFFF;
    if ((u & 0x7FFFFFFF) == 0) return sign;
    if (exponent > 15 || exponent < -24) return -1;  // too large (or inf/NaN), or under the least subnormal
    if (exponent >= -14) return significand & 0x1FFF ? -1 : sign | (exponent + 15) << 10 | significand >> 13;
    const uint32_t full = significand | 0x800000, shift = static_cast<uint32_t>(-exponent - 1);  // subnormal
    return full & ((1u << shift) - 1) ? -1 : sign | static_cast<int32_t>(full >> shift);
}

// The value of element e (column e / 2, input 2p + e % 2) of k-pair step p in a row-major
// QuantizedWeight row layout (bits 4: 32-input blocks of 16 bytes, input j low, 16 + j high).
inline int row_value(int bits, const uint8_t* q, int64_t k, int64_t col, int64_t i) {
    if (bits == 8) return reinterpret_cast<const int8_t*>(q)[col * k + i];
    const uint8_t byte = q[col * (k / 2) + (i / 32) * 16 + (i % 16)];
    return (i % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
}

}  // namespace

extern "C" {

// Bytes of the packed quants: ceil(N / 16) tiles of 16 x K values (kQuantAmxRowsHalf: with
// their scales and offsets).
int64_t kvflow_quant_tiles_bytes(int bits, int layout, int64_t group, int64_t n, int64_t k) {
    return (n + kTileCols - 1) / kTileCols * quant_tile_bytes(bits, k, layout, group);
}

// The layout to pack a weight in for the kernels as they are now: for 4-bit weights whose groups
// are under kBlockedGroupTiles whole k tiles while AMX runs the GEMMs, kQuantAmxRowsHalf when
// `half_scales` (every scale and offset is a float16 value), else kQuantAmxRows; else, where
// the CPU has AMX at all, kQuantPairs (the AMX kernels read float32 scales, and a weight packed
// with AMX switched off still runs on it once it is on); else, on AVX512-BF16 or AVX2 with F16C,
// kQuantPairsHalf when `half_scales`; else kQuantPairs.
int kvflow_quant_tiles_layout(int bits, int64_t group, int64_t k, int half_scales) {
#if defined(KVFLOW_AMX)
    if (kvflow::amx_enabled() && bits == 4 && group > 0 && group % 32 == 0 && k % group == 0 &&
        group / 32 < kvflow::kBlockedGroupTiles)
        return half_scales ? kvflow::kQuantAmxRowsHalf : kvflow::kQuantAmxRows;
    if (kvflow::amx_permitted()) return kvflow::kQuantPairs;
#endif
#if defined(KVFLOW_AVX512BF16) || defined(KVFLOW_AVX2_F16C)
    if (half_scales) return kvflow::kQuantPairsHalf;
#endif
    (void)bits, (void)group, (void)k, (void)half_scales;
    return kvflow::kQuantPairs;
}

// Row-major QuantizedWeight (q [N][K] int8 or [N][K/2] GGUF-order nibbles, scales/offsets
// [N][K / group]) -> the tile layout above (bits 4: offsets_out is required, zeros for none;
// kQuantAmxRowsHalf: neither is written, q_out holds the scales and offsets; kQuantPairsHalf:
// they are float16 bits). Plain C++: runs on every machine. Returns -1 for a layout it does not
// take (a group not a multiple of 4 or not dividing K; bits 4: K not a multiple of 32; the AMX
// row layouts: not 4 bits in groups of whole k tiles; the float16 layouts: a scale or offset that
// is not a float16 value).
int kvflow_pack_quant_tiles(int bits, int layout, const uint8_t* q, const float* scales, const float* offsets,
                            int64_t group, int64_t n, int64_t k, uint8_t* q_out, void* scales_out,
                            void* offsets_out) {
    const bool half = layout == kvflow::kQuantAmxRowsHalf, rows = half || layout == kvflow::kQuantAmxRows;
    const bool pairs_half = layout == kvflow::kQuantPairsHalf;
    if ((bits != 8 && bits != 4) || group <= 0 || group % 4 != 0 || k % group != 0 ||
        (bits == 4 && (k % 32 != 0 || (offsets_out == nullptr && !half))) ||
        (layout != kvflow::kQuantPairs && !pairs_half && !rows) || (rows && (bits != 4 || group % 32 != 0)))
        return -1;
    const int64_t tiles = (n + kTileCols - 1) / kTileCols, groups = k / group;
    if (half || pairs_half)
        for (int64_t i = 0; i < n * groups; ++i)
            if (float16_bits(scales[i]) < 0 || float16_bits(offsets ? offsets[i] : 0.f) < 0) return -1;
#pragma omp parallel for
    for (int64_t tile = 0; tile < tiles; ++tile) {
        uint8_t* dst = q_out + tile * quant_tile_bytes(bits, k, layout, group);
        auto value = [&](int64_t p, int64_t e) {  // element e of k-pair step p
            const int64_t col = tile * kTileCols + e / 2, i = 2 * p + e % 2;
            return col < n ? row_value(bits, q, k, col, i) : 0;
        };
        auto nibble = [&](int64_t col, int64_t i) { return col < n ? row_value(4, q, k, col, i) : 0; };
        if (rows) {  // k tile, row pair p, byte i: column 2p's input i | 2p + 1's << 4
            for (int64_t kt = 0; kt < k / 32; ++kt) {
                const int64_t g = kt * 32 / group;
                uint8_t* at = dst + kt * 256;
                if (half) {  // the group's block: scales, offsets (written at its first k tile), then its k tiles
                    uint8_t* block = dst + g * kvflow::half_rows_group_bytes(group);
                    at = block + 64 + (kt * 32 % group) / 32 * 256;
                    for (int64_t lane = 0; kt * 32 % group == 0 && lane < kTileCols; ++lane) {
                        const int64_t col = tile * kTileCols + lane;
                        const auto s = static_cast<uint16_t>(col < n ? float16_bits(scales[col * groups + g]) : 0);
                        const auto o = static_cast<uint16_t>(
                            col < n && offsets ? float16_bits(offsets[col * groups + g]) : 0);
                        std::memcpy(block + 2 * lane, &s, 2);
                        std::memcpy(block + 32 + 2 * lane, &o, 2);
                    }
                }
                for (int64_t p = 0; p < 8; ++p)
                    for (int64_t i = 0; i < 32; ++i) {
                        const int64_t col = tile * kTileCols + 2 * p;
                        at[p * 32 + i] = static_cast<uint8_t>(nibble(col, kt * 32 + i) | nibble(col + 1, kt * 32 + i) << 4);
                    }
            }
            if (half) continue;
        } else if (bits == 8) {
            for (int64_t p = 0; p < k / 2; ++p)
                for (int64_t e = 0; e < 32; ++e) dst[p * 32 + e] = static_cast<uint8_t>(static_cast<int8_t>(value(p, e)));
        } else {
            for (int64_t b = 0; b < k / 4; ++b)
                for (int64_t e = 0; e < 32; ++e)
                    dst[b * 32 + e] = static_cast<uint8_t>(value(2 * b, e) | value(2 * b + 1, e) << 4);
        }
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t lane = 0; lane < kTileCols; ++lane) {
                const int64_t col = tile * kTileCols + lane, at = (tile * groups + g) * kTileCols + lane;
                const float scale = col < n ? scales[col * groups + g] : 0.f;
                const float offset = col < n && offsets ? offsets[col * groups + g] : 0.f;
                if (pairs_half) {  // checked above: both are float16 values
                    static_cast<uint16_t*>(scales_out)[at] = static_cast<uint16_t>(float16_bits(scale));
                    if (offsets_out) static_cast<uint16_t*>(offsets_out)[at] = static_cast<uint16_t>(float16_bits(offset));
                } else {
                    static_cast<float*>(scales_out)[at] = scale;
                    if (offsets_out) static_cast<float*>(offsets_out)[at] = offset;
                }
            }
    }
    return 0;
}

}  // extern "C"
