// A sparse mixture-of-experts MLP block (kvflow/layers/moe.py) in one call, bf16 or float32.
//
// In Python each chosen expert costs four module calls and their views (~100 us on Zen 1), so
// a batch-1 decode step of a 32-expert, top-4 model spent more time dispatching than in its
// experts' GEMMs. Here, on a step's rows x [tokens, hidden]:
//   logits = x @ Wrouter^T                      (the stack's dtype, as the module's Linear)
//   p      = softmax(logits) in float32         (max, std::exp of each difference, the sum in
//                                                expert order, one division per expert)
//   top-k  = the k largest p, ties to the lower expert id; w = p, or p / (their sum in that
//            order) with norm_topk_prob; w rounded to the dtype with round_weights (the Qwen MoEs)
//   each chosen expert e, on its rows gathered in token order:  y = down(silu(gate) * up)
//   out[t] = sum over t's experts in ascending id of round(y * w), each add rounded to the dtype
//   (+ round(round(sigmoid(x @ Wsg^T)) * shared(x)) for Qwen2-MoE's shared expert, added last)
// Every row's result depends only on that row: the GEMMs are batch-invariant, and routing,
// weighting and the sums are per token. SparseMoeBlock runs this same function (its module
// path) and the fused stack calls it for MoE layers, so the two give the same bits.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#include "common.h"
#include "kernels.h"
#include "stack_gemm.h"

extern "C" {

// One MoE layer's packed weights (kvflow_pack_*_weight, the stack's dtype) or quantized tiles
// (bf16 only); fixed after load. gate_up_q/down_q: per-expert arrays whose null entries (or a
// null array) mean the packed weight.
struct KvflowMoe {
    int64_t num_experts, top_k, intermediate, shared_intermediate;  // shared_intermediate 0: none
    int64_t norm_topk_prob, round_weights;
    const void* router;  // [experts, hidden]
    const void* const* gate_up;  // [experts] of [2 * intermediate, hidden]
    const void* const* down;     // [experts] of [hidden, intermediate]
    const KvflowQuantLinear* const* gate_up_q;
    const KvflowQuantLinear* const* down_q;
    const void* shared_gate_up;
    const KvflowQuantLinear* shared_gate_up_q;
    const void* shared_down;
    const KvflowQuantLinear* shared_down_q;
    const void* shared_gate;  // [1, hidden]
};

}  // extern "C"

