// Paged attention over an int8 KV cache (kv_cache_dtype="int8"): decode rows and prefill
// chunks in one call, reading the int8 blocks in place through the block table.
//
// Storage (kvflow/layers/kv_int8.py): the int8 pool has the float pool's layout
// (common.h: keys dimension-major in 4-byte cells, here of 4 dims; values token-major), and
// beside it one float16 scale per token and KV head for K and for V,
// [num_blocks, block_size, num_kv_heads]. Element x of a token's head is q * scale.
//
// Numerics: int8_attention.h. Keys and values are read as int8 and widened to float32 in
// registers; the K scale multiplies each score and the V scale each probability, so no
// dequantized copy of the cache is ever written. Work items are (sequence, KV head, up to
// 64 positions); an item converts its keys' scales once and hands its rows to the kernel a
// few positions at a time. A row's bits do not depend on the item it lands in.
//
// q and out are float32 or bf16 [T, num_heads, head_dim] (rows q_stride / out_stride elements
// apart): the fused decoder stack passes its own rows, the modules theirs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "attention_ref.h"
#include "common.h"
#include "int8_attention.h"

namespace {

using kvflow::F32;

// IEEE binary16 -> float32, exactly (every half is a float).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
        const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
        std::memcpy(&bits, &magnitude, sizeof(bits));
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

// float32 -> IEEE binary16, rounding to nearest even as torch's .to(float16) does (subnormal
// halves included; 65520 and above become infinity).
inline uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof(x));
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);
    if (ax >= 0x477ff000u) return sign | 0x7c00u;
    if (ax < 0x38800000u) {  // below 2^-14: a multiple of 2^-24 (scaling by 2^24 is exact)
        float a;
        std::memcpy(&a, &ax, sizeof(a));
        return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));
    }
    return sign | static_cast<uint16_t>((ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u) >> 13);
}

// One token's head of head_dim elements -> int8 values and their float16 scale:
// scale = half(min(max|x| / 127, 65504)), q = clamp(round_even(x / scale), -127, 127) (0 when
// the scale is 0): kv_int8.quantize, one head at a time.
template <typename Dt>
inline uint16_t quantize_head(const typename Dt::T* x, int64_t head_dim, int8_t* q) {
    float amax = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) amax = std::fmax(amax, std::fabs(Dt::load(x[d])));
    const uint16_t scale = float_to_half(std::fmin(amax / 127.f, 65504.f));
    const float s = half_to_float(scale);
    for (int64_t d = 0; d < head_dim; ++d)
        q[d] = s > 0.f ? static_cast<int8_t>(std::fmin(std::fmax(std::nearbyint(Dt::load(x[d]) / s), -127.f), 127.f))
                       : int8_t{0};
    return scale;
}

#if defined(KVFLOW_AVX512F)
// quantize_head for head_dim a multiple of 16 (up to 1,024), 16 lanes at a time: the same
// bits. amax ignores NaN as fmax does (_mm512_max_ps returns its second operand when either
// is NaN, so the running maximum goes second); x / s is a true division, rounded to nearest
// even as nearbyint; the clamp maps NaN to -127 as fmin(fmax(NaN, -127), 127) does. A
// W-offline run spent ~5 % of its time in the scalar loop (one division per element).
template <typename Dt>
inline uint16_t quantize_head16(const typename Dt::T* x, int64_t head_dim, int8_t* q) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 amax = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16)
        amax = _mm512_max_ps(_mm512_and_ps(kvflow::load16(x + d), sign), amax);
    const uint16_t scale = float_to_half(std::fmin(_mm512_reduce_max_ps(amax) / 127.f, 65504.f));
    const float s = half_to_float(scale);
    if (!(s > 0.f)) {
        std::memset(q, 0, static_cast<size_t>(head_dim));
        return scale;
    }
    const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(kvflow::load16(x + d), vs),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 c = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
    }
    return scale;
}
#endif

// One head, by the vector path where it applies.
template <typename Dt>
inline uint16_t quantize_head_fast(const typename Dt::T* x, int64_t head_dim, int8_t* q) {
#if defined(KVFLOW_AVX512F)
    if (head_dim % 16 == 0) return quantize_head16<Dt>(x, head_dim, q);
#endif
    return quantize_head<Dt>(x, head_dim, q);
}

