// The C entry points of kvflow's CPU kernels, declared once so that one kernel file can
// compose the others (llama_forward.cpp runs a whole decoder stack through them).
// dtype codes: 0 = float32, 1 = bfloat16. Each returns 0 on success unless it is void.
#pragma once

#include <cstdint>

extern "C" {

int kvflow_add_rms_norm(int dtype, void* x, void* residual, const void* weight, void* out, int64_t rows,
                        int64_t hidden, float eps);
int kvflow_silu_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter);
int kvflow_rotary(int dtype, void* q, int64_t q_row_stride, int64_t q_heads, void* k, int64_t k_row_stride,
                  int64_t k_heads, const int64_t* positions, const float* cos_cache, const float* sin_cache,
                  int64_t tokens, int64_t head_dim, int64_t max_position);
int kvflow_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed, int64_t n,
                     const uint16_t* bias, uint16_t* y, int64_t y_stride);
int kvflow_quant_gemm_bf16(int out_dtype, const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, int bits,
                           int layout, const uint8_t* q, const float* scales, const float* offsets, int64_t group,
                           int64_t n, const void* bias, void* y, int64_t y_stride);
struct KvflowMoe;  // moe.cpp
int kvflow_moe_forward(int dtype, const KvflowMoe* moe, const void* x, int64_t tokens, int64_t hidden, void* out);
int kvflow_gemm_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed, int64_t n,
                    const float* bias, float* y, int64_t y_stride);
int kvflow_write_kv(const void* k, int64_t k_row_stride, const void* v, int64_t v_row_stride, void* key_cache,
                    void* value_cache, const int64_t* slot_mapping, int64_t tokens, int64_t num_kv_heads,
                    int64_t head_dim, int64_t block_size, int64_t elem_bytes);
int kvflow_write_kv_int8(int dtype, const void* k, int64_t k_stride, const void* v, int64_t v_stride,
                         int8_t* key_cache, uint16_t* key_scales, int8_t* value_cache, uint16_t* value_scales,
                         const int64_t* slot_mapping, int64_t tokens, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size);
int kvflow_paged_attention_int8(int dtype, const void* q, int64_t q_stride, const int8_t* key_cache,
                                const uint16_t* key_scales, const int8_t* value_cache, const uint16_t* value_scales,
                                const int64_t* block_tables, int64_t block_table_stride, const int64_t* query_start,
                                const int64_t* seq_lens, void* out, int64_t out_stride, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                float scale, int portable);
int kvflow_paged_decode_attention(int dtype, const void* q, int64_t q_stride, const void* key_cache,
                                  const void* value_cache, const int64_t* block_tables, int64_t block_table_stride,
                                  const int64_t* seq_lens, void* out, int64_t num_seqs, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                  int portable);
int kvflow_decode_fast_path(int dtype, int64_t head_dim);
int kvflow_prefill_fast_path(int dtype, int64_t head_dim);
int kvflow_max_group();
int kvflow_max_head_dim();
int kvflow_packed_prefill_attention(int dtype, const void* q, int64_t q_stride, const void* key_cache,
                                    const void* value_cache, const int64_t* block_tables, int64_t block_table_stride,
                                    const int64_t* query_start, const int64_t* seq_lens, void* out, int64_t out_stride,
                                    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t block_size, float scale);
int kvflow_paged_prefill_attention(int dtype, const void* q, int64_t q_stride, const void* key_cache,
                                   const void* value_cache, const int64_t* block_tables, int64_t block_table_stride,
                                   const int64_t* query_start, const int64_t* seq_lens, void* out, int64_t out_stride,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale);

}  // extern "C"
