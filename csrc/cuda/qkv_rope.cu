/*
 * qkv_rope.cu - tm_qkv_rope on CUDA: the attention input of a layer in one launch, bitwise the result of
 * tm_rmsnorm, tm_matmul (q, k, v, with bias) and tm_rope_kv_append in sequence.
 *
 * One work item per (token, q/k/v head, rotation pair i): its two rows are the pair's rows a, b of W_q, W_k or W_v
 * (a = i, b = i + head_dim/2 for NEOX RoPE; a = 2i, b = 2i + 1 otherwise), run by stream.cuh's pipeline (the dot
 * product of tm_matmul). Each warp normalises the token's x itself with norm.cuh's tree (the h tm_rmsnorm writes)
 * while loading its activation registers. Epilogue as tm_matmul (v = dot + bias) then as tm_rope_kv_append: theta =
 * pos * freq_base^(-2i/head_dim) in double, cos/sin rounded to float32 (each lane of a warp evaluates them for one
 * of the warp's next 32 items), a' = a c - b s, b' = a s + b c; q goes to
 * `q`, k and v (v unrotated) to the cache rows pos[0] + t (rows outside [0, max_ctx) are not written).
 */
#include <cmath>

#include "stream.cuh"

namespace tm_cuda {
namespace {

constexpr int kQkvStages = 4;

struct QkvJob {
  const float* x;
  const float* norm_w;
  float eps;
  const uint8_t* w[3];  // q, k, v
  const float* bias[3];
  float* q;
  float* k_cache;
  float* v_cache;
  const int32_t* pos;
  int64_t n_tokens, hidden, n_heads, n_kv, head_dim, max_ctx, row_bytes;
  float freq_base;
  int neox;