template <typename Dt>
void write_kv_int8(const typename Dt::T* k, int64_t k_stride, const typename Dt::T* v, int64_t v_stride,
                   int8_t* key_cache, uint16_t* key_scales, int8_t* value_cache, uint16_t* value_scales,
                   const int64_t* slot_mapping, int64_t tokens, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size) {
    const int64_t block_elems = block_size * num_kv_heads * head_dim;
#pragma omp parallel for if (tokens * num_kv_heads * head_dim >= (1 << 16))
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slot_mapping[t], b = slot / block_size, i = slot % block_size;
        int8_t q[1024];
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            key_scales[slot * num_kv_heads + h] = quantize_head_fast<Dt>(k + t * k_stride + h * head_dim, head_dim, q);
            int8_t* kblock = key_cache + b * block_elems;
            for (int64_t d = 0; d < head_dim; d += 4)  // one 4-dim cell at a time (head_dim % 4 == 0)
                std::memcpy(kblock + kvflow::key_offset<int8_t>(i, h, d, head_dim, block_size), q + d, 4);
            value_scales[slot * num_kv_heads + h] =
                quantize_head_fast<Dt>(v + t * v_stride + h * head_dim, head_dim,
                                       value_cache + (slot * num_kv_heads + h) * head_dim);
        }
    }
}

// Rows of one sequence and one KV head: query positions [row_begin, row_end) of the flat batch.
struct Item {
    int64_t seq, head, row_begin, row_end, keys;  // keys: how many the last row sees
};

// Prefill positions per item: one long chunk still spreads over every thread, and the item's
// scales are converted once for many rows.
constexpr int64_t kRowsPerItem = 64;

// The float16 scales of keys [0, len) of KV head h as float32 (exactly), zero up to `padded`.
void item_scales(const uint16_t* scales, const int64_t* table, int64_t len, int64_t padded, int64_t h,
                 int64_t num_kv_heads, int64_t block_size, float* out) {
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const uint16_t* s = scales + table[t0 / block_size] * block_size * num_kv_heads + h;
        const int64_t n = std::min(block_size, len - t0);
#if defined(KVFLOW_AVX512F)
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            alignas(32) uint16_t halves[16];
            for (int j = 0; j < 16; ++j) halves[j] = s[(i + j) * num_kv_heads];
            _mm512_storeu_ps(out + t0 + i,
                             _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(halves))));
        }
        for (; i < n; ++i) out[t0 + i] = half_to_float(s[i * num_kv_heads]);
#else
        for (int64_t i = 0; i < n; ++i) out[t0 + i] = half_to_float(s[i * num_kv_heads]);
#endif
    }
    std::fill(out + len, out + padded, 0.f);
}

template <typename Dt>
void attention_int8(const typename Dt::T* q, int64_t q_stride, const int8_t* key_cache, const uint16_t* key_scales,
                    const int8_t* value_cache, const uint16_t* value_scales, const int64_t* block_tables,
                    int64_t block_table_stride, const int64_t* query_start, const int64_t* seq_lens,
                    typename Dt::T* out, int64_t out_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, int64_t block_size, float scale, bool portable) {
    namespace ia = kvflow::int8attn;
    const int64_t group = num_heads / num_kv_heads, D = head_dim;
#if defined(KVFLOW_AVX512F)
    const ia::AttendFn fast = portable || D % 16 != 0 ? nullptr : ia::attend_for(D / 16);
#endif
    std::vector<Item> items;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t rows = query_start[s + 1] - query_start[s];
        const int64_t context = seq_lens[s] - rows;  // keys before the first row's own
        for (int64_t r = 0; r < rows; r += kRowsPerItem) {
            const int64_t end = std::min(rows, r + kRowsPerItem);
            for (int64_t h = 0; h < num_kv_heads; ++h)
                items.push_back({s, h, query_start[s] + r, query_start[s] + end, context + end});
        }
    }
    // The most keys first, taken dynamically: threads finish within about one short item.
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
    const int64_t num_items = static_cast<int64_t>(items.size());
    const int64_t positions_per_call = std::max<int64_t>(1, ia::kMaxRows / group);
    const int64_t block_elems = block_size * num_kv_heads * D;

