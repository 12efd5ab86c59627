// ops.cpp - torch.ops.tornado_moe.*: a thin shell over the C ABI (tornado_moe.h). Each op takes the C function's
// arguments (minus `device` and `stream`) plus a trailing `int stream` (the cudaStream_t as an integer, 0 on CPU),
// checks that the tensors are contiguous, on one device, of the right dtype and large enough for the given sizes,
// calls the C function and turns a failure into a RuntimeError carrying tm_last_error(). No kernel logic here, and
// no CUDA header: the same source builds against CPU and CUDA torch.
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>

#include "../common/qtypes.h"
#include "tornado_moe.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Numbers in messages are formatted here, not streamed: TORCH_CHECK's ostream formatting of integers is inlined
// from the compiler's libstdc++ headers and crashed on the GPU machine, whose g++ 13 headers are newer than the
// libstdc++ the Python process loads. Strings stream safely.
std::string num(int64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
  return buf;
}

// torch's Python names, which is what users of the ops see.
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kByte: return "uint8";
    default: return c10::toString(t);
  }
}

// Collects the tensors of one call: checks each one and that all share a device.
class Args {
 public:
  explicit Args(const char* op) : op_(op) {}

  // A float32 / int32 tensor with at least `numel` elements.
  template <typename T>
  T* data(const Tensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
    check_common(t, name);
    TORCH_CHECK(t.scalar_type() == dtype, op_, ": argument '", name, "' must be a ", dtype_name(dtype),
                " tensor, got ", dtype_name(t.scalar_type()));
    TORCH_CHECK(numel <= 0 || t.numel() >= numel, op_, ": argument '", name, "' has ", num(t.numel()),
                " elements, the sizes given need ", num(numel));
    return static_cast<T*>(t.data_ptr());
  }

  template <typename T>
  T* optional(const OptTensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
    return t.has_value() ? data<T>(*t, name, dtype, numel) : nullptr;
  }

  // Raw GGUF weight bytes: uint8, or the matching float dtype for F32/F16/BF16 tensors.
  const void* weights(const Tensor& t, const char* name, int64_t qtype, int64_t nbytes) {
    check_common(t, name);
    const at::ScalarType dt = t.scalar_type();
    const bool ok = dt == at::kByte || (qtype == TM_F32 && dt == at::kFloat) || (qtype == TM_F16 && dt == at::kHalf) ||
                    (qtype == TM_BF16 && dt == at::kBFloat16);
    TORCH_CHECK(ok, op_, ": argument '", name, "' must hold the raw GGUF bytes as a uint8 tensor (or the matching ",
                "float dtype for F32/F16/BF16), got ", dtype_name(dt), " for qtype ", num(qtype));
    TORCH_CHECK(nbytes <= 0 || t.nbytes() >= static_cast<size_t>(nbytes), op_, ": argument '", name, "' has ",
                num(static_cast<int64_t>(t.nbytes())), " bytes, the sizes given need ", num(nbytes));
    return t.data_ptr();
  }

  tm_device device() const {
    TORCH_CHECK(device_.has_value(), op_, ": no tensor argument");
    return device_->is_cuda() ? TM_DEVICE_CUDA : TM_DEVICE_CPU;
  }

  // Makes the tensors' CUDA device current for the launch (a no-op on CPU).
  c10::Device torch_device() const { return *device_; }

  void check(int status) const {
    TORCH_CHECK(status == TM_OK, op_, ": ", tm_last_error(), " (status ", num(status), ")");
  }

 private:
  void check_common(const Tensor& t, const char* name) {
    TORCH_CHECK(t.defined(), op_, ": argument '", name, "' is an undefined tensor");
    TORCH_CHECK(t.is_contiguous(), op_, ": argument '", name, "' must be contiguous");
    TORCH_CHECK(t.is_cpu() || t.is_cuda(), op_, ": argument '", name, "' is on ", t.device(),
                "; only CPU and CUDA tensors are supported");
    if (!device_.has_value()) {
      device_ = t.device();
      first_ = name;
    } else {
      TORCH_CHECK(t.device() == *device_, op_, ": argument '", name, "' is on ", t.device(), " but '", first_,
                  "' is on ", *device_, "; all tensors must be on one device");
    }
  }

  const char* op_;
  std::optional<c10::Device> device_;
  const char* first_ = "";
};

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

int64_t row_bytes(int64_t qtype, int64_t cols) { return tm_qtype_row_bytes(static_cast<int>(qtype), cols); }

constexpr auto kF32 = at::kFloat;
constexpr auto kI32 = at::kInt;
constexpr auto kU8 = at::kByte;  // int8 activation groups (tm_act_groups_bytes)

void embedding(int64_t qtype, const Tensor& table, const Tensor& ids, const Tensor& out, int64_t n_tokens,
               int64_t vocab, int64_t dim, int64_t stream) {
  Args a("tornado_moe.embedding");
  const void* table_p = a.weights(table, "table", qtype, vocab * row_bytes(qtype, dim));
  const int32_t* ids_p = a.data<const int32_t>(ids, "ids", kI32, n_tokens);
  float* out_p = a.data<float>(out, "out", kF32, n_tokens * dim);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_embedding(a.device(), static_cast<int>(qtype), table_p, ids_p, out_p, n_tokens, vocab, dim,
                       as_stream(stream)));
}

void rmsnorm(const Tensor& x, const Tensor& w, const Tensor& y, int64_t n_tokens, int64_t dim, double eps,
             int64_t stream) {
  Args a("tornado_moe.rmsnorm");
  const float* x_p = a.data<const float>(x, "x", kF32, n_tokens * dim);
  const float* w_p = a.data<const float>(w, "w", kF32, dim);
  float* y_p = a.data<float>(y, "y", kF32, n_tokens * dim);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_rmsnorm(a.device(), x_p, w_p, y_p, n_tokens, dim, static_cast<float>(eps), as_stream(stream)));
}

