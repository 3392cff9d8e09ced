// Weight-only quantized GEMM with bf16 activations on AVX512-BF16:
//
//     y[m, n] = sum over groups g of  s[g, n] * A[m, g, n] + o'[g, n] * X[m, g]   (+ bias)
//     A[m, g, n] = sum_{k in g} x[m, k] * v[k, n]     vdpbf16ps chains, float32
//     X[m, g]    = sum_{k in g} x[m, k]               float32 (group_sum), only with offsets
//
// which is sum_k x[m, k] * (q[k, n] * s + o) in float32, group by group: the weights are the
// exact dequantized ones, never rounded to bf16. v is the integer as a bf16 (exact: 8 bits fit
// its significand): for int8, v = q and o' = o; for 4 bits, v = 128 + q, whose bf16 bits are
// 0x4300 | q, and o' = o - 128 s (integer_offset: one rounding, 128 s being exact). So a 4-bit
// weight becomes vdpbf16ps's operand in one bitwise operation and an int8 one in 2.5
// (sign-extend, convert, pack), where dequantizing it in float32 and rounding it to bf16 (this
// kernel's first version) took ~11 and ~7: that made decode compute-bound, no faster than bf16
// for 4 bits. The cost is the group's scale and offset, two FMAs per 16 columns and group:
// ~12 % more FMA work than the bf16 GEMM at groups of 32, nothing at one group per row
// (kvflow's int8).
//
// Every row's result is the same chain of operations whatever M is and whichever path runs it
// (quants unpacked in registers for up to kUnpackedRows rows, or unpacked once per call into a
// tile in L1/L2 that every row block then reads): batch-invariant.
//
// On CPUs with AVX2 and FMA but no AVX512-BF16, quant_gemm_avx2.h runs the same sums in the
// same order on the same packed tiles (vdpbf16ps as two FMAs under DAZ/FTZ): the same bits.
//
// Why not quant_gemm.cpp's float32 dot products: on AVX512-BF16 CPUs vdpbf16ps does twice their
// arithmetic per instruction, and a decode step is only memory-bound if the unpacking keeps up.
//
// Weights are packed once at load (kvflow_pack_quant_tiles, from QuantizedWeight's row layout)
// into the bf16 GEMM's tile order (gemm_blocking.h), 16 columns a tile, k in pairs:
//   q        [tiles][...], element e = 2 * column + (k & 1) of a k-pair step as vdpbf16ps pairs them;
//            bits 8: 32 bytes a step, one int8 per element;
//            bits 4: 32 bytes per two steps: byte e = step 2b's element e (low nibble) | step
//            2b + 1's (high nibble);
//   scales   [tiles][K / group][16] float32, one per column (zero past N);
//   offsets  the same for o, the weight's own offset, or null for none (bits 8 only). o, not o',
//            because on AMX groups of under 256 inputs multiply the dequantized weights
//            themselves (quant_gemm_amx_folded.h), q * s + o rounded as the reference rounds it.
// That is layout 0 (kQuantPairs). On AMX, 4-bit weights with such groups are packed in layout 1
// (kQuantAmxRows, quant_gemm_amx_rows.h) or, scales and offsets being float16 values, in layout 2
// (kQuantAmxRowsHalf, the same with them as float16 in the quant stream), which only that kernel
// reads. Layout 3 (kQuantPairsHalf) is layout 0 with float16 scales and offsets, for this kernel
// and quant_gemm_avx2.h's on CPUs without AMX.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>

#include "gemm_blocking.h"
#include "quant_gemm_amx_folded.h"
#include "quant_gemm_amx_rows.h"
#include "quant_gemm_avx2.h"
#include "quant_unpack.h"

