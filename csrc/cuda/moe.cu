/*
 * moe.cu - routed/shared experts on CUDA: tm_moe_gate_up, tm_experts_gate_up and tm_moe_down_accumulate.
 *
 * gate_up: blocks of 8 warps; grid x = (token, slot) pairs of the call (pair = t * slot_count + (s - slot_begin)),
 *   grid y = tiles of 8 rows of the expert FFN. A warp computes gate row r and up row r of expert ids[t, s] together
 *   (one warp_dot with NR = 2 sharing the activation loads) and writes act[t, s, r] = silu(g) * u. Pairs in x put
 *   the pairs of one row tile side by side in the schedule, so pairs routed to the same expert read its rows while
 *   they are in L2. Grids larger than the limits are split into several launches (pairs by max_grid_x, row tiles
 *   by max_grid_yz). The result of a (t, s, r) depends only on e, r and h[t]: fused (slot_count = top_k) and
 *   per-slot (slot_count = 1) launches agree bit for bit.
 * experts_gate_up: the blocks of a shared-expert gate_up grid and of a routed one (all slots) in one 1-D grid, each
 *   block doing exactly what it does in its own launch (the same function), so the results are those bits.
 * down_accumulate: blocks of 8 warps; grid x = tiles of 8 output rows, grid y = tokens (split by max_grid_yz).
 *   With gate_inp, warp 0 of every block first computes z = dot(gate_inp, h[t]) with warp_dot (F32 layout, same
 *   order in every block) and sigmoid(z) goes through shared memory. A warp then owns output row r of token t:
 *   acc = x[t, r]; the slot dot products are computed in groups of up to 4 slots (one warp_dot with per-row
 *   activations, so the loads of several experts are in flight together; each row's arithmetic is the same as
 *   alone), then added strictly in slot order: w_eff = weights[t, s] (1 without weights) times sigmoid(z) with the
 *   gate; acc = acc + w_eff * dot as a rounded multiply then a rounded add; x[t, r] = acc once. A per-slot call
 *   starts from the x the previous slot stored (the same float32 the fused accumulator held), so fused and
 *   per-slot calls agree bit for bit.
 * Expert ids outside [0, n_experts) cannot be reported from the device: they produce NaN outputs.
 * Without ids (a shared expert or dense FFN) the rows are known before the inputs: each warp prefetches them into
 * L2 before pdl_wait (common.cuh's protocol); routed rows depend on the router's output and are not prefetched.
 */
#include "qdot.cuh"

namespace tm_cuda {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr float kNaN = __builtin_nanf("");

// One gate-up weight set of a launch: w_gate, w_up [n_experts, ffn, hidden]; act [T, top_k, ffn].
struct GateUpArgs {
  const uint8_t* w_gate;
  const uint8_t* w_up;
  const int32_t* ids;  // nullptr: expert 0 (a shared expert or dense FFN)
  float* act;
  int64_t top_k, slot_begin, slot_count, n_experts, ffn, row_bytes;
};

// Warp `warp` of the block for (pair, row tile): act[t, s, r] = silu(g) * u with g, u one warp_dot (NR = 2).
template <Fmt F, bool V>
__device__ __forceinline__ void gate_up_block(const GateUpArgs& a, const float* __restrict__ h, int64_t hidden,
                                              int64_t nblocks, int64_t pair, int64_t tile) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = tile * kRowsPerBlock + warp;
  if (a.ids == nullptr && r < a.ffn && pair == 0) {  // a shared expert: its rows are known up front
    prefetch_row_l2(a.w_gate + r * a.row_bytes, a.row_bytes, lane);
    prefetch_row_l2(a.w_up + r * a.row_bytes, a.row_bytes, lane);
  }
  pdl_begin();
  if (r >= a.ffn) return;
  const int64_t t = pair / a.slot_count;
  const int64_t slot = t * a.top_k + a.slot_begin + pair % a.slot_count;
  const int64_t e = a.ids != nullptr ? static_cast<int64_t>(a.ids[slot]) : 0;
  float* o = a.act + slot * a.ffn + r;
  if (e < 0 || e >= a.n_experts) {
    if (lane == 0) *o = kNaN;
    return;
  }
  const int64_t off = (e * a.ffn + r) * a.row_bytes;
  const uint8_t* wr[2] = {a.w_gate + off, a.w_up + off};
  const float* xs[1] = {h + t * hidden};
  float gu[2][1];
  warp_dot<F, 2, 1, true, V>(wr, xs, nblocks, gu);
  if (lane == 0) *o = __fmul_rn(silu_f32(gu[0][0]), gu[1][0]);
}

