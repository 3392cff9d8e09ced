// A Llama-family decoder stack in bf16 or float32, all layers in one call.
//
// The Python modules of kvflow/models/llama.py run the same kernels one op at a time; at a
// decode step each op is microseconds of work behind microseconds of Python (module calls,
// views, allocations, ctypes), about 4 ms a step for SmolLM2's 30 layers. This file runs the
// identical sequence of kernels from C++, so the result is bit for bit the modules' result
// (the tests compare them) and the per-step overhead is one call.
//
// Keep the two in step: a change to LlamaDecoderLayer.forward's order of ops is a change here
// (tests/models/test_llama_fused.py fails otherwise).
//
// Per layer, on the step's tokens (rows of the flat batch):
//   h   = rmsnorm(residual += x)              (layer 0: residual = x, h = rmsnorm(x))
//   qkv = h @ Wqkv^T (+ bias)                 (Qwen3: each q/k head RMS-normed in place), q/k
//                                             rotated in place, k/v written to the paged cache
//   a   = attention: decodes first, then prefill chunks over the paged cache (an int8 cache:
//         k/v quantized into it, then one call for decodes and chunks, as kv_int8.py does)
//   x   = a @ Wo^T;  h = rmsnorm(residual += x)
//   x   = (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T, or a mixture of experts' block (moe.cpp)
// and at the end out = rmsnorm(residual += x) with the final norm.
//
// A pipeline stage runs its own range of layers (kvflow_llama_stage_forward): a stage after
// the first starts from the previous stage's pair (x, residual), so its layer 0 is the
// general case, and a stage before the last stops before the final norm and hands on the
// pair, exactly where LlamaDecoderLayer hands (x, residual) to the next layer.

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>

#include "common.h"
#include "kernels.h"
#include "stack_gemm.h"

extern "C" {

// One layer's weights (packed by kvflow_pack_*_weight, in the stack's dtype, or quantized tiles
// where the *_q entry is set: bf16 stacks only) and its KV cache; fixed after load.
struct KvflowLlamaLayer {
    const void* input_norm;
    const void* qkv;
    const void* qkv_bias;  // may be null; in the stack's dtype
    const void* o_proj;
    const void* post_norm;
    const void* gate_up;
    const void* down;
    void* key_cache;  // [num_blocks, ...]: keys dimension-major, values token-major (common.h)
    void* value_cache;
    const KvflowQuantLinear* qkv_q;  // null: the packed weight above
    const KvflowQuantLinear* o_proj_q;
    const KvflowQuantLinear* gate_up_q;
    const KvflowQuantLinear* down_q;
    uint16_t* key_scales;  // an int8 cache's float16 scales [num_blocks, block_size, num_kv_heads]; else null
    uint16_t* value_scales;
    const KvflowMoe* moe;  // non-null: the MLP is this mixture of experts (moe.cpp), not gate_up/down
    const void* q_norm;    // non-null: Qwen3's RMSNorm of each query head (and k_norm of each key head)
    const void* k_norm;
};

struct KvflowLlamaShape {
    int64_t dtype;  // 0 = float32, 1 = bfloat16: weights, activations and KV caches alike
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, max_position;
    float eps, scale;
    const float* cos;  // [max_position, head_dim] float32 rotary tables
    const float* sin;
    const void* final_norm;
    int64_t kv_int8;  // 1: the KV caches are int8 with scales (layers/kv_int8.py), else in `dtype`
};

// One LoRA adapter's delta on one projection (kvflow/lora/layers.py): A [rank, in] and B
// [out, rank] packed by kvflow_pack_*_weight in the stack's dtype; a null `a`: not adapted.
struct KvflowLoraProj {
    const void* a;
    const void* b;
    int64_t rank;
};

// The rows of one step that run one adapter, and its deltas: projs[layer * 4 + p] for p = 0
// qkv, 1 o_proj, 2 gate_up, 3 down.
struct KvflowLoraGroup {
    int64_t num_rows;
    const int64_t* rows;  // [num_rows] rows of the flat batch, ascending
    const KvflowLoraProj* projs;
};

// One step's flat batch: decodes first, then prefill chunks (as the model runner builds it).
struct KvflowStep {
    int64_t tokens, num_seqs, num_decodes;
    const int64_t* positions;     // [tokens]
    const int64_t* slot_mapping;  // [tokens]
    const int64_t* block_tables;  // [num_seqs, block_table_stride]
    int64_t block_table_stride;
    const int64_t* seq_lens;     // [num_seqs]
    const int64_t* query_start;  // [num_seqs + 1]
    int64_t num_lora_groups;     // 0: the base model on every row
    const KvflowLoraGroup* lora_groups;
    int64_t lora_max_rank;  // the widest rank of any group's projection
};

}  // extern "C"

