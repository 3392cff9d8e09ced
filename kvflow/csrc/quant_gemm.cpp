// Weight-only quantized GEMM: y[M,N] = x[M,K] @ dequant(W)^T (+ bias), x float32 or bf16.
//
// W is stored as small integers with one float32 scale (and optionally one offset) per group
// of `group` consecutive inputs of an output row:  w[n][k] = q[n][k] * scale[n][g] + offset[n][g],
// a product and then a sum, each rounded (no FMA): exactly what gguf's and torch's dequantization
// compute, so the weights the kernel multiplies are bit for bit the dequantized reference's.
//   bits = 8: q int8, row-major [N][K] (per-channel int8 is one group of K; GGUF Q8_0 groups of 32);
//   bits = 4: q in 0..15, two per byte, in 32-input blocks of 16 bytes: byte j of a block holds
//             input j in its low nibble and input 16 + j in its high nibble (GGUF's Q4_0/Q4_1
//             order, so a GGUF block's quants are copied, not reshuffled).
// The offset form covers symmetric int8 (none), asymmetric int4 (-scale * zero point), GPTQ and
// GGUF Q4_0 (-8 * d) and Q4_1 (its stored minimum m).
//
// Decode is memory-bound: at one row a step streams every weight once, so reading 1 or 0.5
// bytes per weight instead of 2 (bf16) or 4 (float32) is the gain. Each thread dequantizes a
// block of NC output rows of W into a float32 tile that stays in L1/L2, then every row of x
// runs a float32 dot product against it; the tile is reused by all M rows, so prefill pays
// the dequantization once per weight, not once per token.
//
// Batch invariance: each output y[m][n] is one 8-lane FMA chain over k in order, then the same
// fixed lane reduction, whatever M is and however rows are blocked, so a token's output is
// bit-identical alone or batched. The portable path performs the same operations in the same
// order (fmaf per lane), so it gives the same bits as the AVX2 path (a test checks this).
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVFLOW_QUANT_AVX2 1
#endif

#include "common.h"

// The dequantization is q * s, then + o, rounded twice: the compiler must not contract it into
// an FMA (GCC does across statements and on vector intrinsics under its default
// -ffp-contract=fast). The dot products ask for their FMAs explicitly.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

constexpr int64_t NC = 4;     // output rows of W per dequantized tile
constexpr int64_t LANES = 8;  // accumulator width (one AVX2 register)

struct QuantWeight {
    int bits;
    const uint8_t* q;
    const float* scales;
    const float* offsets;  // may be null: zero
    int64_t group, k;
    int64_t groups() const { return k / group; }
};

// ---- dequantization of one output row of W into float32 ----------------------------------

inline float mul_add(float q, float s, float o) {  // two roundings: see fp contract below
    const float p = q * s;
    return p + o;
}

void dequant_row_portable(const QuantWeight& w, int64_t n, float* out) {
    const float* s = w.scales + n * w.groups();
    const float* o = w.offsets ? w.offsets + n * w.groups() : nullptr;
    if (w.bits == 8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + n * w.k;
        for (int64_t i = 0; i < w.k; ++i) {
            const int64_t g = i / w.group;
            out[i] = mul_add(static_cast<float>(q[i]), s[g], o ? o[g] : 0.f);
        }
        return;
    }
    const uint8_t* q = w.q + n * (w.k / 2);
    for (int64_t b = 0; b < w.k / 32; ++b) {
        const int64_t g = b * 32 / w.group;
        const float scale = s[g], offset = o ? o[g] : 0.f;
        for (int64_t j = 0; j < 16; ++j) {
            const uint8_t byte = q[b * 16 + j];
            out[b * 32 + j] = mul_add(static_cast<float>(byte & 0x0F), scale, offset);
            out[b * 32 + 16 + j] = mul_add(static_cast<float>(byte >> 4), scale, offset);
        }
    }
}

#if defined(KVFLOW_QUANT_AVX2)
void dequant_row_avx2(const QuantWeight& w, int64_t n, float* out) {
    const float* s = w.scales + n * w.groups();
    const float* o = w.offsets ? w.offsets + n * w.groups() : nullptr;
    if (w.bits == 8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + n * w.k;
        for (int64_t g = 0; g < w.groups(); ++g) {
            const __m256 scale = _mm256_set1_ps(s[g]), offset = _mm256_set1_ps(o ? o[g] : 0.f);
            for (int64_t i = g * w.group; i < (g + 1) * w.group; i += 8) {
                const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(v, scale), offset));
            }
        }
        return;
    }
    const uint8_t* q = w.q + n * (w.k / 2);
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < w.k / 32; ++b) {
        const int64_t g = b * 32 / w.group;
        const __m256 scale = _mm256_set1_ps(s[g]), offset = _mm256_set1_ps(o ? o[g] : 0.f);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
        const __m128i lo = _mm_and_si128(bytes, low_nibbles);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int p = 0; p < 4; ++p) {
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
            _mm256_storeu_ps(out + b * 32 + p * 8, _mm256_add_ps(_mm256_mul_ps(v, scale), offset));
        }
    }
}
#endif

