/*
 * moe.cu - routed/shared experts on CUDA: tm_moe_gate_up and tm_moe_down_accumulate, both run by stream.cuh's
 * pipeline (its dot product and order).
 *
 * gate_up: one work item per (token, slot, row r of the expert FFN), item = pair * ffn + r with pair = t *
 *   slot_count + (s - slot_begin); the item's two rows are gate row r and up row r of expert ids[t, s] (sharing the
 *   activation registers), and act[t, s, r] = silu(g) * u. A value depends only on e, r and h[t]: fused
 *   (slot_count = top_k) and per-slot (slot_count = 1) calls agree bit for bit.
 * down_accumulate: one work item per (token, group of kDownRows output rows), its segments the slots of the call
 *   in increasing order. acc = x[t, r]; after each slot's dot products: acc = acc + w_eff * dot (a rounded multiply
 *   then a rounded add), w_eff = weights[t, s] (1 without weights), times sigmoid(z) with the shared-expert gate,
 *   z = dot(gate_inp, h[t]) (stream.cuh's warp_dot_f32); x[t, r] = acc once. A
 *   per-slot call starts from the x the previous slot stored (the same float32 the fused accumulator held), so fused
 *   and per-slot calls agree bit for bit.
 * Expert ids outside [0, n_experts) cannot be reported from the device: they produce NaN outputs (expert 0's rows
 * are streamed in their place).
 */
#include "stream.cuh"

namespace tm_cuda {
namespace {

constexpr float kNaN = __builtin_nanf("");
constexpr int kGateUpStages = 4;
constexpr int kDownRows = 2;
constexpr int kDownStages = 6;

// Expert id of a slot (clamped into range for addressing) and whether it was out of range.
__device__ __forceinline__ int64_t slot_expert(const int32_t* ids, int64_t slot, int64_t n_experts, bool* bad) {
  const int64_t e = ids != nullptr ? static_cast<int64_t>(ids[slot]) : 0;
  *bad = e < 0 || e >= n_experts;
  return *bad ? 0 : e;
}

struct GateUpJob {
  const uint8_t* w_gate;
  const uint8_t* w_up;
  const float* h;
  const int32_t* ids;
  float* act;
  int64_t n_tokens, top_k, slot_begin, slot_count, n_experts, ffn, hidden, row_bytes;

  struct Item {
    const uint8_t* gate;  // the item's gate row; its up row is at the same offset of w_up
    int64_t t, slot, r;
    bool bad;
  };
  struct State {};
  using WarpCache = NoWarpCache;
  __device__ WarpCache warp_cache(int64_t, int64_t) const { return {}; }
  __device__ int64_t items() const { return n_tokens * slot_count * ffn; }
  __device__ Item decode(int64_t item) const {
    const DivMod pr = divmod(item, ffn);
    const DivMod ts = divmod(pr.q, slot_count);
    Item it;
    it.t = ts.q;
    it.slot = ts.q * top_k + slot_begin + ts.r;
    it.r = pr.r;
    const int64_t e = slot_expert(ids, it.slot, n_experts, &it.bad);
    it.gate = w_gate + (e * ffn + it.r) * row_bytes;
    return it;
  }
  __device__ int segments() const { return 1; }
  __device__ int64_t seg_cols(int) const { return hidden; }
  __device__ bool is_static(const Item&) const { return ids == nullptr; }
  __device__ const uint8_t* row(const Item& it, int, int r) const {
    return r == 0 ? it.gate : w_up + (it.gate - w_gate);
  }
  __device__ const float* xrow(const Item& it, int) const { return h + it.t * hidden; }
  template <Fmt F>
  __device__ void load_x(const Item& it, int seg, int64_t c, int lane, float (&x)[kLaneVals], float (&aux)[2],
                         NormCache&) const {
    tm_cuda::load_x<F>(xrow(it, seg), nullptr, 0.0f, hidden, c, lane, x, aux);
  }
  __device__ State begin(const Item&, WarpCache&) const { return {}; }
  __device__ void segment(const Item& it, int, const float (&gu)[2], State&, WarpCache&) const {
    if ((threadIdx.x & 31) == 0) act[it.slot * ffn + it.r] = it.bad ? kNaN : __fmul_rn(silu_f32(gu[0]), gu[1]);
  }
  __device__ void finish(const Item&, State&) const {}
};

struct DownJob {
  const uint8_t* w_down;
  const float* act;
  const int32_t* ids;
  const float* weights;
  const float* gate_inp;
  const float* h;
  float* x;
  int64_t n_tokens, top_k, slot_begin, slot_count, n_experts, hidden, ffn, row_bytes, groups;

