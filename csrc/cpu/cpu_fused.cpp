// cpu_fused.cpp - the fused kernels on the CPU: each runs the unfused CPU kernels it stands for, in order, through
// host scratch buffers, so a fused task is bitwise its unfused sequence by construction (the CUDA kernels keep the
// same promise by sharing the unfused kernels' arithmetic: csrc/cuda/norm.cuh and qdot.cuh).
#include <vector>

#include "act_quant.h"
#include "backends.h"
#include "cpu_math.h"

int tm_cpu::write_norm_factors(const float* x, const float* w, float* xw, float* xss, uint8_t* xw_groups,
                               int64_t n_tokens, int64_t dim, void* stream) {
  std::vector<float> inv(static_cast<size_t>(n_tokens));  // the norm's inv: its consumer computes it itself
  TM_TRY(tm_cpu_rmsnorm_factors(x, w, xw, xss, inv.data(), n_tokens, dim, 1.0f, stream));
  if (xw_groups != nullptr) tm_act::store_row_groups(xw, xw_groups, n_tokens, dim);
  return TM_OK;
}

// Given xw and xss are x's factors as the kernel that wrote x computed them: the same bits as those computed here
// (and xw's groups the values the CPU's Q8_0 products round xw to).
extern "C" int tm_cpu_qkv_rope(int qtype, const float* x, const float* xw, const float* xss, const float* norm_w,
                               float eps,
                               const void* w_q, const void* w_k, const void* w_v, const float* b_q, const float* b_k,
                               const float* b_v, float* q, float* k_cache, float* v_cache, const int32_t* pos,
                               int64_t n_tokens, int64_t hidden, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                               int64_t max_ctx, float freq_base, int neox, const uint8_t* xw_groups, void* stream) {
  (void)xw;
  (void)xss;
  (void)xw_groups;
  const int64_t q_rows = n_heads * head_dim, kv_rows = n_kv_heads * head_dim;
  std::vector<float> xs(static_cast<size_t>(n_tokens * hidden)), inv(static_cast<size_t>(n_tokens));
  std::vector<float> k(static_cast<size_t>(n_tokens * kv_rows)), v(static_cast<size_t>(n_tokens * kv_rows));
  TM_TRY(tm_cpu_rmsnorm_factors(x, norm_w, xs.data(), nullptr, inv.data(), n_tokens, hidden, eps, stream));
  // scale = inv: no x_sums, no eps
  TM_TRY(tm_cpu_matmul(qtype, w_q, xs.data(), b_q, q, n_tokens, q_rows, hidden, 0, inv.data(), nullptr, nullptr, 0.0f,
                       nullptr, nullptr, nullptr, nullptr, stream));
  TM_TRY(tm_cpu_matmul(qtype, w_k, xs.data(), b_k, k.data(), n_tokens, kv_rows, hidden, 0, inv.data(), nullptr,
                       nullptr, 0.0f, nullptr, nullptr, nullptr, nullptr, stream));
  TM_TRY(tm_cpu_matmul(qtype, w_v, xs.data(), b_v, v.data(), n_tokens, kv_rows, hidden, 0, inv.data(), nullptr,
                       nullptr, 0.0f, nullptr, nullptr, nullptr, nullptr, stream));
  return tm_cpu_rope_kv_append(q, k.data(), v.data(), k_cache, v_cache, pos, n_tokens, n_heads, n_kv_heads, head_dim,
                               max_ctx, freq_base, neox, stream);
}

extern "C" int tm_cpu_experts_gate_up(int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                                      int64_t ffn_sh, const void* w_gate, const void* w_up, const float* h,
                                      const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k,
                                      int64_t n_experts, int64_t ffn, int64_t hidden, void* stream) {
  TM_TRY(tm_cpu_moe_gate_up(qtype, w_gate_sh, w_up_sh, h, nullptr, act_sh, n_tokens, 1, 0, 1, 1, ffn_sh, hidden,
                            nullptr, stream));
  return tm_cpu_moe_gate_up(qtype, w_gate, w_up, h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden,
                            nullptr, stream);
}

