/*
 * backends.h - internal: the CPU and CUDA implementations behind the public C ABI (tornado_moe.h).
 * csrc/common/dispatch.cpp validates arguments once and forwards to tm_cpu_* or tm_cuda_*; each backend
 * returns a tm_status and reports failures through tm_set_error().
 */
#ifndef TORNADO_MOE_BACKENDS_H
#define TORNADO_MOE_BACKENDS_H

#include "tornado_moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records a printf-style message for tm_last_error() and returns `status`. */
int tm_set_error(int status, const char* fmt, ...);

/* Evaluates a tm_status expression and returns it from the calling function when it is not TM_OK. */
#define TM_TRY(expr)                                  \
  do {                                                \
    const int tm_try_status_ = (expr);                \
    if (tm_try_status_ != TM_OK) return tm_try_status_; \
  } while (0)

#define TM_BACKEND_KERNELS(PREFIX)                                                                            \
  int PREFIX##embedding(int qtype, const void* table, const int32_t* ids, float* out, int64_t n_tokens,        \
                        int64_t vocab, int64_t dim, void* stream);                                             \
  int PREFIX##rmsnorm(const float* x, const float* w, float* y, int64_t n_tokens, int64_t dim, float eps,      \
                      void* stream);                                                                           \
  int PREFIX##rmsnorm_factors(const float* x, const float* w, float* xw, float* xss, float* inv,             \
                              int64_t n_tokens, int64_t dim, float eps, void* stream);                       \
  int PREFIX##matmul(int qtype, const void* w, const float* x, const float* bias, float* y, int64_t n_tokens,  \
                     int64_t rows, int64_t cols, int accumulate, const float* scale, const uint8_t* x_groups,  \
                     const float* x_sums, float eps, const float* next_norm_w, float* y_w, float* y_ss,       \
                     uint8_t* y_w_groups, void* stream);                                                      \
  int PREFIX##rope_kv_append(float* q, const float* k, const float* v, float* k_cache, float* v_cache,         \
                             const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,        \
                             int64_t head_dim, int64_t max_ctx, float freq_base, int neox, void* stream);      \
  int PREFIX##qkv_rope(int qtype, const float* x, const float* xw, const float* xss, const float* norm_w,     \
                       float eps,                                                                             \
                       const void* w_q,                                                                       \
                       const void* w_k, const void* w_v, const float* b_q, const float* b_k, const float* b_v,       \
                       float* q, float* k_cache, float* v_cache, const int32_t* pos, int64_t n_tokens,             \
                       int64_t hidden, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx,       \
                       float freq_base, int neox, const uint8_t* xw_groups, void* stream);                          \
  int PREFIX##attention(const float* q, const float* k_cache, const float* v_cache, float* out,               \
                        const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,             \
                        int64_t head_dim, int64_t max_ctx, int32_t* scratch, uint8_t* out_groups,             \
                        void* stream);                                                                        \
  int PREFIX##router_topk(const float* w_router, const float* h, int32_t* ids, float* weights,                \
                          int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,  \
                          void* stream);                                                                       \
  int PREFIX##rmsnorm_router_topk(const float* x, const float* norm_w, float eps, float* h,                     \
                                  const float* w_router, int32_t* ids, float* weights, int64_t n_tokens,             \
                                  int64_t n_experts, int64_t hidden, int64_t top_k, int normalize, void* stream);   \
  int PREFIX##moe_gate_up(int qtype, const void* w_gate, const void* w_up, const float* h, const int32_t* ids, \
                          float* act, int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count, \
                          int64_t n_experts, int64_t ffn, int64_t hidden, const float* scale, void* stream); \
  int PREFIX##experts_gate_up(int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,          \
                              int64_t ffn_sh, const void* w_gate, const void* w_up, const float* h,          \
                              const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k,               \
                              int64_t n_experts, int64_t ffn, int64_t hidden, void* stream);                 \
  int PREFIX##router_experts_gate_up(const float* x, const float* norm_w, float eps, float* h,                \
                                     const float* w_router, int32_t* ids, float* weights, int qtype,        \
                                     const void* w_gate_sh, const void* w_up_sh, float* act_sh,             \
                                     int64_t ffn_sh, const float* gate_inp_sh, float* gate_sh,              \
                                     const void* w_gate, const void* w_up, float* act,                      \
                                     int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k,    \
                                     int normalize, int64_t ffn, int32_t* scratch, uint8_t* act_groups_sh,  \
                                     uint8_t* act_groups, const float* xw, const float* xss,                \
                                     const uint8_t* xw_groups, void* stream);                               \
  int PREFIX##moe_down_accumulate(int qtype, const void* w_down, const float* act, const int32_t* ids,         \
                                  const float* weights, const float* gate_inp, const float* h, float* x,      \
                                  int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,     \
                                  int64_t n_experts, int64_t hidden, int64_t ffn, void* stream);              \
  int PREFIX##experts_down_accumulate(int qtype, const void* w_down_sh, const float* act_sh,                 \
                                      const float* gate_inp_sh, const float* gate_sh, int64_t ffn_sh,        \
                                      const void* w_down,                                                    \
                                      const float* act, const int32_t* ids, const float* weights,            \
                                      const float* h, float* x, const float* next_norm_w, float* xw,         \
                                      float* xss,                                                            \
                                      int64_t n_tokens, int64_t top_k,                                       \
                                      int64_t n_experts, int64_t hidden, int64_t ffn,                        \
                                      const uint8_t* act_groups_sh, const uint8_t* act_groups,               \
                                      uint8_t* xw_groups, void* stream);                                     \
  int PREFIX##argmax(const float* logits, int32_t* out, int64_t n_tokens, int64_t vocab, void* stream);       \
  int PREFIX##sample(const float* logits, int32_t* out, int64_t vocab, float temperature, float top_p,         \
                     int64_t top_k, uint64_t seed, const int32_t* step, void* stream);                        \
  int PREFIX##advance_position(int32_t* pos, int32_t delta, const int32_t* token, int32_t* log, int64_t log_len, \
                               void* stream);                                                                \
  int PREFIX##argmax_advance(const float* logits, int32_t* out, int64_t vocab, int32_t* pos, int32_t delta,    \
                             int32_t* log, int64_t log_len, void* stream);

