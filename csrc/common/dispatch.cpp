// dispatch.cpp - the public tm_* entry points: validate every argument once (so neither backend repeats the
// checks and every message names the kernel and the argument), then forward to tm_cpu_* or tm_cuda_*.
#include <cinttypes>
#include <cmath>

#include "backends.h"
#include "qtypes.h"

namespace {

constexpr int kInvalid = TM_ERR_INVALID_ARGUMENT;

// CUDA work needs a CUDA build and a visible device; both answers are fixed for the process, so the device count
// is read once (a launch must not pay for cudaGetDeviceCount, and capture must not call it).
int check_cuda(const char* fn) {
  if (!tm_cuda_compiled_impl())
    return tm_set_error(TM_ERR_NO_CUDA, "%s: this library was built without CUDA (nvcc was not found at build time)",
                        fn);
  static const int device_count = tm_cuda_device_count_impl();
  if (device_count > 0) return TM_OK;
  return tm_set_error(TM_ERR_NO_CUDA, "%s: no CUDA device is visible to this process", fn);
}

int check_device(const char* fn, int device) {
  if (device == TM_DEVICE_CPU) return TM_OK;
  if (device == TM_DEVICE_CUDA) return check_cuda(fn);
  return tm_set_error(kInvalid, "%s: unknown device %d (expected TM_DEVICE_CPU=0 or TM_DEVICE_CUDA=1)", fn, device);
}

int check_ptr(const char* fn, const char* arg, const void* p) {
  if (p != nullptr) return TM_OK;
  return tm_set_error(kInvalid, "%s: argument '%s' is a null pointer", fn, arg);
}

// An int8 group buffer (tornado_moe.h, tm_act_groups_bytes): given only with `with` (its float buffer), 16-byte
// aligned (read as 16-byte words), for values whose groups of 4 do not straddle n_name (a row, or a head).
int check_groups(const char* fn, const char* arg, const void* p, const void* with, const char* with_name,
                 const char* n_name, int64_t n) {
  if (p == nullptr) return TM_OK;
  if (with == nullptr)
    return tm_set_error(kInvalid, "%s: '%s' goes with '%s' (the values whose groups they are)", fn, arg, with_name);
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    return tm_set_error(kInvalid, "%s: '%s' must be 16-byte aligned", fn, arg);
  if (n % 4 != 0)
    return tm_set_error(kInvalid, "%s: '%s' needs %s a multiple of 4, got %" PRId64, fn, arg, n_name, n);
  return TM_OK;
}

int check_eps(const char* fn, float eps) {
  if (!(eps >= 0.0f) || !std::isfinite(eps))
    return tm_set_error(kInvalid, "%s: argument 'eps' must be finite and >= 0, got %g", fn, (double)eps);
  return TM_OK;
}

int check_positive(const char* fn, const char* arg, int64_t v) {
  if (v > 0) return TM_OK;
  return tm_set_error(kInvalid, "%s: argument '%s' must be > 0, got %" PRId64, fn, arg, v);
}

int check_qtype(const char* fn, int qtype) {
  if (tm_qtype_supported(qtype)) return TM_OK;
  return tm_set_error(TM_ERR_UNSUPPORTED_QTYPE,
                      "%s: unsupported weight format qtype %d (GGML %s); supported: " TM_SUPPORTED_QTYPES_TEXT, fn,
                      qtype, tm_ggml_type_name(qtype));
}

// A quantized row is a whole number of blocks.
int check_row_length(const char* fn, const char* arg, int qtype, int64_t cols) {
  int64_t bs = tm_qtype_block_size(qtype);
  if (cols % bs == 0) return TM_OK;
  return tm_set_error(kInvalid, "%s: argument '%s' = %" PRId64 " is not a multiple of the %s block size %" PRId64,
                      fn, arg, cols, tm_ggml_type_name(qtype), bs);
}

int check_slots(const char* fn, int64_t top_k, int64_t slot_begin, int64_t slot_count) {
  if (slot_begin >= 0 && slot_count > 0 && slot_begin + slot_count <= top_k) return TM_OK;
  return tm_set_error(kInvalid,
                      "%s: slot range [slot_begin=%" PRId64 ", slot_begin + slot_count=%" PRId64
                      ") must be a non-empty range inside [0, top_k=%" PRId64 "]",
                      fn, slot_begin, slot_begin + slot_count, top_k);
}

// The checks of the unfused kernels, shared with the fused ones that stand for them (argument names as in the
// header; the fused kernels name their own arguments).
int check_rmsnorm_args(const char* fn, const char* x_name, const float* x, const char* w_name, const float* w,
                       const char* y_name, const float* y, int64_t n_tokens, const char* dim_name, int64_t dim,
                       float eps) {
  TM_TRY(check_ptr(fn, x_name, x));
  TM_TRY(check_ptr(fn, w_name, w));
  TM_TRY(check_ptr(fn, y_name, y));
  TM_TRY(check_positive(fn, "n_tokens", n_tokens));
  TM_TRY(check_positive(fn, dim_name, dim));
  return check_eps(fn, eps);
}

// q, the KV cache and the position of the attention kernels, and the sizes they share.
int check_cache_args(const char* fn, const float* q, const float* k_cache, const float* v_cache, const int32_t* pos,
                     int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx) {
  TM_TRY(check_ptr(fn, "q", q));
  TM_TRY(check_ptr(fn, "k_cache", k_cache));
  TM_TRY(check_ptr(fn, "v_cache", v_cache));
  TM_TRY(check_ptr(fn, "pos", pos));
  TM_TRY(check_positive(fn, "n_tokens", n_tokens));
  TM_TRY(check_positive(fn, "n_heads", n_heads));
  TM_TRY(check_positive(fn, "n_kv_heads", n_kv_heads));
  TM_TRY(check_positive(fn, "head_dim", head_dim));
  TM_TRY(check_positive(fn, "max_ctx", max_ctx));
  if (n_tokens > max_ctx)
    return tm_set_error(kInvalid, "%s: n_tokens = %" PRId64 " does not fit in max_ctx = %" PRId64, fn, n_tokens,
                        max_ctx);
  return TM_OK;
}

int check_rope_args(const char* fn, const float* q, const float* k_cache, const float* v_cache, const int32_t* pos,
                    int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx,
                    float freq_base) {
  TM_TRY(check_cache_args(fn, q, k_cache, v_cache, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx));
  if (head_dim % 2 != 0)
    return tm_set_error(kInvalid, "%s: argument 'head_dim' = %" PRId64 " must be even (RoPE rotates pairs)", fn,
                        head_dim);
  if (!(freq_base > 0.0f) || !std::isfinite(freq_base))
    return tm_set_error(kInvalid, "%s: argument 'freq_base' must be finite and > 0, got %g", fn, (double)freq_base);
  return TM_OK;
}

int check_router_args(const char* fn, const float* w_router, const char* h_name, const float* h, const int32_t* ids,
                      const float* weights, int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k) {
  TM_TRY(check_ptr(fn, "w_router", w_router));
  TM_TRY(check_ptr(fn, h_name, h));
  TM_TRY(check_ptr(fn, "ids", ids));
  TM_TRY(check_ptr(fn, "weights", weights));
  TM_TRY(check_positive(fn, "n_tokens", n_tokens));
  TM_TRY(check_positive(fn, "n_experts", n_experts));
  TM_TRY(check_positive(fn, "hidden", hidden));
  TM_TRY(check_positive(fn, "top_k", top_k));
  if (top_k > n_experts)
    return tm_set_error(kInvalid, "%s: top_k = %" PRId64 " exceeds n_experts = %" PRId64, fn, top_k, n_experts);
  if (n_experts > INT32_MAX)
    return tm_set_error(kInvalid, "%s: n_experts = %" PRId64 " does not fit the int32 expert ids", fn, n_experts);
  return TM_OK;
}

// The arguments of one gate-up weight set (shared by tm_moe_gate_up and both halves of tm_experts_gate_up).
int check_gate_up_args(const char* fn, int qtype, const char* gate_name, const void* w_gate, const char* up_name,
                       const void* w_up, const void* h, const char* act_name, const void* act, int64_t n_tokens,
                       int64_t top_k, int64_t slot_begin, int64_t slot_count, int64_t n_experts,
                       const char* ffn_name, int64_t ffn, int64_t hidden) {
  TM_TRY(check_qtype(fn, qtype));
  TM_TRY(check_ptr(fn, gate_name, w_gate));
  TM_TRY(check_ptr(fn, up_name, w_up));
  TM_TRY(check_ptr(fn, "h", h));
  TM_TRY(check_ptr(fn, act_name, act));
  TM_TRY(check_positive(fn, "n_tokens", n_tokens));
  TM_TRY(check_positive(fn, "top_k", top_k));
  TM_TRY(check_slots(fn, top_k, slot_begin, slot_count));
  TM_TRY(check_positive(fn, "n_experts", n_experts));
  TM_TRY(check_positive(fn, ffn_name, ffn));
  TM_TRY(check_positive(fn, "hidden", hidden));
  return check_row_length(fn, "hidden", qtype, hidden);
}

// The arguments of one down weight set (shared by tm_moe_down_accumulate and both halves of
// tm_experts_down_accumulate).
int check_down_args(const char* fn, int qtype, const char* w_name, const void* w_down, const char* act_name,
                    const void* act, const char* gate_name, const void* gate_inp, const void* h, const void* x,
                    int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count, int64_t n_experts,
                    int64_t hidden, const char* ffn_name, int64_t ffn) {
  TM_TRY(check_qtype(fn, qtype));
  TM_TRY(check_ptr(fn, w_name, w_down));
  TM_TRY(check_ptr(fn, act_name, act));
  TM_TRY(check_ptr(fn, "x", x));
  if (gate_inp != nullptr && h == nullptr)
    return tm_set_error(kInvalid, "%s: argument 'h' is a null pointer but '%s' is given (the gate reads h)", fn,
                        gate_name);
  TM_TRY(check_positive(fn, "n_tokens", n_tokens));
  TM_TRY(check_positive(fn, "top_k", top_k));
  TM_TRY(check_slots(fn, top_k, slot_begin, slot_count));
  TM_TRY(check_positive(fn, "n_experts", n_experts));
  TM_TRY(check_positive(fn, "hidden", hidden));
  TM_TRY(check_positive(fn, ffn_name, ffn));
  return check_row_length(fn, ffn_name, qtype, ffn);
}

// The two halves' int8 groups (tm_router_experts_gate_up writes them, tm_experts_down_accumulate reads them):
// both or neither.
int check_act_groups(const char* fn, const void* groups_sh, const float* act_sh, int64_t ffn_sh, const void* groups,
                     const float* act, int64_t ffn) {
  if ((groups_sh == nullptr) != (groups == nullptr))
    return tm_set_error(kInvalid, "%s: give 'act_groups_sh' and 'act_groups' together or neither", fn);
  TM_TRY(check_groups(fn, "act_groups_sh", groups_sh, act_sh, "act_sh", "ffn_sh", ffn_sh));
  return check_groups(fn, "act_groups", groups, act, "act", "ffn", ffn);
}

// The arguments of a choice of tokens from n_tokens rows of logits (tm_argmax, tm_sample)
int check_choice(const char* fn, tm_device device, const float* logits, const int32_t* out, int64_t n_tokens,
                 int64_t vocab) {
  TM_TRY(check_device(fn, device));
  TM_TRY(check_ptr(fn, "logits", logits));
  TM_TRY(check_ptr(fn, "out", out));
  TM_TRY(check_positive(fn, "n_tokens", n_tokens));
  TM_TRY(check_positive(fn, "vocab", vocab));
  if (vocab > INT32_MAX)
    return tm_set_error(kInvalid, "%s: vocab = %" PRId64 " does not fit the int32 token ids", fn, vocab);
  return TM_OK;
}

// tm_advance_position's arguments (token: where the chosen token is read from)
int check_advance(const char* fn, const int32_t* pos, const int32_t* token, const int32_t* log, int64_t log_len) {
  TM_TRY(check_ptr(fn, "pos", pos));
  if (log != nullptr) {
    TM_TRY(check_ptr(fn, "token", token));
    if (log_len < 0)
      return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: argument 'log_len' must be >= 0, got %lld", fn,
                          static_cast<long long>(log_len));
  }
  return TM_OK;
}

}  // namespace

