/*
 * moe.cuh - routed/shared experts on CUDA: what the expert kernels share (argument blocks, the gate-up and down
 * row functions, the host checks) for the four sources that define them, one translation unit each so that they
 * compile in parallel (moe_gate_up.cu: tm_moe_gate_up, tm_experts_gate_up; moe_router_gate_up.cu:
 * tm_router_experts_gate_up; moe_down.cu: tm_moe_down_accumulate; moe_experts_down.cu: tm_experts_down_accumulate).
 *
 * gate_up: blocks of 8 warps; grid x = (token, slot) pairs of the call (pair = t * slot_count + (s - slot_begin)),
 *   grid y = tiles of 8 rows of the expert FFN. A warp computes gate row r and up row r of expert ids[t, s] together
 *   (one warp_dot with NR = 2 sharing the activation loads) and writes act[t, s, r] = silu(g) * u. Pairs in x put
 *   the pairs of one row tile side by side in the schedule, so pairs routed to the same expert read its rows while
 *   they are in L2. Grids larger than the limits are split into several launches (pairs by max_grid_x, row tiles
 *   by max_grid_yz). The result of a (t, s, r) depends only on e, r and h[t]: fused (slot_count = top_k) and
 *   per-slot (slot_count = 1) launches agree bit for bit. A step of several tokens takes grouped_gate_up_kernel
 *   instead where it fits (a block per expert and row tile, each row read once per 4 of its tokens): the same bits.
 * experts_gate_up: the blocks of a shared-expert gate_up grid and of a routed one (all slots) in one 1-D grid, each
 *   block doing exactly what it does in its own launch (the same function), so the results are those bits.
 * router_experts_gate_up: the router's blocks and experts_gate_up's in one grid, ordered by integer flags instead
 *   of a launch boundary (see the kernel); a step whose gate-ups fit the grouped kernel takes the router's launch
 *   and experts_gate_up's instead.
 * experts_down_accumulate: the shared expert's down and every slot's in one launch, bitwise the two launches
 *   (moe_experts_down.cu's experts_down_kernel); with next_norm_w it also writes xw = x * next_norm_w beside each x
 *   it stores (the next layer's norm factor, norm.cuh's deferred form).
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
 * Without ids (a shared expert or dense FFN) the rows are known before the inputs: before pdl_wait each down warp
 * prefetches them into L2 (common.cuh's protocol), or experts_down_accumulate's shared warps have them copied into
 * shared memory; the gate-up does not (gate_up_block says why). Routed rows
 * depend on the router's output and are not prefetched (prefetching them once the ids are read was slower).
 */
#ifndef TM_CUDA_MOE_CUH
#define TM_CUDA_MOE_CUH

#include <cstdint>

#include "norm.cuh"
#include "qdot.cuh"