namespace {

using kvflow::kNT;
using kvflow::kTileCols;
using kvflow::quant_tile_bytes;
using Weight = kvflow::QuantTileWeight;

#if defined(KVFLOW_AVX512BF16)
using kvflow::group_sum;
using kvflow::kPrefetchBytes;
using kvflow::store_tile;
using kvflow::Unpack;

// Rows per block that unpack the quants in registers: as many as the bf16 GEMM's blocks take, so
// that 9-24 rows unpack each quant once or twice, not two or three times (in cache, two threads,
// 1,536 x 576 on CPU family 26, 8 -> 12: int8 at 9-12 rows 52-97 -> 30-37 us, at 17-24 rows 70-111
// -> 49-67 us; int4 0-15 % faster).
constexpr int64_t kRegisterRows = kvflow::kMaxBlockRows;
// Up to this many rows, blocks of kRegisterRows unpack the chunk's quants again (from L1) rather
// than one unpacked tile being stored and read back: in cache, single thread, 512 x 576, int4
// M=16 29.8 -> 25.9 us, M=32 55.5 -> 50.1 us; from 64 rows on the two are even. An int8 quant
// takes 2.5 operations to unpack against 4 bits' one, so int8 stores its tile from 25 rows (the
// 120 linears from memory, two threads, CPU family 26, three alternations: 28 rows 11.5-12.0 ->
// 10.4-11.2 ms, 32 rows 12.0-14.2 -> 11.2-11.8; 4 bits at 25 rows were 20-40 % slower so).
template <int Bits>
constexpr int64_t kUnpackedRows = Bits == 8 ? 24 : 32;
// Up to this many rows, kQuantPairsHalf's blocks widen their float16 factors themselves
// (quant_gemm_bf16 below says why).
constexpr int64_t kHalfInBlockRows = 8;

// How far ahead decode rows ask for the quant stream: twice the stored-tile path's
// kPrefetchBytes. The 120 linears from memory, two threads, family 26, two alternations: int8 at
// one row 3.75-3.97 -> 3.29-3.52 ms (8 KiB: 5.7-7.1, 64 KiB: 3.5-3.7), at 12 rows 4.73-5.05 ->
// 4.43-4.62; int4 even or slightly faster.
constexpr int64_t kDecodePrefetchBytes = 2 * kPrefetchBytes;

// Where a block's operands come from: the packed quants (decode rows) ...
template <int Bits>
struct PackedQuants {
    const uint8_t* q;  // the chunk's first tile
    int64_t tile_bytes;
    inline void block(int j, int64_t b, __m512i& even, __m512i& odd) const {
        const uint8_t* src = q + j * tile_bytes + b * Unpack<Bits>::kBytes;
        // One stream over the whole weight (tiles lie back to back): a hint per 64 bytes.
        if (Bits == 8 || (b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kDecodePrefetchBytes), _MM_HINT_T1);
        Unpack<Bits>::block(src, even, odd);
    }
};

// ... or a tile unpacked once per call into memory (`store_tile`), for prefill-sized M.
template <int Bits>
struct StoredTile {
    const uint16_t* tile;
    int64_t tile_stride;  // uint16 elements between tiles
    const uint8_t* next_q;  // the next chunk's quants, asked for into L2 meanwhile; or null
    int64_t q_tile_bytes;
    inline void block(int j, int64_t b, __m512i& even, __m512i& odd) const {
        const uint16_t* src = tile + j * tile_stride + b * 64;
        if (next_q != nullptr && (Bits == 8 || (b & 1) == 0))
            _mm_prefetch(reinterpret_cast<const char*>(next_q + j * q_tile_bytes + b * Unpack<Bits>::kBytes), _MM_HINT_T1);
        // Each row block streams the tile from L2 again: into L1 4 KiB ahead, as the bf16 GEMM does.
        _mm_prefetch(reinterpret_cast<const char*>(src + 2048), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(src + 2048 + 32), _MM_HINT_T0);
        even = _mm512_loadu_si512(src);
        odd = _mm512_loadu_si512(src + 32);
    }
};

// count float16 values (a multiple of 16) widened to float32, exactly; with `next`, the count
// after them asked for into L2 meanwhile (the next chunk's).
inline void widen_half(const uint16_t* h, int64_t count, float* out, bool next) {
    for (int64_t i = 0; i < count; i += 16) {
        if (next && i % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(h + count + i), _MM_HINT_T1);
        _mm512_store_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
    }
}

// MT rows x NT tiles. `out` accumulates across groups in memory (L1), so that the group's
// MT x NT vdpbf16ps accumulators keep the registers (12 x 2 at prefill sizes).
template <int MT, int NT, bool Offsets, bool Half, typename Source, typename Store>
inline void grouped_block(const uint16_t* x, int64_t x_stride, const float* xsums, const Weight& w, int64_t tile0,
                          const Source& src, Store& store) {
    const int64_t groups = w.groups(), blocks_per_group = w.group / 4;
    const float* s = w.scales + tile0 * groups * 16;  // (not Half)
    const float* o = Offsets ? w.offsets + tile0 * groups * 16 : nullptr;
    const uint16_t* s_half = Weight::half(w.scales) + tile0 * groups * 16;  // (Half)
    const uint16_t* o_half = Offsets ? Weight::half(w.offsets) + tile0 * groups * 16 : nullptr;
    alignas(64) float out[MT][NT][16] = {};
    for (int64_t g = 0; g < groups; ++g) {
        __m512 acc[MT][NT];
        for (int m = 0; m < MT; ++m)
            for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
        for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
            __m512i even[NT], odd[NT];
            for (int j = 0; j < NT; ++j) src.block(j, b, even[j], odd[j]);
            // Step 2b for every row, then step 2b + 1: each accumulator's chain is even then odd.
            for (int m = 0; m < MT; ++m) {
                int32_t pair;  // a 4-byte load: a broadcast from memory
                std::memcpy(&pair, x + m * x_stride + 4 * b, sizeof(pair));
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, (__m512bh)even[j]);
            }
            for (int m = 0; m < MT; ++m) {
                int32_t pair;
                std::memcpy(&pair, x + m * x_stride + 4 * b + 2, sizeof(pair));
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, (__m512bh)odd[j]);
            }
        }
        for (int j = 0; j < NT; ++j) {
            // Scales and offsets are two more streams (4-bit groups of 32: half the quants'
            // bytes as float32, a quarter as float16); left to the hardware they stalled each
            // flush (single thread, 960 x 576 at one row: 24.9 -> 15.8 us with the hint, 3072 x
            // 576: 85.9 -> 50.5 us). The hints run 2,048 elements ahead, as far in time whichever
            // the width; float16 widens to float32 exactly, so both layouts give the same bits.
            __m512 sj, oj = _mm512_setzero_ps();
            if constexpr (Half) {
                const uint16_t* sh = s_half + (j * groups + g) * 16;
                const uint16_t* oh = Offsets ? o_half + (j * groups + g) * 16 : nullptr;
                _mm_prefetch(reinterpret_cast<const char*>(sh + 2048), _MM_HINT_T1);
                if constexpr (Offsets) _mm_prefetch(reinterpret_cast<const char*>(oh + 2048), _MM_HINT_T1);
                sj = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sh)));
                if constexpr (Offsets)
                    oj = kvflow::integer_offset(
                        w.bits, sj, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(oh))));
            } else {
                _mm_prefetch(reinterpret_cast<const char*>(s + (j * groups + g) * 16 + 2048), _MM_HINT_T1);
                if constexpr (Offsets) _mm_prefetch(reinterpret_cast<const char*>(o + (j * groups + g) * 16 + 2048), _MM_HINT_T1);
                sj = _mm512_loadu_ps(s + (j * groups + g) * 16);
                if constexpr (Offsets) oj = kvflow::integer_offset(w.bits, sj, _mm512_loadu_ps(o + (j * groups + g) * 16));
            }
            for (int m = 0; m < MT; ++m) {
                __m512 v = _mm512_fmadd_ps(acc[m][j], sj, _mm512_load_ps(out[m][j]));
                if constexpr (Offsets) v = _mm512_fmadd_ps(_mm512_set1_ps(xsums[m * groups + g]), oj, v);
                _mm512_store_ps(out[m][j], v);
            }
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NT; ++j) store(m, j, _mm512_load_ps(out[m][j]));
}

