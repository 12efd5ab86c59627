/*
 * moe_gate_up.cu - tm_moe_gate_up and tm_experts_gate_up: the gate-up + SwiGLU of routed slots (and of a shared
 * expert) for decode steps, and the grouped GEMMs of prefill steps (moe.cuh describes the kernels).
 */
#include "moe.cuh"

namespace tm_cuda {
namespace {

template <Fmt F, bool V>
__global__ void __launch_bounds__(kRowsPerBlock * 32, gate_up_min_blocks(F))
    moe_gate_up_kernel(const GateUpArgs a, const float* __restrict__ h, int64_t hidden, int64_t nblocks,
                       uint32_t pair0, uint32_t tile0) {
  pdl_begin();
  gate_up_block<F, V>(a, h, hidden, nblocks, pair0 + blockIdx.x, tile0 + blockIdx.y);
}

template <Fmt F, bool V>
__global__ void __launch_bounds__(kRowsPerBlock * 32, gate_up_min_blocks(F))
    experts_gate_up_kernel(const GateUpArgs sh, const GateUpArgs rt, const float* __restrict__ h, int64_t n_tokens,
                           int64_t hidden, int64_t nblocks, uint32_t block0) {
  pdl_begin();
  const PairTile p = experts_gate_up_tile(sh, rt, n_tokens, block0 + blockIdx.x);
  experts_gate_up_block<F, V>(sh, rt, h, hidden, nblocks, p);
}

// Q: the warps multiply h's int8 groups hq (tiled rows; a row of q8act_bytes(hidden) a token) instead of rounding
// h per token and lane step: the same bits.
template <Fmt F, bool V, bool Q>
__global__ void __launch_bounds__(kRowsPerBlock * 32, gate_up_min_blocks(F))
    grouped_gate_up_kernel(const GateUpArgs a, const float* __restrict__ h, int64_t n_tokens, int64_t hidden,
                           int64_t nblocks, const uint8_t* __restrict__ hq) {
  __shared__ uint32_t s_pairs[kGroupMaxPairs];
  __shared__ uint32_t s_count;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t g = blockIdx.x;
  const uint32_t slots = static_cast<uint32_t>(a.slot_count), n_pairs = static_cast<uint32_t>(n_tokens) * slots;
  auto slot_of = [&](uint32_t p) {
    const uint32_t t = p / slots;
    return static_cast<int64_t>(t) * a.top_k + a.slot_begin + (p - t * slots);
  };
  pdl_begin();
  if (warp == 0) {  // the pairs of group g, in ascending order
    uint32_t count = 0;
    for (uint32_t p0 = 0; p0 < n_pairs; p0 += 32) {
      const uint32_t p = p0 + lane;
      bool mine = false;
      if (p < n_pairs) {
        const int64_t e = slot_expert(a, slot_of(p));
        const bool bad = e < 0 || e >= a.n_experts;
        mine = g < a.n_experts ? !bad && e == g : bad;
      }
      const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, mine);
      if (mine) s_pairs[count + __popc(ballot & ((1u << lane) - 1u))] = p;
      count += __popc(ballot);
    }
    if (lane == 0) s_count = count;
  }
  __syncthreads();
  const uint32_t count = s_count;
  const int64_t r = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock + warp;
  if (r >= a.ffn) return;
  if (g == a.n_experts) {  // ids out of range
    for (uint32_t i = 0; i < count; ++i)
      if (lane == 0) a.act[slot_of(s_pairs[i]) * a.ffn + r] = kNaN;
    return;
  }
  const int64_t off = (g * a.ffn + r) * a.row_bytes;
  const uint8_t* wr[2] = {a.w_gate + off, a.w_up + off};
  auto group = [&](uint32_t i, auto nt) {
    constexpr int NT = decltype(nt)::value;
    const float* xs[NT];
    const uint8_t* xq[NT];
    int64_t slot[NT];
#pragma unroll
    for (int u = 0; u < NT; ++u) {
      const uint32_t p = s_pairs[i + u];
      slot[u] = slot_of(p);
      xs[u] = h + static_cast<int64_t>(p / slots) * hidden;
      xq[u] = hq + static_cast<int64_t>(p / slots) * q8act_bytes(hidden);
    }
    float gu[2][NT];
    if constexpr (Q)
      warp_dot_q8act<F, 2, NT, true>(wr, xq, nblocks, gu);
    else
      warp_dot<F, 2, NT, true, V>(wr, xs, nblocks, gu);
    if (lane == 0)
#pragma unroll
      for (int u = 0; u < NT; ++u) {
        float g = gu[0][u], up = gu[1][u];
        if (a.scale != nullptr) {  // the deferred norm: gate_up_block's scale (DN = 1)
          const float inv = __ldg(a.scale + s_pairs[i + u] / slots);
          g = __fmul_rn(g, inv);
          up = __fmul_rn(up, inv);
        }
        a.act[slot[u] * a.ffn + r] = __fmul_rn(silu_f32(g), up);
      }
  };
  uint32_t i = 0;
  for (; i + kGroupTokens <= count; i += kGroupTokens) group(i, std::integral_constant<int, kGroupTokens>{});
  for (; i < count; ++i) group(i, std::integral_constant<int, 1>{});
}

// One grouped launch of a call's weight set (grid: groups x row tiles).
template <Fmt F, bool V>
int launch_grouped_gate_up(const Limits& lim, const char* fn, const GateUpArgs& a, const float* h,
                           const uint8_t* hq, int64_t n_tokens, int64_t hidden, int64_t nblocks, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(a.n_experts + 1), static_cast<unsigned>(ceil_div(a.ffn, kRowsPerBlock)));
  if constexpr (fmt_tiled(F)) {
    if (hq != nullptr)
      return launch(lim, fn, grouped_gate_up_kernel<F, V, true>, grid, dim3(kRowsPerBlock * 32), 0, s, a, h,
                    n_tokens, hidden, nblocks, hq);
  }
  return launch(lim, fn, grouped_gate_up_kernel<F, V, false>, grid, dim3(kRowsPerBlock * 32), 0, s, a, h, n_tokens,
                hidden, nblocks, hq);
}