#define TM_FORWARD(kernel, device, ...)                                                              \
  ((device) == TM_DEVICE_CPU ? tm_cpu_##kernel(__VA_ARGS__) : tm_cuda_##kernel(__VA_ARGS__))

extern "C" {

// ---- library and device ----------------------------------------------------------------------------------

TM_API int tm_cuda_compiled(void) { return tm_cuda_compiled_impl(); }

TM_API int tm_cuda_device_count(void) { return tm_cuda_device_count_impl(); }

TM_API int tm_cuda_device_props(tm_device_props* out) {
  TM_TRY(check_ptr("tm_cuda_device_props", "out", out));
  return tm_cuda_device_props_impl(out);
}

TM_API int tm_set_launch_limits_for_testing(int64_t smem_per_block, int max_grid_yz) {
  const char* fn = "tm_set_launch_limits_for_testing";
  if (smem_per_block < 0)
    return tm_set_error(kInvalid, "%s: argument 'smem_per_block' must be >= 0 (0 = device value), got %" PRId64, fn,
                        smem_per_block);
  if (max_grid_yz < 0 || max_grid_yz > 65535)
    return tm_set_error(kInvalid, "%s: argument 'max_grid_yz' must be in [0, 65535] (0 = device value), got %d", fn,
                        max_grid_yz);
  return tm_cuda_set_launch_limits_impl(smem_per_block, max_grid_yz);
}

TM_API int tm_set_ffn_one_launch(int on) {
  if (on < -1 || on > 1)
    return tm_set_error(kInvalid, "tm_set_ffn_one_launch: argument 'on' must be -1, 0 or 1, got %d", on);
  return tm_cuda_set_ffn_one_launch_impl(on);
}

TM_API int tm_cuda_graph_begin_capture(void* stream) {
  TM_TRY(check_cuda("tm_cuda_graph_begin_capture"));
  return tm_cuda_graph_begin_capture_impl(stream);
}

TM_API int tm_cuda_graph_end_capture(void* stream, void** graph_exec_out) {
  TM_TRY(check_ptr("tm_cuda_graph_end_capture", "graph_exec_out", graph_exec_out));
  return tm_cuda_graph_end_capture_impl(stream, graph_exec_out);
}

TM_API int tm_cuda_graph_launch(void* graph_exec, void* stream) {
  TM_TRY(check_ptr("tm_cuda_graph_launch", "graph_exec", graph_exec));
  return tm_cuda_graph_launch_impl(graph_exec, stream);
}

TM_API int tm_cuda_graph_destroy(void* graph_exec) {
  TM_TRY(check_ptr("tm_cuda_graph_destroy", "graph_exec", graph_exec));
  return tm_cuda_graph_destroy_impl(graph_exec);
}

TM_API int tm_stream_synchronize(tm_device device, void* stream) {
  TM_TRY(check_device("tm_stream_synchronize", device));
  if (device == TM_DEVICE_CPU) return TM_OK;  // CPU kernels are synchronous
  return tm_cuda_stream_synchronize_impl(stream);
}

// ---- kernels -------------------------------------------------------------------------------------------------

TM_API int tm_embedding(tm_device device, int qtype, const void* table, const int32_t* ids, float* out,
                        int64_t n_tokens, int64_t vocab, int64_t dim, void* stream) {
  const char* fn = "tm_embedding";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_qtype(fn, qtype));
  TM_TRY(check_ptr(fn, "table", table));
  TM_TRY(check_ptr(fn, "ids", ids));
  TM_TRY(check_ptr(fn, "out", out));
  TM_TRY(check_positive(fn, "n_tokens", n_tokens));
  TM_TRY(check_positive(fn, "vocab", vocab));
  TM_TRY(check_positive(fn, "dim", dim));
  TM_TRY(check_row_length(fn, "dim", qtype, dim));
  return TM_FORWARD(embedding, device, qtype, table, ids, out, n_tokens, vocab, dim, stream);
}

TM_API int tm_rmsnorm(tm_device device, const float* x, const float* w, float* y, int64_t n_tokens, int64_t dim,
                      float eps, void* stream) {
  const char* fn = "tm_rmsnorm";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_rmsnorm_args(fn, "x", x, "w", w, "y", y, n_tokens, "dim", dim, eps));
  return TM_FORWARD(rmsnorm, device, x, w, y, n_tokens, dim, eps, stream);
}