template <int NT, bool Offsets, bool Half, typename Source, typename Store>
inline void rows(int64_t rows, const uint16_t* x, int64_t x_stride, const float* xsums, const Weight& w, int64_t tile0,
                 const Source& src, Store& store) {
    kvflow::with_block_rows(rows, [&](auto mt) {
        grouped_block<decltype(mt)::value, NT, Offsets, Half>(x, x_stride, xsums, w, tile0, src, store);
    });
}

// Out: bf16 (bias bf16) or float32 (bias float32): StoreRow<BF16> / StoreRow<F32>.
// Half (kQuantPairsHalf): up to kHalfInBlockRows rows the blocks widen the float16 scales and
// offsets as they read them (the 120 int4 layers at one row 2.7 -> 2.1 ms: a sixth fewer bytes
// at groups of 32). Past that the registers run short (12-24 rows ran 1.3-1.4x slower so), and
// each thread widens a chunk's factors into float32 once, for all its row blocks, which then run
// the float32 layout's code itself. The same values either way: the same bits.
template <typename Out, int Bits, bool Offsets, bool Half>
int quant_gemm_bf16(const uint16_t* x, int64_t m, int64_t x_stride, const Weight& w, int64_t n,
                    const typename Out::T* bias, typename Out::T* y, int64_t y_stride) {
    const int64_t groups = w.groups(), tile_stride = w.k * kTileCols, bytes = quant_tile_bytes(Bits, w.k);
    std::unique_ptr<float[]> xsums(Offsets ? new (std::nothrow) float[static_cast<size_t>(m * groups)] : nullptr);
    if (Offsets && !xsums) return -4;  // OUT_OF_MEMORY in layers/cpu_kernels.py
    int failed = 0;
#pragma omp parallel
    {
        if constexpr (Offsets) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; ++r)
                for (int64_t g = 0; g < groups; ++g)
                    xsums[r * groups + g] = group_sum(x + r * x_stride + g * w.group, w.group);
            // (the loop's barrier: every row's sums are in place before any chunk reads them)
        }
        uint16_t* tiles = m <= kUnpackedRows<Bits>
                              ? nullptr
                              : static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(kNT * tile_stride) * 2));
        if (m > kUnpackedRows<Bits> && tiles == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
        // One chunk's scales, then its offsets, each followed by the 2,048 floats that the
        // blocks' prefetch hints run ahead, so that those land in this buffer, not on pages
        // elsewhere (unmapped ones cost a page walk each).
        const int64_t chunk_factors = kNT * groups * kTileCols + 2048;
        const bool widen = Half && m > kHalfInBlockRows;
        float* widened = widen ? static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(2 * chunk_factors) * 4))
                               : nullptr;
        if (widen && widened == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
        Weight chunk_w = w;  // widen: the chunk's factors in `widened`, its first tile as tile 0
        const int64_t chunks = (n + kTileCols * kNT - 1) / (kTileCols * kNT);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t n0 = c * kTileCols * kNT, tile0 = n0 / kTileCols;
            const bool full = (n - n0 + kTileCols - 1) / kTileCols >= kNT;
            if (widen) {
                if (widened == nullptr) continue;  // out of memory: `failed` is set
                const int64_t count = (full ? kNT : 1) * groups * kTileCols, first = tile0 * groups * kTileCols;
                const bool next = n0 + 2 * kTileCols * kNT <= n;  // this thread's next chunk, as static scheduling hands them
                widen_half(Weight::half(w.scales) + first, count, widened, next);
                if constexpr (Offsets) widen_half(Weight::half(w.offsets) + first, count, widened + chunk_factors, next);
                chunk_w.scales = widened;
                chunk_w.offsets = Offsets ? widened + chunk_factors : nullptr;
            }
            const Weight& cw = widen ? chunk_w : w;
            const int64_t factors_tile0 = widen ? 0 : tile0;
            // Rows r .. r + block_rows of this chunk, their operands from `src`.
            auto row_block = [&](const auto& src, int64_t r, int64_t block_rows) {
                kvflow::StoreRow<Out> store{y + r * y_stride, y_stride, n0, n, bias};
                const float* sums = Offsets ? xsums.get() + r * groups : nullptr;
                if constexpr (Half && std::is_same_v<std::decay_t<decltype(src)>, PackedQuants<Bits>>) {
                    if (!widen) {
                        if (full)
                            rows<kNT, Offsets, true>(block_rows, x + r * x_stride, x_stride, sums, w, tile0, src, store);
                        else
                            rows<1, Offsets, true>(block_rows, x + r * x_stride, x_stride, sums, w, tile0, src, store);
                        return;
                    }
                }
                if (full)
                    rows<kNT, Offsets, false>(block_rows, x + r * x_stride, x_stride, sums, cw, factors_tile0, src, store);
                else
                    rows<1, Offsets, false>(block_rows, x + r * x_stride, x_stride, sums, cw, factors_tile0, src, store);
            };
            if (m <= kUnpackedRows<Bits>) {  // row blocks of up to kRegisterRows, each unpacking the quants again
                const PackedQuants<Bits> src{w.q + tile0 * bytes, bytes};
                const int64_t blocks = (m + kRegisterRows - 1) / kRegisterRows;
                for (int64_t b = 0, r = 0; b < blocks; ++b) {
                    const int64_t block_rows = m / blocks + (b < m % blocks ? 1 : 0);
                    row_block(src, r, block_rows);
                    r += block_rows;
                }
                continue;
            }
            if (tiles == nullptr) continue;  // out of memory: `failed` is set
            for (int64_t t = 0; t < (full ? kNT : 1); ++t) store_tile<Bits>(w.q + (tile0 + t) * bytes, w.k, tiles + t * tile_stride);
            // The second row block also asks for the next chunk's quants, so that chunk's
            // store_tile reads L2, not memory (int8 and int4 at 128-256 rows: 4-6 % faster).
            const bool next_full = n0 + 2 * kTileCols * kNT <= n;
            const StoredTile<Bits> plain{tiles, tile_stride, nullptr, bytes};
            const StoredTile<Bits> with_next{tiles, tile_stride, next_full ? w.q + (tile0 + kNT) * bytes : nullptr, bytes};
            int64_t block_index = 0;
            kvflow::for_each_row_block(m, [&](int64_t r, int64_t block_rows) {
                row_block(block_index++ == 1 ? with_next : plain, r, block_rows);
            }, 0, kvflow::Micro<kvflow::BF16>::kPrefillRows);
        }
        std::free(tiles);
        std::free(widened);
    }
    return failed ? -4 : 0;
}
#endif

