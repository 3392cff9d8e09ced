// GEMM for every linear layer: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 accumulation,
// in bf16 (AVX512-BF16) and in float32 (AVX-512F); on CPUs without them, the same weights and
// bits through AVX2 + FMA (gemm_avx2.h).
//
// At the 1-32 rows of a decode step a linear layer is a stream over its weight, and
// PyTorch's oneDNN path leaves much of the memory bandwidth unused there. These kernels read
// a weight packed once at load time so that one 64-byte load feeds one instruction per row:
//   bf16:    [ceil(N/16)][K/2][16][2] bf16, for `vdpbf16ps` (16 columns x 2 consecutive k);
//            K must be even;
//   float32: [ceil(N/16)][K][16] float32, for `vfmadd` (16 columns x 1 k).
// Columns past N are zero. Every output element is summed in the same order whatever M is,
// so results do not depend on how many rows share the step.

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include <omp.h>

#include "gemm_amx.h"
#include "gemm_avx2.h"
#include "gemm_blocking.h"
#include "kernels.h"
#include "microkernel.h"

namespace {

using kvflow::kNT;
using kvflow::kTileCols;

// Packing is plain C++ and runs on every machine. KGroup consecutive k share a lane: 2 for
// bf16 (the pairs vdpbf16ps takes), 1 for float32.
template <typename T, int KGroup>
void pack_weight(const T* w, int64_t n, int64_t k, T* packed) {
    const int64_t tiles = (n + kTileCols - 1) / kTileCols, groups = k / KGroup;
#pragma omp parallel for
    for (int64_t tile = 0; tile < tiles; ++tile) {
        T* dst = packed + tile * groups * kTileCols * KGroup;
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t lane = 0; lane < kTileCols; ++lane) {
                const int64_t col = tile * kTileCols + lane;
                for (int64_t e = 0; e < KGroup; ++e)
                    dst[(g * kTileCols + lane) * KGroup + e] = col < n ? w[col * k + KGroup * g + e] : T(0);
            }
    }
}

#if defined(KVFLOW_AVX512F)
// y = x @ W^T (+ bias) for a weight packed by pack_weight<T, Micro<Dt>::G>; Y: the output's
// elements (kvflow::StoreFor).
template <typename Dt, typename Y = typename Dt::T>
int gemm(const typename Dt::T* x, int64_t m, int64_t k, int64_t x_stride, const typename Dt::T* packed, int64_t n,
         const typename Dt::T* bias, Y* y, int64_t y_stride) {
    using M = kvflow::Micro<Dt>;
    if (k % M::G != 0) return -1;
    const int64_t tile_stride = k * kTileCols;
    kvflow::for_each_chunk(n, [&](int64_t n0, bool full) {
        const typename Dt::T* tile0 = packed + (n0 / kTileCols) * tile_stride;
        // Row blocks after the first find the chunk's weights in cache: they pull the next
        // chunk's into L2 meanwhile, so the weight stream overlaps the arithmetic.
        const bool next_full = n0 + 2 * kTileCols * kNT <= n;
        kvflow::for_each_row_block(m, [&](int64_t r, int64_t rows) {
            typename kvflow::StoreFor<Dt, Y>::type store{y + r * y_stride, y_stride, n0, n, bias};
            const typename Dt::T* next = r > 0 && next_full ? tile0 + kNT * tile_stride : nullptr;
            if (full)
                M::template rows<kNT>(rows, x + r * x_stride, x_stride, tile0, tile_stride, k / M::G, store, next);
            else
                M::template rows<1>(rows, x + r * x_stride, x_stride, tile0, tile_stride, k / M::G, store);
        }, 0, M::kPrefillRows);
    });
    return 0;
}
#endif