TM_API int tm_rmsnorm_factors(tm_device device, const float* x, const float* w, float* xw, float* xss, float* inv,
                              int64_t n_tokens, int64_t dim, float eps, void* stream) {
  const char* fn = "tm_rmsnorm_factors";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_rmsnorm_args(fn, "x", x, "w", w, "xw", xw, n_tokens, "dim", dim, eps));
  TM_TRY(check_ptr(fn, "inv", inv));
  return TM_FORWARD(rmsnorm_factors, device, x, w, xw, xss, inv, n_tokens, dim, eps, stream);
}

TM_API int tm_matmul(tm_device device, int qtype, const void* w, const float* x, const float* bias, float* y,
                     int64_t n_tokens, int64_t rows, int64_t cols, int accumulate, const float* scale,
                     const uint8_t* x_groups, const float* x_sums, float eps, const float* next_norm_w, float* y_w,
                     float* y_ss, uint8_t* y_w_groups, void* stream) {
  const char* fn = "tm_matmul";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_qtype(fn, qtype));
  TM_TRY(check_ptr(fn, "w", w));
  TM_TRY(check_ptr(fn, "x", x));
  TM_TRY(check_ptr(fn, "y", y));
  TM_TRY(check_positive(fn, "n_tokens", n_tokens));
  TM_TRY(check_positive(fn, "rows", rows));
  TM_TRY(check_positive(fn, "cols", cols));
  TM_TRY(check_row_length(fn, "cols", qtype, cols));
  TM_TRY(check_groups(fn, "x_groups", x_groups, x, "x", "cols", cols));
  if (x_sums != nullptr) {
    if (scale != nullptr) return tm_set_error(kInvalid, "%s: give 'scale' or 'x_sums', not both", fn);
    TM_TRY(check_eps(fn, eps));
  }
  if ((next_norm_w == nullptr) != (y_w == nullptr) || (y_w == nullptr) != (y_ss == nullptr))
    return tm_set_error(kInvalid, "%s: give 'next_norm_w', 'y_w' and 'y_ss' together (the next normalisation's "
                        "factor and partial sums) or none of them", fn);
  TM_TRY(check_groups(fn, "y_w_groups", y_w_groups, y_w, "y_w", "rows", rows));
  return TM_FORWARD(matmul, device, qtype, w, x, bias, y, n_tokens, rows, cols, accumulate ? 1 : 0, scale, x_groups,
                    x_sums, eps, next_norm_w, y_w, y_ss, y_w_groups, stream);
}