#if defined(KVFLOW_AVX512BF16) || defined(KVFLOW_AVX2_GEMM)
// The instantiation for a weight's format: this kernel on AVX512-BF16, quant_gemm_avx2.h's
// (the same bits) on other CPUs with AVX2 and FMA.
template <typename Out>
int quant_gemm_bf16_for(const uint16_t* x, int64_t m, int64_t x_stride, const Weight& w, int64_t n,
                        const typename Out::T* bias, typename Out::T* y, int64_t y_stride) {
    if (w.layout == kvflow::kQuantAmxRows || w.layout == kvflow::kQuantAmxRowsHalf) {
        const bool half = w.layout == kvflow::kQuantAmxRowsHalf;
        if (w.bits != 4 || (!half && w.offsets == nullptr) || w.group % 32 != 0 || w.k % w.group != 0) return -1;
#if defined(KVFLOW_AMX)
        if (kvflow::amx_enabled())
            return half ? kvflow::quant_gemm_amx_rows<Out, true>(x, m, x_stride, w, n, bias, y, y_stride)
                        : kvflow::quant_gemm_amx_rows<Out, false>(x, m, x_stride, w, n, bias, y, y_stride);
#endif
        return -5;  // packed while AMX ran the GEMMs; it does not now
    }
    if (w.layout == kvflow::kQuantPairsHalf) {  // packed only without AMX (kvflow_quant_tiles_layout)
        if (w.bits == 4 && w.offsets == nullptr) return -1;
#if defined(KVFLOW_AVX512BF16)
        if (w.bits == 4) return quant_gemm_bf16<Out, 4, true, true>(x, m, x_stride, w, n, bias, y, y_stride);
        return w.offsets ? quant_gemm_bf16<Out, 8, true, true>(x, m, x_stride, w, n, bias, y, y_stride)
                         : quant_gemm_bf16<Out, 8, false, true>(x, m, x_stride, w, n, bias, y, y_stride);
#elif defined(KVFLOW_AVX2_F16C)
        using T = typename Out::T;
        if (w.bits == 4) return kvflow::quant_gemm_avx2<T, 4, true, true>(x, m, x_stride, w, n, bias, y, y_stride);
        return w.offsets ? kvflow::quant_gemm_avx2<T, 8, true, true>(x, m, x_stride, w, n, bias, y, y_stride)
                         : kvflow::quant_gemm_avx2<T, 8, false, true>(x, m, x_stride, w, n, bias, y, y_stride);
#else
        return -1;
#endif
    }
    if (w.layout != kvflow::kQuantPairs) return -1;
    auto run = [&](auto bits, auto offsets) {
        constexpr int Bits = decltype(bits)::value;
        constexpr bool Offsets = decltype(offsets)::value;
#if defined(KVFLOW_AMX)
        if (kvflow::amx_enabled() && w.group % 32 == 0 && w.k % 32 == 0)  // short groups fold (quant_gemm_amx_folded.h)
            return w.group / 32 < kvflow::kBlockedGroupTiles
                       ? kvflow::quant_gemm_amx_folded<Out, Bits, Offsets>(x, m, x_stride, w, n, bias, y, y_stride)
                       : kvflow::quant_gemm_amx<Out, Bits, Offsets>(x, m, x_stride, w, n, bias, y, y_stride);
#endif
#if defined(KVFLOW_AVX512BF16)
        return quant_gemm_bf16<Out, Bits, Offsets, false>(x, m, x_stride, w, n, bias, y, y_stride);
#else
        return kvflow::quant_gemm_avx2<typename Out::T, Bits, Offsets>(x, m, x_stride, w, n, bias, y, y_stride);
#endif
    };
    using Four = std::integral_constant<int, 4>;
    using Eight = std::integral_constant<int, 8>;
    if (w.bits == 4)  // 4-bit tiles always carry offsets: o' = o - 128 s is never zero
        return w.offsets ? run(Four{}, std::true_type{}) : -1;
    return w.offsets ? run(Eight{}, std::true_type{}) : run(Eight{}, std::false_type{});
}
#endif

}  // namespace

