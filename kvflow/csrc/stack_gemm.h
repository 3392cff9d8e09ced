// What the composed kernels (llama_forward.cpp, moe.cpp) share: the error-passing macro, a
// linear layer's quantized weight record, and one GEMM call for a packed or quantized weight.
#pragma once

#include <cstdint>

#include "kernels.h"

// The first failing kernel's code is the call's result.
#define KVFLOW_TRY(call)               \
    do {                               \
        const int rc_ = (call);        \
        if (rc_ != 0) return rc_;      \
    } while (0)

extern "C" {

// A quantized linear layer's weight in tiles (kvflow_pack_quant_tiles, quant_gemm_bf16.cpp).
struct KvflowQuantLinear {
    int64_t bits;
    const uint8_t* q;
    const float* scales;
    const float* offsets;  // may be null
    int64_t group;
    int64_t layout;  // kQuantPairs, kQuantAmxRows or kQuantAmxRowsHalf (quant_tiles.h)
};

}  // extern "C"

namespace kvflow {

// y [m, n] = x [m, k] @ W^T (+ bias): W packed for kvflow's GEMM, or quantized tiles where
// `quant` is set (bf16 activations only), exactly as a `Linear` module computes it.
inline int stack_gemm(const uint16_t* x, int64_t m, int64_t k, const void* packed, const KvflowQuantLinear* quant,
                      int64_t n, const void* bias, uint16_t* y) {
    if (quant != nullptr)
        return kvflow_quant_gemm_bf16(1, x, m, k, k, static_cast<int>(quant->bits), static_cast<int>(quant->layout),
                                      quant->q, quant->scales, quant->offsets, quant->group, n, bias, y, n);
    return kvflow_gemm_bf16(x, m, k, k, static_cast<const uint16_t*>(packed), n, static_cast<const uint16_t*>(bias),
                            y, n);
}

inline int stack_gemm(const float* x, int64_t m, int64_t k, const void* packed, const KvflowQuantLinear* quant,
                      int64_t n, const void* bias, float* y) {
    if (quant != nullptr) return -2;  // quantized tiles take bf16 activations
    return kvflow_gemm_f32(x, m, k, k, static_cast<const float*>(packed), n, static_cast<const float*>(bias), y, n);
}

}  // namespace kvflow
