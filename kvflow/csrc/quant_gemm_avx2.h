// Quantized tiles (quant_gemm_bf16.cpp's layout) on CPUs with AVX2 and FMA but no AVX512-BF16:
// the same packed weights, each output summed in the AVX-512 kernel's order, so the same bits.
//
// vdpbf16ps adds a k-pair's odd product, then its even one, each product exact (a bf16 times an
// integer of at most 8 significant bits) and each sum rounded once, denormals flushed: here two
// FMAs under DAZ/FTZ on the integer as float32. A 4-bit integer is 128 + q, as on AVX-512, whose
// float32 bits are 0x43000000 | q << 16: one vpshufb away from the masked nibbles (Avx2Unpack<4>).
// Each group's scale and offset FMAs follow in the AVX-512 kernel's order, without DAZ/FTZ.
//
// Below kAvx2QuantWidenFrom rows (decode), row blocks unpack the quants in registers: the weights
// stream from memory once, at 0.5 or 1 byte each. From there on (prefill), each thread unpacks
// its chunk's tiles once into float32 [k][16], each k-pair's odd k first, and every row block
// runs plain FMAs over them, x widened in the same order (gemm_avx2.h does this for bf16).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "gemm_avx2.h"
#include "gemm_blocking.h"
#include "quant_tiles.h"

#if defined(KVFLOW_AVX2_GEMM)
namespace kvflow {

constexpr int64_t kAvx2QuantWidenFrom = 16;
constexpr int kAvx2QuantRows = 4;         // register unpacking: 8 accumulators, 4 operands, 3 constants
constexpr int kAvx2QuantStoredRows = 6;   // stored tiles: 12 accumulators, 2 operands, 1 broadcast
constexpr int64_t kAvx2QuantPrefetch = 16384;  // ahead in the quant stream, into L2 (as on AVX-512)

// Half h (8 columns) of a tile's two k-pair steps 2b, 2b + 1 as float32 operands:
// v = {step 2b's odd k, its even k, step 2b + 1's odd k, its even k}.
template <int Bits>
struct Avx2Unpack;

template <>
struct Avx2Unpack<4> {
    static constexpr int64_t kBytes = 32;  // the two steps of all 16 columns
    // Half h's 16 bytes (column c's even-k byte at 2c, its odd-k byte at 2c + 1; each byte holds
    // step 2b in its low nibble and step 2b + 1 in its high one) sit in both 128-bit halves, so
    // that vpshufb, which picks within a half, can put a nibble in byte 2 and 0x43 in byte 3 of
    // every 32-bit lane: the float32 0x43000000 | q << 16. Lanes 0-3 (columns 0-3) read bytes
    // 0-7 of the low half and lanes 4-7 bytes 8-15 of the high one; 0x43 goes in a byte each half
    // leaves unread (8 and 0). 9 operations per 8 columns x 4 steps, where widening the bytes to
    // words and masking and shifting them into place took 12.
    static inline void block(const uint8_t* src, int h, __m256 (&v)[4]) {
        const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * h)));
        const __m256i mask = _mm256_setr_epi8(15, 15, 15, 15, 15, 15, 15, 15, 0, 15, 15, 15, 15, 15, 15, 15,
                                              0, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15);
        const __m256i magic = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0x43, 0, 0, 0, 0, 0, 0, 0,
                                               0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        constexpr char z = -128;  // vpshufb writes zero
        const __m256i odd = _mm256_setr_epi8(z, z, 1, 8, z, z, 3, 8, z, z, 5, 8, z, z, 7, 8,
                                             z, z, 9, 0, z, z, 11, 0, z, z, 13, 0, z, z, 15, 0);
        const __m256i even = _mm256_setr_epi8(z, z, 0, 8, z, z, 2, 8, z, z, 4, 8, z, z, 6, 8,
                                              z, z, 8, 0, z, z, 10, 0, z, z, 12, 0, z, z, 14, 0);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(bytes, mask), magic);
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask), magic);
        v[0] = _mm256_castsi256_ps(_mm256_shuffle_epi8(lo, odd));  // step 2b, odd k
        v[1] = _mm256_castsi256_ps(_mm256_shuffle_epi8(lo, even));
        v[2] = _mm256_castsi256_ps(_mm256_shuffle_epi8(hi, odd));  // step 2b + 1
        v[3] = _mm256_castsi256_ps(_mm256_shuffle_epi8(hi, even));
    }
};

