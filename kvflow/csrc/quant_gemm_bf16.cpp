// Weight-only quantized GEMM with bf16 activations on AVX512-BF16.
//
// 8-bit weights: y[M, N] = x[M, K] @ bf16(dequant(W))^T (+ bias), exactly what the bf16 GEMM
// (gemm.cpp) computes on the weight dequantized in float32 and rounded to bf16 (vcvtne2ps2bf16
// reads a denormal float32 weight, below 1.2e-38, as zero where torch would round it; no real
// scale comes near that): the same tiles, the same vdpbf16ps chains, the same stores. An int8
// bf16 model is therefore bit for bit the bf16 model whose weights are the quantized ones.
// 4-bit weights run quant_int4_bf16.h, which skips the rounding of weights to bf16 (see there).
//
// Why not quant_gemm.cpp's float32 dot products: on AVX512-BF16 CPUs the bf16 GEMM runs at twice
// their arithmetic rate, and a decode step is only memory-bound if the dequantization keeps up.
// Here each thread dequantizes its chunk of 32 output columns (kNT tiles) into a bf16 tile in
// L1/L2, once per call, and every row block of x then runs the bf16 microkernel over it: prefill
// pays the dequantization once per weight (not once per token), decode streams 1 byte per weight
// instead of 2.
//
// Weights are packed once at load (kvflow_pack_quant_tiles, from QuantizedWeight's row layout)
// into the bf16 GEMM's tile order, one k pair of 16 columns per step:
//   q        [tiles][K / 2][32 elements], element e = 2 * column + (k & 1) as vdpbf16ps pairs them;
//            bits 8: one int8 per element (32 bytes a step);
//            bits 4: 32 bytes per two steps, byte e = step 2b's element e (low nibble) | step
//            2b + 1's (high nibble);
//   scales   [tiles][K / group][16] float32, one per column (zero past N);
//   offsets  the same, or null: w = q * scale + offset, a product then a sum, each rounded;
//            bits 4 always has them, stored as offset - 128 * scale (quant_int4_bf16.h).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "gemm_blocking.h"
#include "microkernel.h"
#include "quant_int4_bf16.h"

// The dequantization is q * s, then + o, rounded twice (as QuantizedWeight.dequantize and torch
// compute it), so the two must not be contracted into an FMA. GCC contracts plain vector
// arithmetic under its default -ffp-contract=fast, but never an explicitly rounded product; a
// file-wide `#pragma GCC optimize` would do it too, but it also stops the microkernel from
// being inlined here. The emulated build (-ffp-contract=off) takes the plain product.
#if defined(KVFLOW_SIMDE)
#define KVFLOW_MUL_ROUNDED(a, b) _mm512_mul_ps(a, b)
#else
#define KVFLOW_MUL_ROUNDED(a, b) _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#endif

