// Paged attention over an int8 KV cache (kv_cache_dtype="int8"): decode rows and prefill
// chunks in one call, reading the int8 blocks in place through the block table.
//
// Storage (kvflow/layers/kv_int8.py): the int8 pool has the float pool's layout
// (common.h: keys dimension-major in 4-byte cells, here of 4 dims; values token-major), and
// beside it one float16 scale per token and KV head for K and for V,
// [num_blocks, block_size, num_kv_heads]. Element x of a token's head is q * scale.
//
// Numerics: each (sequence, KV head) item dequantizes the keys and values its rows see into
// float32 scratch (q * scale, one rounding), then runs attention_ref.h's float32 attention
// over that scratch. A row's output is therefore bit for bit what the float32 kernels give
// over a float32 cache holding the dequantized values: the int8 cache changes what is
// stored, never how attention is computed, so batch, chunking and prefix-caching invariance
// carry over unchanged. Reading 1 byte per element instead of 4 (or 2) is where the time
// goes at long contexts; the dequantization is a pass over data already in cache.
//
// q and out are float32 [T, num_heads, head_dim] (rows q_stride / out_stride elements apart);
// a bf16 model converts its query rows and the result around this call.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include <omp.h>

#include "attention_ref.h"
#include "common.h"

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
            key_scales[slot * num_kv_heads + h] = quantize_head<Dt>(k + t * k_stride + h * head_dim, head_dim, q);
            int8_t* kblock = key_cache + b * block_elems;
            for (int64_t d = 0; d < head_dim; ++d)
                kblock[kvflow::key_offset<int8_t>(i, h, d, head_dim, block_size)] = q[d];
            value_scales[slot * num_kv_heads + h] =
                quantize_head<Dt>(v + t * v_stride + h * head_dim, head_dim,
                                  value_cache + (slot * num_kv_heads + h) * head_dim);
        }
    }
}

// Rows of one sequence and one KV head: query positions [row_begin, row_end) of the flat batch.
struct Item {
    int64_t seq, head, row_begin, row_end, keys;  // keys: how many the last row sees
};

// Prefill rows per item: enough that dequantizing the context is a small share of the work,
// few enough that one long chunk still spreads over every thread.
constexpr int64_t kRowsPerItem = 64;

// Keys and values [0, len) of KV head h, dequantized into the single-head float32 layout
// attention_ref.h reads with an identity block table: keys [block][head_dim][block_size],
// values [block][block_size][head_dim].
void dequantize_head(const int8_t* key_cache, const uint16_t* key_scales, const int8_t* value_cache,
                     const uint16_t* value_scales, const int64_t* table, int64_t len, int64_t h, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, float* keys, float* values) {
    const int64_t block_elems = block_size * num_kv_heads * head_dim;
    const int64_t scratch_block = block_size * head_dim;
    for (int64_t b = 0; b * block_size < len; ++b) {
        const int64_t n = std::min(block_size, len - b * block_size);
        const int8_t* kblock = key_cache + table[b] * block_elems;
        const int8_t* vblock = value_cache + table[b] * block_elems;
        const uint16_t* ks = key_scales + table[b] * block_size * num_kv_heads + h;
        const uint16_t* vs = value_scales + table[b] * block_size * num_kv_heads + h;
        float* kout = keys + b * scratch_block;
        float* vout = values + b * scratch_block;
        float kscale[512];  // block sizes above 512 take the slow path below
        const bool cached = block_size <= 512;
        if (cached)
            for (int64_t t = 0; t < n; ++t) kscale[t] = half_to_float(ks[t * num_kv_heads]);
        for (int64_t d = 0; d < head_dim; ++d) {
            // Dim d of key t: cell (h, d / 4) of the block, slot t, byte d % 4 (common.h, key_offset).
            const int8_t* cells = kblock + ((h * (head_dim / 4) + d / 4) * block_size) * 4 + d % 4;
            float* row = kout + d * block_size;
            for (int64_t t = 0; t < n; ++t)
                row[t] = static_cast<float>(cells[4 * t]) * (cached ? kscale[t] : half_to_float(ks[t * num_kv_heads]));
            std::fill(row + n, row + block_size, 0.f);
        }
        for (int64_t t = 0; t < n; ++t) {
            const int8_t* src = vblock + (t * num_kv_heads + h) * head_dim;
            const float s = half_to_float(vs[t * num_kv_heads]);
            float* dst = vout + t * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * s;
        }
        std::fill(vout + n * head_dim, vout + scratch_block, 0.f);
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
// Returns -1 for a shape the scratch layout cannot take.
int kvflow_paged_attention_int8(const float* q, int64_t q_stride, const int8_t* key_cache, const uint16_t* key_scales,
                                const int8_t* value_cache, const uint16_t* value_scales, const int64_t* block_tables,
                                int64_t block_table_stride, const int64_t* query_start, const int64_t* seq_lens,
                                float* out, int64_t out_stride, int64_t num_seqs, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kvflow::ref::kMaxRefRows ||
        head_dim % 4 != 0 || block_size < 1)
        return -1;
    const int64_t group = num_heads / num_kv_heads;
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

#pragma omp parallel
    {
        std::vector<float> keys, values, scores, acc(static_cast<size_t>(kvflow::ref::kRefPositions * group * head_dim));
        std::vector<int64_t> identity;
        std::vector<const float*> vrows;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; ++i) {
            const Item& it = items[static_cast<size_t>(i)];
            const int64_t num_blocks = (it.keys + block_size - 1) / block_size;
            const size_t scratch = static_cast<size_t>(num_blocks * block_size * head_dim);
            if (keys.size() < scratch) {
                keys.resize(scratch);
                values.resize(scratch);
            }
            if (static_cast<int64_t>(identity.size()) < num_blocks) {
                identity.resize(static_cast<size_t>(num_blocks));
                std::iota(identity.begin(), identity.end(), int64_t{0});
            }
            dequantize_head(key_cache, key_scales, value_cache, value_scales, block_tables + it.seq * block_table_stride,
                            it.keys, it.head, num_kv_heads, head_dim, block_size, keys.data(), values.data());
            scores.resize(static_cast<size_t>(kvflow::ref::kRefPositions * group * kvflow::ref::score_stride(it.keys)));
            vrows.resize(static_cast<size_t>(it.keys));
            const int64_t first_len = seq_lens[it.seq] - (query_start[it.seq + 1] - it.row_begin) + 1;
            for (int64_t row = it.row_begin; row < it.row_end; row += kvflow::ref::kRefPositions) {
                const int64_t positions = std::min(kvflow::ref::kRefPositions, it.row_end - row);
                int64_t lens[kvflow::ref::kRefPositions];
                for (int64_t p = 0; p < positions; ++p) lens[p] = first_len + (row - it.row_begin) + p;
                kvflow::ref::attend_rows<F32>(q + row * q_stride + it.head * group * head_dim, q_stride, positions, group,
                                              lens, keys.data(), values.data(), identity.data(),
                                              out + row * out_stride + it.head * group * head_dim, out_stride,
                                              head_dim, block_size, head_dim, block_size * head_dim, scale,
                                              scores.data(), acc.data(), vrows.data());
            }
        }
    }
    return 0;
}

}  // extern "C"
