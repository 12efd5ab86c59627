/*
 * matmul.cu - tm_matmul on CUDA: y[t, r] = dot(W[r, :], x[t, :]) (+ bias[r]) (y[t, r] + that when accumulating).
 *
 * One work item per (token, row), item = t * rows + r, run by stream.cuh's pipeline (its dot product and order).
 * Epilogue: v = dot + bias, y = y + v, each a rounded add as in the CPU kernel. A (token, row) value is bitwise
 * the same for any n_tokens, launch shape and pipeline depth.
 */
#include "stream.cuh"

namespace tm_cuda {
namespace {

struct MatmulJob {
  const uint8_t* w;
  const float* x;
  const float* bias;
  float* y;
  int64_t n_tokens, rows, cols, row_bytes;
  int accumulate;

  struct Item {
    int64_t t, r;
  };
  struct State {};
  using WarpCache = NoWarpCache;
  __device__ WarpCache warp_cache(int64_t, int64_t) const { return {}; }
  __device__ int64_t items() const { return n_tokens * rows; }
  __device__ Item decode(int64_t item) const {
    const DivMod d = divmod(item, rows);
    return Item{d.q, d.r};
  }
  __device__ int segments() const { return 1; }
  __device__ int64_t seg_cols(int) const { return cols; }
  __device__ bool is_static(const Item&) const { return true; }
  __device__ const uint8_t* row(const Item& it, int, int) const { return w + it.r * row_bytes; }
  __device__ const float* xrow(const Item& it, int) const { return x + it.t * cols; }
  template <Fmt F>
  __device__ void load_x(const Item& it, int seg, int64_t c, int lane, float (&xr)[kLaneVals], float (&aux)[2],
                         NormCache&) const {
    tm_cuda::load_x<F>(xrow(it, seg), nullptr, 0.0f, cols, c, lane, xr, aux);
  }
  __device__ State begin(const Item&, WarpCache&) const { return {}; }
  __device__ void segment(const Item& it, int, const float (&dot)[1], State&, WarpCache&) const {
    if ((threadIdx.x & 31) != 0) return;
    float v = dot[0];
    if (bias != nullptr) v = __fadd_rn(v, __ldg(bias + it.r));
    float* o = y + it.t * rows + it.r;
    *o = accumulate ? __fadd_rn(__ldcg(o), v) : v;  // read around L1 (see common.cuh)
  }
  __device__ void finish(const Item&, State&) const {}
};

constexpr int kMatmulStages = 4;

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_matmul(int qtype, const void* w, const float* x, const float* bias, float* y, int64_t n_tokens,
                              int64_t rows, int64_t cols, int accumulate, void* stream) {
  const char* fn = "tm_matmul";
  TM_STATUS_TRY(check_weight_alignment(fn, "w", qtype, w));
  TM_STATUS_TRY(check_f32_alignment(fn, "x", x));
  TM_STATUS_TRY(check_f32_alignment(fn, "bias", bias));
  TM_STATUS_TRY(check_f32_alignment(fn, "y", y));
  Limits lim;
  TM_STATUS_TRY(get_limits(&lim));
  const MatmulJob job{static_cast<const uint8_t*>(w), x, bias, y, n_tokens, rows, cols,
                      tm_qtype_row_bytes(qtype, cols), accumulate};
  return dispatch_fmt(fn, qtype, [&](auto ftag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    return launch_stream<F, 1>(lim, fn, job, n_tokens * rows, kMatmulStages, as_stream(stream));
  });
}