#if defined(KVFLOW_AVX2_GEMM)
// The same product with gemm_avx2.h's blocks; bf16 rows of x are widened to float32 once per
// call (exact), into the calling thread's scratch, and read by every thread. From
// kAvx2WidenFrom rows on, each thread also widens its chunk's bf16 weights once and runs the
// float32 block over them (the same FMAs in the same order, under DAZ/FTZ).
template <typename T>
int gemm_avx2(const T* x, int64_t m, int64_t k, int64_t x_stride, const T* packed, int64_t n, const T* bias, T* y,
              int64_t y_stride) {
    constexpr bool bf16 = std::is_same_v<T, uint16_t>;
    if (bf16 && k % 2 != 0) return -1;
    const bool widen_weights = bf16 && m >= kvflow::kAvx2WidenFrom;
    const int64_t tile_stride = k * kTileCols;
    float* wide = nullptr;
    if constexpr (bf16) {
        wide = kvflow::scratch_floats(m * k);
        if (wide == nullptr) return -4;  // OUT_OF_MEMORY in layers/cpu_kernels.py
#pragma omp parallel for schedule(static) if (m * k >= 65536)
        for (int64_t r = 0; r < m; ++r)
            kvflow::avx2_widen_rows(x + r * x_stride, x_stride, 1, k, wide + r * k, widen_weights);
    }
    std::atomic<bool> out_of_memory{false};
    kvflow::for_each_chunk(n, [&](int64_t n0, bool full) {
        const int64_t tiles = std::min<int64_t>(kNT, (n - n0 + kTileCols - 1) / kTileCols);
        const float* wide_tiles = nullptr;  // this chunk's weights as float32 tiles [k][16]
        if (widen_weights) {
            float* buffer = kvflow::scratch_floats<1>(kNT * k * kTileCols);
            if (buffer == nullptr) return out_of_memory.store(true);
            kvflow::avx2_widen_tiles(reinterpret_cast<const uint16_t*>(packed) + (n0 / kTileCols) * tile_stride,
                                     tile_stride, tiles, k / 2, buffer);
            wide_tiles = buffer;
        }
        // A block of rows x NT tiles from column col: the chunk's tiles one at a time, or both at
        // once for a block of one or two rows.
        auto block = [&](auto mt, auto nt, int64_t r, int64_t col) {
            constexpr int MT = decltype(mt)::value, NT = decltype(nt)::value;
            const int64_t cols = std::min<int64_t>(NT * kTileCols, n - col);
            const T* b = bias != nullptr ? bias + col : nullptr;
            if constexpr (bf16) {
                if (wide_tiles != nullptr)
                    kvflow::avx2_f32_block<MT, NT, true>(wide + r * k, k, wide_tiles + (col - n0) * k, tile_stride, k,
                                                         b, y + r * y_stride + col, y_stride, cols);
                else if constexpr (MT <= kvflow::kAvx2RowsBF16)
                    kvflow::avx2_bf16_block<MT, NT>(wide + r * k, k, packed + (col / kTileCols) * tile_stride,
                                                    tile_stride, k / 2, b, y + r * y_stride + col, y_stride, cols);
            } else {
                kvflow::avx2_f32_block<MT, NT>(x + r * x_stride, x_stride, packed + (col / kTileCols) * tile_stride,
                                               tile_stride, k, b, y + r * y_stride + col, y_stride, cols);
            }
        };
        const int64_t max_rows = bf16 && !widen_weights ? kvflow::kAvx2RowsBF16 : kvflow::kAvx2RowsF32;
        kvflow::for_each_row_block(m, [&](int64_t r, int64_t rows) {
            kvflow::with_block_rows<kvflow::kAvx2RowsF32>(rows, [&](auto mt) {
                if constexpr (decltype(mt)::value <= kvflow::kAvx2WideRows) {
                    if (full) return block(mt, std::integral_constant<int, kNT>{}, r, n0);
                }
                for (int64_t col = n0; col < std::min(n, n0 + kNT * kTileCols); col += kTileCols)
                    block(mt, std::integral_constant<int, 1>{}, r, col);
            });
        }, max_rows);
    });
    return out_of_memory ? -4 : 0;
}
#endif

}  // namespace