namespace tm_cuda {

constexpr int kRowsPerBlock = 8;
constexpr float kNaN = __builtin_nanf("");

// One gate-up weight set of a launch: w_gate, w_up [n_experts, ffn, hidden]; act [T, top_k, ffn].
struct GateUpArgs {
  const uint8_t* w_gate;
  const uint8_t* w_up;
  const int32_t* ids;  // nullptr: expert 0 (a shared expert or dense FFN)
  float* act;
  int64_t top_k, slot_begin, slot_count, n_experts, ffn, row_bytes;
  uint8_t* act_q;  // nullable: act's int8 groups too (qdot.cuh's q8act layout, act_q_stride bytes a slot row)
  int64_t act_q_stride;
  // The deferred norm (h is xw; g and u scaled by token t's inv): scale[t] (nullable; tm_moe_gate_up's scale), or
  // in the fused launch's shared blocks the inv of the group sums h_sums + t * norm_groups(h_dim) with eps
  const float* scale;
  const float* h_sums;
  int64_t h_dim;
  float eps;
};
// One down weight set of a launch: w_down [n_experts, hidden, ffn]; act [T, top_k, ffn].
struct DownArgs {
  const uint8_t* w_down;
  const float* act;
  const int32_t* ids;
  const float* weights;
  int64_t top_k, n_experts, hidden, ffn, row_bytes, nblocks;
  const uint8_t* act_q;  // nullable: act's int8 groups as the gate-up stored them (q8act layout), act_q_stride
  int64_t act_q_stride;  // bytes a slot row; read by the Q instantiations instead of act
};

// A weight set's int8 activation groups (nullable: none), a slot row of q8act_bytes(n) bytes for rows of n values.
template <class Args, class Groups>
inline void set_act_groups(Args* a, Groups* groups, int64_t n) {
  a->act_q = groups;
  a->act_q_stride = q8act_bytes(n);
}

// The host parts one source defines and another calls (a TM_* status each; their definitions say more).
// moe_gate_up.cu's:
int gate_up_args(const char* fn, int qtype, const void* w_gate, const void* w_up, const int32_t* ids, float* act,
                 int64_t top_k, int64_t slot_begin, int64_t slot_count, int64_t n_experts, int64_t ffn,
                 int64_t hidden, const float* h, GateUpArgs* out, bool* v, const float* scale);
int experts_gate_up_args(const char* fn, int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                         int64_t ffn_sh, const void* w_gate, const void* w_up, const int32_t* ids, float* act,
                         int64_t top_k, int64_t n_experts, int64_t ffn, int64_t hidden, const float* h,
                         GateUpArgs* sh, GateUpArgs* rt, bool* v);
int experts_gate_up(const char* fn, int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                    int64_t ffn_sh, const void* w_gate, const void* w_up, const float* h, const uint8_t* hq,
                    const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k, int64_t n_experts, int64_t ffn,
                    int64_t hidden, cudaStream_t s);
int moe_gate_up(const char* fn, int qtype, const void* w_gate, const void* w_up, const float* h, const uint8_t* hq,
                const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k, int64_t slot_begin,
                int64_t slot_count, int64_t n_experts, int64_t ffn, int64_t hidden, const float* scale,
                cudaStream_t s);
// moe_down.cu's:
int down_args(const char* fn, int qtype, const void* w_down, const float* act, const int32_t* ids,
              const float* weights, const float* gate_inp, const float* h, int64_t top_k, int64_t n_experts,
              int64_t hidden, int64_t ffn, DownArgs* a, int* gate_mode, bool* v);
int launch_moe_down(const Limits& lim, const char* fn, int qtype, const DownArgs& a, bool v, const float* gate_inp,
                    const float* h, float* x, int64_t n_tokens, int64_t slot_begin, int64_t slot_count,
                    int gate_mode, cudaStream_t s);

namespace {

// A slot's expert id (no ids: expert 0) and routing weight (no weights: 1), as a launch's arguments hold them.
template <class Args>
__device__ __forceinline__ int64_t slot_expert(const Args& a, int64_t slot) {
  return a.ids != nullptr ? static_cast<int64_t>(a.ids[slot]) : 0;
}
template <class Args>
__device__ __forceinline__ float slot_weight(const Args& a, int64_t slot) {
  return a.weights != nullptr ? a.weights[slot] : 1.0f;
}

// Timing-only probes (wrong results; results/NOTES.md lesson 139): 0 leaves out the gate-up's group epilogue
// (TM_PROBE_GU_GROUPS) or the shared blocks' quantization of h (TM_PROBE_SH_Q8), to price each.
#ifndef TM_PROBE_GU_GROUPS
#define TM_PROBE_GU_GROUPS 1
#endif
#ifndef TM_PROBE_SH_Q8
#define TM_PROBE_SH_Q8 1
#endif
// The int8 groups of a block's kRowsPerBlock consecutive values (warp w's lane 0 holds value w, row tile * 8 + w
// of a row of n values, n a multiple of 4): two groups of the row's q8act layout at buf, written by warp 0 after a
// barrier of the whole block (every warp of the block calls it). The consumer (the down) reads them instead of
// rounding the floats itself: the same groups, made once.
__device__ __forceinline__ void store_block_act_groups(uint8_t* buf, uint32_t tile, int64_t n, float v) {
  static_assert(kRowsPerBlock == 8, "a block's rows are two groups");
  __shared__ float s_vals[kRowsPerBlock];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) s_vals[warp] = v;
  __syncthreads();
  const int64_t j = static_cast<int64_t>(tile) * 2 + lane;  // the group of rows 4j .. 4j + 3
  if (warp == 0 && lane < 2 && 4 * j < n) {
    const float* q = s_vals + 4 * lane;
    store_q8act(buf, j, tm_act::q8_group(q[0], q[1], q[2], q[3]));
  }
}

// Warp `warp` of the block for (pair, row tile): act[t, s, r] = silu(g) * u with g, u one warp_dot (NR = 2) of
// h[t] = h + t * h_stride (h_stride 0: the block's own token row, e.g. in shared memory). Called after pdl_begin.
// The kernels do not prefetch a shared expert's rows before pdl_wait: 24.5 MB of prefetches slowed the kernel
// before them more than they sped this one (the router's, results/NOTES.md v4h; attn_output's since the router
// joined this grid, v7: 813.9 against 817.3 tok/s). h is
// read with plain loads (the fused router kernel writes it in the same grid, or it sits in shared memory).
// Block indices are 32-bit (the launchers keep every grid's block count below 2^31): a 64-bit division is a
// ~70-instruction call, paid by every warp before its first load.
// e_given >= 0: the slot's expert id, known to the caller (router_experts_gate_up's flag carries it), not read.
// XT = uint8_t (tiled rows only): h is the q8act layout of the activations (qdot.cuh), h_stride in its bytes.
// With a.act_q the block stores its rows' int8 groups instead of the floats (store_block_act_groups: the whole
// block calls this).
// The deferred norm (results/NOTES.md lessons 180-189): DN = 0 never (the fused launch's routed blocks), DN = 1 by
// a.scale where given, DN = 2 always, by the inv of a.h_sums, each lane adding its chunk of the sums before the
// dots and holding only that one float across them (the fused launch's shared blocks: on the H200 +3% decode
// against the norm of x in every block, lesson 186; the sums held whole across the dots, 16 registers, measured
// slower at this kernel's 64-register cap, lesson 182). The same inv either way: norm.cuh's (tm_rmsnorm_factors').
template <Fmt F, bool V, class XT = float, int DN = 1>
__device__ __forceinline__ void gate_up_block(const GateUpArgs& a, const XT* h, int64_t h_stride,
                                              int64_t nblocks, uint32_t pair, uint32_t tile, int e_given = -1) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(tile) * kRowsPerBlock + warp;
  const bool row = r < a.ffn;
  const bool groups = TM_PROBE_GU_GROUPS && a.act_q != nullptr;
  if (!row && !groups) return;
  const uint32_t slots = static_cast<uint32_t>(a.slot_count), t = pair / slots;
  const int64_t slot = static_cast<int64_t>(t) * a.top_k + a.slot_begin + (pair - t * slots);
  const int64_t e = e_given >= 0 ? e_given : slot_expert(a, slot);
  float v = kNaN;  // an expert id out of range gives NaN rows
  if (row && e >= 0 && e < a.n_experts) {
    const int64_t off = (e * a.ffn + r) * a.row_bytes;
    const uint8_t* wr[2] = {a.w_gate + off, a.w_up + off};
    const XT* xs[1] = {h + t * h_stride};
    float lane_ss = 0.0f;  // DN = 2: this lane's chunk of the sums, added before the dots
    if constexpr (DN == 2) lane_ss = lane_grouped_sum(a.h_sums + t * norm_groups(a.h_dim), a.h_dim);
    float gu[2][1];
    if constexpr (std::is_same_v<XT, uint8_t>)
      warp_dot_q8act<F, 2, 1, true>(wr, xs, nblocks, gu);
    else
      warp_dot<F, 2, 1, true, V>(wr, xs, nblocks, gu);
    float g = gu[0][0], u = gu[1][0];
    if constexpr (DN == 2) {
      const float inv = rms_inv_from_sum(warp_sum(lane_ss), a.h_dim, a.eps);
      g = __fmul_rn(g, inv);
      u = __fmul_rn(u, inv);
    } else if (DN == 1 && a.scale != nullptr) {
      const float inv = __ldg(a.scale + t);
      g = __fmul_rn(g, inv);
      u = __fmul_rn(u, inv);
    }
    v = __fmul_rn(silu_f32(g), u);
  }
  // With groups the consumer reads only them (tornado_moe.h): no floats. Their stores cost 0.5% of the decode
  // step on an H100 and 0.4% on the H200 (results/NOTES.md lesson 177).
  if (row && lane == 0 && a.act_q == nullptr) a.act[slot * a.ffn + r] = v;
  if (groups) store_block_act_groups(a.act_q + slot * a.act_q_stride, tile, a.ffn, v);
}