void rmsnorm_factors(const Tensor& x, const Tensor& w, const Tensor& xw, const OptTensor& xss, const Tensor& inv,
                     int64_t n_tokens, int64_t dim, double eps, int64_t stream) {
  Args a("tornado_moe.rmsnorm_factors");
  const float* x_p = a.data<const float>(x, "x", kF32, n_tokens * dim);
  const float* w_p = a.data<const float>(w, "w", kF32, dim);
  float* xw_p = a.data<float>(xw, "xw", kF32, n_tokens * dim);
  float* xss_p = a.optional<float>(xss, "xss", kF32, n_tokens * tm_norm_groups(dim));
  float* inv_p = a.data<float>(inv, "inv", kF32, n_tokens);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_rmsnorm_factors(a.device(), x_p, w_p, xw_p, xss_p, inv_p, n_tokens, dim, static_cast<float>(eps),
                             as_stream(stream)));
}

void matmul(int64_t qtype, const Tensor& w, const Tensor& x, const OptTensor& bias, const Tensor& y, int64_t n_tokens,
            int64_t rows, int64_t cols, bool accumulate, const OptTensor& scale, const OptTensor& x_groups,
            const OptTensor& x_sums, double eps, const OptTensor& next_norm_w, const OptTensor& y_w,
            const OptTensor& y_ss, const OptTensor& y_w_groups, int64_t stream) {
  Args a("tornado_moe.matmul");
  const void* w_p = a.weights(w, "w", qtype, rows * row_bytes(qtype, cols));
  const float* x_p = a.data<const float>(x, "x", kF32, n_tokens * cols);
  const float* b_p = a.optional<const float>(bias, "bias", kF32, rows);
  float* y_p = a.data<float>(y, "y", kF32, n_tokens * rows);
  const float* s_p = a.optional<const float>(scale, "scale", kF32, n_tokens);
  const uint8_t* xg_p = a.optional<const uint8_t>(x_groups, "x_groups", kU8, n_tokens * tm_act_groups_bytes(cols));
  const float* xs_p = a.optional<const float>(x_sums, "x_sums", kF32, n_tokens * tm_norm_groups(cols));
  const float* nw_p = a.optional<const float>(next_norm_w, "next_norm_w", kF32, rows);
  float* yw_p = a.optional<float>(y_w, "y_w", kF32, n_tokens * rows);
  float* yss_p = a.optional<float>(y_ss, "y_ss", kF32, n_tokens * tm_norm_groups(rows));
  uint8_t* ywg_p = a.optional<uint8_t>(y_w_groups, "y_w_groups", kU8, n_tokens * tm_act_groups_bytes(rows));
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_matmul(a.device(), static_cast<int>(qtype), w_p, x_p, b_p, y_p, n_tokens, rows, cols, accumulate ? 1 : 0,
                    s_p, xg_p, xs_p, static_cast<float>(eps), nw_p, yw_p, yss_p, ywg_p, as_stream(stream)));
}

void rope_kv_append(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                    const Tensor& pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                    int64_t max_ctx, double freq_base, bool neox, int64_t stream) {
  Args a("tornado_moe.rope_kv_append");
  float* q_p = a.data<float>(q, "q", kF32, n_tokens * n_heads * head_dim);
  const float* k_p = a.data<const float>(k, "k", kF32, n_tokens * n_kv_heads * head_dim);
  const float* v_p = a.data<const float>(v, "v", kF32, n_tokens * n_kv_heads * head_dim);
  float* kc_p = a.data<float>(k_cache, "k_cache", kF32, max_ctx * n_kv_heads * head_dim);
  float* vc_p = a.data<float>(v_cache, "v_cache", kF32, max_ctx * n_kv_heads * head_dim);
  const int32_t* pos_p = a.data<const int32_t>(pos, "pos", kI32, 1);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_rope_kv_append(a.device(), q_p, k_p, v_p, kc_p, vc_p, pos_p, n_tokens, n_heads, n_kv_heads, head_dim,
                            max_ctx, static_cast<float>(freq_base), neox ? 1 : 0, as_stream(stream)));
}

void qkv_rope(int64_t qtype, const Tensor& x, const OptTensor& xw, const OptTensor& xss, const Tensor& norm_w, double eps,
              const Tensor& w_q,
              const Tensor& w_k, const Tensor& w_v, const OptTensor& b_q, const OptTensor& b_k, const OptTensor& b_v, const Tensor& q,
              const Tensor& k_cache, const Tensor& v_cache, const Tensor& pos, int64_t n_tokens, int64_t hidden,
              int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx, double freq_base, bool neox,
              const OptTensor& xw_groups, int64_t stream) {
  Args a("tornado_moe.qkv_rope");
  const int64_t q_rows = n_heads * head_dim, kv_rows = n_kv_heads * head_dim;
  const float* x_p = a.data<const float>(x, "x", kF32, n_tokens * hidden);
  const float* xw_p = a.optional<const float>(xw, "xw", kF32, n_tokens * hidden);
  const float* xss_p = a.optional<const float>(xss, "xss", kF32, n_tokens * tm_norm_groups(hidden));
  const float* nw_p = a.data<const float>(norm_w, "norm_w", kF32, hidden);
  const void* wq_p = a.weights(w_q, "w_q", qtype, q_rows * row_bytes(qtype, hidden));
  const void* wk_p = a.weights(w_k, "w_k", qtype, kv_rows * row_bytes(qtype, hidden));
  const void* wv_p = a.weights(w_v, "w_v", qtype, kv_rows * row_bytes(qtype, hidden));
  const float* bq_p = a.optional<const float>(b_q, "b_q", kF32, q_rows);
  const float* bk_p = a.optional<const float>(b_k, "b_k", kF32, kv_rows);
  const float* bv_p = a.optional<const float>(b_v, "b_v", kF32, kv_rows);
  float* q_p = a.data<float>(q, "q", kF32, n_tokens * q_rows);
  float* kc_p = a.data<float>(k_cache, "k_cache", kF32, max_ctx * kv_rows);
  float* vc_p = a.data<float>(v_cache, "v_cache", kF32, max_ctx * kv_rows);
  const int32_t* pos_p = a.data<const int32_t>(pos, "pos", kI32, 1);
  const uint8_t* xwg_p = a.optional<const uint8_t>(xw_groups, "xw_groups", kU8, n_tokens * tm_act_groups_bytes(hidden));
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_qkv_rope(a.device(), static_cast<int>(qtype), x_p, xw_p, xss_p, nw_p, static_cast<float>(eps), wq_p, wk_p, wv_p,
                      bq_p, bk_p, bv_p, q_p, kc_p, vc_p, pos_p, n_tokens, hidden, n_heads, n_kv_heads, head_dim,
                      max_ctx, static_cast<float>(freq_base), neox ? 1 : 0, xwg_p, as_stream(stream)));
}