namespace {

using kvflow::kNT;
using kvflow::kTileCols;

constexpr int64_t kPrefetchBytes = kvflow::int4::kPrefetchBytes;  // into L2, as there (measured the same way)

struct QuantTiles {
    int bits;
    const uint8_t* q;
    const float* scales;
    const float* offsets;  // may be null: zero
    int64_t group, k;
    int64_t step_bytes() const { return bits == 8 ? 32 : 16; }
    int64_t tile_bytes() const { return k / 2 * step_bytes(); }
    int64_t groups() const { return k / group; }
};

// The value of element e (column e / 2, input 2p + e % 2) of k-pair step p in a row-major
// QuantizedWeight row layout (bits 4: 32-input blocks of 16 bytes, input j low, 16 + j high).
inline int row_value(int bits, const uint8_t* q, int64_t k, int64_t col, int64_t i) {
    if (bits == 8) return reinterpret_cast<const int8_t*>(q)[col * k + i];
    const uint8_t byte = q[col * (k / 2) + (i / 32) * 16 + (i % 16)];
    return (i % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
}

#if defined(KVFLOW_AVX512BF16)
// One tile's weights, dequantized a k-pair step at a time into a vector of 32 bf16 (16 columns x
// 2 inputs, vdpbf16ps's operand). `group(g)` loads group g's scales and offsets, spread so that
// element e gets column e / 2's (lanes 0-15 are columns 0-7, lanes 16-31 columns 8-15).
template <bool Offsets>
struct TileDequant {
    const uint8_t* q;
    const float* s;
    const float* o;
    __m512 s_lo, s_hi, o_lo, o_hi;

    TileDequant(const QuantTiles& w, int64_t tile)
        : q(w.q + tile * w.tile_bytes()), s(w.scales + tile * w.groups() * 16),
          o(Offsets ? w.offsets + tile * w.groups() * 16 : nullptr) {}

    inline void group(int64_t g) {
        alignas(64) static constexpr int32_t kLow[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
        alignas(64) static constexpr int32_t kHigh[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
        const __m512i low_cols = _mm512_load_si512(kLow), high_cols = _mm512_load_si512(kHigh);
        const __m512 sg = _mm512_loadu_ps(s + g * 16);
        s_lo = _mm512_permutexvar_ps(low_cols, sg);
        s_hi = _mm512_permutexvar_ps(high_cols, sg);
        if constexpr (Offsets) {
            const __m512 og = _mm512_loadu_ps(o + g * 16);
            o_lo = _mm512_permutexvar_ps(low_cols, og);
            o_hi = _mm512_permutexvar_ps(high_cols, og);
        }
    }

    inline __m512i step(int64_t p) const {
        constexpr int64_t kStep = 32;
        // The quants are one stream over the whole weight (tiles lie back to back): ask for it
        // 16 KiB ahead, or each step waits on its load (measured: most of a decode's time).
        if ((p * kStep) % 64 == 0)
            _mm_prefetch(reinterpret_cast<const char*>(q + p * kStep + kPrefetchBytes), _MM_HINT_T1);
        const __m128i* src = reinterpret_cast<const __m128i*>(q + p * kStep);
        const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(src)), hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1));
        __m512 f_lo = KVFLOW_MUL_ROUNDED(_mm512_cvtepi32_ps(lo), s_lo),
               f_hi = KVFLOW_MUL_ROUNDED(_mm512_cvtepi32_ps(hi), s_hi);
        if constexpr (Offsets) {
            f_lo = _mm512_add_ps(f_lo, o_lo);
            f_hi = _mm512_add_ps(f_hi, o_hi);
        }
        return (__m512i)_mm512_cvtne2ps_pbh(f_hi, f_lo);  // f_lo's 16 values first
    }
};

// Dequantize one tile (16 columns x K) into the bf16 GEMM's packed tile [K/2][16][2].
template <bool Offsets>
void dequant_tile(const QuantTiles& w, int64_t tile, uint16_t* out) {
    TileDequant<Offsets> d(w, tile);
    const int64_t steps_per_group = w.group / 2;
    for (int64_t g = 0; g < w.groups(); ++g) {
        d.group(g);
        for (int64_t p = g * steps_per_group; p < (g + 1) * steps_per_group; ++p)
            _mm512_storeu_si512(out + p * 32, d.step(p));
    }
}

// Decode rows (R <= kFusedRows) against one full chunk: the kNT tiles dequantized in registers
// and multiplied at once, never stored. Each output is the same chain of vdpbf16ps over the same
// bf16 weights in the same order as dpbf16_block's, so the bits are the tile path's.
template <bool Offsets, int R, typename Store>
void fused_rows(const QuantTiles& w, int64_t tile0, const uint16_t* x, int64_t x_stride, Store& store) {
    static_assert(kNT == 2, "two tiles per chunk");
    TileDequant<Offsets> d0(w, tile0), d1(w, tile0 + 1);
    __m512 acc[R][kNT];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t steps_per_group = w.group / 2;
    for (int64_t g = 0; g < w.groups(); ++g) {
        d0.group(g);
        d1.group(g);
        for (int64_t p = g * steps_per_group; p < (g + 1) * steps_per_group; ++p) {
            const __m512bh w0 = (__m512bh)d0.step(p), w1 = (__m512bh)d1.step(p);
            for (int r = 0; r < R; ++r) {
                int32_t pair;
                std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < kNT; ++j) store(r, j, acc[r][j]);
}

constexpr int64_t kFusedRows = 8;  // up to this many rows skip the stored tile (8 x 2 accumulators fit)

// Out: bf16 (bias bf16) or float32 (bias float32): StoreRow<BF16> / StoreRow<F32>.
template <typename Out, bool Offsets>
int quant_gemm_bf16(const uint16_t* x, int64_t m, int64_t x_stride, const QuantTiles& w, int64_t n,
                    const typename Out::T* bias, typename Out::T* y, int64_t y_stride) {
    using M = kvflow::Micro<kvflow::BF16>;
    const int64_t k = w.k, tile_stride = k * kTileCols;
    int failed = 0;
#pragma omp parallel
    {
        // This thread's dequantized chunk: kNT packed bf16 tiles (not needed for decode rows).
        uint16_t* tiles = m <= kFusedRows ? nullptr
                                          : static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(kNT * tile_stride) * 2));
        if (m > kFusedRows && tiles == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
        const int64_t chunks = (n + kTileCols * kNT - 1) / (kTileCols * kNT);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t n0 = c * kTileCols * kNT, tile0 = n0 / kTileCols;
            const bool full = (n - n0 + kTileCols - 1) / kTileCols >= kNT;
            if (m <= kFusedRows && full) {
                kvflow::StoreRow<Out> store{y, y_stride, n0, n, bias};
                kvflow::with_block_rows(m, [&](auto rows) {
                    if constexpr (decltype(rows)::value <= kFusedRows)
                        fused_rows<Offsets, decltype(rows)::value>(w, tile0, x, x_stride, store);
                });
                continue;
            }
            if (m > kFusedRows && tiles == nullptr) continue;  // out of memory: `failed` is set
            uint16_t* buffer = tiles;
            std::unique_ptr<uint16_t, decltype(&std::free)> tail(nullptr, &std::free);
            if (buffer == nullptr) {  // a decode's last, partial chunk (one tile): its own buffer
                tail.reset(static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(tile_stride) * 2)));
                buffer = tail.get();
                if (buffer == nullptr) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
            }
            for (int64_t t = 0; t < (full ? kNT : 1); ++t) dequant_tile<Offsets>(w, tile0 + t, buffer + t * tile_stride);
            kvflow::for_each_row_block(m, [&](int64_t r, int64_t rows) {
                kvflow::StoreRow<Out> store{y + r * y_stride, y_stride, n0, n, bias};
                if (full)
                    M::rows<kNT>(rows, x + r * x_stride, x_stride, buffer, tile_stride, k / 2, store);
                else
                    M::rows<1>(rows, x + r * x_stride, x_stride, buffer, tile_stride, k / 2, store);
            });
        }
        std::free(tiles);
    }
    return failed ? -3 : 0;
}