  struct Item {
    const uint8_t* row_a;  // rows a and b of the item's matrix
    const uint8_t* row_b;
    int64_t t, head, i;
    int which;  // 0 q, 1 k, 2 v
  };
  struct State {
    int trig_lane;  // the lane holding this item's cos/sin
  };
  // cos/sin of the rotation of the warp's items, 32 at a time: lane j holds those of the warp's item count + j, all
  // computed in parallel (double-precision pow and sincos are long) when the previous 32 are used up.
  struct WarpCache {
    int64_t first, step, count;
    float c, s;
  };
  __device__ int64_t half() const { return head_dim / 2; }
  __device__ int64_t per_token() const { return (n_heads + 2 * n_kv) * half(); }
  __device__ int64_t dim_a(int64_t i) const { return neox ? i : 2 * i; }
  __device__ int64_t dim_b(int64_t i) const { return neox ? i + half() : 2 * i + 1; }
  __device__ int64_t items() const { return n_tokens * per_token(); }
  __device__ Item decode(int64_t item) const {
    Item p;
    const DivMod tr = divmod(item, per_token());
    p.t = tr.q;
    int64_t rest = tr.r;
    p.which = 0;
    if (rest >= n_heads * half()) {
      rest -= n_heads * half();
      p.which = 1;
      if (rest >= n_kv * half()) {
        rest -= n_kv * half();
        p.which = 2;
      }
    }
    const DivMod hi = divmod(rest, half());
    p.head = hi.q;
    p.i = hi.r;
    const uint8_t* base = w[p.which] + p.head * head_dim * row_bytes;
    p.row_a = base + dim_a(p.i) * row_bytes;
    p.row_b = base + dim_b(p.i) * row_bytes;
    return p;
  }
  __device__ int segments() const { return 1; }
  __device__ int64_t seg_cols(int) const { return hidden; }
  __device__ bool is_static(const Item&) const { return true; }
  __device__ const uint8_t* row(const Item& it, int, int r) const { return r == 0 ? it.row_a : it.row_b; }
  __device__ const float* xrow(const Item& it, int) const { return x + it.t * hidden; }
  template <Fmt F>
  __device__ void load_x(const Item& it, int seg, int64_t c, int lane, float (&xr)[kLaneVals], float (&aux)[2],
                         NormCache& norm) const {
    const float* row_x = xrow(it, seg);
    if (norm.row != row_x) {
      norm.inv = warp_rms_inv(row_x, hidden, eps);
      norm.row = row_x;
    }
    tm_cuda::load_x<F>(row_x, norm_w, norm.inv, hidden, c, lane, xr, aux);
  }
  __device__ WarpCache warp_cache(int64_t first, int64_t step) const { return WarpCache{first, step, 0, 1.0f, 0.0f}; }
  __device__ State begin(const Item&, WarpCache& wc) const {
    const int lane = threadIdx.x & 31;
    if (wc.count % 32 == 0) {
      const int64_t item = wc.first + (wc.count + lane) * wc.step;
      if (item < items()) {
        const Item q = decode(item);
        if (q.which < 2) {
          const int64_t ps = static_cast<int64_t>(pos[0]) + q.t;
          const double theta = static_cast<double>(ps) *
                               pow(static_cast<double>(freq_base), -2.0 * static_cast<double>(q.i) /
                                                                       static_cast<double>(head_dim));
          double sd, cd;
          sincos(theta, &sd, &cd);
          wc.c = static_cast<float>(cd);
          wc.s = static_cast<float>(sd);
        }
      }
    }
    return State{static_cast<int>(wc.count++ % 32)};
  }
  __device__ void segment(const Item& p, int, const float (&dot)[2], State& st, WarpCache& wc) const {
    const float c = __shfl_sync(kFullMask, wc.c, st.trig_lane), s = __shfl_sync(kFullMask, wc.s, st.trig_lane);
    if ((threadIdx.x & 31) != 0) return;
    const int64_t da = dim_a(p.i), db = dim_b(p.i);
    const int64_t ra = p.head * head_dim + da, rb = p.head * head_dim + db;
    float a = dot[0], b = dot[1];
    if (bias[p.which] != nullptr) {
      a = __fadd_rn(a, __ldg(bias[p.which] + ra));
      b = __fadd_rn(b, __ldg(bias[p.which] + rb));
    }
    const int64_t ps = static_cast<int64_t>(pos[0]) + p.t;
    if (p.which < 2) {
      const float a2 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
      const float b2 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
      a = a2;
      b = b2;
    }
    float* out;
    if (p.which == 0) {
      out = q + (p.t * n_heads + p.head) * head_dim;
    } else {
      if (ps < 0 || ps >= max_ctx) return;
      out = (p.which == 1 ? k_cache : v_cache) + (ps * n_kv + p.head) * head_dim;
    }
    out[da] = a;
    out[db] = b;
  }
  __device__ void finish(const Item&, State&) const {}
};

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_qkv_rope(int qtype, const float* x, const float* norm_w, float eps, const void* w_q,
                                const void* w_k, const void* w_v, const float* b_q, const float* b_k, const float* b_v,
                                float* q, float* k_cache, float* v_cache, const int32_t* pos, int64_t n_tokens,
                                int64_t hidden, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx,
                                float freq_base, int neox, void* stream) {
  const char* fn = "tm_qkv_rope";
  TM_STATUS_TRY(check_f32_alignment(fn, "x", x));
  TM_STATUS_TRY(check_f32_alignment(fn, "norm_w", norm_w));
  TM_STATUS_TRY(check_weight_alignment(fn, "w_q", qtype, w_q));
  TM_STATUS_TRY(check_weight_alignment(fn, "w_k", qtype, w_k));
  TM_STATUS_TRY(check_weight_alignment(fn, "w_v", qtype, w_v));
  TM_STATUS_TRY(check_f32_alignment(fn, "b_q", b_q));
  TM_STATUS_TRY(check_f32_alignment(fn, "b_k", b_k));
  TM_STATUS_TRY(check_f32_alignment(fn, "b_v", b_v));
  TM_STATUS_TRY(check_f32_alignment(fn, "q", q));
  TM_STATUS_TRY(check_f32_alignment(fn, "k_cache", k_cache));
  TM_STATUS_TRY(check_f32_alignment(fn, "v_cache", v_cache));
  Limits lim;
  TM_STATUS_TRY(get_limits(&lim));
  QkvJob job{};
  job.x = x;
  job.norm_w = norm_w;
  job.eps = eps;
  job.w[0] = static_cast<const uint8_t*>(w_q);
  job.w[1] = static_cast<const uint8_t*>(w_k);
  job.w[2] = static_cast<const uint8_t*>(w_v);
  job.bias[0] = b_q;
  job.bias[1] = b_k;
  job.bias[2] = b_v;
  job.q = q;
  job.k_cache = k_cache;
  job.v_cache = v_cache;
  job.pos = pos;
  job.n_tokens = n_tokens;
  job.hidden = hidden;
  job.n_heads = n_heads;
  job.n_kv = n_kv_heads;
  job.head_dim = head_dim;
  job.max_ctx = max_ctx;
  job.row_bytes = tm_qtype_row_bytes(qtype, hidden);
  job.freq_base = freq_base;
  job.neox = neox;
  const int64_t items = n_tokens * (n_heads + 2 * n_kv_heads) * (head_dim / 2);
  return dispatch_fmt(fn, qtype, [&](auto ftag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    return launch_stream<F, 2>(lim, fn, job, items, kQkvStages, as_stream(stream));
  });
}