// The gate-up kernels on tiled Q8_0 rows: 4 blocks per SM (<= 64 registers; results/NOTES.md lesson 6: occupancy
// decides these kernels). Left to themselves the compiler gives the reader's whole-batch path (all activation
// loads in flight) and the fused kernel's router phase (its F32X4 dot) 80-90 registers, and 2-3 blocks per SM.
// Other formats keep TM_WEIGHT_MIN_BLOCKS (their dots need more registers than 4 blocks leave). 5 blocks (48
// registers) measured 2% slower with int8 activations (lesson 148).
constexpr int gate_up_min_blocks(Fmt f) {
  return fmt_tiled(f) ? 4 : TM_WEIGHT_MIN_BLOCKS;
}

// Block b of tm_experts_gate_up's 1-D grid: the shared expert's blocks first, then the routed ones; each part
// numbers its blocks (pair, tile) as moe_gate_up_kernel's grid does (pair fastest).
__device__ __forceinline__ uint32_t shared_gate_up_blocks(const GateUpArgs& sh, int64_t n_tokens) {
  return static_cast<uint32_t>(n_tokens * ceil_div(sh.ffn, kRowsPerBlock));
}
// Block b of the grid as (pair, tile) of its part: the shared expert's pairs are tokens.
struct PairTile {
  bool shared;
  uint32_t pair, tile;
};
__device__ __forceinline__ PairTile experts_gate_up_tile(const GateUpArgs& sh, const GateUpArgs& rt,
                                                         int64_t n_tokens, uint32_t b) {
  const uint32_t sh_blocks = shared_gate_up_blocks(sh, n_tokens);
  const bool shared = b < sh_blocks;
  const uint32_t i = shared ? b : b - sh_blocks;
  const uint32_t pairs = static_cast<uint32_t>(shared ? n_tokens : n_tokens * rt.slot_count);
  const uint32_t tile = i / pairs;
  return PairTile{shared, i - tile * pairs, tile};
}
template <Fmt F, bool V>
__device__ __forceinline__ void experts_gate_up_block(const GateUpArgs& sh, const GateUpArgs& rt, const float* h,
                                                      int64_t hidden, int64_t nblocks, const PairTile& p) {
  if (p.shared)  // two calls, not one on a selected reference: each reads its own kernel parameters
    gate_up_block<F, V>(sh, h, hidden, nblocks, p.pair, p.tile);
  else
    gate_up_block<F, V>(rt, h, hidden, nblocks, p.pair, p.tile);
}

