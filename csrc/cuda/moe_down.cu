/*
 * moe_down.cu - tm_moe_down_accumulate: the down projection of routed slots (or of a shared expert) added to the
 * residual in slot order (moe.cuh describes the kernel).
 */
#include "moe.cuh"

namespace tm_cuda {
namespace {

// acc + sum over slots [s, s + NR) in order of w_eff * dot(W_down[e][r], act[t, s]) (Q: act's groups a.act_q).
template <Fmt F, int NR, bool V, bool Q>
__device__ __forceinline__ float down_group(const DownArgs& a, int64_t t, int64_t r, int64_t s, bool gated,
                                            float gate, float acc) {
  float d[NR][1], w_eff[NR];
  down_dots<F, NR, V, false, Q>(a, t, r, s, gated, gate, d, w_eff);
#pragma unroll
  for (int i = 0; i < NR; ++i) acc = __fadd_rn(acc, __fmul_rn(w_eff[i], d[i][0]));
  return acc;
}

// Calls fn(s, n) for the slot groups of [begin, end): fours, then a two, then a one.
template <class Fn>
__device__ __forceinline__ void for_slot_groups(int64_t begin, int64_t end, Fn&& fn) {
  int64_t s = begin;
  for (; end - s >= 4; s += 4) fn(s, std::integral_constant<int, 4>{});
  if (end - s >= 2) {
    fn(s, std::integral_constant<int, 2>{});
    s += 2;
  }
  if (end - s >= 1) fn(s, std::integral_constant<int, 1>{});
}

template <Fmt F, bool V, bool Q>
__global__ void __launch_bounds__(kRowsPerBlock * 32, TM_WEIGHT_MIN_BLOCKS)
    moe_down_kernel(DownArgs a, const float* __restrict__ gate_inp, const float* __restrict__ h, float* x,
                    int64_t slot_begin, int64_t slot_count, int gate_mode, int64_t tok0) {
  __shared__ float s_gate;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = tok0 + blockIdx.y;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp;
  if (a.ids == nullptr && r < a.hidden && t == 0)  // a shared expert: its rows are known up front
    prefetch_row_l2(a.w_down + r * a.row_bytes, a.row_bytes, lane);
  pdl_begin();
  float gate = 1.0f;
  if (gate_mode != kGateNone) {
    if (warp == 0) {
      const float g = shared_gate(gate_inp, h + t * a.hidden, a.hidden, gate_mode);
      if (lane == 0) s_gate = g;
    }
    __syncthreads();
    gate = s_gate;
  }
  if (r >= a.hidden) return;
  const bool gated = gate_mode != kGateNone;
  float* xo = x + t * a.hidden + r;
  float acc = __ldcg(xo);  // in place: read around L1 (common.cuh)
  for_slot_groups(slot_begin, slot_begin + slot_count, [&](int64_t s, auto n) {
    acc = down_group<F, decltype(n)::value, V, Q>(a, t, r, s, gated, gate, acc);
  });
  if (lane == 0) *xo = acc;
}

}  // namespace

// The checks and the layout of one down weight set; gate_mode from gate_inp (nullable) and h.
int down_args(const char* fn, int qtype, const void* w_down, const float* act, const int32_t* ids,
              const float* weights, const float* gate_inp, const float* h, int64_t top_k, int64_t n_experts,
              int64_t hidden, int64_t ffn, DownArgs* a, int* gate_mode, bool* v) {
  TM_TRY(check_weight_alignment(fn, "w_down", qtype, w_down));
  TM_TRY(check_f32_alignment(fn, "act", act));
  TM_TRY(check_f32_alignment(fn, "weights", weights));
  TM_TRY(check_f32_alignment(fn, "gate_inp", gate_inp));
  TM_TRY(check_f32_alignment(fn, "h", h));
  const Fmt f = fmt_for(qtype, ffn);
  *a = DownArgs{static_cast<const uint8_t*>(w_down), act, ids, weights, top_k, n_experts, hidden, ffn,
                tm_qtype_row_bytes(qtype, ffn), ffn / fmt_vals(f), nullptr, 0};
  *gate_mode = gate_inp != nullptr ? f32_row_mode(hidden, aligned(gate_inp, 16) && aligned(h, 16)) : kGateNone;
  *v = fmt_vector_ok(f, w_down, aligned(act, 16));
  return TM_OK;
}

int launch_moe_down(const Limits& lim, const char* fn, int qtype, const DownArgs& a, bool v, const float* gate_inp,
                    const float* h, float* x, int64_t n_tokens, int64_t slot_begin, int64_t slot_count,
                    int gate_mode, cudaStream_t s) {
  const int64_t gx = ceil_div(a.hidden, kRowsPerBlock);
  if (gx > lim.max_grid_x)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: hidden = %lld needs more blocks than the grid allows", fn,
                        static_cast<long long>(a.hidden));
  return dispatch_fmt(fmt_for(qtype, a.ffn), v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    // given act's groups (tm_experts_down_accumulate's two launches), tiled rows multiply them, not act
    auto kernel = moe_down_kernel<F, V, false>;
    if constexpr (fmt_tiled(F))
      if (a.act_q != nullptr) kernel = moe_down_kernel<F, V, true>;
    for (int64_t t0 = 0; t0 < n_tokens; t0 += lim.max_grid_yz) {
      const int64_t gy = n_tokens - t0 < lim.max_grid_yz ? n_tokens - t0 : lim.max_grid_yz;
      TM_TRY(launch(lim, fn, kernel, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                    dim3(kRowsPerBlock * 32), 0, s, a, gate_inp, h, x, slot_begin, slot_count, gate_mode, t0));
    }
    return TM_OK;
  });
}

}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_moe_down_accumulate(int qtype, const void* w_down, const float* act, const int32_t* ids,
                                           const float* weights, const float* gate_inp, const float* h, float* x,
                                           int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                           int64_t n_experts, int64_t hidden, int64_t ffn, void* stream) {
  const char* fn = "tm_moe_down_accumulate";
  TM_TRY(check_f32_alignment(fn, "x", x));
  DownArgs a;
  int gate_mode;
  bool v;
  TM_TRY(down_args(fn, qtype, w_down, act, ids, weights, gate_inp, h, top_k, n_experts, hidden, ffn, &a, &gate_mode,
                   &v));
  Limits lim;
  TM_TRY(get_limits(&lim));
  return launch_moe_down(lim, fn, qtype, a, v, gate_inp, h, x, n_tokens, slot_begin, slot_count, gate_mode,
                         as_stream(stream));
}