// The gate-up kernels index blocks with 32 bits (gate_up_block says why).
int check_gate_up_blocks(const char* fn, int64_t blocks, int64_t n_tokens) {
  if (blocks < (int64_t{1} << 31)) return TM_OK;
  return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: n_tokens = %lld needs 2^31 or more blocks", fn,
                      static_cast<long long>(n_tokens));
}

}  // namespace

// The checks and the layout shared by both gate-up entry points; `v` is narrowed for every weight set it sees.
int gate_up_args(const char* fn, int qtype, const void* w_gate, const void* w_up, const int32_t* ids, float* act,
                 int64_t top_k, int64_t slot_begin, int64_t slot_count, int64_t n_experts, int64_t ffn,
                 int64_t hidden, const float* h, GateUpArgs* out, bool* v, const float* scale) {
  TM_TRY(check_weight_alignment(fn, "w_gate", qtype, w_gate));
  TM_TRY(check_weight_alignment(fn, "w_up", qtype, w_up));
  TM_TRY(check_f32_alignment(fn, "act", act));
  TM_TRY(check_f32_alignment(fn, "scale", scale));
  const Fmt f = fmt_for(qtype, hidden);
  *v = *v && fmt_vector_ok(f, w_gate, aligned(h, 16)) && fmt_vector_ok(f, w_up, true);
  *out = GateUpArgs{static_cast<const uint8_t*>(w_gate), static_cast<const uint8_t*>(w_up), ids, act, top_k,
                    slot_begin, slot_count, n_experts, ffn, tm_qtype_row_bytes(qtype, hidden), nullptr, 0, scale,
                    nullptr, hidden, 0.0f};
  return TM_OK;
}

// Both weight sets of an experts gate-up launch: the shared expert's (expert 0 of one, no ids) and the slots'.
int experts_gate_up_args(const char* fn, int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                         int64_t ffn_sh, const void* w_gate, const void* w_up, const int32_t* ids, float* act,
                         int64_t top_k, int64_t n_experts, int64_t ffn, int64_t hidden, const float* h,
                         GateUpArgs* sh, GateUpArgs* rt, bool* v) {
  TM_TRY(check_f32_alignment(fn, "h", h));
  *v = true;
  TM_TRY(gate_up_args(fn, qtype, w_gate_sh, w_up_sh, nullptr, act_sh, 1, 0, 1, 1, ffn_sh, hidden, h, sh, v, nullptr));
  return gate_up_args(fn, qtype, w_gate, w_up, ids, act, top_k, 0, top_k, n_experts, ffn, hidden, h, rt, v, nullptr);
}