// The instantiation for a weight's format.
template <typename Out>
int quant_gemm_bf16_for(const uint16_t* x, int64_t m, int64_t x_stride, const QuantTiles& w, int64_t n,
                        const typename Out::T* bias, typename Out::T* y, int64_t y_stride) {
    if (w.bits == 4) {
        if (w.offsets == nullptr) return -1;  // 4-bit tiles always carry o' = o - 128 s
        const kvflow::int4::Weight w4{w.q, w.scales, w.offsets, w.group, w.k};
        return kvflow::int4::gemm<Out>(x, m, x_stride, w4, n, bias, y, y_stride);
    }
    return w.offsets ? quant_gemm_bf16<Out, true>(x, m, x_stride, w, n, bias, y, y_stride)
                     : quant_gemm_bf16<Out, false>(x, m, x_stride, w, n, bias, y, y_stride);
}
#endif

}  // namespace

extern "C" {

int kvflow_has_quant_gemm_bf16() {
#if defined(KVFLOW_AVX512BF16)
    return 1;
#else
    return 0;
#endif
}

// Bytes of the packed quants: [ceil(N / 16)][K / 2][bits == 8 ? 32 : 16].
int64_t kvflow_quant_tiles_bytes(int bits, int64_t n, int64_t k) {
    return (n + kTileCols - 1) / kTileCols * (k / 2) * (bits == 8 ? 32 : 16);
}

// Row-major QuantizedWeight (q [N][K] int8 or [N][K/2] GGUF-order nibbles, scales/offsets
// [N][K / group]) -> the tile layout above (bits 4: offsets_out is required and receives
// offset - 128 * scale). Plain C++: runs on every machine. Returns -1 for a layout it does not
// take (K odd, a group not a whole number of k pairs or not dividing K; bits 4: K not a
// multiple of 32 or a group not of 16).
int kvflow_pack_quant_tiles(int bits, const uint8_t* q, const float* scales, const float* offsets, int64_t group,
                            int64_t n, int64_t k, uint8_t* q_out, float* scales_out, float* offsets_out) {
    if ((bits != 8 && bits != 4) || k % 2 != 0 || group <= 0 || group % 2 != 0 || k % group != 0 ||
        (bits == 4 && (k % 32 != 0 || group % 16 != 0 || offsets_out == nullptr)))
        return -1;
    const int64_t tiles = (n + kTileCols - 1) / kTileCols, groups = k / group;
#pragma omp parallel for
    for (int64_t tile = 0; tile < tiles; ++tile) {
        uint8_t* dst = q_out + tile * (k / 2) * (bits == 8 ? 32 : 16);
        auto value = [&](int64_t p, int64_t e) {  // element e of k-pair step p
            const int64_t col = tile * kTileCols + e / 2, i = 2 * p + e % 2;
            return col < n ? row_value(bits, q, k, col, i) : 0;
        };
        if (bits == 8) {
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
                scales_out[at] = scale;
                if (offsets_out) offsets_out[at] = bits == 4 ? offset - 128.f * scale : offset;
            }
    }
    return 0;
}

// out_dtype 1: y bf16, bias bf16 (or null); 0: y float32, bias float32 (the LM head's logits).
// Returns 0, -2 without AVX512-BF16, -3 out of memory.
int kvflow_quant_gemm_bf16(int out_dtype, const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, int bits,
                           const uint8_t* q, const float* scales, const float* offsets, int64_t group, int64_t n,
                           const void* bias, void* y, int64_t y_stride) {
#if defined(KVFLOW_AVX512BF16)
    if (m == 0) return 0;
    const QuantTiles w{bits, q, scales, offsets, group, k};
    if (out_dtype == 1)
        return quant_gemm_bf16_for<kvflow::BF16>(x, m, x_stride, w, n, static_cast<const uint16_t*>(bias),
                                             static_cast<uint16_t*>(y), y_stride);
    return quant_gemm_bf16_for<kvflow::F32>(x, m, x_stride, w, n, static_cast<const float*>(bias),
                                        static_cast<float*>(y), y_stride);
#else
    (void)out_dtype; (void)x; (void)m; (void)k; (void)x_stride; (void)bits; (void)q; (void)scales; (void)offsets;
    (void)group; (void)n; (void)bias; (void)y; (void)y_stride;
    return -2;
#endif
}

}  // extern "C"