namespace {

using kvflow::stack_gemm;

inline float add_rounded(float a, float b) { return a + b; }
inline uint16_t add_rounded(uint16_t a, uint16_t b) {
    return kvflow::float_to_bf16(kvflow::bf16_to_float(a) + kvflow::bf16_to_float(b));
}

// out[rows] += B(A(in[rows])) for each LoRA group that adapts projection `p` of layer `l`, as
// LoRALinear.forward does after the base GEMM: the same two GEMMs on the gathered rows, then one
// add rounded to T (round to nearest even for bf16, as torch's in-place add).
template <typename T>
int add_lora(const KvflowStep* step, int64_t l, int p, const T* in, int64_t k, T* out, int64_t n, T* xg, T* t,
             T* d) {
    for (int64_t g = 0; g < step->num_lora_groups; ++g) {
        const KvflowLoraGroup& G = step->lora_groups[g];
        const KvflowLoraProj& P = G.projs[l * 4 + p];
        if (P.a == nullptr || G.num_rows == 0) continue;
        for (int64_t r = 0; r < G.num_rows; ++r)
            std::memcpy(xg + r * k, in + G.rows[r] * k, static_cast<size_t>(k) * sizeof(T));
        KVFLOW_TRY(stack_gemm(xg, G.num_rows, k, P.a, nullptr, P.rank, nullptr, t));
        KVFLOW_TRY(stack_gemm(t, G.num_rows, P.rank, P.b, nullptr, n, nullptr, d));
        for (int64_t r = 0; r < G.num_rows; ++r) {
            T* dst = out + G.rows[r] * n;
            const T* src = d + r * n;
            for (int64_t c = 0; c < n; ++c) dst[c] = add_rounded(dst[c], src[c]);
        }
    }
    return 0;
}

template <typename T>
int forward(const KvflowLlamaShape* shape, const KvflowLlamaLayer* layers, const KvflowStep* step, T* x,
            const T* x_in, T* out) {
    const int64_t tokens = step->tokens, H = shape->hidden, D = shape->head_dim, inter = shape->intermediate;
    const int64_t q_size = shape->num_heads * D, kv_size = shape->num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
    const int64_t nd = step->num_decodes, num_prefills = step->num_seqs - nd;
    const int dt = static_cast<int>(shape->dtype);
    if (tokens <= 0) return 0;
    // Scratch for one layer's intermediates, reused by every layer (not zeroed: all written before read).
    const int64_t widest = qkv_size > 2 * inter ? qkv_size : 2 * inter;
    std::unique_ptr<T[]> scratch(new (std::nothrow) T[static_cast<size_t>(tokens * (2 * H + widest + q_size + inter))]);
    if (!scratch) return -4;  // no exception may cross into ctypes
    T* h = scratch.get();          // [T, H] normed input of a sublayer
    T* y = h + tokens * H;             // [T, H] a sublayer's output
    T* wide = y + tokens * H;          // [T, qkv_size] or [T, 2 * inter]
    T* attn = wide + tokens * widest;  // [T, q_size]
    T* act = attn + tokens * q_size;   // [T, inter]
    // LoRA scratch: a group's gathered input rows, their A output and their B output.
    const int64_t widest_in = H > inter ? (H > q_size ? H : q_size) : (inter > q_size ? inter : q_size);
    const int64_t widest_out = widest > H ? widest : H;
    std::unique_ptr<T[]> lora_scratch;
    T *xg = nullptr, *lt = nullptr, *ld = nullptr;
    if (step->num_lora_groups > 0) {
        const int64_t rank = step->lora_max_rank;
        lora_scratch.reset(new (std::nothrow) T[static_cast<size_t>(tokens * (widest_in + rank + widest_out))]);
        if (!lora_scratch) return -4;
        xg = lora_scratch.get();
        lt = xg + tokens * widest_in;
        ld = lt + tokens * rank;
    }
    for (int64_t l = 0; l < shape->num_layers; ++l) {
        const KvflowLlamaLayer& L = layers[l];
        const T* sub = l > 0 ? y : x_in;  // the sublayer output still to add; none on the first stage's layer 0
        KVFLOW_TRY(sub == nullptr ? kvflow_add_rms_norm(dt, x, nullptr, L.input_norm, h, tokens, H, shape->eps)
                                  : kvflow_add_rms_norm(dt, const_cast<T*>(sub), x, L.input_norm, h, tokens, H,
                                                        shape->eps));  // sub is only read
        KVFLOW_TRY(stack_gemm(h, tokens, H, L.qkv, L.qkv_q, qkv_size, L.qkv_bias, wide));
        KVFLOW_TRY(add_lora(step, l, 0, h, H, wide, qkv_size, xg, lt, ld));
        T *q = wide, *k = wide + q_size, *v = k + kv_size;
        if (L.q_norm != nullptr) {  // each (token, head) row normed in place, as LlamaAttention norms its rows
            int rc = 0;
#pragma omp parallel for if (tokens >= 64) reduction(| : rc)
            for (int64_t t = 0; t < tokens; ++t) {
                T* qt = q + t * qkv_size;
                T* kt = k + t * qkv_size;
                rc |= kvflow_add_rms_norm(dt, qt, nullptr, L.q_norm, qt, shape->num_heads, D, shape->eps);
                rc |= kvflow_add_rms_norm(dt, kt, nullptr, L.k_norm, kt, shape->num_kv_heads, D, shape->eps);
            }
            if (rc != 0) return rc;
        }
        KVFLOW_TRY(kvflow_rotary(dt, q, qkv_size, shape->num_heads, k, qkv_size, shape->num_kv_heads,
                                 step->positions, shape->cos, shape->sin, tokens, D, shape->max_position));
        if (shape->kv_int8 != 0) {
            int8_t* kc = static_cast<int8_t*>(L.key_cache);
            int8_t* vc = static_cast<int8_t*>(L.value_cache);
            KVFLOW_TRY(kvflow_write_kv_int8(dt, k, qkv_size, v, qkv_size, kc, L.key_scales, vc, L.value_scales,
                                            step->slot_mapping, tokens, shape->num_kv_heads, D, shape->block_size));
            KVFLOW_TRY(kvflow_paged_attention_int8(dt, q, qkv_size, kc, L.key_scales, vc, L.value_scales,
                                                   step->block_tables, step->block_table_stride, step->query_start,
                                                   step->seq_lens, attn, q_size, step->num_seqs, shape->num_heads,
                                                   shape->num_kv_heads, D, shape->block_size, shape->scale, 0));
        } else {
            KVFLOW_TRY(kvflow_write_kv(k, qkv_size * sizeof(T), v, qkv_size * sizeof(T), L.key_cache, L.value_cache,
                                       step->slot_mapping, tokens, shape->num_kv_heads, D, shape->block_size,
                                       sizeof(T)));
            if (nd > 0)
                KVFLOW_TRY(kvflow_paged_decode_attention(dt, q, qkv_size, L.key_cache, L.value_cache,
                                                         step->block_tables, step->block_table_stride, step->seq_lens,
                                                         attn, nd, shape->num_heads, shape->num_kv_heads, D,
                                                         shape->block_size, shape->scale, 0));
            if (num_prefills > 0)
                KVFLOW_TRY(kvflow_paged_prefill_attention(
                    dt, q, qkv_size, L.key_cache, L.value_cache, step->block_tables + nd * step->block_table_stride,
                    step->block_table_stride, step->query_start + nd, step->seq_lens + nd, attn, q_size, num_prefills,
                    shape->num_heads, shape->num_kv_heads, D, shape->block_size, shape->scale));
        }
        KVFLOW_TRY(stack_gemm(attn, tokens, q_size, L.o_proj, L.o_proj_q, H, nullptr, y));
        KVFLOW_TRY(add_lora(step, l, 1, attn, q_size, y, H, xg, lt, ld));
        KVFLOW_TRY(kvflow_add_rms_norm(dt, y, x, L.post_norm, h, tokens, H, shape->eps));
        if (L.moe != nullptr) {
            KVFLOW_TRY(kvflow_moe_forward(dt, L.moe, h, tokens, H, y));
            continue;
        }
        KVFLOW_TRY(stack_gemm(h, tokens, H, L.gate_up, L.gate_up_q, 2 * inter, nullptr, wide));
        KVFLOW_TRY(add_lora(step, l, 2, h, H, wide, 2 * inter, xg, lt, ld));
        KVFLOW_TRY(kvflow_silu_and_mul(dt, wide, act, tokens, inter));
        KVFLOW_TRY(stack_gemm(act, tokens, inter, L.down, L.down_q, H, nullptr, y));
        KVFLOW_TRY(add_lora(step, l, 3, act, inter, y, H, xg, lt, ld));
    }
    if (shape->final_norm == nullptr) {  // a stage before the last: hand on (y, residual) as they are
        std::memcpy(out, y, static_cast<size_t>(tokens * H) * sizeof(T));
        return 0;
    }
    return kvflow_add_rms_norm(dt, y, x, shape->final_norm, out, tokens, H, shape->eps);
}

}  // namespace