void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& out, const Tensor& pos,
               int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx,
               const Tensor& scratch, const OptTensor& out_groups, int64_t stream) {
  Args a("tornado_moe.attention");
  const float* q_p = a.data<const float>(q, "q", kF32, n_tokens * n_heads * head_dim);
  const float* kc_p = a.data<const float>(k_cache, "k_cache", kF32, max_ctx * n_kv_heads * head_dim);
  const float* vc_p = a.data<const float>(v_cache, "v_cache", kF32, max_ctx * n_kv_heads * head_dim);
  float* out_p = a.data<float>(out, "out", kF32, n_tokens * n_heads * head_dim);
  const int32_t* pos_p = a.data<const int32_t>(pos, "pos", kI32, 1);
  c10::DeviceGuard guard(a.torch_device());
  int32_t* sc_p = a.data<int32_t>(scratch, "scratch", kI32, tm_attention_scratch_words(n_tokens, n_heads, head_dim));
  uint8_t* og_p =
      a.optional<uint8_t>(out_groups, "out_groups", kU8, n_tokens * tm_act_groups_bytes(n_heads * head_dim));
  a.check(tm_attention(a.device(), q_p, kc_p, vc_p, out_p, pos_p, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx, sc_p,
                       og_p, as_stream(stream)));
}

void router_topk(const Tensor& w_router, const Tensor& h, const Tensor& ids, const Tensor& weights, int64_t n_tokens,
                 int64_t n_experts, int64_t hidden, int64_t top_k, bool normalize, int64_t stream) {
  Args a("tornado_moe.router_topk");
  const float* w_p = a.data<const float>(w_router, "w_router", kF32, n_experts * hidden);
  const float* h_p = a.data<const float>(h, "h", kF32, n_tokens * hidden);
  int32_t* ids_p = a.data<int32_t>(ids, "ids", kI32, n_tokens * top_k);
  float* wt_p = a.data<float>(weights, "weights", kF32, n_tokens * top_k);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_router_topk(a.device(), w_p, h_p, ids_p, wt_p, n_tokens, n_experts, hidden, top_k, normalize ? 1 : 0,
                         as_stream(stream)));
}

// The tensors of the fused RMSNorm + router (rmsnorm_router_topk and router_experts_gate_up).
struct RouterPtrs {
  float* x;  // written in place by router_experts_ffn
  const float* norm_w;
  float* h;
  const float* w_router;
  int32_t* ids;
  float* weights;
};
RouterPtrs router_ptrs(Args& a, const Tensor& x, const Tensor& norm_w, const Tensor& h, const Tensor& w_router,
                       const Tensor& ids, const Tensor& weights, int64_t n_tokens, int64_t n_experts, int64_t hidden,
                       int64_t top_k) {
  return RouterPtrs{a.data<float>(x, "x", kF32, n_tokens * hidden),
                    a.data<const float>(norm_w, "norm_w", kF32, hidden),
                    a.data<float>(h, "h", kF32, n_tokens * hidden),
                    a.data<const float>(w_router, "w_router", kF32, n_experts * hidden),
                    a.data<int32_t>(ids, "ids", kI32, n_tokens * top_k),
                    a.data<float>(weights, "weights", kF32, n_tokens * top_k)};
}

void rmsnorm_router_topk(const Tensor& x, const Tensor& norm_w, double eps, const Tensor& h, const Tensor& w_router,
                         const Tensor& ids, const Tensor& weights, int64_t n_tokens, int64_t n_experts, int64_t hidden,
                         int64_t top_k, bool normalize, int64_t stream) {
  Args a("tornado_moe.rmsnorm_router_topk");
  const RouterPtrs r = router_ptrs(a, x, norm_w, h, w_router, ids, weights, n_tokens, n_experts, hidden, top_k);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_rmsnorm_router_topk(a.device(), r.x, r.norm_w, static_cast<float>(eps), r.h, r.w_router, r.ids,
                                 r.weights, n_tokens, n_experts, hidden, top_k, normalize ? 1 : 0,
                                 as_stream(stream)));
}

