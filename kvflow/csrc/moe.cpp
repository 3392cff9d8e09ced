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
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "common.h"
#include "kernels.h"
#include "stack_gemm.h"
#include "vec_dtype.h"

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

// A step's buffers, carved one after another out of one block. A prefill chunk's expert rows are
// tens of MB: allocated afresh on every call, the kernel page-faulted and zeroed them each time
// (clear_page alone was ~5 % of a 2,048-token block on an AMX machine). So up to kKeptBytes the
// block is a per-thread one kept between calls (common.h's scratch_floats, slot 8: no other
// kernel uses it); larger steps (big models' prefill chunks) allocate theirs for the call only,
// so no thread holds hundreds of MB after its largest step.
class StepArena {
public:
    static constexpr size_t kKeptBytes = size_t{64} << 20;

    // Room for `bytes` (the sum of piece() over every take).
    explicit StepArena(size_t bytes) {
        if (bytes <= kKeptBytes) {
            base_ = reinterpret_cast<char*>(kvflow::scratch_floats<8>(static_cast<int64_t>(bytes / 4)));
        } else {
            owned_.reset(static_cast<char*>(std::aligned_alloc(64, bytes)));  // a multiple of 64
            base_ = owned_.get();
        }
        size_ = base_ != nullptr ? bytes : 0;
    }
    template <typename T>
    static size_t piece(int64_t n) { return (static_cast<size_t>(n > 0 ? n : 1) * sizeof(T) + 63) / 64 * 64; }
    // n values of T, 64-byte aligned; null out of memory or past the block.
    template <typename T>
    T* take(int64_t n) {
        const size_t bytes = piece<T>(n);
        if (base_ == nullptr || used_ + bytes > size_) return nullptr;
        T* p = reinterpret_cast<T*>(base_ + used_);
        used_ += bytes;
        return p;
    }

private:
    struct Free {
        void operator()(char* p) const { std::free(p); }
    };
    std::unique_ptr<char, Free> owned_;
    char* base_ = nullptr;
    size_t size_ = 0, used_ = 0;
};

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

// A product kept as its own rounded float32 value. In float32, where the dtype's round does
// nothing, GCC would otherwise contract `acc + y * w` into one FMA (-ffp-contract=fast is its
// C++ default), on some columns and not others: the reference multiplies, then adds.
// (The SIMDe build emulates the vectors as structs and is compiled with -ffp-contract=off.)
template <typename V>
inline V unfused(V product) {
#if !defined(KVFLOW_SIMDE)
    __asm__("" : "+x"(product));
#endif
    return product;
}

// out[c] = round(... round(round(y_0[c] * w_0) + round(y_1[c] * w_1)) ...), the experts' rows y_j
// = ys + slot[j] * H in the order given: each product and each partial sum rounded to the dtype,
// as the module path's `acc = acc + y * w` does. 16 (or 8) columns at a time, the same bits.
template <typename D>
void weighted_sum(const typename D::T* ys, const int64_t* slot, const float* w, int64_t K, int64_t H,
                  typename D::T* out) {
    int64_t c = 0;
#if defined(KVFLOW_AVX512F)
    for (; c + 16 <= H; c += 16) {
        __m512 acc = kvflow::round16<D>(_mm512_mul_ps(kvflow::load16(ys + slot[0] * H + c), _mm512_set1_ps(w[0])));
        for (int64_t j = 1; j < K; ++j)
            acc = kvflow::round16<D>(_mm512_add_ps(
                acc, kvflow::round16<D>(unfused(_mm512_mul_ps(kvflow::load16(ys + slot[j] * H + c), _mm512_set1_ps(w[j]))))));
        kvflow::store16<D>(out + c, acc);
    }
#elif defined(KVFLOW_REF_AVX2)
    for (; c + 8 <= H; c += 8) {
        __m256 acc = kvflow::round8<D>(_mm256_mul_ps(kvflow::load8(ys + slot[0] * H + c), _mm256_set1_ps(w[0])));
        for (int64_t j = 1; j < K; ++j)
            acc = kvflow::round8<D>(_mm256_add_ps(
                acc, kvflow::round8<D>(unfused(_mm256_mul_ps(kvflow::load8(ys + slot[j] * H + c), _mm256_set1_ps(w[j]))))));
        kvflow::store8<D>(out + c, acc);
    }
#endif
    for (; c < H; ++c) {
        float acc = D::round(D::load(ys[slot[0] * H + c]) * w[0]);
        for (int64_t j = 1; j < K; ++j) acc = D::round(acc + D::round(unfused(D::load(ys[slot[j] * H + c]) * w[j])));
        out[c] = D::store(acc);
    }
}