TM_API int tm_rope_kv_append(tm_device device, float* q, const float* k, const float* v, float* k_cache,
                             float* v_cache, const int32_t* pos, int64_t n_tokens, int64_t n_heads,
                             int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx, float freq_base, int neox,
                             void* stream) {
  const char* fn = "tm_rope_kv_append";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_ptr(fn, "k", k));
  TM_TRY(check_ptr(fn, "v", v));
  TM_TRY(check_rope_args(fn, q, k_cache, v_cache, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx, freq_base));
  return TM_FORWARD(rope_kv_append, device, q, k, v, k_cache, v_cache, pos, n_tokens, n_heads, n_kv_heads,
                    head_dim, max_ctx, freq_base, neox ? 1 : 0, stream);
}

TM_API int tm_qkv_rope(tm_device device, int qtype, const float* x, const float* xw, const float* xss,
                       const float* norm_w, float eps, const void* w_q,
                       const void* w_k, const void* w_v, const float* b_q, const float* b_k, const float* b_v, float* q,
                       float* k_cache, float* v_cache, const int32_t* pos, int64_t n_tokens, int64_t hidden,
                       int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx, float freq_base,
                       int neox, const uint8_t* xw_groups, void* stream) {
  const char* fn = "tm_qkv_rope";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_qtype(fn, qtype));
  TM_TRY(check_rmsnorm_args(fn, "x", x, "norm_w", norm_w, "q", q, n_tokens, "hidden", hidden, eps));
  TM_TRY(check_ptr(fn, "w_q", w_q));
  TM_TRY(check_ptr(fn, "w_k", w_k));
  TM_TRY(check_ptr(fn, "w_v", w_v));
  TM_TRY(check_row_length(fn, "hidden", qtype, hidden));
  TM_TRY(check_rope_args(fn, q, k_cache, v_cache, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx, freq_base));
  if ((xw == nullptr) != (xss == nullptr))
    return tm_set_error(kInvalid, "%s: give 'xw' and 'xss' together (as one kernel wrote them) or neither", fn);
  TM_TRY(check_groups(fn, "xw_groups", xw_groups, xw, "xw", "hidden", hidden));
  return TM_FORWARD(qkv_rope, device, qtype, x, xw, xss, norm_w, eps, w_q, w_k, w_v, b_q, b_k, b_v, q, k_cache, v_cache, pos,
                    n_tokens, hidden, n_heads, n_kv_heads, head_dim, max_ctx, freq_base, neox ? 1 : 0, xw_groups,
                    stream);
}