namespace {

template <typename T>
T* alloc(std::unique_ptr<T[]>& holder, int64_t n) {
    holder.reset(new (std::nothrow) T[static_cast<size_t>(n > 0 ? n : 1)]);
    return holder.get();
}

const KvflowQuantLinear* quant_of(const KvflowQuantLinear* const* array, int64_t e) {
    return array == nullptr ? nullptr : array[e];
}

// One token's top-k experts (ascending id) and their weights, from its router logits.
template <typename D>
void route(const KvflowMoe* m, const typename D::T* logits, float* probs, int64_t* ids, float* weights) {
    const int64_t E = m->num_experts, K = m->top_k;
    float top = D::load(logits[0]);
    for (int64_t e = 1; e < E; ++e) top = std::fmax(top, D::load(logits[e]));
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
        probs[e] = std::exp(D::load(logits[e]) - top);
        sum += probs[e];
    }
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    float chosen_sum = 0.f;
    for (int64_t j = 0; j < K; ++j) {  // selection: the largest left, ties to the lower id
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
            bool taken = false;
            for (int64_t i = 0; i < j; ++i) taken = taken || ids[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        ids[j] = best;
        weights[j] = probs[best];
        chosen_sum += probs[best];
    }
    for (int64_t j = 0; j < K; ++j) {
        if (m->norm_topk_prob != 0) weights[j] /= chosen_sum;
        if (m->round_weights != 0) weights[j] = D::round(weights[j]);
    }
    for (int64_t j = 1; j < K; ++j)  // ascending id: the order the outputs are added in
        for (int64_t i = j; i > 0 && ids[i - 1] > ids[i]; --i) {
            std::swap(ids[i - 1], ids[i]);
            std::swap(weights[i - 1], weights[i]);
        }
}

template <typename D>
int moe_forward(const KvflowMoe* m, const typename D::T* x, int64_t tokens, int64_t H, typename D::T* out, int dt) {
    using T = typename D::T;
    const int64_t E = m->num_experts, K = m->top_k, I = m->intermediate, P = tokens * K;
    if (tokens <= 0) return 0;
    if (E <= 0 || K <= 0 || K > E || I <= 0) return -1;
    std::unique_ptr<T[]> logits_h, rows_h, wide_h, act_h, ys_h;
    std::unique_ptr<float[]> probs_h, weights_h;
    std::unique_ptr<int64_t[]> ids_h, start_h, order_h, slot_h;
    T* logits = alloc(logits_h, tokens * E);
    float* probs = alloc(probs_h, tokens * E);
    float* weights = alloc(weights_h, P);
    int64_t* ids = alloc(ids_h, P);
    int64_t* start = alloc(start_h, E + 1);
    int64_t* order = alloc(order_h, P);  // the pairs (t * K + j) grouped by expert, tokens in order
    int64_t* slot = alloc(slot_h, P);    // where each pair's row sits in `order`
    T* rows = alloc(rows_h, P * H);
    T* wide = alloc(wide_h, P * 2 * I);
    T* act = alloc(act_h, P * I);
    T* ys = alloc(ys_h, P * H);
    if (!logits || !probs || !weights || !ids || !start || !order || !slot || !rows || !wide || !act || !ys)
        return -4;  // no exception may cross into ctypes

    KVFLOW_TRY(kvflow::stack_gemm(x, tokens, H, m->router, nullptr, E, nullptr, logits));
#pragma omp parallel for if (tokens >= 64)
    for (int64_t t = 0; t < tokens; ++t) route<D>(m, logits + t * E, probs + t * E, ids + t * K, weights + t * K);

    for (int64_t e = 0; e <= E; ++e) start[e] = 0;  // a stable counting sort of the pairs by expert
    for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    {
        std::unique_ptr<int64_t[]> next_h;
        int64_t* next = alloc(next_h, E);
        if (!next) return -4;
        std::memcpy(next, start, static_cast<size_t>(E) * sizeof(int64_t));
        for (int64_t p = 0; p < P; ++p) {
            slot[p] = next[ids[p]]++;
            order[slot[p]] = p;
        }
    }
#pragma omp parallel for if (P * H >= (1 << 16))
    for (int64_t i = 0; i < P; ++i)
        std::memcpy(rows + i * H, x + (order[i] / K) * H, static_cast<size_t>(H) * sizeof(T));
    for (int64_t e = 0; e < E; ++e) {
        const int64_t n = start[e + 1] - start[e], off = start[e];
        if (n == 0) continue;
        KVFLOW_TRY(kvflow::stack_gemm(rows + off * H, n, H, m->gate_up[e], quant_of(m->gate_up_q, e), 2 * I, nullptr,
                                      wide + off * 2 * I));
        KVFLOW_TRY(kvflow_silu_and_mul(dt, wide + off * 2 * I, act + off * I, n, I));
        KVFLOW_TRY(kvflow::stack_gemm(act + off * I, n, I, m->down[e], quant_of(m->down_q, e), H, nullptr,
                                      ys + off * H));
    }
#pragma omp parallel for if (tokens * H >= (1 << 16))
    for (int64_t t = 0; t < tokens; ++t) {
        const T* y0 = ys + slot[t * K] * H;
        const float w0 = weights[t * K];
        T* o = out + t * H;
        for (int64_t c = 0; c < H; ++c) {
            float acc = D::round(D::load(y0[c]) * w0);
            for (int64_t j = 1; j < K; ++j)
                acc = D::round(acc + D::round(D::load(ys[slot[t * K + j] * H + c]) * weights[t * K + j]));
            o[c] = D::store(acc);
        }
    }
    const int64_t S = m->shared_intermediate;
    if (S <= 0) return 0;
    // The shared expert on every row, gated by sigmoid(x @ Wsg^T) and added last (reusing the
    // expert buffers: P >= tokens rows of each).
    T* gate = logits;  // [tokens, 1]
    KVFLOW_TRY(kvflow::stack_gemm(x, tokens, H, m->shared_gate, nullptr, 1, nullptr, gate));
    std::unique_ptr<T[]> swide_h, sact_h;
    T* swide = alloc(swide_h, tokens * 2 * S);
    T* sact = alloc(sact_h, tokens * S);
    if (!swide || !sact) return -4;
    KVFLOW_TRY(kvflow::stack_gemm(x, tokens, H, m->shared_gate_up, m->shared_gate_up_q, 2 * S, nullptr, swide));
    KVFLOW_TRY(kvflow_silu_and_mul(dt, swide, sact, tokens, S));
    KVFLOW_TRY(kvflow::stack_gemm(sact, tokens, S, m->shared_down, m->shared_down_q, H, nullptr, ys));
#pragma omp parallel for if (tokens * H >= (1 << 16))
    for (int64_t t = 0; t < tokens; ++t) {
        const float g = D::round(1.f / (1.f + std::exp(-D::load(gate[t]))));
        T* o = out + t * H;
        for (int64_t c = 0; c < H; ++c)
            o[c] = D::store(D::round(D::load(o[c]) + D::round(g * D::load(ys[t * H + c]))));
    }
    return 0;
}

}  // namespace

extern "C" {

// out [tokens, hidden] = the MoE block of x [tokens, hidden] (contiguous rows; out may not alias x).
int kvflow_moe_forward(int dtype, const KvflowMoe* moe, const void* x, int64_t tokens, int64_t hidden, void* out) {
    if (dtype == 0)
        return moe_forward<kvflow::F32>(moe, static_cast<const float*>(x), tokens, hidden, static_cast<float*>(out),
                                        dtype);
    if (dtype == 1)
        return moe_forward<kvflow::BF16>(moe, static_cast<const uint16_t*>(x), tokens, hidden,
                                         static_cast<uint16_t*>(out), dtype);
    return -2;
}

}  // extern "C"