template <Fmt F, bool V>
__global__ void __launch_bounds__(kRowsPerBlock * 32, TM_WEIGHT_MIN_BLOCKS)
    moe_gate_up_kernel(const GateUpArgs a, const float* __restrict__ h, int64_t hidden, int64_t nblocks,
                       int64_t pair0, int64_t tile0) {
  gate_up_block<F, V>(a, h, hidden, nblocks, pair0 + blockIdx.x, tile0 + blockIdx.y);
}

// tm_experts_gate_up: a 1-D grid, the shared expert's blocks first, then the routed ones; each part numbers its
// blocks (pair, tile) as moe_gate_up_kernel's grid does (pair fastest).
template <Fmt F, bool V>
__global__ void __launch_bounds__(kRowsPerBlock * 32, TM_WEIGHT_MIN_BLOCKS)
    experts_gate_up_kernel(const GateUpArgs sh, const GateUpArgs rt, const float* __restrict__ h, int64_t n_tokens,
                           int64_t hidden, int64_t nblocks, int64_t block0) {
  const int64_t b = block0 + blockIdx.x;
  const int64_t sh_blocks = n_tokens * ceil_div(sh.ffn, kRowsPerBlock);
  if (b < sh_blocks) {
    gate_up_block<F, V>(sh, h, hidden, nblocks, b % n_tokens, b / n_tokens);
  } else {
    const int64_t pairs = n_tokens * rt.slot_count;
    gate_up_block<F, V>(rt, h, hidden, nblocks, (b - sh_blocks) % pairs, (b - sh_blocks) / pairs);
  }
}

// How the shared-expert gate dot product is evaluated (chosen on the host from hidden and the alignment).
enum GateMode : int { kGateNone = 0, kGateF32 = 1, kGateF32X4 = 2, kGateF32X4Vec = 3 };

struct DownArgs {
  const uint8_t* w_down;
  const float* act;
  const int32_t* ids;
  const float* weights;
  int64_t top_k, n_experts, hidden, ffn, row_bytes, nblocks;
};

// acc + sum over slots [s, s + NR) in order of w_eff * dot(W_down[e][r], act[t, s]).
template <Fmt F, int NR, bool V>
__device__ __forceinline__ float down_group(const DownArgs& a, int64_t t, int64_t r, int64_t s, bool gated,
                                            float gate, float acc) {
  const uint8_t* wr[NR];
  const float* xs[NR];
  float w_eff[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int64_t slot = t * a.top_k + s + i;
    int64_t e = a.ids != nullptr ? static_cast<int64_t>(a.ids[slot]) : 0;
    const bool bad = e < 0 || e >= a.n_experts;
    if (bad) e = 0;
    wr[i] = a.w_down + (e * a.hidden + r) * a.row_bytes;
    xs[i] = a.act + slot * a.ffn;
    float w = a.weights != nullptr ? a.weights[slot] : 1.0f;
    if (gated) w = __fmul_rn(w, gate);
    w_eff[i] = bad ? kNaN : w;
  }
  float d[NR][1];
  warp_dot<F, NR, 1, false, V>(wr, xs, a.nblocks, d);
#pragma unroll
  for (int i = 0; i < NR; ++i) acc = __fadd_rn(acc, __fmul_rn(w_eff[i], d[i][0]));
  return acc;
}