#pragma omp parallel
    {
        std::vector<float> ks, vs, scores, qf(static_cast<size_t>(ia::kMaxRows * D)),
            acc(static_cast<size_t>(ia::kMaxRows * D)), res(static_cast<size_t>(ia::kMaxRows * D));
        std::vector<int8_t> gather(static_cast<size_t>(4 * D * 16));
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; ++i) {
            const Item& it = items[static_cast<size_t>(i)];
            const int64_t* table = block_tables + it.seq * block_table_stride;
            const int64_t ld = kvflow::ref::score_stride(it.keys);
            if (static_cast<int64_t>(ks.size()) < ld) {
                ks.resize(static_cast<size_t>(ld));
                vs.resize(static_cast<size_t>(ld));
            }
            item_scales(key_scales, table, it.keys, ld, it.head, num_kv_heads, block_size, ks.data());
            item_scales(value_scales, table, it.keys, ld, it.head, num_kv_heads, block_size, vs.data());
            scores.resize(static_cast<size_t>(ia::kMaxRows * ld));
            const ia::HeadCache cache{key_cache + it.head * (D / 4) * block_size * 4, value_cache + it.head * D, table,
                                      D, block_size, num_kv_heads * D, block_elems};
            const int64_t first_len = seq_lens[it.seq] - (query_start[it.seq + 1] - it.row_begin) + 1;
            for (int64_t row = it.row_begin; row < it.row_end; row += positions_per_call) {
                const int64_t positions = std::min(positions_per_call, it.row_end - row);
                int64_t lens[ia::kMaxRows];
                for (int64_t p = 0; p < positions; ++p) lens[p] = first_len + (row - it.row_begin) + p;
                for (int64_t p = 0; p < positions; ++p)  // row r = (position p, head j): q as float32
                    for (int64_t e = 0; e < group * D; ++e)
                        qf[p * group * D + e] = Dt::load(q[(row + p) * q_stride + it.head * group * D + e]);
                const ia::Rows x{qf.data(), positions * group, group, lens, ks.data(), vs.data(), scale,
                                 scores.data(), ld, acc.data(), res.data()};
#if defined(KVFLOW_AVX512F)
                if (fast != nullptr)
                    fast(cache, x, gather.data());
                else
#endif
                    ia::attend_portable(cache, x);
                for (int64_t p = 0; p < positions; ++p)
                    for (int64_t e = 0; e < group * D; ++e)
                        out[(row + p) * out_stride + it.head * group * D + e] = Dt::store(res[p * group * D + e]);
            }
        }
    }
}

}  // namespace

extern "C" {

// The step's K and V ([tokens, num_kv_heads, head_dim] rows, k_stride / v_stride elements
// apart; dtype 0 float32, 1 bf16) quantized into their slots with their scales. -1: a head
// wider than 1024 or not a whole number of 4-byte key cells.
int kvflow_write_kv_int8(int dtype, const void* k, int64_t k_stride, const void* v, int64_t v_stride,
                         int8_t* key_cache, uint16_t* key_scales, int8_t* value_cache, uint16_t* value_scales,
                         const int64_t* slot_mapping, int64_t tokens, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size) {
    if (head_dim > 1024 || head_dim % 4 != 0) return -1;
    if (dtype == 0) {
        write_kv_int8<kvflow::F32>(static_cast<const float*>(k), k_stride, static_cast<const float*>(v), v_stride,
                                   key_cache, key_scales, value_cache, value_scales, slot_mapping, tokens,
                                   num_kv_heads, head_dim, block_size);
    } else if (dtype == 1) {
        write_kv_int8<kvflow::BF16>(static_cast<const uint16_t*>(k), k_stride, static_cast<const uint16_t*>(v),
                                    v_stride, key_cache, key_scales, value_cache, value_scales, slot_mapping, tokens,
                                    num_kv_heads, head_dim, block_size);
    } else {
        return -2;
    }
    return 0;
}

// Attention of every query row of the batch: sequence s has rows [query_start[s],
// query_start[s + 1]), the last at position seq_lens[s] - 1, each seeing the keys up to and
// including its own (decode rows are one-row sequences). The step's K/V are already written.
// q and out: [T, num_heads, head_dim] rows q_stride / out_stride elements apart, in dtype
// (0 float32, 1 bf16; computed in float32, int8_attention.h). portable != 0 forces the
// portable implementation (for tests). Returns -1 for a shape it cannot take, -2 for a dtype.
int kvflow_paged_attention_int8(int dtype, const void* q, int64_t q_stride, const int8_t* key_cache,
                                const uint16_t* key_scales, const int8_t* value_cache, const uint16_t* value_scales,
                                const int64_t* block_tables, int64_t block_table_stride, const int64_t* query_start,
                                const int64_t* seq_lens, void* out, int64_t out_stride, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                float scale, int portable) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kvflow::int8attn::kMaxRows ||
        head_dim % 4 != 0 || head_dim > 1024 || block_size < 1)
        return -1;
    if (dtype == 0) {
        attention_int8<F32>(static_cast<const float*>(q), q_stride, key_cache, key_scales, value_cache, value_scales,
                            block_tables, block_table_stride, query_start, seq_lens, static_cast<float*>(out),
                            out_stride, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, portable != 0);
    } else if (dtype == 1) {
        attention_int8<kvflow::BF16>(static_cast<const uint16_t*>(q), q_stride, key_cache, key_scales, value_cache,
                                     value_scales, block_tables, block_table_stride, query_start, seq_lens,
                                     static_cast<uint16_t*>(out), out_stride, num_seqs, num_heads, num_kv_heads,
                                     head_dim, block_size, scale, portable != 0);
    } else {
        return -2;
    }
    return 0;
}

}  // extern "C"
