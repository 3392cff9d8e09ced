// Shared helpers for kvflow's CPU kernels: bf16 <-> float32 and a vectorised e^x.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

#include <xmmintrin.h>
#if defined(__AVX2__)
#include <immintrin.h>  // load8
#endif

#include "isa.h"

namespace kvflow {

// The most rows of x one register block of the GEMM microkernels takes (dpbf16.h, fma_f32.h:
// 12 rows x 2 tiles = 24 accumulators of the 32 vector registers).
constexpr int kMaxBlockRows = 12;

// f(std::integral_constant<int, rows>{}) for a runtime row count in [1, Max]: the
// microkernels' fully unrolled register blocks, picked by the rows a block really has.
// Max: the largest block the caller's microkernel takes.
template <int Max = kMaxBlockRows, int R = 1, typename F>
inline void with_block_rows(int64_t rows, F&& f) {
    if constexpr (R <= Max) {
        if (rows == R)
            f(std::integral_constant<int, R>{});
        else
            with_block_rows<Max, R + 1>(rows, f);
    }
}

inline float bf16_to_float(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// Storage dtypes: load to float32, store from float32, and `round` to what the dtype can hold
// (where the reference rounds an intermediate result).
struct F32 {
    using T = float;
    static inline float load(T x) { return x; }
    static inline T store(float x) { return x; }
    static inline float round(float x) { return x; }
};

// Keys in the KV pool (kvflow/layers/kv_layout.py): per block and KV head, dimension-major
// in 4-byte cells of kKeyGroup<T> consecutive dims, [num_kv_heads][head_dim / G][block_size][G],
// so that one dim group of 16 consecutive keys is one 64-byte vector. Values stay
// [block_size][num_kv_heads][head_dim].
template <typename T>
constexpr int64_t kKeyGroup = static_cast<int64_t>(4 / sizeof(T));

// Element offset, within its block, of dim d of key t (t < block_size) of KV head h.
template <typename T>
inline int64_t key_offset(int64_t t, int64_t h, int64_t d, int64_t head_dim, int64_t block_size) {
    constexpr int64_t G = kKeyGroup<T>;
    return ((h * (head_dim / G) + d / G) * block_size + t) * G + d % G;
}

struct BF16 {
    using T = uint16_t;
    static inline float load(T x) { return bf16_to_float(x); }
    static inline T store(float x) { return float_to_bf16(x); }
    static inline float round(float x) { return bf16_to_float(float_to_bf16(x)); }
};

// A per-thread float32 buffer of at least n values (kept, and grown, until the thread ends), or
// null out of memory: the bf16 GEMM blocks widen their rows of x into it once per block. Slot:
// independent buffers for one thread (the calling thread of a GEMM is also one of its workers).
template <int Slot = 0>
inline float* scratch_floats(int64_t n) {
    struct FreeDeleter {
        void operator()(float* p) const { std::free(p); }
    };
    thread_local std::unique_ptr<float, FreeDeleter> buffer;
    thread_local int64_t size = 0;
    if (size < n) {
        buffer.reset(static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64)));
        size = buffer ? n : 0;
    }
    return buffer.get();
}

// In its scope, float32 arithmetic reads denormal inputs and writes denormal results as zero, as
// vdpbf16ps does: the FMA forms of that instruction (dpbf16.h, gemm_avx2.h) run inside one.
struct FlushDenormals {
    const unsigned saved = _mm_getcsr();
    FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ (bit 15), DAZ (bit 6)
    ~FlushDenormals() { _mm_setcsr(saved); }
};