void moe_gate_up(int64_t qtype, const Tensor& w_gate, const Tensor& w_up, const Tensor& h, const OptTensor& ids,
                 const Tensor& act, int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                 int64_t n_experts, int64_t ffn, int64_t hidden, const OptTensor& scale, int64_t stream) {
  Args a("tornado_moe.moe_gate_up");
  const int64_t expert_bytes = ffn * row_bytes(qtype, hidden);
  const void* g_p = a.weights(w_gate, "w_gate", qtype, n_experts * expert_bytes);
  const void* u_p = a.weights(w_up, "w_up", qtype, n_experts * expert_bytes);
  const float* h_p = a.data<const float>(h, "h", kF32, n_tokens * hidden);
  const int32_t* ids_p = a.optional<const int32_t>(ids, "ids", kI32, n_tokens * top_k);
  float* act_p = a.data<float>(act, "act", kF32, n_tokens * top_k * ffn);
  const float* s_p = a.optional<const float>(scale, "scale", kF32, n_tokens);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_moe_gate_up(a.device(), static_cast<int>(qtype), g_p, u_p, h_p, ids_p, act_p, n_tokens, top_k, slot_begin,
                         slot_count, n_experts, ffn, hidden, s_p, as_stream(stream)));
}

// The weights and activations of both gate-up halves (experts_gate_up and router_experts_gate_up).
struct ExpertsGateUpPtrs {
  const void* w_gate_sh;
  const void* w_up_sh;
  float* act_sh;
  const void* w_gate;
  const void* w_up;
  float* act;
};
ExpertsGateUpPtrs experts_gate_up_ptrs(Args& a, int64_t qtype, const Tensor& w_gate_sh, const Tensor& w_up_sh,
                                       const Tensor& act_sh, int64_t ffn_sh, const Tensor& w_gate, const Tensor& w_up,
                                       const Tensor& act, int64_t n_tokens, int64_t top_k, int64_t n_experts,
                                       int64_t ffn, int64_t hidden) {
  const int64_t rb = row_bytes(qtype, hidden);
  return ExpertsGateUpPtrs{a.weights(w_gate_sh, "w_gate_sh", qtype, ffn_sh * rb),
                           a.weights(w_up_sh, "w_up_sh", qtype, ffn_sh * rb),
                           a.data<float>(act_sh, "act_sh", kF32, n_tokens * ffn_sh),
                           a.weights(w_gate, "w_gate", qtype, n_experts * ffn * rb),
                           a.weights(w_up, "w_up", qtype, n_experts * ffn * rb),
                           a.data<float>(act, "act", kF32, n_tokens * top_k * ffn)};
}

// The shared expert's deferred FFN norm (router_experts_gate_up and router_experts_ffn): xw, xss, xw_groups.
struct DeferredNormPtrs {
  const float* xw;
  const float* xss;
  const uint8_t* xw_groups;
};
DeferredNormPtrs deferred_norm_ptrs(Args& a, const OptTensor& xw, const OptTensor& xss, const OptTensor& xw_groups,
                                    int64_t n_tokens, int64_t hidden) {
  return DeferredNormPtrs{
      a.optional<const float>(xw, "xw", kF32, n_tokens * hidden),
      a.optional<const float>(xss, "xss", kF32, n_tokens * tm_norm_groups(hidden)),
      a.optional<const uint8_t>(xw_groups, "xw_groups", kU8, n_tokens * tm_act_groups_bytes(hidden))};
}

void experts_gate_up(int64_t qtype, const Tensor& w_gate_sh, const Tensor& w_up_sh, const Tensor& act_sh, int64_t ffn_sh,
                     const Tensor& w_gate, const Tensor& w_up, const Tensor& h, const Tensor& ids, const Tensor& act,
                     int64_t n_tokens, int64_t top_k, int64_t n_experts, int64_t ffn, int64_t hidden,
                     int64_t stream) {
  Args a("tornado_moe.experts_gate_up");
  const ExpertsGateUpPtrs g = experts_gate_up_ptrs(a, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, act,
                                                   n_tokens, top_k, n_experts, ffn, hidden);
  const float* h_p = a.data<const float>(h, "h", kF32, n_tokens * hidden);
  const int32_t* ids_p = a.data<const int32_t>(ids, "ids", kI32, n_tokens * top_k);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_experts_gate_up(a.device(), static_cast<int>(qtype), g.w_gate_sh, g.w_up_sh, g.act_sh, ffn_sh, g.w_gate,
                             g.w_up, h_p, ids_p, g.act, n_tokens, top_k, n_experts, ffn, hidden, as_stream(stream)));
}

void router_experts_gate_up(const Tensor& x, const Tensor& norm_w, double eps, const Tensor& h, const Tensor& w_router,
                            const Tensor& ids, const Tensor& weights, int64_t qtype, const Tensor& w_gate_sh,
                            const Tensor& w_up_sh, const Tensor& act_sh, int64_t ffn_sh,
                            const OptTensor& gate_inp_sh, const OptTensor& gate_sh, const Tensor& w_gate,
                            const Tensor& w_up, const Tensor& act, int64_t n_tokens, int64_t n_experts,
                            int64_t hidden, int64_t top_k, bool normalize, int64_t ffn, const Tensor& scratch,
                            const OptTensor& act_groups_sh, const OptTensor& act_groups, const OptTensor& xw,
                            const OptTensor& xss, const OptTensor& xw_groups, int64_t stream) {
  Args a("tornado_moe.router_experts_gate_up");
  const RouterPtrs r = router_ptrs(a, x, norm_w, h, w_router, ids, weights, n_tokens, n_experts, hidden, top_k);
  const ExpertsGateUpPtrs g = experts_gate_up_ptrs(a, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, act,
                                                   n_tokens, top_k, n_experts, ffn, hidden);
  const float* gi_p = a.optional<const float>(gate_inp_sh, "gate_inp_sh", kF32, hidden);
  float* gs_p = a.optional<float>(gate_sh, "gate_sh", kF32, n_tokens);
  int32_t* sc_p = a.data<int32_t>(scratch, "scratch", kI32, tm_router_gate_up_scratch_words(n_tokens, n_experts, hidden));
  uint8_t* ags_p = a.optional<uint8_t>(act_groups_sh, "act_groups_sh", kU8, n_tokens * tm_act_groups_bytes(ffn_sh));
  uint8_t* ag_p = a.optional<uint8_t>(act_groups, "act_groups", kU8, n_tokens * top_k * tm_act_groups_bytes(ffn));
  const DeferredNormPtrs dn = deferred_norm_ptrs(a, xw, xss, xw_groups, n_tokens, hidden);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_router_experts_gate_up(a.device(), r.x, r.norm_w, static_cast<float>(eps), r.h, r.w_router, r.ids,
                                    r.weights, static_cast<int>(qtype), g.w_gate_sh, g.w_up_sh, g.act_sh, ffn_sh,
                                    gi_p, gs_p, g.w_gate, g.w_up, g.act, n_tokens, n_experts, hidden, top_k,
                                    normalize ? 1 : 0, ffn, sc_p, ags_p, ag_p, dn.xw, dn.xss, dn.xw_groups,
                                    as_stream(stream)));
}