TM_API int tm_attention(tm_device device, const float* q, const float* k_cache, const float* v_cache, float* out,
                        const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,
                        int64_t head_dim, int64_t max_ctx, int32_t* scratch, uint8_t* out_groups, void* stream) {
  const char* fn = "tm_attention";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_ptr(fn, "out", out));
  TM_TRY(check_ptr(fn, "scratch", scratch));
  TM_TRY(check_cache_args(fn, q, k_cache, v_cache, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx));
  if (n_heads % n_kv_heads != 0)
    return tm_set_error(kInvalid, "%s: n_heads = %" PRId64 " is not a multiple of n_kv_heads = %" PRId64, fn,
                        n_heads, n_kv_heads);
  TM_TRY(check_groups(fn, "out_groups", out_groups, out, "out", "head_dim", head_dim));
  return TM_FORWARD(attention, device, q, k_cache, v_cache, out, pos, n_tokens, n_heads, n_kv_heads, head_dim,
                    max_ctx, scratch, out_groups, stream);
}

TM_API int tm_router_topk(tm_device device, const float* w_router, const float* h, int32_t* ids, float* weights,
                          int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                          void* stream) {
  const char* fn = "tm_router_topk";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_router_args(fn, w_router, "h", h, ids, weights, n_tokens, n_experts, hidden, top_k));
  return TM_FORWARD(router_topk, device, w_router, h, ids, weights, n_tokens, n_experts, hidden, top_k,
                    normalize ? 1 : 0, stream);
}

TM_API int tm_rmsnorm_router_topk(tm_device device, const float* x, const float* norm_w, float eps, float* h,
                                  const float* w_router, int32_t* ids, float* weights, int64_t n_tokens,
                                  int64_t n_experts, int64_t hidden, int64_t top_k, int normalize, void* stream) {
  const char* fn = "tm_rmsnorm_router_topk";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_rmsnorm_args(fn, "x", x, "norm_w", norm_w, "h", h, n_tokens, "hidden", hidden, eps));
  TM_TRY(check_router_args(fn, w_router, "h", h, ids, weights, n_tokens, n_experts, hidden, top_k));
  return TM_FORWARD(rmsnorm_router_topk, device, x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts,
                    hidden, top_k, normalize ? 1 : 0, stream);
}

TM_API int tm_moe_gate_up(tm_device device, int qtype, const void* w_gate, const void* w_up, const float* h,
                          const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k, int64_t slot_begin,
                          int64_t slot_count, int64_t n_experts, int64_t ffn, int64_t hidden, const float* scale,
                          void* stream) {
  const char* fn = "tm_moe_gate_up";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_gate_up_args(fn, qtype, "w_gate", w_gate, "w_up", w_up, h, "act", act, n_tokens, top_k, slot_begin,
                            slot_count, n_experts, "ffn", ffn, hidden));
  return TM_FORWARD(moe_gate_up, device, qtype, w_gate, w_up, h, ids, act, n_tokens, top_k, slot_begin, slot_count,
                    n_experts, ffn, hidden, scale, stream);
}

