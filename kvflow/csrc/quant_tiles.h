// The quantized tiles' layouts (kvflow_pack_quant_tiles in quant_pack.cpp) and the weight record
// every quantized tile kernel reads: AVX-512 (quant_gemm_bf16.cpp), AMX (quant_gemm_amx*.h) and
// AVX2 (quant_gemm_avx2.h).
#pragma once

#include <cstdint>

#include "gemm_blocking.h"

namespace kvflow {

// How the quants of a tile are ordered (kvflow_pack_quant_tiles): in k-pair steps as the bf16
// GEMM's B tiles (every kernel), or, 4 bits only, as rows of AMX A tiles (quant_gemm_amx_rows.h),
// with float32 scales and offsets beside them or, where both are float16 values, inside the
// quant stream as float16 (kQuantAmxRowsHalf: a sixth fewer bytes at groups of 32, one stream).
// kQuantPairsHalf is kQuantPairs with the scales and offsets beside it as float16 bits in the
// same [tiles][groups][16] order (the AVX512-BF16 and AVX2 + F16C kernels, on CPUs without AMX:
// 4-bit groups of 32 stream a sixth fewer bytes, and a float16 value widens to float32 exactly).
constexpr int kQuantPairs = 0;
constexpr int kQuantAmxRows = 1;
constexpr int kQuantAmxRowsHalf = 2;
constexpr int kQuantPairsHalf = 3;

// A quantized weight in tiles (kvflow_pack_quant_tiles): quants, per-group scales and offsets.
struct QuantTileWeight {
    int bits;
    const uint8_t* q;
    const float* scales;   // [tiles][groups][16] (kQuantPairsHalf: float16 bits, read through half())
    const float* offsets;  // o (quant_gemm_bf16.cpp), the same shape, or null
    int64_t group, k;
    int layout = kQuantPairs;
    int64_t groups() const { return k / group; }
    // kQuantPairsHalf's scales or offsets as what they hold: float16 bits.
    static const uint16_t* half(const float* p) { return reinterpret_cast<const uint16_t*>(p); }
};

// Bytes of one tile's quants: 16 columns x k inputs.
inline int64_t quant_tile_bytes(int bits, int64_t k) { return k * kTileCols * bits / 8; }

// kQuantAmxRowsHalf: per column tile and group, the 16 columns' float16 scales (32 bytes), their
// offsets (32 bytes), then the group's k tiles of quants (256 bytes each).
inline int64_t half_rows_group_bytes(int64_t group) { return 64 + group * kTileCols / 2; }

// Bytes of one tile in `layout`: quants, and in kQuantAmxRowsHalf the scales and offsets too.
inline int64_t quant_tile_bytes(int bits, int64_t k, int layout, int64_t group) {
    return layout == kQuantAmxRowsHalf ? k / group * half_rows_group_bytes(group) : quant_tile_bytes(bits, k);
}

}  // namespace kvflow