extern "C" {

void kvflow_pack_bf16_weight(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
    pack_weight<uint16_t, 2>(w, n, k, packed);
}

void kvflow_pack_f32_weight(const float* w, int64_t n, int64_t k, float* packed) {
    pack_weight<float, 1>(w, n, k, packed);
}

// out[r] = row ids[r] of a weight of `rows` rows in tiles of 16 columns whose cells (a k group
// of one column: 4 bytes in bf16 and float32, 2 in 8-bit quantized tiles) lie 16 apart: `cells`
// cells a row, as they are stored. For a tied embedding read from its LM head
// (layers/embedding.py). Returns 0, -1 for another cell size, -6 for an id outside [0, rows)
// (the last tile's padding included), before anything is written.
int kvflow_gather_packed_rows(const void* packed, int64_t rows, int64_t cell_bytes, int64_t cells, const int64_t* ids,
                              int64_t n, void* out) {
    for (int64_t r = 0; r < n; ++r)
        if (ids[r] < 0 || ids[r] >= rows) return -6;
    auto gather = [&](auto cell) {
        using Cell = decltype(cell);
        const Cell* src = static_cast<const Cell*>(packed);
        Cell* dst = static_cast<Cell*>(out);
#pragma omp parallel for if (n * cells >= (1 << 16))
        for (int64_t r = 0; r < n; ++r) {
            const Cell* row = src + (ids[r] / kTileCols * cells * kTileCols + ids[r] % kTileCols);
            for (int64_t i = 0; i < cells; ++i) dst[r * cells + i] = row[i * kTileCols];
        }
        return 0;
    };
    if (cell_bytes == 4) return gather(uint32_t{});
    if (cell_bytes == 2) return gather(uint16_t{});
    return -1;
}

// The instruction sets the library's fast paths were built for: 1 AVX-512F, 2 AVX512-BF16,
// 4 the AVX2 GEMM (for the dtypes without an AVX-512 one), 8 AMX tiles granted on this CPU, 16 F16C
// beside the AVX2 GEMM (its quantized tiles read float16 scales).
int kvflow_isa() {
    int isa = 0;
#if defined(KVFLOW_AVX512F)
    isa |= 1;
#endif
#if defined(KVFLOW_AVX512BF16)
    isa |= 2;
#endif
#if defined(KVFLOW_AVX2_GEMM)
    isa |= 4;
#endif
#if defined(KVFLOW_AVX2_F16C)
    isa |= 16;
#endif
#if defined(KVFLOW_AMX)
    if (kvflow::amx_permitted()) isa |= 8;  // the CPU and kernel grant AMX tiles, whether or not they are switched on
#endif
    return isa;
}

#if defined(KVFLOW_AVX512BF16) || defined(KVFLOW_AVX2_GEMM)
int kvflow_has_gemm_bf16() { return 1; }
#else
int kvflow_has_gemm_bf16() { return 0; }
#endif

#if defined(KVFLOW_AVX512F) || defined(KVFLOW_AVX2_GEMM)
int kvflow_has_gemm_f32() { return 1; }
#else
int kvflow_has_gemm_f32() { return 0; }
#endif

}  // extern "C"

namespace {
// kvflow_gemm_bf16's dispatch for an output of Y: AMX tiles where they are on, the AVX512-BF16
// blocks, or (bf16 output only) the AVX2 ones; -2 where none runs that output.
template <typename Y>
int gemm_bf16_to(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed, int64_t n,
                 const uint16_t* bias, Y* y, int64_t y_stride) {
#if defined(KVFLOW_AMX)
    if (kvflow::amx_enabled() && k % 32 == 0) return kvflow::gemm_amx_bf16(x, m, k, x_stride, packed, n, bias, y, y_stride);
#endif
#if defined(KVFLOW_AVX512BF16)
    return gemm<kvflow::BF16, Y>(x, m, k, x_stride, packed, n, bias, y, y_stride);
#else
#if defined(KVFLOW_AVX2_GEMM)
    if constexpr (std::is_same_v<Y, uint16_t>) return gemm_avx2<uint16_t>(x, m, k, x_stride, packed, n, bias, y, y_stride);
#endif
    (void)x; (void)m; (void)k; (void)x_stride; (void)packed; (void)n; (void)bias; (void)y; (void)y_stride;
    return -2;
#endif
}
}  // namespace

extern "C" {

int kvflow_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed, int64_t n,
                     const uint16_t* bias, uint16_t* y, int64_t y_stride) {
    return gemm_bf16_to(x, m, k, x_stride, packed, n, bias, y, y_stride);
}

// kvflow_gemm_bf16's values, rounded to bf16 as there, written widened to float32 (a bf16 LM
// head's logits for the sampler, without a second pass). Returns -2 where only the AVX2 GEMM
// runs: the caller widens kvflow_gemm_bf16's output itself.
int kvflow_gemm_bf16_widened(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed,
                             int64_t n, const uint16_t* bias, float* y, int64_t y_stride) {
    return gemm_bf16_to(x, m, k, x_stride, packed, n, bias, y, y_stride);
}