TM_API int tm_experts_gate_up(tm_device device, int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                              int64_t ffn_sh, const void* w_gate, const void* w_up, const float* h,
                              const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k, int64_t n_experts,
                              int64_t ffn, int64_t hidden, void* stream) {
  const char* fn = "tm_experts_gate_up";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_gate_up_args(fn, qtype, "w_gate_sh", w_gate_sh, "w_up_sh", w_up_sh, h, "act_sh", act_sh, n_tokens, 1,
                            0, 1, 1, "ffn_sh", ffn_sh, hidden));
  TM_TRY(check_gate_up_args(fn, qtype, "w_gate", w_gate, "w_up", w_up, h, "act", act, n_tokens, top_k, 0, top_k,
                            n_experts, "ffn", ffn, hidden));
  TM_TRY(check_ptr(fn, "ids", ids));
  return TM_FORWARD(experts_gate_up, device, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, h, ids, act,
                    n_tokens, top_k, n_experts, ffn, hidden, stream);
}

// The shared expert's deferred FFN norm (tm_router_experts_gate_up's xw, xss and xw_groups).
int check_deferred_norm(const char* fn, const float* xw, const float* xss, const uint8_t* xw_groups, int64_t hidden) {
  if ((xw == nullptr) != (xss == nullptr))
    return tm_set_error(kInvalid, "%s: give 'xw' and 'xss' together (as one kernel wrote them) or neither", fn);
  return check_groups(fn, "xw_groups", xw_groups, xw, "xw", "hidden", hidden);
}

// The arguments of tm_router_experts_gate_up (which tm_router_experts_ffn takes too).
int check_router_experts_gate_up_args(const char* fn, const float* x, const float* norm_w, float eps, float* h,
                                      const float* w_router, int32_t* ids, float* weights, int qtype,
                                      const void* w_gate_sh, const void* w_up_sh, float* act_sh, int64_t ffn_sh,
                                      const float* gate_inp_sh, float* gate_sh, const void* w_gate,
                                      const void* w_up, float* act, int64_t n_tokens, int64_t n_experts,
                                      int64_t hidden, int64_t top_k, int64_t ffn, int32_t* scratch) {
  TM_TRY(check_rmsnorm_args(fn, "x", x, "norm_w", norm_w, "h", h, n_tokens, "hidden", hidden, eps));
  TM_TRY(check_router_args(fn, w_router, "h", h, ids, weights, n_tokens, n_experts, hidden, top_k));
  TM_TRY(check_gate_up_args(fn, qtype, "w_gate_sh", w_gate_sh, "w_up_sh", w_up_sh, h, "act_sh", act_sh, n_tokens, 1,
                            0, 1, 1, "ffn_sh", ffn_sh, hidden));
  TM_TRY(check_gate_up_args(fn, qtype, "w_gate", w_gate, "w_up", w_up, h, "act", act, n_tokens, top_k, 0, top_k,
                            n_experts, "ffn", ffn, hidden));
  TM_TRY(check_ptr(fn, "scratch", scratch));
  if ((gate_inp_sh == nullptr) != (gate_sh == nullptr))
    return tm_set_error(kInvalid, "%s: 'gate_inp_sh' and 'gate_sh' go together (the gate row and its output)", fn);
  return TM_OK;
}

TM_API int tm_router_experts_gate_up(tm_device device, const float* x, const float* norm_w, float eps, float* h,
                                     const float* w_router, int32_t* ids, float* weights, int qtype,
                                     const void* w_gate_sh, const void* w_up_sh, float* act_sh, int64_t ffn_sh,
                                     const float* gate_inp_sh, float* gate_sh, const void* w_gate,
                                     const void* w_up, float* act, int64_t n_tokens, int64_t n_experts,
                                     int64_t hidden, int64_t top_k, int normalize, int64_t ffn, int32_t* scratch,
                                     uint8_t* act_groups_sh, uint8_t* act_groups, const float* xw,
                                     const float* xss, const uint8_t* xw_groups, void* stream) {
  const char* fn = "tm_router_experts_gate_up";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_router_experts_gate_up_args(fn, x, norm_w, eps, h, w_router, ids, weights, qtype, w_gate_sh, w_up_sh,
                                           act_sh, ffn_sh, gate_inp_sh, gate_sh, w_gate, w_up, act, n_tokens,
                                           n_experts, hidden, top_k, ffn, scratch));
  TM_TRY(check_act_groups(fn, act_groups_sh, act_sh, ffn_sh, act_groups, act, ffn));
  TM_TRY(check_deferred_norm(fn, xw, xss, xw_groups, hidden));
  return TM_FORWARD(router_experts_gate_up, device, x, norm_w, eps, h, w_router, ids, weights, qtype, w_gate_sh,
                    w_up_sh, act_sh, ffn_sh, gate_inp_sh, gate_sh, w_gate, w_up, act, n_tokens, n_experts, hidden,
                    top_k, normalize ? 1 : 0, ffn, scratch, act_groups_sh, act_groups, xw, xss, xw_groups, stream);
}