template <>
struct Avx2Unpack<8> {
    static constexpr int64_t kBytes = 64;
    // One step's half: 32-bit lane c holds column c's even-k int8 in bits 0-15, odd in 16-31.
    static inline void step(const uint8_t* src, __m256& odd, __m256& even) {
        const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
        odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(w, 16));
        even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 16), 16));
    }
    static inline void block(const uint8_t* src, int h, __m256 (&v)[4]) {
        step(src + 16 * h, v[0], v[1]);
        step(src + 32 + 16 * h, v[2], v[3]);
    }
};

// A tile's quants from memory, unpacked in registers (decode rows).
template <int Bits>
struct Avx2PackedQuants {
    const uint8_t* q;  // the block's first tile
    int64_t tile_bytes;
    inline void get(int j, int h, int64_t b, __m256 (&v)[4]) const {
        const uint8_t* src = q + j * tile_bytes + b * Avx2Unpack<Bits>::kBytes;
        if (h == 0 && (Bits == 8 || (b & 1) == 0))  // one hint per 64 bytes of the stream
            _mm_prefetch(reinterpret_cast<const char*>(src + kAvx2QuantPrefetch), _MM_HINT_T1);
        Avx2Unpack<Bits>::block(src, h, v);
    }
};

// One tile's quants as float32 [k][16] in Avx2StoredDots' order (odd k of each pair first).
template <int Bits>
inline void avx2_unpack_tile(const uint8_t* q, int64_t k, float* out) {
    for (int64_t b = 0; b < k / 4; ++b) {
        const uint8_t* src = q + b * Avx2Unpack<Bits>::kBytes;
        if (Bits == 8 || (b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kAvx2QuantPrefetch), _MM_HINT_T1);
        for (int h = 0; h < 2; ++h) {
            __m256 v[4];
            Avx2Unpack<Bits>::block(src, h, v);
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 64 * b + 16 * i + 8 * h, v[i]);
        }
    }
}

// quant_gemm_bf16.cpp's group_sum (x's group summed in float32) in the same order: lane l of 16
// sums x[i + l] for i in steps of 16 (two vectors of 8 lanes), then common.h's reduce_add16 order.
inline float avx2_group_sum(const uint16_t* x, int64_t group) {
    float lane[16] = {};
    if (group % 16 == 0) {
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int64_t i = 0; i < group; i += 16) {
            lo = _mm256_add_ps(lo, load8(x + i));
            hi = _mm256_add_ps(hi, load8(x + i + 8));
        }
        _mm256_storeu_ps(lane, lo);
        _mm256_storeu_ps(lane + 8, hi);
    } else {
        for (int64_t i = 0; i < group; i += 16)
            for (int64_t l = 0; l < 16 && i + l < group; ++l) lane[l] += bf16_to_float(x[i + l]);
    }
    float h[8], q[4];
    for (int i = 0; i < 8; ++i) h[i] = lane[i] + lane[i + 8];
    for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
    return (q[0] + q[2]) + (q[1] + q[3]);
}

// A block's scales or offsets from its first tile's: float32, or (Half, kQuantPairsHalf) float16
// bits, which F16C widens to float32 exactly, so either layout gives the same bits.
template <bool Half>
struct Avx2Factors {
    const char* base;
    Avx2Factors(const float* tiles, int64_t at)
        : base(tiles != nullptr ? reinterpret_cast<const char*>(tiles) + at * (Half ? 2 : 4) : nullptr) {}
    const char* at(int64_t i) const { return base + i * (Half ? 2 : 4); }
    inline __m256 load(int64_t i) const {
        if constexpr (Half)
            return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at(i))));
        else
            return _mm256_loadu_ps(reinterpret_cast<const float*>(at(i)));
    }
};

// MT rows x NT tiles: `group_dots(g, acc)` sets acc to group g's dot products (the rows' x
// against the tiles' integers), `sums` are the rows' group sums ([rows][groups]), `scales` and
// `offsets` the block's first tile's. The dot products run under DAZ/FTZ, kGroupBatch groups at
// a time, into memory; the scale and offset FMAs then run without, as on AVX-512 (where only
// vdpbf16ps flushes), so a row of tiny activations gives the same bits too.
constexpr int64_t kGroupBatch = 16;