void router_experts_ffn(const Tensor& x, const Tensor& norm_w, double eps, const Tensor& h, const Tensor& w_router,
                        const Tensor& ids, const Tensor& weights, int64_t qtype, const Tensor& w_gate_sh,
                        const Tensor& w_up_sh, const Tensor& w_down_sh, const Tensor& act_sh, int64_t ffn_sh,
                        const OptTensor& gate_inp_sh, const OptTensor& gate_sh, const Tensor& w_gate,
                        const Tensor& w_up, const Tensor& w_down, const Tensor& act, int64_t n_tokens,
                        int64_t n_experts, int64_t hidden, int64_t top_k, bool normalize, int64_t ffn,
                        const Tensor& scratch, const OptTensor& xw, const OptTensor& xss, const OptTensor& xw_groups,
                        int64_t stream) {
  Args a("tornado_moe.router_experts_ffn");
  const RouterPtrs r = router_ptrs(a, x, norm_w, h, w_router, ids, weights, n_tokens, n_experts, hidden, top_k);
  const ExpertsGateUpPtrs g = experts_gate_up_ptrs(a, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, act,
                                                   n_tokens, top_k, n_experts, ffn, hidden);
  const void* ds_p = a.weights(w_down_sh, "w_down_sh", qtype, hidden * row_bytes(qtype, ffn_sh));
  const void* d_p = a.weights(w_down, "w_down", qtype, n_experts * hidden * row_bytes(qtype, ffn));
  const float* gi_p = a.optional<const float>(gate_inp_sh, "gate_inp_sh", kF32, hidden);
  float* gs_p = a.optional<float>(gate_sh, "gate_sh", kF32, n_tokens);
  int32_t* sc_p =
      a.data<int32_t>(scratch, "scratch", kI32, tm_router_experts_ffn_scratch_words(n_tokens, n_experts, hidden));
  const DeferredNormPtrs dn = deferred_norm_ptrs(a, xw, xss, xw_groups, n_tokens, hidden);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_router_experts_ffn(a.device(), r.x, r.norm_w, static_cast<float>(eps), r.h, r.w_router, r.ids, r.weights,
                                static_cast<int>(qtype), g.w_gate_sh, g.w_up_sh, ds_p, g.act_sh, ffn_sh, gi_p, gs_p,
                                g.w_gate, g.w_up, d_p, g.act, n_tokens, n_experts, hidden, top_k, normalize ? 1 : 0,
                                ffn, sc_p, dn.xw, dn.xss, dn.xw_groups, as_stream(stream)));
}

int64_t router_experts_ffn_scratch_words(int64_t n_tokens, int64_t n_experts, int64_t hidden) {
  return tm_router_experts_ffn_scratch_words(n_tokens, n_experts, hidden);
}

int64_t router_experts_ffn_launches(bool cuda, int64_t qtype, int64_t n_tokens, int64_t n_experts, int64_t top_k,
                                    int64_t hidden, int64_t ffn_sh, int64_t ffn, bool deferred_norm) {
  const int n = tm_router_experts_ffn_launches(cuda ? TM_DEVICE_CUDA : TM_DEVICE_CPU, static_cast<int>(qtype),
                                               n_tokens, n_experts, top_k, hidden, ffn_sh, ffn, deferred_norm ? 1 : 0);
  TORCH_CHECK(n > 0, "tornado_moe.router_experts_ffn_launches: ", tm_last_error(), " (status ", num(n), ")");
  return n;
}

int64_t attention_scratch_words(int64_t n_tokens, int64_t n_heads, int64_t head_dim) {
  return tm_attention_scratch_words(n_tokens, n_heads, head_dim);
}

int64_t router_gate_up_scratch_words(int64_t n_tokens, int64_t n_experts, int64_t hidden) {
  return tm_router_gate_up_scratch_words(n_tokens, n_experts, hidden);
}

int64_t act_groups_bytes(int64_t n) { return tm_act_groups_bytes(n); }

void moe_down_accumulate(int64_t qtype, const Tensor& w_down, const Tensor& act, const OptTensor& ids,
                         const OptTensor& weights, const OptTensor& gate_inp, const OptTensor& h, const Tensor& x,
                         int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count, int64_t n_experts,
                         int64_t hidden, int64_t ffn, int64_t stream) {
  Args a("tornado_moe.moe_down_accumulate");
  const void* w_p = a.weights(w_down, "w_down", qtype, n_experts * hidden * row_bytes(qtype, ffn));
  const float* act_p = a.data<const float>(act, "act", kF32, n_tokens * top_k * ffn);
  const int32_t* ids_p = a.optional<const int32_t>(ids, "ids", kI32, n_tokens * top_k);
  const float* wt_p = a.optional<const float>(weights, "weights", kF32, n_tokens * top_k);
  const float* gi_p = a.optional<const float>(gate_inp, "gate_inp", kF32, hidden);
  const float* h_p = a.optional<const float>(h, "h", kF32, n_tokens * hidden);
  float* x_p = a.data<float>(x, "x", kF32, n_tokens * hidden);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_moe_down_accumulate(a.device(), static_cast<int>(qtype), w_p, act_p, ids_p, wt_p, gi_p, h_p, x_p,
                                 n_tokens, top_k, slot_begin, slot_count, n_experts, hidden, ffn, as_stream(stream)));
}