TM_API int tm_router_experts_ffn(tm_device device, float* x, const float* norm_w, float eps, float* h,
                                 const float* w_router, int32_t* ids, float* weights, int qtype,
                                 const void* w_gate_sh, const void* w_up_sh, const void* w_down_sh, float* act_sh,
                                 int64_t ffn_sh, const float* gate_inp_sh, float* gate_sh, const void* w_gate,
                                 const void* w_up, const void* w_down, float* act, int64_t n_tokens,
                                 int64_t n_experts, int64_t hidden, int64_t top_k, int normalize, int64_t ffn,
                                 int32_t* scratch, const float* xw, const float* xss, const uint8_t* xw_groups,
                                 void* stream) {
  const char* fn = "tm_router_experts_ffn";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_router_experts_gate_up_args(fn, x, norm_w, eps, h, w_router, ids, weights, qtype, w_gate_sh, w_up_sh,
                                           act_sh, ffn_sh, gate_inp_sh, gate_sh, w_gate, w_up, act, n_tokens,
                                           n_experts, hidden, top_k, ffn, scratch));
  TM_TRY(check_down_args(fn, qtype, "w_down_sh", w_down_sh, "act_sh", act_sh, "gate_inp_sh", nullptr, h, x,
                         n_tokens, 1, 0, 1, 1, hidden, "ffn_sh", ffn_sh));
  TM_TRY(check_down_args(fn, qtype, "w_down", w_down, "act", act, "gate_inp", nullptr, nullptr, x, n_tokens, top_k,
                         0, top_k, n_experts, hidden, "ffn", ffn));
  TM_TRY(check_deferred_norm(fn, xw, xss, xw_groups, hidden));
  const int norm = normalize ? 1 : 0;
  if (device == TM_DEVICE_CUDA && xw == nullptr) {  // the persistent launch where it applies (not deferred)
    const int status = tm_cuda_router_experts_ffn(x, norm_w, eps, h, w_router, ids, weights, qtype, w_gate_sh,
                                                  w_up_sh, w_down_sh, act_sh, ffn_sh, gate_inp_sh, gate_sh, w_gate,
                                                  w_up, w_down, act, n_tokens, n_experts, hidden, top_k, norm, ffn,
                                                  scratch, stream);
    if (status != TM_NOT_APPLICABLE) return status;
  }
  // the two calls it stands for, on either backend
  TM_TRY(TM_FORWARD(router_experts_gate_up, device, x, norm_w, eps, h, w_router, ids, weights, qtype, w_gate_sh,
                    w_up_sh, act_sh, ffn_sh, gate_inp_sh, gate_sh, w_gate, w_up, act, n_tokens, n_experts, hidden,
                    top_k, norm, ffn, scratch, nullptr, nullptr, xw, xss, xw_groups, stream));
  return TM_FORWARD(experts_down_accumulate, device, qtype, w_down_sh, act_sh, nullptr, gate_sh, ffn_sh, w_down, act,
                    ids, weights, h, x, nullptr, nullptr, nullptr, n_tokens, top_k, n_experts, hidden, ffn, nullptr,
                    nullptr, nullptr, stream);
}

TM_API int tm_router_experts_ffn_launches(tm_device device, int qtype, int64_t n_tokens, int64_t n_experts,
                                          int64_t top_k, int64_t hidden, int64_t ffn_sh, int64_t ffn,
                                          int deferred_norm) {
  TM_TRY(check_device("tm_router_experts_ffn_launches", device));
  if (device == TM_DEVICE_CPU) return 1;
  if (deferred_norm) return 2;  // the persistent launch takes h alone
  return tm_cuda_router_experts_ffn_launches(qtype, n_tokens, n_experts, top_k, hidden, ffn_sh, ffn);
}

TM_API int tm_moe_down_accumulate(tm_device device, int qtype, const void* w_down, const float* act,
                                  const int32_t* ids, const float* weights, const float* gate_inp, const float* h,
                                  float* x, int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                  int64_t n_experts, int64_t hidden, int64_t ffn, void* stream) {
  const char* fn = "tm_moe_down_accumulate";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_down_args(fn, qtype, "w_down", w_down, "act", act, "gate_inp", gate_inp, h, x, n_tokens, top_k,
                         slot_begin, slot_count, n_experts, hidden, "ffn", ffn));
  return TM_FORWARD(moe_down_accumulate, device, qtype, w_down, act, ids, weights, gate_inp, h, x, n_tokens, top_k,
                    slot_begin, slot_count, n_experts, hidden, ffn, stream);
}