extern "C" {

int kvflow_has_quant_gemm_bf16() {
#if defined(KVFLOW_AVX512BF16) || defined(KVFLOW_AVX2_GEMM)
    return 1;
#else
    return 0;
#endif
}

// out_dtype 1: y bf16, bias bf16 (or null); 0: y float32, bias float32 (the LM head's logits).
// Returns 0, -1 for an unknown layout or an AMX row-layout weight it cannot be, -2 without
// AVX512-BF16 or AVX2 + FMA, -4 out of memory, -5 for AMX row-layout tiles (kQuantAmxRows,
// kQuantAmxRowsHalf) while AMX is off.
int kvflow_quant_gemm_bf16(int out_dtype, const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, int bits,
                           int layout, const uint8_t* q, const float* scales, const float* offsets, int64_t group,
                           int64_t n, const void* bias, void* y, int64_t y_stride) {
#if defined(KVFLOW_AVX512BF16) || defined(KVFLOW_AVX2_GEMM)
    if (m == 0) return 0;
    const Weight w{bits, q, scales, offsets, group, k, layout};
    if (out_dtype == 1)
        return quant_gemm_bf16_for<kvflow::BF16>(x, m, x_stride, w, n, static_cast<const uint16_t*>(bias),
                                             static_cast<uint16_t*>(y), y_stride);
    return quant_gemm_bf16_for<kvflow::F32>(x, m, x_stride, w, n, static_cast<const float*>(bias),
                                        static_cast<float*>(y), y_stride);
#else
    (void)out_dtype; (void)x; (void)m; (void)k; (void)x_stride; (void)bits; (void)layout; (void)q; (void)scales;
    (void)offsets;
    (void)group; (void)n; (void)bias; (void)y; (void)y_stride;
    return -2;
#endif
}

}  // extern "C"