// out[c] = round(out[c] + round(g * y[c])): the shared expert's gated output, added last.
template <typename D>
void add_gated(const typename D::T* y, float g, int64_t H, typename D::T* out) {
    int64_t c = 0;
#if defined(KVFLOW_AVX512F)
    for (; c + 16 <= H; c += 16)
        kvflow::store16<D>(out + c, _mm512_add_ps(kvflow::load16(out + c),
                                                  kvflow::round16<D>(unfused(_mm512_mul_ps(_mm512_set1_ps(g), kvflow::load16(y + c))))));
#elif defined(KVFLOW_REF_AVX2)
    for (; c + 8 <= H; c += 8)
        kvflow::store8<D>(out + c, _mm256_add_ps(kvflow::load8(out + c),
                                                 kvflow::round8<D>(unfused(_mm256_mul_ps(_mm256_set1_ps(g), kvflow::load8(y + c))))));
#endif
    for (; c < H; ++c) out[c] = D::store(D::round(D::load(out[c]) + D::round(unfused(g * D::load(y[c])))));
}

template <typename D>
int moe_forward(const KvflowMoe* m, const typename D::T* x, int64_t tokens, int64_t H, typename D::T* out, int dt) {
    using T = typename D::T;
    const int64_t E = m->num_experts, K = m->top_k, I = m->intermediate, P = tokens * K;
    if (tokens <= 0) return 0;
    if (E <= 0 || K <= 0 || K > E || I <= 0) return -1;
    const int64_t S = m->shared_intermediate > 0 ? m->shared_intermediate : 0;
    using A = StepArena;
    A arena(A::piece<T>(tokens * E) + A::piece<float>(tokens * E) + A::piece<float>(P) + 3 * A::piece<int64_t>(P) +
            A::piece<int64_t>(E + 1) + A::piece<int64_t>(E) + 2 * A::piece<T>(P * H) + A::piece<T>(P * 2 * I) +
            A::piece<T>(P * I) + A::piece<T>(tokens * 2 * S) + A::piece<T>(tokens * S));
    T* logits = arena.take<T>(tokens * E);
    float* probs = arena.take<float>(tokens * E);
    float* weights = arena.take<float>(P);
    int64_t* ids = arena.take<int64_t>(P);
    int64_t* start = arena.take<int64_t>(E + 1);
    int64_t* next = arena.take<int64_t>(E);
    int64_t* order = arena.take<int64_t>(P);  // the pairs (t * K + j) grouped by expert, tokens in order
    int64_t* slot = arena.take<int64_t>(P);   // where each pair's row sits in `order`
    T* rows = arena.take<T>(P * H);
    T* wide = arena.take<T>(P * 2 * I);
    T* act = arena.take<T>(P * I);
    T* ys = arena.take<T>(P * H);
    T* swide = arena.take<T>(tokens * 2 * S);
    T* sact = arena.take<T>(tokens * S);
    if (!logits || !probs || !weights || !ids || !start || !next || !order || !slot || !rows || !wide || !act || !ys ||
        !swide || !sact)
        return -4;  // no exception may cross into ctypes

    KVFLOW_TRY(kvflow::stack_gemm(x, tokens, H, m->router, nullptr, E, nullptr, logits));
#pragma omp parallel for if (tokens >= 64)
    for (int64_t t = 0; t < tokens; ++t) route<D>(m, logits + t * E, probs + t * E, ids + t * K, weights + t * K);

    for (int64_t e = 0; e <= E; ++e) start[e] = 0;  // a stable counting sort of the pairs by expert
    for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    std::memcpy(next, start, static_cast<size_t>(E) * sizeof(int64_t));
    for (int64_t p = 0; p < P; ++p) {
        slot[p] = next[ids[p]]++;
        order[slot[p]] = p;
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
    for (int64_t t = 0; t < tokens; ++t) weighted_sum<D>(ys, slot + t * K, weights + t * K, K, H, out + t * H);
    if (S == 0) return 0;
    // The shared expert on every row, gated by sigmoid(x @ Wsg^T) and added last (reusing the
    // expert buffers: P >= tokens rows of each).
    T* gate = logits;  // [tokens, 1]
    KVFLOW_TRY(kvflow::stack_gemm(x, tokens, H, m->shared_gate, nullptr, 1, nullptr, gate));
    KVFLOW_TRY(kvflow::stack_gemm(x, tokens, H, m->shared_gate_up, m->shared_gate_up_q, 2 * S, nullptr, swide));
    KVFLOW_TRY(kvflow_silu_and_mul(dt, swide, sact, tokens, S));
    KVFLOW_TRY(kvflow::stack_gemm(sact, tokens, S, m->shared_down, m->shared_down_q, H, nullptr, ys));
#pragma omp parallel for if (tokens * H >= (1 << 16))
    for (int64_t t = 0; t < tokens; ++t)
        add_gated<D>(ys + t * H, D::round(1.f / (1.f + std::exp(-D::load(gate[t])))), H, out + t * H);
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