// A gate-up of several tokens (a prefill step) as grouped GEMMs (results/NOTES.md lessons 117, 126-127; H200,
// 128-token steps: 1,791 against 1,520 prompt tok/s for a pair per block). Block (g, tile) of grouped_gate_up_kernel
// takes the pairs of the call routed to expert g (warp 0 lists them in ascending pair order) and each warp
// multiplies its gate and up rows with kGroupTokens of their tokens at once (warp_dot with NT tokens), so a row is
// read once per group of tokens instead of once per pair, from L1 after the first. Column g = n_experts takes the
// pairs whose id is out of range (NaN rows, as gate_up_block writes them). Each (t, s, r) is warp_dot's value for
// that row and h[t], whatever the number of tokens the warp takes at once (qdot.cuh), then gate_up_block's silu(g) *
// u: the bits of the pair-per-block kernels, which decode steps and calls beyond a block's pair list or the y limit
// keep.
constexpr int kGroupTokens = 4;
constexpr uint32_t kGroupMaxPairs = 4096;  // a block's pair list: 16 KB of shared memory

// Whether grouped_gate_up_kernel takes a call of n_pairs pairs and n_tiles row tiles.
inline bool grouped_gate_up_fits(const Limits& lim, int64_t n_tokens, int64_t n_pairs, int64_t n_tiles,
                                 int64_t n_experts) {
  return n_tokens > 1 && n_pairs <= kGroupMaxPairs && n_tiles <= lim.max_grid_yz && n_experts < lim.max_grid_x;
}
// The same for experts_gate_up's two weight sets: the routed pairs' test covers the shared expert's (one pair a
// token, one expert) but for its row tiles.
inline bool grouped_experts_gate_up_fits(const Limits& lim, int64_t n_tokens, int64_t top_k, int64_t n_experts,
                                         int64_t ffn_sh, int64_t ffn) {
  return ceil_div(ffn_sh, kRowsPerBlock) <= lim.max_grid_yz &&
         grouped_gate_up_fits(lim, n_tokens, n_tokens * top_k, ceil_div(ffn, kRowsPerBlock), n_experts);
}