#if defined(KVFLOW_AVX512F)
// e^x as 2^n * e^r with |r| <= ln2/2 and a degree-7 Taylor polynomial for e^r (relative
// error below 1e-8, under float32's epsilon). Inputs are clamped to [-100, 88]: e^-100 comes
// out as 0 through scalef, and -inf never meets the range reduction.
inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// r[i] = sum of the 16 lanes of a[i], for 16 vectors at once: 15 adds and 30 shuffles
// instead of 16 separate horizontal reductions (about 3x fewer instructions).
inline __m512 sum_lanes16(const __m512* a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// The sum of a vector's 16 lanes in a fixed order (halves, then quarters, then pairs), spelled
// out so that it does not depend on how a compiler expands _mm512_reduce_add_ps;
// attention_ref.h's reduce16 is the same sum one lane at a time.
inline float reduce_add16(__m512 v) {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 h = _mm256_add_ps(lo, hi);                                             // l[i] + l[i + 8]
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // h[i] + h[i + 4]
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));                                // q0 + q2, q1 + q3
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

// max(row[0:len)), len >= 1: the first pass of an exact softmax.
inline float row_max(const float* row, int64_t len) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + t));
    const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
    mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, row + t));
    return _mm512_reduce_max_ps(mx);
}

// Asks for `bytes` from `p` on into L2 ahead of use (pool blocks lie scattered in memory, so
// the hardware prefetcher restarts at every block: decode attention waits on each block's
// first lines unless they were asked for while the previous block was being computed).
inline void prefetch_l2(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// Lines to ask for into L1, spread over the loop steps that hide them. A burst of a few hundred
// prefetches (prefetch_l2 on a whole block group) overruns the core's outstanding-miss slots
// and stalls it; a few lines per step of the arithmetic keep memory busy meanwhile. Decode
// attention, one thread, W-offline-like contexts: 57 -> 44 ns per key and layer into L2,
// 40.5 -> 38 into L1 (6-24 KiB ahead: the next block or key group, which L1 holds).
// Ranges of `bytes` each, up to kMaxRanges; spread(steps) before the first step().
//
// Into L1 on AMD (the figures above); into L2 on Intel, where the decode kernel stalled on the
// prefetches themselves (perf: 60 % of p.V's samples on the instruction after them) and asking
// for L2 instead measured 1.13x faster (AMX Xeon, model 167: 32 sequences of 200-700 keys, 30
// layers, 23.3 -> 20.6 ms a step). kvflow_set_stream_prefetch (paged_attention.cpp) sets it.
inline bool& stream_prefetch_l2() {
    static bool l2 = false;
    return l2;
}
inline void stream_prefetch(const char* p) {
    if (stream_prefetch_l2()) _mm_prefetch(p, _MM_HINT_T1);
    else _mm_prefetch(p, _MM_HINT_T0);
}

struct PrefetchStream {
    static constexpr int kMaxRanges = 8;
    const char* start[kMaxRanges];
    int64_t bytes = 0;
    int ranges = 0, next_range = 0, per_step = 0;
    int64_t offset = 0;
    inline void reset(int64_t range_bytes) { bytes = range_bytes; ranges = next_range = per_step = 0; offset = 0; }
    inline void add(const void* p) { if (ranges < kMaxRanges) start[ranges++] = static_cast<const char*>(p); }
    inline void spread(int64_t steps) {
        const int64_t lines = ranges * ((bytes + 63) / 64);
        per_step = static_cast<int>(steps > 0 ? (lines + steps - 1) / steps : lines);
    }
    inline void step() {
        for (int k = 0; k < per_step && next_range < ranges; ++k) {
            stream_prefetch(start[next_range] + offset);
            offset += 64;
            if (offset >= bytes) { ++next_range; offset = 0; }
        }
    }
    inline void drain() {  // whatever the steps did not reach
        for (; next_range < ranges; ++next_range, offset = 0)
            for (; offset < bytes; offset += 64) stream_prefetch(start[next_range] + offset);
    }
};

// The first `left` of 16 lanes (all 16 when left >= 16).
inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// float_to_bf16 on 16 lanes (round to nearest even, NaN kept quiet, denormals kept): each
// lane's bf16 bits in its low half.
inline __m512i bf16_bits16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

#if defined(__AVX2__)
// load16 on 8 lanes, for the AVX2 kernels: 8 float32 values, or 8 bf16 widened exactly.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

}  // namespace kvflow