// tm_experts_gate_up, with hq (nullable): h's int8 groups, which the grouped GEMMs of tiled rows then read.
int experts_gate_up(const char* fn, int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                    int64_t ffn_sh, const void* w_gate, const void* w_up, const float* h, const uint8_t* hq,
                    const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k, int64_t n_experts, int64_t ffn,
                    int64_t hidden, cudaStream_t s) {
  GateUpArgs sh, rt;
  bool v;
  TM_TRY(experts_gate_up_args(fn, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, ids, act, top_k,
                              n_experts, ffn, hidden, h, &sh, &rt, &v));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const Fmt f = fmt_for(qtype, hidden);
  const int64_t nblocks = hidden / fmt_vals(f);
  const int64_t total = n_tokens * (ceil_div(ffn_sh, kRowsPerBlock) + top_k * ceil_div(ffn, kRowsPerBlock));
  TM_TRY(check_gate_up_blocks(fn, total, n_tokens));
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    if (grouped_experts_gate_up_fits(lim, n_tokens, top_k, n_experts, ffn_sh, ffn)) {
      TM_TRY((launch_grouped_gate_up<F, V>(lim, fn, sh, h, hq, n_tokens, hidden, nblocks, s)));
      return launch_grouped_gate_up<F, V>(lim, fn, rt, h, hq, n_tokens, hidden, nblocks, s);
    }
    for (int64_t b0 = 0; b0 < total; b0 += lim.max_grid_x) {
      const int64_t gx = total - b0 < lim.max_grid_x ? total - b0 : lim.max_grid_x;
      TM_TRY(launch(lim, fn, experts_gate_up_kernel<F, V>, dim3(static_cast<unsigned>(gx)), dim3(kRowsPerBlock * 32),
                    0, s, sh, rt, h, n_tokens, hidden, nblocks, static_cast<uint32_t>(b0)));
    }
    return TM_OK;
  });
}

// tm_moe_gate_up, with hq (nullable): h's int8 groups, which the grouped GEMMs of tiled rows then read.
int moe_gate_up(const char* fn, int qtype, const void* w_gate, const void* w_up, const float* h, const uint8_t* hq,
                const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k, int64_t slot_begin,
                int64_t slot_count, int64_t n_experts, int64_t ffn, int64_t hidden, const float* scale,
                cudaStream_t s) {
  TM_TRY(check_f32_alignment(fn, "h", h));
  GateUpArgs a;
  bool v = true;
  TM_TRY(gate_up_args(fn, qtype, w_gate, w_up, ids, act, top_k, slot_begin, slot_count, n_experts, ffn, hidden, h,
                      &a, &v, scale));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const Fmt f = fmt_for(qtype, hidden);
  const int64_t nblocks = hidden / fmt_vals(f);
  const int64_t n_pairs = n_tokens * slot_count;
  const int64_t n_tiles = ceil_div(ffn, kRowsPerBlock);
  TM_TRY(check_gate_up_blocks(fn, n_pairs * n_tiles, n_tokens));
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    if (grouped_gate_up_fits(lim, n_tokens, n_pairs, n_tiles, n_experts))
      return launch_grouped_gate_up<F, V>(lim, fn, a, h, hq, n_tokens, hidden, nblocks, s);
    for (int64_t p0 = 0; p0 < n_pairs; p0 += lim.max_grid_x) {
      const int64_t gx = n_pairs - p0 < lim.max_grid_x ? n_pairs - p0 : lim.max_grid_x;
      for (int64_t y0 = 0; y0 < n_tiles; y0 += lim.max_grid_yz) {
        const int64_t gy = n_tiles - y0 < lim.max_grid_yz ? n_tiles - y0 : lim.max_grid_yz;
        TM_TRY(launch(lim, fn, moe_gate_up_kernel<F, V>, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                      dim3(kRowsPerBlock * 32), 0, s, a, h, hidden, nblocks, static_cast<uint32_t>(p0),
                      static_cast<uint32_t>(y0)));
      }
    }
    return TM_OK;
  });
}

}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_moe_gate_up(int qtype, const void* w_gate, const void* w_up, const float* h, const int32_t* ids,
                                   float* act, int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                   int64_t n_experts, int64_t ffn, int64_t hidden, const float* scale, void* stream) {
  return moe_gate_up("tm_moe_gate_up", qtype, w_gate, w_up, h, nullptr, ids, act, n_tokens, top_k, slot_begin,
                     slot_count, n_experts, ffn, hidden, scale, as_stream(stream));
}

extern "C" int tm_cuda_experts_gate_up(int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                                       int64_t ffn_sh, const void* w_gate, const void* w_up, const float* h,
                                       const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k,
                                       int64_t n_experts, int64_t ffn, int64_t hidden, void* stream) {
  return experts_gate_up("tm_experts_gate_up", qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, h, nullptr,
                         ids, act, n_tokens, top_k, n_experts, ffn, hidden, as_stream(stream));
}
