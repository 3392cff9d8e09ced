// Fused elementwise ops of a Llama layer: residual add + RMSNorm, SiLU(gate) * up, and rotary.
//
// In PyTorch each is 3-12 separate ops, each a full pass over memory and a few microseconds
// of dispatch; here each is one pass. Arithmetic is float32; where the reference rounds an
// intermediate to the activation dtype (bf16), the kernel rounds at the same point, so the
// bf16 results follow Hugging Face's order of roundings.
//
// All tensors are contiguous row-major; rows are split across PyTorch's OpenMP threads.

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <omp.h>

#include "attention_ref_avx2.h"
#include "common.h"
#include "kernels.h"
#include "vec_dtype.h"

namespace {

using kvflow::BF16;
using kvflow::F32;

// Rows per OpenMP task: small tensors stay on one thread (a fork costs more than the work).
inline bool worth_threads(int64_t elements) { return elements >= (1 << 15); }

#if defined(KVFLOW_AVX512F)
using kvflow::round16;
using kvflow::store16;
#elif defined(KVFLOW_REF_AVX2)
using kvflow::round8;
using kvflow::store8;
#endif

// The sum of a row's squares in float32. On Zen 1 GCC kept the `omp simd` reduction one scalar
// chain of dependent adds as long as the row; on AVX2 here it is two 8-lane sums, folded in a
// fixed order, so a row's result never depends on the batch around it.
template <typename Dt>
inline float sum_of_squares(const typename Dt::T* src, int64_t hidden) {
    float sum = 0.f;
    int64_t i = 0;
#if !defined(KVFLOW_AVX512F) && defined(KVFLOW_REF_AVX2)
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (; i + 16 <= hidden; i += 16) {
        const __m256 a = kvflow::load8(src + i), b = kvflow::load8(src + i + 8);
        even = _mm256_fmadd_ps(a, a, even);
        odd = _mm256_fmadd_ps(b, b, odd);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(even, odd));
    for (const float lane : lanes) sum += lane;
#endif
#pragma omp simd reduction(+ : sum)
    for (int64_t j = i; j < hidden; ++j) {
        const float v = Dt::load(src[j]);
        sum += v * v;
    }
    return sum;
}

// residual (optional, in place) += x; out = weight * round(norm(residual)).
template <typename Dt>
void add_rms_norm(typename Dt::T* x, typename Dt::T* residual, const typename Dt::T* weight, typename Dt::T* out,
                  int64_t rows, int64_t hidden, float eps) {
    using T = typename Dt::T;
#pragma omp parallel for if (worth_threads(rows * hidden))
    for (int64_t r = 0; r < rows; ++r) {
        T* src = residual != nullptr ? residual + r * hidden : x + r * hidden;
        if (residual != nullptr) {
            const T* delta = x + r * hidden;
            int64_t i = 0;
#if defined(KVFLOW_AVX512F)
            for (; i + 16 <= hidden; i += 16) store16<Dt>(src + i, _mm512_add_ps(kvflow::load16(src + i), kvflow::load16(delta + i)));
#elif defined(KVFLOW_REF_AVX2)
            for (; i + 8 <= hidden; i += 8) store8<Dt>(src + i, _mm256_add_ps(kvflow::load8(src + i), kvflow::load8(delta + i)));
#endif
#pragma omp simd
            for (int64_t j = i; j < hidden; ++j) src[j] = Dt::store(Dt::load(src[j]) + Dt::load(delta[j]));
        }
        const float inv = 1.f / std::sqrt(sum_of_squares<Dt>(src, hidden) / static_cast<float>(hidden) + eps);
        T* dst = out + r * hidden;
        int64_t i = 0;
#if defined(KVFLOW_AVX512F)
        for (; i + 16 <= hidden; i += 16)
            store16<Dt>(dst + i, _mm512_mul_ps(kvflow::load16(weight + i),
                                               round16<Dt>(_mm512_mul_ps(kvflow::load16(src + i), _mm512_set1_ps(inv)))));
#elif defined(KVFLOW_REF_AVX2)
        for (; i + 8 <= hidden; i += 8)
            store8<Dt>(dst + i, _mm256_mul_ps(kvflow::load8(weight + i),
                                              round8<Dt>(_mm256_mul_ps(kvflow::load8(src + i), _mm256_set1_ps(inv)))));
#endif
#pragma omp simd
        for (int64_t j = i; j < hidden; ++j) dst[j] = Dt::store(Dt::load(weight[j]) * Dt::round(Dt::load(src[j]) * inv));
    }
}

// out[r, :] = round(silu(gate)) * up, with gate_up[r] = [gate (inter) | up (inter)].
template <typename Dt>
void silu_and_mul(const typename Dt::T* gate_up, typename Dt::T* out, int64_t rows, int64_t inter) {
    using T = typename Dt::T;
#pragma omp parallel for if (worth_threads(rows * inter))
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = gate_up + r * 2 * inter;
        const T* up = gate + inter;
        T* dst = out + r * inter;
        int64_t i = 0;
#if defined(KVFLOW_AVX512F)
        // Vectorised e^x: the scalar expf of the loop below would dominate the whole op.
        for (; i + 16 <= inter; i += 16) {
            const __m512 g = kvflow::load16(gate + i);
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), kvflow::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            // The scalar loop's round, product and store on 16 lanes (it used to finish each
            // vector one lane at a time: two thirds of the op's time).
            store16<Dt>(dst + i, _mm512_mul_ps(round16<Dt>(silu), kvflow::load16(up + i)));
        }
#elif defined(KVFLOW_REF_AVX2)
        // The AVX-512 loop on 8 lanes, exp_ref8 being exp512's operations: the same bits, and the
        // same columns left to the scalar tail (those past a multiple of 16). With the scalar
        // expf for every column, SiLU took 6 % of W-offline's prefill on an AVX2 CPU.
        for (const int64_t vector_end = inter / 16 * 16; i < vector_end; i += 8) {
            const __m256 g = kvflow::load8(gate + i);
            const __m256 silu = _mm256_div_ps(
                g, _mm256_add_ps(_mm256_set1_ps(1.f), kvflow::ref::exp_ref8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            store8<Dt>(dst + i, _mm256_mul_ps(round8<Dt>(silu), kvflow::load8(up + i)));
        }
#endif
        for (; i < inter; ++i) {
            const float g = Dt::load(gate[i]);
            dst[i] = Dt::store(Dt::round(g / (1.f + std::exp(-g))) * Dt::load(up[i]));
        }
    }
}

// Rotate-half rotary embedding in place on q [T, q_heads, D] and k [T, kv_heads, D] (row
// stride given: q and k may be views into the fused QKV output). cos/sin: [max_pos, D] float32.
template <typename Dt>
void rotary(typename Dt::T* q, int64_t q_row_stride, int64_t q_heads, typename Dt::T* k, int64_t k_row_stride,
            int64_t k_heads, const int64_t* positions, const float* cos_cache, const float* sin_cache,
            int64_t tokens, int64_t head_dim) {
    using T = typename Dt::T;
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (worth_threads(tokens * (q_heads + k_heads) * head_dim))
    for (int64_t t = 0; t < tokens; ++t) {
        const float* cos = cos_cache + positions[t] * head_dim;
        const float* sin = sin_cache + positions[t] * head_dim;
        for (int64_t which = 0; which < 2; ++which) {
            T* base = which == 0 ? q + t * q_row_stride : k + t * k_row_stride;
            const int64_t heads = which == 0 ? q_heads : k_heads;
            for (int64_t h = 0; h < heads; ++h) {
                T* x = base + h * head_dim;
                int64_t i = 0;
#if !defined(KVFLOW_AVX512F) && defined(KVFLOW_REF_AVX2)
                // The loop below on 8 lanes, each product rounded before the sum as there (no
                // FMA): the same bits. GCC's cost model for Zen 1 gave that loop 4 lanes at most.
                for (; i + 8 <= half; i += 8) {
                    const __m256 x1 = kvflow::load8(x + i), x2 = kvflow::load8(x + i + half);
                    const __m256 c1 = round8<Dt>(_mm256_loadu_ps(cos + i)), s1 = round8<Dt>(_mm256_loadu_ps(sin + i));
                    const __m256 c2 = round8<Dt>(_mm256_loadu_ps(cos + i + half));
                    const __m256 s2 = round8<Dt>(_mm256_loadu_ps(sin + i + half));
                    const __m256 minus_x2 = _mm256_xor_ps(x2, _mm256_set1_ps(-0.f));
                    store8<Dt>(x + i, _mm256_add_ps(round8<Dt>(_mm256_mul_ps(x1, c1)), round8<Dt>(_mm256_mul_ps(minus_x2, s1))));
                    store8<Dt>(x + i + half, _mm256_add_ps(round8<Dt>(_mm256_mul_ps(x2, c2)), round8<Dt>(_mm256_mul_ps(x1, s2))));
                }
#endif
#pragma omp simd
                for (int64_t j = i; j < half; ++j) {
                    const float x1 = Dt::load(x[j]), x2 = Dt::load(x[j + half]);
                    const float c1 = Dt::round(cos[j]), s1 = Dt::round(sin[j]);
                    const float c2 = Dt::round(cos[j + half]), s2 = Dt::round(sin[j + half]);
                    // Reference order: round(x * cos) + round(rotate_half(x) * sin), rounded.
                    x[j] = Dt::store(Dt::round(x1 * c1) + Dt::round(-x2 * s1));
                    x[j + half] = Dt::store(Dt::round(x2 * c2) + Dt::round(x1 * s2));
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. residual may be null (plain RMSNorm).
int kvflow_add_rms_norm(int dtype, void* x, void* residual, const void* weight, void* out, int64_t rows,
                        int64_t hidden, float eps) {
    if (dtype == 0)
        add_rms_norm<F32>(static_cast<float*>(x), static_cast<float*>(residual), static_cast<const float*>(weight),
                          static_cast<float*>(out), rows, hidden, eps);
    else if (dtype == 1)
        add_rms_norm<BF16>(static_cast<uint16_t*>(x), static_cast<uint16_t*>(residual),
                           static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows, hidden, eps);
    else
        return -2;
    return 0;
}

int kvflow_silu_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter) {
    if (dtype == 0)
        silu_and_mul<F32>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter);
    else if (dtype == 1)
        silu_and_mul<BF16>(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, inter);
    else
        return -2;
    return 0;
}

int kvflow_rotary(int dtype, void* q, int64_t q_row_stride, int64_t q_heads, void* k, int64_t k_row_stride,
                  int64_t k_heads, const int64_t* positions, const float* cos_cache, const float* sin_cache,
                  int64_t tokens, int64_t head_dim, int64_t max_position) {
    if (head_dim % 2 != 0) return -1;
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return -3;
    if (dtype == 0)
        rotary<F32>(static_cast<float*>(q), q_row_stride, q_heads, static_cast<float*>(k), k_row_stride, k_heads,
                    positions, cos_cache, sin_cache, tokens, head_dim);
    else if (dtype == 1)
        rotary<BF16>(static_cast<uint16_t*>(q), q_row_stride, q_heads, static_cast<uint16_t*>(k), k_row_stride,
                     k_heads, positions, cos_cache, sin_cache, tokens, head_dim);
    else
        return -2;
    return 0;
}

}  // extern "C"