extern "C" {

// One pipeline stage's layers. x [tokens, hidden]: the residual stream in (the embeddings on
// the first stage), overwritten. x_in: the previous stage's last sublayer output, nullptr on
// the first stage. out: the final normed hidden states when shape->final_norm is set (the
// last stage), else the last sublayer output (x and out then go to the next stage).
int kvflow_llama_stage_forward(const KvflowLlamaShape* shape, const KvflowLlamaLayer* layers,
                               const KvflowStep* step, void* x, const void* x_in, void* out) {
    if (shape->num_layers <= 0) return -1;
    if (shape->dtype == 0)
        return forward(shape, layers, step, static_cast<float*>(x), static_cast<const float*>(x_in),
                       static_cast<float*>(out));
    if (shape->dtype == 1)
        return forward(shape, layers, step, static_cast<uint16_t*>(x), static_cast<const uint16_t*>(x_in),
                       static_cast<uint16_t*>(out));
    return -2;
}

// x [tokens, hidden]: the embeddings in; used as the residual stream (overwritten).
// out [tokens, hidden]: the final normed hidden states.
int kvflow_llama_forward(const KvflowLlamaShape* shape, const KvflowLlamaLayer* layers, const KvflowStep* step,
                         void* x, void* out) {
    if (shape->num_layers <= 0 || shape->final_norm == nullptr) return -1;
    return kvflow_llama_stage_forward(shape, layers, step, x, nullptr, out);
}

}  // extern "C"