TM_API int tm_experts_down_accumulate(tm_device device, int qtype, const void* w_down_sh, const float* act_sh,
                                      const float* gate_inp_sh, const float* gate_sh, int64_t ffn_sh,
                                      const void* w_down, const float* act, const int32_t* ids,
                                      const float* weights, const float* h, float* x, const float* next_norm_w,
                                      float* xw, float* xss, int64_t n_tokens, int64_t top_k, int64_t n_experts,
                                      int64_t hidden, int64_t ffn, const uint8_t* act_groups_sh,
                                      const uint8_t* act_groups, uint8_t* xw_groups, void* stream) {
  const char* fn = "tm_experts_down_accumulate";
  TM_TRY(check_device(fn, device));
  if (gate_inp_sh != nullptr && gate_sh != nullptr)
    return tm_set_error(kInvalid, "%s: give the shared gate once: 'gate_inp_sh' (computed here) or 'gate_sh' "
                        "(computed by tm_router_experts_gate_up), not both", fn);
  TM_TRY(check_down_args(fn, qtype, "w_down_sh", w_down_sh, "act_sh", act_sh, "gate_inp_sh", gate_inp_sh, h, x,
                         n_tokens, 1, 0, 1, 1, hidden, "ffn_sh", ffn_sh));
  TM_TRY(check_down_args(fn, qtype, "w_down", w_down, "act", act, "gate_inp", nullptr, nullptr, x, n_tokens, top_k,
                         0, top_k, n_experts, hidden, "ffn", ffn));
  TM_TRY(check_ptr(fn, "ids", ids));
  if ((next_norm_w == nullptr) != (xw == nullptr) || (xw == nullptr) != (xss == nullptr))
    return tm_set_error(kInvalid, "%s: give 'next_norm_w', 'xw' and 'xss' together (the next normalisation's "
                        "factor and partial sums) or none of them", fn);
  TM_TRY(check_act_groups(fn, act_groups_sh, act_sh, ffn_sh, act_groups, act, ffn));
  if (act_groups != nullptr && qtype != TM_Q8_0_TILED)  // the groups stand for act: only Q8_0 rows multiply them
    return tm_set_error(kInvalid, "%s: 'act_groups' need TM_Q8_0_TILED rows (qtype %d given), which multiply "
                        "int8 groups", fn, qtype);
  TM_TRY(check_groups(fn, "xw_groups", xw_groups, xw, "xw", "hidden", hidden));
  return TM_FORWARD(experts_down_accumulate, device, qtype, w_down_sh, act_sh, gate_inp_sh, gate_sh, ffn_sh, w_down,
                    act, ids, weights, h, x, next_norm_w, xw, xss, n_tokens, top_k, n_experts, hidden, ffn,
                    act_groups_sh, act_groups, xw_groups, stream);
}

TM_API int tm_argmax(tm_device device, const float* logits, int32_t* out, int64_t n_tokens, int64_t vocab,
                     void* stream) {
  TM_TRY(check_choice("tm_argmax", device, logits, out, n_tokens, vocab));
  return TM_FORWARD(argmax, device, logits, out, n_tokens, vocab, stream);
}

TM_API int tm_argmax_advance(tm_device device, const float* logits, int32_t* out, int64_t vocab, int32_t* pos,
                             int32_t delta, int32_t* log, int64_t log_len, void* stream) {
  const char* fn = "tm_argmax_advance";
  TM_TRY(check_choice(fn, device, logits, out, 1, vocab));
  TM_TRY(check_advance(fn, pos, out, log, log_len));
  return TM_FORWARD(argmax_advance, device, logits, out, vocab, pos, delta, log, log_len, stream);
}

TM_API int tm_sample(tm_device device, const float* logits, int32_t* out, int64_t vocab, float temperature,
                     float top_p, int64_t top_k, uint64_t seed, const int32_t* step, void* stream) {
  const char* fn = "tm_sample";
  TM_TRY(check_choice(fn, device, logits, out, 1, vocab));
  TM_TRY(check_ptr(fn, "step", step));
  if (!(temperature > 0.0f) || !std::isfinite(temperature))
    return tm_set_error(kInvalid,
                        "%s: argument 'temperature' must be finite and > 0, got %g (use tm_argmax for greedy)", fn,
                        (double)temperature);
  if (!(top_p > 0.0f))
    return tm_set_error(kInvalid, "%s: argument 'top_p' must be > 0 (>= 1 keeps all), got %g", fn, (double)top_p);
  return TM_FORWARD(sample, device, logits, out, vocab, temperature, top_p, top_k, seed, step, stream);
}

TM_API int tm_advance_position(tm_device device, int32_t* pos, int32_t delta, const int32_t* token, int32_t* log,
                               int64_t log_len, void* stream) {
  const char* fn = "tm_advance_position";
  TM_TRY(check_device(fn, device));
  TM_TRY(check_advance(fn, pos, token, log, log_len));
  return TM_FORWARD(advance_position, device, pos, delta, token, log, log_len, stream);
}

}  // extern "C"