void experts_down_accumulate(int64_t qtype, const Tensor& w_down_sh, const Tensor& act_sh, const OptTensor& gate_inp_sh,
                             const OptTensor& gate_sh, int64_t ffn_sh, const Tensor& w_down, const Tensor& act,
                             const Tensor& ids, const OptTensor& weights, const OptTensor& h, const Tensor& x,
                             const OptTensor& next_norm_w, const OptTensor& xw, const OptTensor& xss, int64_t n_tokens,
                             int64_t top_k,
                             int64_t n_experts, int64_t hidden, int64_t ffn, const OptTensor& act_groups_sh,
                             const OptTensor& act_groups, const OptTensor& xw_groups, int64_t stream) {
  Args a("tornado_moe.experts_down_accumulate");
  const void* ws_p = a.weights(w_down_sh, "w_down_sh", qtype, hidden * row_bytes(qtype, ffn_sh));
  const float* acts_p = a.data<const float>(act_sh, "act_sh", kF32, n_tokens * ffn_sh);
  const float* gi_p = a.optional<const float>(gate_inp_sh, "gate_inp_sh", kF32, hidden);
  const float* gs_p = a.optional<const float>(gate_sh, "gate_sh", kF32, n_tokens);
  const void* w_p = a.weights(w_down, "w_down", qtype, n_experts * hidden * row_bytes(qtype, ffn));
  const float* act_p = a.data<const float>(act, "act", kF32, n_tokens * top_k * ffn);
  const int32_t* ids_p = a.data<const int32_t>(ids, "ids", kI32, n_tokens * top_k);
  const float* wt_p = a.optional<const float>(weights, "weights", kF32, n_tokens * top_k);
  const float* h_p = a.optional<const float>(h, "h", kF32, n_tokens * hidden);
  float* x_p = a.data<float>(x, "x", kF32, n_tokens * hidden);
  const float* nw_p = a.optional<const float>(next_norm_w, "next_norm_w", kF32, hidden);
  float* xw_p = a.optional<float>(xw, "xw", kF32, n_tokens * hidden);
  float* xss_p = a.optional<float>(xss, "xss", kF32, n_tokens * tm_norm_groups(hidden));
  const uint8_t* ags_p =
      a.optional<const uint8_t>(act_groups_sh, "act_groups_sh", kU8, n_tokens * tm_act_groups_bytes(ffn_sh));
  const uint8_t* ag_p =
      a.optional<const uint8_t>(act_groups, "act_groups", kU8, n_tokens * top_k * tm_act_groups_bytes(ffn));
  uint8_t* xwg_p = a.optional<uint8_t>(xw_groups, "xw_groups", kU8, n_tokens * tm_act_groups_bytes(hidden));
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_experts_down_accumulate(a.device(), static_cast<int>(qtype), ws_p, acts_p, gi_p, gs_p, ffn_sh, w_p,
                                     act_p, ids_p, wt_p, h_p, x_p, nw_p, xw_p, xss_p, n_tokens, top_k, n_experts, hidden, ffn,
                                     ags_p, ag_p, xwg_p, as_stream(stream)));
}

void argmax(const Tensor& logits, const Tensor& out, int64_t n_tokens, int64_t vocab, int64_t stream) {
  Args a("tornado_moe.argmax");
  const float* l_p = a.data<const float>(logits, "logits", kF32, n_tokens * vocab);
  int32_t* out_p = a.data<int32_t>(out, "out", kI32, n_tokens);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_argmax(a.device(), l_p, out_p, n_tokens, vocab, as_stream(stream)));
}

// `seed` is a uint64 in C; torch ints are int64, so it travels as the same 64 bits (the Python wrapper folds seeds
// >= 2^63 into negative ints).
void sample(const Tensor& logits, const Tensor& out, int64_t vocab, double temperature, double top_p, int64_t top_k,
            int64_t seed, const Tensor& step, int64_t stream) {
  Args a("tornado_moe.sample");
  const float* l_p = a.data<const float>(logits, "logits", kF32, vocab);
  int32_t* out_p = a.data<int32_t>(out, "out", kI32, 1);
  const int32_t* step_p = a.data<const int32_t>(step, "step", kI32, 1);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_sample(a.device(), l_p, out_p, vocab, static_cast<float>(temperature), static_cast<float>(top_p), top_k,
                    static_cast<uint64_t>(seed), step_p, as_stream(stream)));
}

void advance_position(const Tensor& pos, int64_t delta, const OptTensor& token, const OptTensor& log,
                      int64_t log_len, int64_t stream) {
  Args a("tornado_moe.advance_position");
  TORCH_CHECK(delta >= INT32_MIN && delta <= INT32_MAX, "tornado_moe.advance_position: delta ", num(delta),
              " does not fit int32");
  TORCH_CHECK(token.has_value() == log.has_value(), "tornado_moe.advance_position: give token and log together");
  int32_t* pos_p = a.data<int32_t>(pos, "pos", kI32, 1);
  const int32_t* token_p = a.optional<const int32_t>(token, "token", kI32, 1);
  int32_t* log_p = a.optional<int32_t>(log, "log", kI32, log_len);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_advance_position(a.device(), pos_p, static_cast<int32_t>(delta), token_p, log_p, log_len,
                              as_stream(stream)));
}