// sigmoid(dot(gate_inp, h_t)) by one warp (warp_dot in the F32 layout: the same bits in every block).
__device__ __forceinline__ float shared_gate(const float* gate_inp, const float* ht, int64_t hidden, int gate_mode) {
  const uint8_t* gw[1] = {reinterpret_cast<const uint8_t*>(gate_inp)};
  const float* gx[1] = {ht};
  float z[1][1];
  if (gate_mode == kGateF32)
    warp_dot<Fmt::F32, 1, 1, true, false>(gw, gx, hidden, z);
  else if (gate_mode == kGateF32X4)
    warp_dot<Fmt::F32X4, 1, 1, true, false>(gw, gx, hidden / 4, z);
  else
    warp_dot<Fmt::F32X4, 1, 1, true, true>(gw, gx, hidden / 4, z);
  return sigmoid_f32(z[0][0]);
}

template <Fmt F, bool V>
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
  int64_t s = slot_begin;
  const int64_t end = slot_begin + slot_count;
  for (; end - s >= 4; s += 4) acc = down_group<F, 4, V>(a, t, r, s, gated, gate, acc);
  if (end - s >= 2) {
    acc = down_group<F, 2, V>(a, t, r, s, gated, gate, acc);
    s += 2;
  }
  if (end - s >= 1) acc = down_group<F, 1, V>(a, t, r, s, gated, gate, acc);
  if (lane == 0) *xo = acc;
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

namespace tm_cuda {
namespace {

// The checks and the layout shared by both gate-up entry points; `v` is narrowed for every weight set it sees.
int gate_up_args(const char* fn, int qtype, const void* w_gate, const void* w_up, const int32_t* ids, float* act,
                 int64_t top_k, int64_t slot_begin, int64_t slot_count, int64_t n_experts, int64_t ffn,
                 int64_t hidden, const float* h, GateUpArgs* out, bool* v) {
  TM_TRY(check_weight_alignment(fn, "w_gate", qtype, w_gate));
  TM_TRY(check_weight_alignment(fn, "w_up", qtype, w_up));
  TM_TRY(check_f32_alignment(fn, "act", act));
  const Fmt f = fmt_for(qtype, hidden);
  *v = *v && fmt_vector_ok(f, w_gate, aligned(h, 16)) && fmt_vector_ok(f, w_up, true);
  *out = GateUpArgs{static_cast<const uint8_t*>(w_gate), static_cast<const uint8_t*>(w_up), ids, act, top_k,
                    slot_begin, slot_count, n_experts, ffn, tm_qtype_row_bytes(qtype, hidden)};
  return TM_OK;
}

}  // namespace
}  // namespace tm_cuda

extern "C" int tm_cuda_moe_gate_up(int qtype, const void* w_gate, const void* w_up, const float* h, const int32_t* ids,
                                   float* act, int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                   int64_t n_experts, int64_t ffn, int64_t hidden, void* stream) {
  const char* fn = "tm_moe_gate_up";
  TM_TRY(check_f32_alignment(fn, "h", h));
  GateUpArgs a;
  bool v = true;
  TM_TRY(gate_up_args(fn, qtype, w_gate, w_up, ids, act, top_k, slot_begin, slot_count, n_experts, ffn, hidden, h,
                      &a, &v));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const Fmt f = fmt_for(qtype, hidden);
  const int64_t nblocks = hidden / fmt_vals(f);
  const int64_t n_pairs = n_tokens * slot_count;
  const int64_t n_tiles = ceil_div(ffn, kRowsPerBlock);
  const cudaStream_t s = as_stream(stream);
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    for (int64_t p0 = 0; p0 < n_pairs; p0 += lim.max_grid_x) {
      const int64_t gx = n_pairs - p0 < lim.max_grid_x ? n_pairs - p0 : lim.max_grid_x;
      for (int64_t y0 = 0; y0 < n_tiles; y0 += lim.max_grid_yz) {
        const int64_t gy = n_tiles - y0 < lim.max_grid_yz ? n_tiles - y0 : lim.max_grid_yz;
        TM_TRY(launch(lim, fn, moe_gate_up_kernel<F, V>, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                      dim3(kRowsPerBlock * 32), 0, s, a, h, hidden, nblocks, p0, y0));
      }
    }
    return TM_OK;
  });
}