int kvflow_gemm_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed, int64_t n,
                    const float* bias, float* y, int64_t y_stride) {
#if defined(KVFLOW_AVX512F)
    return gemm<kvflow::F32>(x, m, k, x_stride, packed, n, bias, y, y_stride);
#elif defined(KVFLOW_AVX2_GEMM)
    return gemm_avx2<float>(x, m, k, x_stride, packed, n, bias, y, y_stride);
#else
    (void)x; (void)m; (void)k; (void)x_stride; (void)packed; (void)n; (void)bias; (void)y; (void)y_stride;
    return -2;
#endif
}

// Whether bf16 GEMMs with K a multiple of 32, and quantized tiles with groups of a multiple of
// 32, run on AMX tiles (gemm_amx.h, quant_gemm_amx.h: other bits than the vector kernels,
// batch-invariant all the same). Returns the setting in force: 0 where the
// library was built without AMX or the kernel does not grant the tiles.
int kvflow_set_amx(int on) {
#if defined(KVFLOW_AMX)
    kvflow::amx_enabled() = on != 0 && kvflow::amx_permitted();
    return kvflow::amx_enabled() ? 1 : 0;
#else
    (void)on;
    return 0;
#endif
}

// Which block runs the bf16 products (dpbf16.h): 0 vdpbf16ps, 1 float32 FMAs; the same bits
// either way. Returns the setting now in force (0 where the FMA block is not compiled).
int kvflow_set_bf16_dot(int with_fma) {
#if defined(KVFLOW_AVX512BF16) && !defined(KVFLOW_SIMDE)
    kvflow::bf16_dot_with_fma() = with_fma != 0;
    return kvflow::bf16_dot_with_fma() ? 1 : 0;
#else
    (void)with_fma;
    return 0;
#endif
}

// Seconds one thread takes for a prefill-sized register block (12 rows x 2 tiles x K = 576,
// the weights in L1/L2) with each block, best of `trials`: out[0] vdpbf16ps, out[1] FMAs.
// The compute rate is what differs between CPUs; memory-bound calls take the same time either way.
int kvflow_time_bf16_dot(int trials, double* out) {
#if defined(KVFLOW_AVX512BF16) && !defined(KVFLOW_SIMDE)
    constexpr int64_t k = 576, rows = kvflow::kMaxBlockRows, reps = 200;
    const int64_t tile_stride = k * kTileCols;
    std::unique_ptr<uint16_t[]> x(new uint16_t[rows * k]), w(new uint16_t[kNT * tile_stride]);
    for (int64_t i = 0; i < rows * k; ++i) x[i] = kvflow::float_to_bf16(0.001f * static_cast<float>(i % 97));
    for (int64_t i = 0; i < kNT * tile_stride; ++i) w[i] = kvflow::float_to_bf16(0.01f * static_cast<float>(i % 89) - 0.4f);
    alignas(64) float sink[rows][kNT][16];
    auto store = [&](int m, int j, __m512 acc) { _mm512_store_ps(sink[m][j], acc); };
    for (int with_fma = 0; with_fma < 2; ++with_fma) {
        double best = 1e30;
        for (int t = 0; t < trials; ++t) {
            const auto t0 = std::chrono::steady_clock::now();
            for (int64_t r = 0; r < reps; ++r) {
                // Every repetition really runs: x, w and sink may have changed.
                __asm__ volatile("" : : "r"(x.get()), "r"(w.get()), "r"(&sink[0][0][0]) : "memory");
                if (with_fma)
                    kvflow::fma_bf16_block<rows, kNT>(x.get(), k, w.get(), tile_stride, k / 2, store);
                else
                    kvflow::dpbf16_block<rows, kNT>(x.get(), k, w.get(), tile_stride, k / 2, store);
            }
            best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        out[with_fma] = best;
    }
    volatile float keep = sink[rows - 1][kNT - 1][15];
    (void)keep;
    return 0;
#else
    (void)trials; (void)out;
    return -2;
#endif
}

}  // extern "C"