void argmax_advance(const Tensor& logits, const Tensor& out, int64_t vocab, const Tensor& pos, int64_t delta,
                    const OptTensor& log, int64_t log_len, int64_t stream) {
  Args a("tornado_moe.argmax_advance");
  TORCH_CHECK(delta >= INT32_MIN && delta <= INT32_MAX, "tornado_moe.argmax_advance: delta ", num(delta),
              " does not fit int32");
  const float* l_p = a.data<const float>(logits, "logits", kF32, vocab);
  int32_t* out_p = a.data<int32_t>(out, "out", kI32, 1);
  int32_t* pos_p = a.data<int32_t>(pos, "pos", kI32, 1);
  int32_t* log_p = a.optional<int32_t>(log, "log", kI32, log_len);
  c10::DeviceGuard guard(a.torch_device());
  a.check(tm_argmax_advance(a.device(), l_p, out_p, vocab, pos_p, static_cast<int32_t>(delta), log_p, log_len,
                            as_stream(stream)));
}

bool cuda_compiled() { return tm_cuda_compiled() != 0; }

int64_t cuda_device_count() { return tm_cuda_device_count(); }

std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, std::string> cuda_device_props() {
  tm_device_props p{};
  const int status = tm_cuda_device_props(&p);
  TORCH_CHECK(status == TM_OK, "tornado_moe.cuda_device_props: ", tm_last_error(), " (status ", num(status), ")");
  return {p.sm_count, p.max_grid_y, p.max_grid_z, p.smem_per_block_optin, p.l2_bytes, std::string(p.name)};
}

void set_launch_limits_for_testing(int64_t smem_per_block, int64_t max_grid_yz) {
  TORCH_CHECK(max_grid_yz >= 0 && max_grid_yz <= INT32_MAX,
              "tornado_moe.set_launch_limits_for_testing: max_grid_yz out of range: ", num(max_grid_yz));
  const int status = tm_set_launch_limits_for_testing(smem_per_block, static_cast<int>(max_grid_yz));
  TORCH_CHECK(status == TM_OK, "tornado_moe.set_launch_limits_for_testing: ", tm_last_error(), " (status ",
              num(status), ")");
}

void set_ffn_one_launch(int64_t on) {
  const int status = tm_set_ffn_one_launch(static_cast<int>(on));
  TORCH_CHECK(status == TM_OK, "tornado_moe.set_ffn_one_launch: ", tm_last_error(), " (status ", num(status), ")");
}

std::string version() { return tm_version(); }

}  // namespace