// A given gate_sh enters as the shared call's slot weights: w_eff = gate_sh[t], the bits of the gated call's
// 1 * sigmoid(z). Given act's groups, the down multiplies their values (act is then work space, tornado_moe.h):
// what the Q8_0 products would round the floats to, so the same bits.
extern "C" int tm_cpu_experts_down_accumulate(int qtype, const void* w_down_sh, const float* act_sh,
                                              const float* gate_inp_sh, const float* gate_sh, int64_t ffn_sh,
                                              const void* w_down, const float* act, const int32_t* ids,
                                              const float* weights, const float* h, float* x,
                                              const float* next_norm_w, float* xw, float* xss, int64_t n_tokens,
                                              int64_t top_k,
                                              int64_t n_experts, int64_t hidden, int64_t ffn,
                                              const uint8_t* act_groups_sh, const uint8_t* act_groups,
                                              uint8_t* xw_groups, void* stream) {
  std::vector<float> from_groups_sh, from_groups;
  if (act_groups_sh != nullptr) {
    from_groups_sh.resize(static_cast<size_t>(n_tokens * ffn_sh));
    from_groups.resize(static_cast<size_t>(n_tokens * top_k * ffn));
    tm_act::load_row_groups(act_groups_sh, from_groups_sh.data(), n_tokens, ffn_sh);
    tm_act::load_row_groups(act_groups, from_groups.data(), n_tokens * top_k, ffn);
    act_sh = from_groups_sh.data();
    act = from_groups.data();
  }
  TM_TRY(tm_cpu_moe_down_accumulate(qtype, w_down_sh, act_sh, nullptr, gate_sh, gate_inp_sh, h, x, n_tokens, 1, 0, 1,
                                    1, hidden, ffn_sh, stream));
  TM_TRY(tm_cpu_moe_down_accumulate(qtype, w_down, act, ids, weights, nullptr, nullptr, x, n_tokens, top_k, 0, top_k,
                                    n_experts, hidden, ffn, stream));
  if (xw == nullptr) return TM_OK;
  return tm_cpu::write_norm_factors(x, next_norm_w, xw, xss, xw_groups, n_tokens, hidden, stream);
}

extern "C" int tm_cpu_router_experts_gate_up(const float* x, const float* norm_w, float eps, float* h,
                                             const float* w_router, int32_t* ids, float* weights, int qtype,
                                             const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                                             int64_t ffn_sh, const float* gate_inp_sh, float* gate_sh,
                                             const void* w_gate, const void* w_up, float* act, int64_t n_tokens,
                                             int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                                             int64_t ffn, int32_t* /*scratch: unused*/, uint8_t* act_groups_sh,
                                             uint8_t* act_groups, const float* xw, const float* xss,
                                             const uint8_t* /*xw_groups: the values xw rounds to here*/,
                                             void* stream) {
  TM_TRY(tm_cpu_rmsnorm_router_topk(x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts, hidden, top_k,
                                    normalize, stream));
  if (gate_inp_sh != nullptr)
    for (int64_t t = 0; t < n_tokens; ++t) gate_sh[t] = tm_cpu::shared_gate(gate_inp_sh, h + t * hidden, hidden);
  // the shared expert's gate-up on h, or in the deferred form on xw scaled by the inv of xss
  const std::vector<float> inv = xw != nullptr ? tm_cpu::grouped_rms_invs(xss, n_tokens, hidden, eps)
                                               : std::vector<float>();
  TM_TRY(tm_cpu_moe_gate_up(qtype, w_gate_sh, w_up_sh, xw != nullptr ? xw : h, nullptr, act_sh, n_tokens, 1, 0, 1, 1,
                            ffn_sh, hidden, xw != nullptr ? inv.data() : nullptr, stream));
  TM_TRY(tm_cpu_moe_gate_up(qtype, w_gate, w_up, h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden,
                            nullptr, stream));
  if (act_groups_sh != nullptr) {
    tm_act::store_row_groups(act_sh, act_groups_sh, n_tokens, ffn_sh);
    tm_act::store_row_groups(act, act_groups, n_tokens * top_k, ffn);
  }
  return TM_OK;
}

extern "C" int tm_cpu_rmsnorm_router_topk(const float* x, const float* norm_w, float eps, float* h,
                                          const float* w_router, int32_t* ids, float* weights, int64_t n_tokens,
                                          int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                                          void* stream) {
  TM_TRY(tm_cpu_rmsnorm(x, norm_w, h, n_tokens, hidden, eps, stream));
  return tm_cpu_router_topk(w_router, h, ids, weights, n_tokens, n_experts, hidden, top_k, normalize, stream);
}