extern "C" int tm_cuda_experts_gate_up(int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                                       int64_t ffn_sh, const void* w_gate, const void* w_up, const float* h,
                                       const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k,
                                       int64_t n_experts, int64_t ffn, int64_t hidden, void* stream) {
  const char* fn = "tm_experts_gate_up";
  TM_TRY(check_f32_alignment(fn, "h", h));
  GateUpArgs sh, rt;
  bool v = true;
  TM_TRY(gate_up_args(fn, qtype, w_gate_sh, w_up_sh, nullptr, act_sh, 1, 0, 1, 1, ffn_sh, hidden, h, &sh, &v));
  TM_TRY(gate_up_args(fn, qtype, w_gate, w_up, ids, act, top_k, 0, top_k, n_experts, ffn, hidden, h, &rt, &v));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const Fmt f = fmt_for(qtype, hidden);
  const int64_t nblocks = hidden / fmt_vals(f);
  const int64_t total = n_tokens * (ceil_div(ffn_sh, kRowsPerBlock) + top_k * ceil_div(ffn, kRowsPerBlock));
  const cudaStream_t s = as_stream(stream);
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    for (int64_t b0 = 0; b0 < total; b0 += lim.max_grid_x) {
      const int64_t gx = total - b0 < lim.max_grid_x ? total - b0 : lim.max_grid_x;
      TM_TRY(launch(lim, fn, experts_gate_up_kernel<F, V>, dim3(static_cast<unsigned>(gx)), dim3(kRowsPerBlock * 32),
                    0, s, sh, rt, h, n_tokens, hidden, nblocks, b0));
    }
    return TM_OK;
  });
}

extern "C" int tm_cuda_moe_down_accumulate(int qtype, const void* w_down, const float* act, const int32_t* ids,
                                           const float* weights, const float* gate_inp, const float* h, float* x,
                                           int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                           int64_t n_experts, int64_t hidden, int64_t ffn, void* stream) {
  const char* fn = "tm_moe_down_accumulate";
  TM_TRY(check_weight_alignment(fn, "w_down", qtype, w_down));
  TM_TRY(check_f32_alignment(fn, "act", act));
  TM_TRY(check_f32_alignment(fn, "weights", weights));
  TM_TRY(check_f32_alignment(fn, "gate_inp", gate_inp));
  TM_TRY(check_f32_alignment(fn, "h", h));
  TM_TRY(check_f32_alignment(fn, "x", x));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const Fmt f = fmt_for(qtype, ffn);
  DownArgs a;
  a.w_down = static_cast<const uint8_t*>(w_down);
  a.act = act;
  a.ids = ids;
  a.weights = weights;
  a.top_k = top_k;
  a.n_experts = n_experts;
  a.hidden = hidden;
  a.ffn = ffn;
  a.row_bytes = tm_qtype_row_bytes(qtype, ffn);
  a.nblocks = ffn / fmt_vals(f);
  int gate_mode = kGateNone;
  if (gate_inp != nullptr) {
    if (hidden % 4 != 0)
      gate_mode = kGateF32;
    else
      gate_mode = (aligned(gate_inp, 16) && aligned(h, 16)) ? kGateF32X4Vec : kGateF32X4;
  }
  const bool v = fmt_vector_ok(f, w_down, aligned(act, 16));
  const int64_t gx = ceil_div(hidden, kRowsPerBlock);
  if (gx > lim.max_grid_x)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: hidden = %lld needs more blocks than the grid allows", fn,
                        static_cast<long long>(hidden));
  const cudaStream_t s = as_stream(stream);
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    for (int64_t t0 = 0; t0 < n_tokens; t0 += lim.max_grid_yz) {
      const int64_t gy = n_tokens - t0 < lim.max_grid_yz ? n_tokens - t0 : lim.max_grid_yz;
      TM_TRY(launch(lim, fn, moe_down_kernel<F, V>, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                           dim3(kRowsPerBlock * 32), 0, s, a, gate_inp, h, x, slot_begin, slot_count, gate_mode, t0));
    }
    return TM_OK;
  });
}