// ---- float32 dot products against the tile ------------------------------------------------

// The fixed reduction of 8 lanes: (l0+l4, l1+l5, l2+l6, l3+l7), then pairs, then the last two.
inline float reduce8(const float* l) {
    const float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
    return (a0 + a2) + (a1 + a3);
}

// out[r][c] for rows r of x and tile rows c: one 8-lane FMA chain over k per pair.
void dot_portable(const float* const* xs, int64_t rows, const float* tile, int64_t cols, int64_t k,
                  float* out /* [rows][cols] */) {
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
            float acc[LANES] = {0.f};
            const float* w = tile + c * k;
            for (int64_t i = 0; i < k; i += LANES)
                for (int64_t l = 0; l < LANES; ++l) acc[l] = std::fma(xs[r][i + l], w[i + l], acc[l]);
            out[r * cols + c] = reduce8(acc);
        }
    }
}

#if defined(KVFLOW_QUANT_AVX2)
inline float reduce8(__m256 v) {
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l0+l4 ...
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));  // (a0+a2, a1+a3)
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}

// R rows of x by C tile rows per register block: R * C accumulators plus R x vectors in the
// 16 AVX2 registers (3 x 4 = 12 + 3); the tile's loads are memory operands of the FMAs.
template <int R, int C>
void dot_block_avx2(const float* const* xs, const float* tile, int64_t k, float* out, int64_t cols) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += LANES) {
        __m256 x[R];
        for (int r = 0; r < R; ++r) x[r] = _mm256_loadu_ps(xs[r] + i);
        for (int c = 0; c < C; ++c) {
            const __m256 wv = _mm256_loadu_ps(tile + c * k + i);
            for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(x[r], wv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[r * cols + c] = reduce8(acc[r][c]);
}

template <int R>
void dot_rows_avx2(const float* const* xs, const float* tile, int64_t cols, int64_t k, float* out) {
    if (cols == 4) return dot_block_avx2<R, 4>(xs, tile, k, out, cols);
    for (int64_t c = 0; c < cols; ++c) dot_block_avx2<R, 1>(xs, tile + c * k, k, out + c, cols);
}

// Decode (1-2 rows): NC = 4 whole output rows of W are dequantized in registers and
// multiplied at once, never stored. Each output is still one 8-lane FMA chain over k of the
// same rounded weights, so it is bit-identical to the tile path (batch invariance across the
// two paths); the four outputs' chains interleave, so FMA latency overlaps.
template <int R>
void fused_rows_avx2(const float* const* xs, const QuantWeight& w, int64_t n0, float* out) {
    __m256 acc[R][NC];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
    const int64_t groups = w.groups();
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; ++g) {
        __m256 scale[NC], offset[NC];
        for (int c = 0; c < NC; ++c) {
            scale[c] = _mm256_set1_ps(w.scales[(n0 + c) * groups + g]);
            offset[c] = _mm256_set1_ps(w.offsets ? w.offsets[(n0 + c) * groups + g] : 0.f);
        }
        const int64_t k0 = g * w.group, k1 = k0 + w.group;
        if (w.bits == 8) {
            const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + n0 * w.k;
            for (int64_t i = k0; i < k1; i += LANES) {
                for (int c = 0; c < NC; ++c) {
                    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + c * w.k + i));
                    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                    const __m256 wv = _mm256_add_ps(_mm256_mul_ps(v, scale[c]), offset[c]);
                    for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[r] + i), wv, acc[r][c]);
                }
            }
            continue;
        }
        const uint8_t* q = w.q + n0 * (w.k / 2);
        for (int64_t i = k0; i < k1; i += 32) {
            for (int c = 0; c < NC; ++c) {
                const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * (w.k / 2) + i / 2));
                const __m128i lo = _mm_and_si128(bytes, low_nibbles);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
                const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                for (int p = 0; p < 4; ++p) {
                    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
                    const __m256 wv = _mm256_add_ps(_mm256_mul_ps(v, scale[c]), offset[c]);
                    for (int r = 0; r < R; ++r)
                        acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[r] + i + p * 8), wv, acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) out[r * NC + c] = reduce8(acc[r][c]);
}

void dot_avx2(const float* const* xs, int64_t rows, const float* tile, int64_t cols, int64_t k, float* out) {
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3) dot_rows_avx2<3>(xs + r, tile, cols, k, out + r * cols);
    if (rows - r == 2) dot_rows_avx2<2>(xs + r, tile, cols, k, out + r * cols);
    if (rows - r == 1) dot_rows_avx2<1>(xs + r, tile, cols, k, out + r * cols);
}
#endif

constexpr int64_t ROW_BLOCK = 64;  // rows of x per pass over a tile (bounds the scratch output)