  struct Item {
    int64_t t, r0;
  };
  struct State {
    float acc[kDownRows];
    float gate;
  };
  using WarpCache = NoWarpCache;
  __device__ WarpCache warp_cache(int64_t, int64_t) const { return {}; }
  __device__ int64_t slot(const Item& it, int seg) const { return it.t * top_k + slot_begin + seg; }
  __device__ int64_t items() const { return n_tokens * groups; }
  __device__ Item decode(int64_t item) const {
    const DivMod d = divmod(item, groups);
    return Item{d.q, d.r * kDownRows};
  }
  __device__ int segments() const { return static_cast<int>(slot_count); }
  __device__ int64_t seg_cols(int) const { return ffn; }
  __device__ bool is_static(const Item&) const { return ids == nullptr; }
  __device__ const uint8_t* row(const Item& it, int seg, int r) const {
    bool bad;
    const int64_t e = slot_expert(ids, slot(it, seg), n_experts, &bad);
    int64_t rr = it.r0 + r;
    if (rr >= hidden) rr = hidden - 1;  // the last group's missing rows re-read a valid row, never stored
    return w_down + (e * hidden + rr) * row_bytes;
  }
  __device__ const float* xrow(const Item& it, int seg) const { return act + slot(it, seg) * ffn; }
  template <Fmt F>
  __device__ void load_x(const Item& it, int seg, int64_t c, int lane, float (&xr)[kLaneVals], float (&aux)[2],
                         NormCache&) const {
    tm_cuda::load_x<F>(xrow(it, seg), nullptr, 0.0f, ffn, c, lane, xr, aux);
  }
  __device__ State begin(const Item& it, WarpCache&) const {
    // Pull every segment's first activation chunk (this lane's part) into L1: the segments load them one by one.
    const int lane = threadIdx.x & 31;
    for (int seg = 0; seg < segments(); ++seg) {
      const float* xr = xrow(it, seg) + 64 * lane;
      if (64 * lane < ffn) {
        prefetch_l1(xr);
        prefetch_l1(xr + 32);
      }
    }
    State st;
    const float* xt = x + it.t * hidden + it.r0;
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) st.acc[r] = it.r0 + r < hidden ? __ldcg(xt + r) : 0.0f;  // see common.cuh
    st.gate = gate_inp != nullptr ? sigmoid_f32(warp_dot_f32(gate_inp, h + it.t * hidden, hidden)) : 1.0f;
    return st;
  }
  __device__ void segment(const Item& it, int seg, const float (&dot)[kDownRows], State& st, WarpCache&) const {
    const int64_t s = slot(it, seg);
    bool bad;
    slot_expert(ids, s, n_experts, &bad);
    float w = weights != nullptr ? weights[s] : 1.0f;
    if (gate_inp != nullptr) w = __fmul_rn(w, st.gate);
    if (bad) w = kNaN;
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) st.acc[r] = __fadd_rn(st.acc[r], __fmul_rn(w, dot[r]));
  }
  __device__ void finish(const Item& it, State& st) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < kDownRows; ++r)
      if (lane == r && it.r0 + r < hidden) x[it.t * hidden + it.r0 + r] = st.acc[r];
  }
};

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_moe_gate_up(int qtype, const void* w_gate, const void* w_up, const float* h, const int32_t* ids,
                                   float* act, int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                   int64_t n_experts, int64_t ffn, int64_t hidden, void* stream) {
  const char* fn = "tm_moe_gate_up";
  TM_STATUS_TRY(check_weight_alignment(fn, "w_gate", qtype, w_gate));
  TM_STATUS_TRY(check_weight_alignment(fn, "w_up", qtype, w_up));
  TM_STATUS_TRY(check_f32_alignment(fn, "h", h));
  TM_STATUS_TRY(check_f32_alignment(fn, "act", act));
  Limits lim;
  TM_STATUS_TRY(get_limits(&lim));
  const GateUpJob job{static_cast<const uint8_t*>(w_gate), static_cast<const uint8_t*>(w_up), h, ids, act, n_tokens,
                      top_k, slot_begin, slot_count, n_experts, ffn, hidden, tm_qtype_row_bytes(qtype, hidden)};
  return dispatch_fmt(fn, qtype, [&](auto ftag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    return launch_stream<F, 2>(lim, fn, job, n_tokens * slot_count * ffn, kGateUpStages, as_stream(stream));
  });
}

extern "C" int tm_cuda_moe_down_accumulate(int qtype, const void* w_down, const float* act, const int32_t* ids,
                                           const float* weights, const float* gate_inp, const float* h, float* x,
                                           int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                           int64_t n_experts, int64_t hidden, int64_t ffn, void* stream) {
  const char* fn = "tm_moe_down_accumulate";
  TM_STATUS_TRY(check_weight_alignment(fn, "w_down", qtype, w_down));
  TM_STATUS_TRY(check_f32_alignment(fn, "act", act));
  TM_STATUS_TRY(check_f32_alignment(fn, "weights", weights));
  TM_STATUS_TRY(check_f32_alignment(fn, "gate_inp", gate_inp));
  TM_STATUS_TRY(check_f32_alignment(fn, "h", h));
  TM_STATUS_TRY(check_f32_alignment(fn, "x", x));
  Limits lim;
  TM_STATUS_TRY(get_limits(&lim));
  const int64_t groups = ceil_div(hidden, kDownRows);
  const DownJob job{static_cast<const uint8_t*>(w_down), act, ids, weights, gate_inp, h, x, n_tokens, top_k,
                    slot_begin, slot_count, n_experts, hidden, ffn, tm_qtype_row_bytes(qtype, ffn), groups};
  return dispatch_fmt(fn, qtype, [&](auto ftag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    return launch_stream<F, kDownRows>(lim, fn, job, n_tokens * groups, kDownStages, as_stream(stream));
  });
}