template <int MT, int NT, bool Offsets, bool Half, typename GroupDots, typename T>
inline void avx2_quant_block(int bits, int64_t groups, const float* sums, Avx2Factors<Half> scales,
                             Avx2Factors<Half> offsets, GroupDots group_dots, const T* bias, T* y, int64_t y_stride, int64_t cols) {
    alignas(32) float out[MT][2 * NT][8] = {};
    alignas(32) float dots[kGroupBatch][MT][2 * NT][8];
    for (int64_t g0 = 0; g0 < groups; g0 += kGroupBatch) {
        const int64_t batch = std::min(kGroupBatch, groups - g0);
        {
            const FlushDenormals flush;
            for (int64_t g = g0; g < g0 + batch; ++g) {
                __m256 acc[MT][2 * NT];
#pragma GCC unroll 16
                for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
                    for (int i = 0; i < 2 * NT; ++i) acc[m][i] = _mm256_setzero_ps();
                group_dots(g, acc);
#pragma GCC unroll 16
                for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
                    for (int i = 0; i < 2 * NT; ++i) _mm256_store_ps(dots[g - g0][m][i], acc[m][i]);
            }
        }
        // Each output vector's running sum stays in a register across the batch's groups: the
        // same FMAs in the same order per element, without a load and a store per group (on Zen 1
        // a 256-bit store takes two cycles).
        for (int i = 0; i < 2 * NT; ++i) {
            __m256 o[MT];
#pragma GCC unroll 16
            for (int m = 0; m < MT; ++m) o[m] = _mm256_load_ps(out[m][i]);
            for (int64_t g = g0; g < g0 + batch; ++g) {
                const int64_t at = ((i / 2) * groups + g) * kTileCols + 8 * (i % 2);
                // Scales and offsets are two more streams (4 bits, groups of 32: half the quants'
                // bytes), asked for ahead as on AVX-512.
                _mm_prefetch(scales.at(at + 2048), _MM_HINT_T1);
                if constexpr (Offsets) _mm_prefetch(offsets.at(at + 2048), _MM_HINT_T1);
                const __m256 s = scales.load(at);
                // o' (quant_gemm_bf16.cpp): o - 128 s for 4 bits, one rounding as on AVX-512.
                __m256 o_prime = _mm256_setzero_ps();
                if constexpr (Offsets) {
                    o_prime = offsets.load(at);
                    if (bits == 4) o_prime = _mm256_fnmadd_ps(_mm256_set1_ps(128.f), s, o_prime);
                }
#pragma GCC unroll 16
                for (int m = 0; m < MT; ++m) {
                    o[m] = _mm256_fmadd_ps(_mm256_load_ps(dots[g - g0][m][i]), s, o[m]);
                    if constexpr (Offsets)
                        o[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(sums + m * groups + g), o_prime, o[m]);
                }
            }
#pragma GCC unroll 16
            for (int m = 0; m < MT; ++m) _mm256_store_ps(out[m][i], o[m]);
        }
    }
    avx2_store_rows(&out[0][0][0], MT, 16 * NT, bias, y, y_stride, cols);  // bias and rounding: no DAZ either
}

// Group g's dot products of MT rows of `wide` (k floats each, pairs odd first) with NT tiles
// unpacked in registers from `src`: per 4 inputs, each half-tile's 4 operand vectors, then the rows.
template <int MT, int NT, int Bits>
struct Avx2RegisterDots {
    const float* wide;
    int64_t k, blocks_per_group;
    Avx2PackedQuants<Bits> src;
    inline void operator()(int64_t g, __m256 (&acc)[MT][2 * NT]) const {
        for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
#pragma GCC unroll 8
            for (int i = 0; i < 2 * NT; ++i) {
                __m256 v[4];
                src.get(i / 2, i % 2, b, v);
#pragma GCC unroll 16
                for (int m = 0; m < MT; ++m) {
                    const float* xm = wide + m * k + 4 * b;  // x[4b + 1], x[4b], x[4b + 3], x[4b + 2]
#pragma GCC unroll 4
                    for (int t = 0; t < 4; ++t) acc[m][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + t), v[t], acc[m][i]);
                }
            }
        }
    }
};

// The same over one tile unpacked into float32 [k][16] (avx2_unpack_tile): per input, the two
// half-tile vectors and one broadcast per row, as gemm_avx2.h's float32 block.
template <int MT>
struct Avx2StoredDots {
    const float* wide;
    int64_t k, group;
    const float* tile;
    inline void operator()(int64_t g, __m256 (&acc)[MT][2]) const {
        for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
            const float* src = tile + kk * kTileCols;
            _mm_prefetch(reinterpret_cast<const char*>(src) + kAvx2PrefetchBytes, _MM_HINT_T0);
            const __m256 w0 = _mm256_loadu_ps(src), w1 = _mm256_loadu_ps(src + 8);
#pragma GCC unroll 16
            for (int m = 0; m < MT; ++m) {
                const __m256 xb = _mm256_broadcast_ss(wide + m * k + kk);
                acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
            }
        }
    }
};