TM_BACKEND_KERNELS(tm_cpu_)
TM_BACKEND_KERNELS(tm_cuda_)

/* CUDA-only helpers implemented in csrc/cuda (stubs returning TM_ERR_NO_CUDA in csrc/no_cuda/no_cuda.cpp when
 * the library is built without nvcc). */
int tm_cuda_compiled_impl(void);
int tm_cuda_device_count_impl(void);
int tm_cuda_device_props_impl(tm_device_props* out);
int tm_cuda_set_launch_limits_impl(int64_t smem_per_block, int max_grid_yz);
int tm_cuda_set_ffn_one_launch_impl(int on);
int tm_cuda_graph_begin_capture_impl(void* stream);
int tm_cuda_graph_end_capture_impl(void* stream, void** graph_exec_out);
int tm_cuda_graph_launch_impl(void* graph_exec, void* stream);
int tm_cuda_graph_destroy_impl(void* graph_exec);
int tm_cuda_stream_synchronize_impl(void* stream);
/* tm_router_experts_ffn's persistent launch; TM_NOT_APPLICABLE (nothing launched) where it does not apply or is
 * not chosen: the caller (dispatch.cpp) then makes the two calls it stands for. */
#define TM_NOT_APPLICABLE 1
int tm_cuda_router_experts_ffn(float* x, const float* norm_w, float eps, float* h, const float* w_router,
                               int32_t* ids, float* weights, int qtype, const void* w_gate_sh, const void* w_up_sh,
                               const void* w_down_sh, float* act_sh, int64_t ffn_sh, const float* gate_inp_sh,
                               float* gate_sh, const void* w_gate, const void* w_up, const void* w_down, float* act,
                               int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                               int64_t ffn, int32_t* scratch, void* stream);
/* 1 or 2: the launches tm_router_experts_ffn makes for these shapes on the current device (negative: error). */
int tm_cuda_router_experts_ffn_launches(int qtype, int64_t n_tokens, int64_t n_experts, int64_t top_k,
                                        int64_t hidden, int64_t ffn_sh, int64_t ffn);

#ifdef __cplusplus
}
#endif
#endif