template <typename T>
using Storage = std::conditional_t<std::is_same_v<T, float>, kvflow::F32, kvflow::BF16>;

// x in T, y in O (float32 output from bf16 input: logits keep the accumulator's precision).
template <typename T, typename O>
int quant_gemm(const T* x, int64_t m, int64_t k, int64_t x_stride, const QuantWeight& w, int64_t n,
               const float* bias, O* y, int64_t y_stride, bool portable) {
    using IO = Storage<T>;
    using OUT = Storage<O>;
    // float32 rows of x: bf16 input is widened once; float32 input is read in place.
    std::vector<float> widened;
    std::vector<const float*> rows(m);
    if constexpr (std::is_same_v<T, float>) {
        for (int64_t r = 0; r < m; ++r) rows[r] = x + r * x_stride;
    } else {
        widened.resize(static_cast<size_t>(m * k));
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t i = 0; i < k; ++i) widened[r * k + i] = IO::load(x[r * x_stride + i]);
        for (int64_t r = 0; r < m; ++r) rows[r] = widened.data() + r * k;
    }
    const int64_t blocks = (n + NC - 1) / NC;
    int failed = 0;
#pragma omp parallel
    {
        float* tile = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(NC * k) * sizeof(float)));
        float* part = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(ROW_BLOCK * NC) * sizeof(float)));
        if (tile == nullptr || part == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            if (tile == nullptr || part == nullptr) continue;
            const int64_t n0 = b * NC, cols = std::min(NC, n - n0);
#if defined(KVFLOW_QUANT_AVX2)
            if (!portable && m <= 2 && cols == NC) {
                if (m == 2)
                    fused_rows_avx2<2>(rows.data(), w, n0, part);
                else
                    fused_rows_avx2<1>(rows.data(), w, n0, part);
                for (int64_t r = 0; r < m; ++r)
                    for (int64_t c = 0; c < cols; ++c)
                        y[r * y_stride + n0 + c] = OUT::store(part[r * cols + c] + (bias ? bias[n0 + c] : 0.f));
                continue;
            }
#endif
            for (int64_t c = 0; c < cols; ++c) {
#if defined(KVFLOW_QUANT_AVX2)
                if (!portable) {
                    dequant_row_avx2(w, n0 + c, tile + c * k);
                    continue;
                }
#endif
                dequant_row_portable(w, n0 + c, tile + c * k);
            }
            for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
                const int64_t count = std::min(ROW_BLOCK, m - r0);
#if defined(KVFLOW_QUANT_AVX2)
                if (!portable)
                    dot_avx2(rows.data() + r0, count, tile, cols, k, part);
                else
#endif
                    dot_portable(rows.data() + r0, count, tile, cols, k, part);
                for (int64_t r = 0; r < count; ++r)
                    for (int64_t c = 0; c < cols; ++c) {
                        const float v = part[r * cols + c] + (bias ? bias[n0 + c] : 0.f);
                        y[(r0 + r) * y_stride + n0 + c] = OUT::store(v);
                    }
            }
        }
        std::free(tile);
        std::free(part);
    }
    return failed ? -3 : 0;
}

}  // namespace

extern "C" {

int kvflow_has_quant_gemm_simd() {
#if defined(KVFLOW_QUANT_AVX2)
    return 1;
#else
    return 0;
#endif
}

// dtype: x's (0 float32, 1 bf16); out_dtype: y's (the same, or 0 for float32 from bf16 input).
// Returns 0, or -1 for a layout it does not take (checked in Python first), -3 out of memory.
int kvflow_quant_gemm(int dtype, int out_dtype, const void* x, int64_t m, int64_t k, int64_t x_stride, int bits,
                      const uint8_t* q, const float* scales, const float* offsets, int64_t group, int64_t n,
                      const float* bias, void* y, int64_t y_stride, int portable) {
    if ((bits != 8 && bits != 4) || group <= 0 || k % group != 0 || k % LANES != 0 || group % LANES != 0 ||
        (bits == 4 && (group % 32 != 0 || k % 32 != 0)))
        return -1;
    if (m == 0) return 0;
    const QuantWeight w{bits, q, scales, offsets, group, k};
    const bool p = portable != 0;
    if (dtype == 0 && out_dtype == 0)
        return quant_gemm(static_cast<const float*>(x), m, k, x_stride, w, n, bias, static_cast<float*>(y), y_stride, p);
    if (dtype == 1 && out_dtype == 1)
        return quant_gemm(static_cast<const uint16_t*>(x), m, k, x_stride, w, n, bias, static_cast<uint16_t*>(y),
                          y_stride, p);
    if (dtype == 1 && out_dtype == 0)
        return quant_gemm(static_cast<const uint16_t*>(x), m, k, x_stride, w, n, bias, static_cast<float*>(y),
                          y_stride, p);
    return -1;
}

}  // extern "C"