// y[M, N] = x @ dequant(W)^T (+ bias), x bf16; T: the output's dtype (bf16 bits or float32).
// Half: kQuantPairsHalf (needs F16C). Returns 0, or -4 (out of memory).
template <typename T, int Bits, bool Offsets, bool Half = false>
int quant_gemm_avx2(const uint16_t* x, int64_t m, int64_t x_stride, const QuantTileWeight& w, int64_t n,
                    const T* bias, T* y, int64_t y_stride) {
    const int64_t k = w.k, groups = w.groups(), tile_bytes = quant_tile_bytes(Bits, k);
    float* wide = scratch_floats(m * k);
    float* sums = Offsets ? scratch_floats<2>(m * groups) : nullptr;
    if (wide == nullptr || (Offsets && sums == nullptr)) return -4;
#pragma omp parallel for schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; ++r) {
        avx2_widen_rows(x + r * x_stride, x_stride, 1, k, wide + r * k, /*odd_first=*/true);
        if constexpr (Offsets)
            for (int64_t g = 0; g < groups; ++g) sums[r * groups + g] = avx2_group_sum(x + r * x_stride + g * w.group, w.group);
    }
    const bool stored = m >= kAvx2QuantWidenFrom;
    std::atomic<bool> out_of_memory{false};
    for_each_chunk(n, [&](int64_t n0, bool full) {
        const int64_t tile0 = n0 / kTileCols, tiles = std::min<int64_t>(kNT, (n - n0 + kTileCols - 1) / kTileCols);
        // A block of rows r.. x NT tiles from tile t of the chunk, its dot products from `dots`.
        auto block = [&](auto mt, auto nt, int64_t r, int64_t t, const auto& dots) {
            constexpr int MT = decltype(mt)::value, NT = decltype(nt)::value;
            const int64_t col = n0 + t * kTileCols, cols = std::min<int64_t>(NT * kTileCols, n - col);
            const int64_t at = (tile0 + t) * groups * kTileCols;
            avx2_quant_block<MT, NT, Offsets, Half>(Bits, groups, Offsets ? sums + r * groups : nullptr,
                                                    {w.scales, at}, {w.offsets, at}, dots,
                                              bias != nullptr ? bias + col : nullptr, y + r * y_stride + col, y_stride,
                                              cols);
        };
        if (stored) {
            float* buffer = scratch_floats<1>(kNT * k * kTileCols);
            if (buffer == nullptr) return out_of_memory.store(true);
            for (int64_t t = 0; t < tiles; ++t)
                avx2_unpack_tile<Bits>(w.q + (tile0 + t) * tile_bytes, k, buffer + t * k * kTileCols);
            for_each_row_block(m, [&](int64_t r, int64_t rows) {
                with_block_rows<kAvx2QuantStoredRows>(rows, [&](auto mt) {
                    constexpr int MT = decltype(mt)::value;
                    for (int64_t t = 0; t < tiles; ++t)
                        block(mt, std::integral_constant<int, 1>{}, r, t,
                              Avx2StoredDots<MT>{wide + r * k, k, w.group, buffer + t * k * kTileCols});
                });
            }, kAvx2QuantStoredRows);
            return;
        }
        for_each_row_block(m, [&](int64_t r, int64_t rows) {
            with_block_rows<kAvx2QuantRows>(rows, [&](auto mt) {
                constexpr int MT = decltype(mt)::value;
                if constexpr (MT <= kAvx2WideRows) {
                    if (full)
                        return block(mt, std::integral_constant<int, kNT>{}, r, 0,
                                     Avx2RegisterDots<MT, kNT, Bits>{wide + r * k, k, w.group / 4,
                                                                     {w.q + tile0 * tile_bytes, tile_bytes}});
                }
                for (int64_t t = 0; t < tiles; ++t)
                    block(mt, std::integral_constant<int, 1>{}, r, t,
                          Avx2RegisterDots<MT, 1, Bits>{wide + r * k, k, w.group / 4,
                                                        {w.q + (tile0 + t) * tile_bytes, tile_bytes}});
            });
        }, kAvx2QuantRows);
    });
    return out_of_memory ? -4 : 0;
}

}  // namespace kvflow
#endif