TORCH_LIBRARY(tornado_moe, m) {
  m.def("embedding(int qtype, Tensor table, Tensor ids, Tensor(a!) out, int n_tokens, int vocab, int dim, "
        "int stream) -> ()");
  m.def("rmsnorm(Tensor x, Tensor w, Tensor(a!) y, int n_tokens, int dim, float eps, int stream) -> ()");
  m.def("rmsnorm_factors(Tensor x, Tensor w, Tensor(a!) xw, Tensor(b!)? xss, Tensor(c!) inv, int n_tokens, int dim, "
        "float eps, int stream) -> ()");
  m.def("matmul(int qtype, Tensor w, Tensor x, Tensor? bias, Tensor(a!) y, int n_tokens, int rows, int cols, "
        "bool accumulate, Tensor? scale, Tensor? x_groups, Tensor? x_sums, float eps, Tensor? next_norm_w, "
        "Tensor(b!)? y_w, Tensor(c!)? y_ss, Tensor(d!)? y_w_groups, int stream) -> ()");
  m.def("rope_kv_append(Tensor(a!) q, Tensor k, Tensor v, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor pos, "
        "int n_tokens, int n_heads, int n_kv_heads, int head_dim, int max_ctx, float freq_base, bool neox, "
        "int stream) -> ()");
  m.def("qkv_rope(int qtype, Tensor x, Tensor? xw, Tensor? xss, Tensor norm_w, float eps, Tensor w_q, Tensor w_k, Tensor w_v, Tensor? b_q, "
        "Tensor? b_k, Tensor? b_v, Tensor(a!) q, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor pos, int n_tokens, "
        "int hidden, int n_heads, int n_kv_heads, int head_dim, int max_ctx, float freq_base, bool neox, "
        "Tensor? xw_groups, int stream) -> ()");
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, Tensor pos, int n_tokens, "
        "int n_heads, int n_kv_heads, int head_dim, int max_ctx, Tensor(b!) scratch, Tensor(c!)? out_groups, "
        "int stream) -> ()");
  m.def("router_topk(Tensor w_router, Tensor h, Tensor(a!) ids, Tensor(b!) weights, int n_tokens, int n_experts, "
        "int hidden, int top_k, bool normalize, int stream) -> ()");
  m.def("rmsnorm_router_topk(Tensor x, Tensor norm_w, float eps, Tensor(a!) h, Tensor w_router, Tensor(b!) ids, "
        "Tensor(c!) weights, int n_tokens, int n_experts, int hidden, int top_k, bool normalize, int stream) -> ()");
  m.def("moe_gate_up(int qtype, Tensor w_gate, Tensor w_up, Tensor h, Tensor? ids, Tensor(a!) act, int n_tokens, "
        "int top_k, int slot_begin, int slot_count, int n_experts, int ffn, int hidden, Tensor? scale, "
        "int stream) -> ()");
  m.def("experts_gate_up(int qtype, Tensor w_gate_sh, Tensor w_up_sh, Tensor(a!) act_sh, int ffn_sh, Tensor w_gate, "
        "Tensor w_up, Tensor h, Tensor ids, Tensor(b!) act, int n_tokens, int top_k, int n_experts, int ffn, "
        "int hidden, int stream) -> ()");
  m.def("router_experts_gate_up(Tensor x, Tensor norm_w, float eps, Tensor(a!) h, Tensor w_router, Tensor(b!) ids, "
        "Tensor(c!) weights, int qtype, Tensor w_gate_sh, Tensor w_up_sh, Tensor(d!) act_sh, int ffn_sh, "
        "Tensor? gate_inp_sh, Tensor(g!)? gate_sh, Tensor w_gate, Tensor w_up, Tensor(e!) act, int n_tokens, "
        "int n_experts, int hidden, int top_k, bool normalize, int ffn, Tensor(f!) scratch, Tensor(h!)? act_groups_sh, "
        "Tensor(i!)? act_groups, Tensor? xw, Tensor? xss, Tensor? xw_groups, int stream) -> ()");
  m.def("router_experts_ffn(Tensor(a!) x, Tensor norm_w, float eps, Tensor(b!) h, Tensor w_router, Tensor(c!) ids, "
        "Tensor(d!) weights, int qtype, Tensor w_gate_sh, Tensor w_up_sh, Tensor w_down_sh, Tensor(e!) act_sh, "
        "int ffn_sh, Tensor? gate_inp_sh, Tensor(f!)? gate_sh, Tensor w_gate, Tensor w_up, Tensor w_down, "
        "Tensor(g!) act, int n_tokens, int n_experts, int hidden, int top_k, bool normalize, int ffn, "
        "Tensor(h!) scratch, Tensor? xw, Tensor? xss, Tensor? xw_groups, int stream) -> ()");
  m.def("moe_down_accumulate(int qtype, Tensor w_down, Tensor act, Tensor? ids, Tensor? weights, Tensor? gate_inp, "
        "Tensor? h, Tensor(a!) x, int n_tokens, int top_k, int slot_begin, int slot_count, int n_experts, "
        "int hidden, int ffn, int stream) -> ()");
  m.def("experts_down_accumulate(int qtype, Tensor w_down_sh, Tensor act_sh, Tensor? gate_inp_sh, Tensor? gate_sh, "
        "int ffn_sh, Tensor w_down, Tensor act, Tensor ids, Tensor? weights, Tensor? h, Tensor(a!) x, "
        "Tensor? next_norm_w, Tensor(b!)? xw, Tensor(c!)? xss, int n_tokens, int top_k, int n_experts, int hidden, int ffn, "
        "Tensor? act_groups_sh, Tensor? act_groups, Tensor(d!)? xw_groups, int stream) -> ()");
  m.def("argmax(Tensor logits, Tensor(a!) out, int n_tokens, int vocab, int stream) -> ()");
  m.def("sample(Tensor logits, Tensor(a!) out, int vocab, float temperature, float top_p, int top_k, int seed, "
        "Tensor step, int stream) -> ()");
  m.def("advance_position(Tensor(a!) pos, int delta, Tensor? token, Tensor(b!)? log, int log_len, int stream) -> ()");
  m.def("argmax_advance(Tensor logits, Tensor(a!) out, int vocab, Tensor(b!) pos, int delta, Tensor(c!)? log, "
        "int log_len, int stream) -> ()");
  // No tensor arguments: catch-all kernels.
  m.def("cuda_compiled() -> bool", &cuda_compiled);
  m.def("cuda_device_count() -> int", &cuda_device_count);
  m.def("cuda_device_props() -> (int sm_count, int max_grid_y, int max_grid_z, int smem_per_block_optin, "
        "int l2_bytes, str name)",
        &cuda_device_props);
  m.def("set_launch_limits_for_testing(int smem_per_block, int max_grid_yz) -> ()", &set_launch_limits_for_testing);
  m.def("set_ffn_one_launch(int on) -> ()", &set_ffn_one_launch);
  m.def("version() -> str", &version);
  m.def("router_gate_up_scratch_words(int n_tokens, int n_experts, int hidden) -> int", &router_gate_up_scratch_words);
  m.def("act_groups_bytes(int n) -> int", &act_groups_bytes);
  m.def("attention_scratch_words(int n_tokens, int n_heads, int head_dim) -> int", &attention_scratch_words);
  m.def("router_experts_ffn_scratch_words(int n_tokens, int n_experts, int hidden) -> int", &router_experts_ffn_scratch_words);
  m.def("router_experts_ffn_launches(bool cuda, int qtype, int n_tokens, int n_experts, int top_k, int hidden, "
        "int ffn_sh, int ffn, bool deferred_norm) -> int",
        &router_experts_ffn_launches);
}

// One marshalling function per op serves both dispatch keys: the C ABI picks the backend from the device.
#define TM_REGISTER_KERNELS(m)                              \
  m.impl("embedding", &embedding);                         \
  m.impl("rmsnorm", &rmsnorm);                             \
  m.impl("rmsnorm_factors", &rmsnorm_factors);             \
  m.impl("matmul", &matmul);                               \
  m.impl("rope_kv_append", &rope_kv_append);               \
  m.impl("qkv_rope", &qkv_rope);                           \
  m.impl("attention", &attention);                         \
  m.impl("router_topk", &router_topk);                     \
  m.impl("rmsnorm_router_topk", &rmsnorm_router_topk);     \
  m.impl("moe_gate_up", &moe_gate_up);                     \
  m.impl("experts_gate_up", &experts_gate_up);             \
  m.impl("router_experts_gate_up", &router_experts_gate_up); \
  m.impl("router_experts_ffn", &router_experts_ffn);       \
  m.impl("moe_down_accumulate", &moe_down_accumulate);     \
  m.impl("experts_down_accumulate", &experts_down_accumulate); \
  m.impl("argmax", &argmax);                               \
  m.impl("sample", &sample);                               \
  m.impl("advance_position", &advance_position);           \
  m.impl("argmax_advance", &argmax_advance)

TORCH_LIBRARY_IMPL(tornado_moe, CPU, m) { TM_REGISTER_KERNELS(m); }

TORCH_LIBRARY_IMPL(tornado_moe, CUDA, m) { TM_REGISTER_KERNELS(m); }