// The shared-expert gate's dot: an F32RowMode (qdot.cuh), or none.
constexpr int kGateNone = -1;

// sigmoid(dot(gate_inp, h_t)) by one warp (qdot.cuh's float32-row dot, whose bits depend only on the length: the
// same bits in every block and kernel that computes it, with h_t in global or in shared memory).
__device__ __forceinline__ float shared_gate(const float* gate_inp, const float* ht, int64_t hidden, int gate_mode) {
  return sigmoid_f32(warp_dot_f32_row(gate_mode, gate_inp, ht, hidden));
}

// The down's L2 prefetch distance when it reads int8 groups (qdot.cuh's PF; results/NOTES.md lesson 136).
#ifndef TM_DOWN_PF
#define TM_DOWN_PF 2
#endif

// The dot products dot(W_down[e][r], act[t, s + i]) of slots s .. s + NR - 1 (one warp_dot with per-row
// activations, so the loads of several experts are in flight together) and their factors w_eff (NaN for an expert
// id out of range).
// SM: the row (NR = 1) is the copy `row_copy` in shared memory. Q: the activations are a.act_q's groups.
template <Fmt F, int NR, bool V, bool SM = false, bool Q = false>
__device__ __forceinline__ void down_dots(const DownArgs& a, int64_t t, int64_t r, int64_t s, bool gated,
                                          float gate, float (&d)[NR][1], float (&w_eff)[NR],
                                          const uint8_t* row_copy = nullptr) {
  static_assert(!SM || NR == 1, "one row copy");
  const uint8_t* wr[NR];
  const float* xs[NR];
  const uint8_t* xq[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int64_t slot = t * a.top_k + s + i;
    int64_t e = slot_expert(a, slot);
    const bool bad = e < 0 || e >= a.n_experts;
    if (bad) e = 0;
    wr[i] = SM ? row_copy : a.w_down + (e * a.hidden + r) * a.row_bytes;
    xs[i] = a.act + slot * a.ffn;
    xq[i] = a.act_q + slot * a.act_q_stride;
    float w = slot_weight(a, slot);
    if (gated) w = __fmul_rn(w, gate);
    w_eff[i] = bad ? kNaN : w;
  }
  if constexpr (Q)
    warp_dot_q8act<F, NR, 1, false, SM, TM_DOWN_PF>(wr, xq, a.nblocks, d);
  else
    warp_dot<F, NR, 1, false, V, SM>(wr, xs, a.nblocks, d);
}

}  // namespace
}  // namespace tm_cuda

#endif
