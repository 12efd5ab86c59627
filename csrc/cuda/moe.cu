/*
 * moe.cu - routed/shared experts on CUDA: tm_moe_gate_up, tm_experts_gate_up, tm_router_experts_gate_up,
 * tm_moe_down_accumulate and tm_experts_down_accumulate.
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
 *   (experts_down_kernel below); with next_norm_w it also writes xw = x * next_norm_w beside each x it stores (the
 *   next layer's norm factor, norm.cuh's deferred form).
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
#include <cstdint>

namespace tm_cuda {
namespace {
// ---- a measurement build only (-DTM_RGU_TIMELINE=1; results/NOTES.md lesson 46 a) ----
// Per block of the latest router_experts_gate_up launch: the global timer (ns) at its start, after pdl_wait,
// when its role is known, when its inputs are ready (shared: h normalised; router: its logits stored; routed:
// the flag acquired) and the latest end of its warps; its role (0 router, 1 shared, 2 routed) and SM. The blocks
// of the experts_down launch after it follow from row kDownTimelineRow0 (role 3; its third and fourth stamps are
// when the block's last routed warp and its last shared warp finished their dot products), on the same clock, and
// the last row (no decode block reaches it) holds router_topk_warp's steps (role 4, through router.cuh's
// TM_TOPK_STAMP hook: poll start, logits in, softmax, picks, ids stored).
// tm_cuda_rgu_timeline copies the rows out and clears them (scripts/rgu_timeline.py). Without the flag the stamps
// are empty and the kernels are the product's, bit for bit.
#ifndef TM_RGU_TIMELINE
#define TM_RGU_TIMELINE 0
#endif
#if TM_RGU_TIMELINE
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
constexpr int kTimelineRows = 8192;
constexpr uint32_t kDownTimelineRow0 = 4096;
struct TimelineRow {
  unsigned long long t[5];
  uint32_t role, sm;
};
static_assert(sizeof(TimelineRow) == 48, "scripts/rgu_timeline.py's ROW");
__device__ TimelineRow rgu_timeline[kTimelineRows];
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(v));
  return v;
}
// row0: kDownTimelineRow0 for the down's blocks (its first token's only)
__device__ __forceinline__ void stamp(int k, uint32_t row0 = 0) {
  const uint32_t r = row0 + blockIdx.x;
  if (threadIdx.x == 0 && blockIdx.y == 0 && r < kTimelineRows) rgu_timeline[r].t[k] = global_ns();
}
__device__ __forceinline__ void stamp_role(uint32_t role, uint32_t row0 = 0) {
  const uint32_t r = row0 + blockIdx.x;
  if (threadIdx.x == 0 && blockIdx.y == 0 && r < kTimelineRows) {
    rgu_timeline[r].role = role;
    rgu_timeline[r].sm = sm_id();
  }
}
// Stamp k at the latest of the calling warps (the rows start cleared: tm_cuda_rgu_timeline zeroes them).
__device__ __forceinline__ void stamp_latest(int k, uint32_t row0 = 0) {
  const uint32_t r = row0 + blockIdx.x;
  if ((threadIdx.x & 31) == 0 && blockIdx.y == 0 && r < kTimelineRows) atomicMax(&rgu_timeline[r].t[k], global_ns());
}
// The end of the block's last warp.
__device__ __forceinline__ void stamp_end(uint32_t row0 = 0) { stamp_latest(4, row0); }
// One step of the publishing router block's top-k, by lane 0 of its warp.
__device__ __forceinline__ void stamp_topk(int k) {
  if ((threadIdx.x & 31) == 0) {
    rgu_timeline[kTimelineRows - 1].t[k] = global_ns();
    rgu_timeline[kTimelineRows - 1].role = 4;
  }
}
#define TM_TOPK_STAMP(k) stamp_topk(k)
#else
__device__ __forceinline__ void stamp(int, uint32_t = 0) {}
__device__ __forceinline__ void stamp_role(uint32_t, uint32_t = 0) {}
__device__ __forceinline__ void stamp_latest(int, uint32_t = 0) {}
__device__ __forceinline__ void stamp_end(uint32_t = 0) {}
constexpr uint32_t kDownTimelineRow0 = 0;
#endif

}  // namespace
}  // namespace tm_cuda

#include "norm.cuh"
#include "router.cuh"

namespace tm_cuda {
namespace {

constexpr int kRowsPerBlock = 8;
// Timing probes of router_experts_gate_up (wrong results; results/NOTES.md v7): TM_RGU_IDS_PROBE=1 lets the
// routed blocks start once h is out, without the router's ids (the bound of a router off the launch's path);
// TM_RGU_NORM_PROBE=1 lets the shared blocks read x as h (the bound of h computed before the launch).
#ifndef TM_RGU_IDS_PROBE
#define TM_RGU_IDS_PROBE 0
#endif
#ifndef TM_RGU_NORM_PROBE
#define TM_RGU_NORM_PROBE 0
#endif
// The shared blocks ask for the first TM_RGU_SHARED_L1_LINES 128-byte lines of each warp's gate and up rows in L1
// right after pdl_wait, so that their DRAM round trip overlaps the norm of x: prefetches hold no register and
// return nothing to the warp, unlike the loads of results/NOTES.md lesson 56. H200 (NOTES v8): 8 lines 826.0 tok/s,
// the whole row (17) 817.5, none 819.7, in one call. 0: none.
#ifndef TM_RGU_SHARED_L1_LINES
#define TM_RGU_SHARED_L1_LINES 8
#endif
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
};
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
// With a.act_q the block also stores its rows' int8 groups (store_block_act_groups: the whole block calls this).
template <Fmt F, bool V, class XT = float>
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
    float gu[2][1];
    if constexpr (std::is_same_v<XT, uint8_t>)
      warp_dot_q8act<F, 2, 1, true>(wr, xs, nblocks, gu);
    else
      warp_dot<F, 2, 1, true, V>(wr, xs, nblocks, gu);
    v = __fmul_rn(silu_f32(gu[0][0]), gu[1][0]);
  }
  if (row && lane == 0) a.act[slot * a.ffn + r] = v;
  if (groups) store_block_act_groups(a.act_q + slot * a.act_q_stride, tile, a.ffn, v);
}

// The gate-up kernels on tiled Q8_0 rows: 4 blocks per SM (<= 64 registers; results/NOTES.md lesson 6: occupancy
// decides these kernels). Left to themselves the compiler gives the reader's whole-batch path (all activation
// loads in flight) and the fused kernel's router phase (its F32X4 dot) 80-90 registers, and 2-3 blocks per SM.
// Other formats keep TM_WEIGHT_MIN_BLOCKS (their dots need more registers than 4 blocks leave).
constexpr int gate_up_min_blocks(Fmt f) {
  return fmt_tiled(f) ? 4 : TM_WEIGHT_MIN_BLOCKS;
}
// Measurement knobs (results/NOTES.md lesson 144): blocks per SM of router_experts_gate_up and of the down on tiled
// rows (4: the product; int8 activations leave the decode's instantiations registers to spare for 5).
#ifndef TM_RGU_TILED_MIN_BLOCKS
#define TM_RGU_TILED_MIN_BLOCKS 4
#endif
#ifndef TM_DOWN_TILED_MIN_BLOCKS
#define TM_DOWN_TILED_MIN_BLOCKS 4
#endif
constexpr int router_gate_up_min_blocks(Fmt f) {
  return fmt_tiled(f) ? TM_RGU_TILED_MIN_BLOCKS : TM_WEIGHT_MIN_BLOCKS;
}

template <Fmt F, bool V>
__global__ void __launch_bounds__(kRowsPerBlock * 32, gate_up_min_blocks(F))
    moe_gate_up_kernel(const GateUpArgs a, const float* __restrict__ h, int64_t hidden, int64_t nblocks,
                       uint32_t pair0, uint32_t tile0) {
  pdl_begin();
  gate_up_block<F, V>(a, h, hidden, nblocks, pair0 + blockIdx.x, tile0 + blockIdx.y);
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

template <Fmt F, bool V>
__global__ void __launch_bounds__(kRowsPerBlock * 32, gate_up_min_blocks(F))
    experts_gate_up_kernel(const GateUpArgs sh, const GateUpArgs rt, const float* __restrict__ h, int64_t n_tokens,
                           int64_t hidden, int64_t nblocks, uint32_t block0) {
  pdl_begin();
  const PairTile p = experts_gate_up_tile(sh, rt, n_tokens, block0 + blockIdx.x);
  experts_gate_up_block<F, V>(sh, rt, h, hidden, nblocks, p);
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
      for (int u = 0; u < NT; ++u) a.act[slot[u] * a.ffn + r] = __fmul_rn(silu_f32(gu[0][u]), gu[1][u]);
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

// The shared-expert gate's dot: an F32RowMode (qdot.cuh), or none.
constexpr int kGateNone = -1;

// sigmoid(dot(gate_inp, h_t)) by one warp (qdot.cuh's float32-row dot, whose bits depend only on the length: the
// same bits in every block and kernel that computes it, with h_t in global or in shared memory).
__device__ __forceinline__ float shared_gate(const float* gate_inp, const float* ht, int64_t hidden, int gate_mode) {
  return sigmoid_f32(warp_dot_f32_row(gate_mode, gate_inp, ht, hidden));
}

// gate[t] = shared_gate(h[t]) by one warp a token: tm_router_experts_gate_up's gate output where it falls back to
// separate launches.
__global__ void __launch_bounds__(kRowsPerBlock * 32)
    shared_gate_kernel(const float* __restrict__ gate_inp, const float* __restrict__ h, float* gate,
                       int64_t n_tokens, int64_t hidden, int gate_mode) {
  pdl_begin();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5); t < n_tokens;
       t += stride) {
    const float g = shared_gate(gate_inp, h + t * hidden, hidden, gate_mode);
    if ((threadIdx.x & 31) == 0) gate[t] = g;
  }
}

// ---- tm_router_experts_gate_up: the router and experts_gate_up_kernel's blocks in one grid ----
// Grid: n_tokens * router_blocks(n_experts) ticketed blocks, then the shared expert's gate-up blocks (by blockIdx),
// then as many ticketed blocks as the routed gate-up has. A ticketed block's role is its ticket (an atomic counter
// taken after pdl_wait), not blockIdx: tickets below the router block count make router blocks, the others routed
// gate-up blocks, and a routed block waits only for router blocks, which hold lower tickets and so are running
// already: the grid progresses in whatever order the blocks start.
//   router block (t, j): h = rmsnorm(x[t]) into its shared memory (norm.cuh: the bits tm_rmsnorm writes; j = 0
//     also stores it to h); warp w computes the logit of expert 8 j + w and stores it as a tagged word (the
//     call's tag beside the float's bits, no fence) into the scratch (with a shared-expert gate row, "expert"
//     n_experts is that row: gate[t] = shared_gate(h), read by the down after this launch, so that the down's
//     2,048 shared warps no longer each read the 16 KB row and h from L2: H200, 774.1 -> 790.8 tok/s in one call,
//     results/NOTES.md v4q). Block j = 0 then releases h_ready[t] (its h) and its warp 0 polls the token's
//     tagged logits until all carry the tag, runs router_topk_warp on them, writes ids/weights and stores the ids
//     packed beside the tag into ids_ready[t]. The same functions as router_kernel: the same bits. (An arrival
//     counter and a last-arrival release had put two fences on this path: H200, the ids 1.2 us later and
//     805.4 against 812.5 tok/s in one call, results/NOTES.md v4r and lesson 47.)
//   shared-expert block: normalises x[t] itself into shared memory (the same function again, so the same h) and
//     runs experts_gate_up_block on it: no ticket, no wait, so it starts streaming as soon as pdl_wait returns.
//     (Waiting for router block 0's h, with a ticket, cost each of them two dependent round trips: NOTES v4l.)
//   routed block: polls ids_ready[t] (relaxed) and h_ready[t] (acquire: then h is visible) in one loop, takes
//     its slot's expert id from the ids word, then experts_gate_up_block. Beyond kIdsInFlag slots block 0
//     releases h_ready after ids instead, and the routed blocks wait for it alone and read ids.
// Nothing is cleared at the end of a call (that took every block one more atomic round trip): the ticket word
// holds the call's epoch beside the count (one 64-bit atomic returns both), the block with the last ticket starts
// the next epoch at count 0, and every flag and logit is tagged with the epoch + 1 (a value older calls never
// wrote, within 2^32 calls). Calls of one scratch run one after another (a stream), so no block of the next call
// reads these words before every block of this one has.
struct RouterArgs {
  const float* x;
  const float* norm_w;
  float eps;
  const float* w_router;
  int32_t* ids;
  float* weights;
  int64_t n_experts, top_k;
  int normalize;
  const float* gate_inp;  // the shared expert's gate row, or nullptr
  float* gate;            // [n_tokens] gate outputs (with gate_inp)
  int gate_mode;
};
// Router rows a token computes: the experts' logits, then the shared-expert gate's row if any.
__host__ __device__ inline int64_t router_rows(int64_t n_experts, const float* gate_inp) {
  return n_experts + (gate_inp != nullptr ? 1 : 0);
}

// The scratch (tm_router_gate_up_scratch_words in tornado_moe.h counts its words): the ticket word (count, epoch:
// 64 bits; its atomics on 256 bytes of their own), then per token the 64-bit ids_ready and h_ready flags, each
// group on 128-byte lines of its own, then the tagged logits [n_tokens, n_experts] (64 bits each), then from
// tm_router_gate_up_groups_word per token h's int8 groups in qdot.cuh's q8act layout (router block 0 writes them
// with h, before h_ready: the routed blocks of tiled rows multiply them).
struct RouterSync {
  unsigned long long* ticket;
  unsigned long long* ids_ready;  // tag << 32 | packed_ids(the token's ids) once they are written
  unsigned long long* h_ready;    // tag << 32: h[t] (and beyond kIdsInFlag slots ids) released
  unsigned long long* logits;     // tag << 32 | the logit's float bits
  uint8_t* hq;                    // token t's groups at hq + t * q8act_bytes(hidden)
};
// h_groups: the scratch at tm_router_gate_up_groups_word (the launcher computes it: the header is host code).
__device__ __forceinline__ RouterSync router_sync(uint32_t* scratch, uint8_t* h_groups, int64_t n_tokens) {
  const int64_t group = ceil_div(n_tokens, 32) * 32;
  auto* flags = reinterpret_cast<unsigned long long*>(scratch + 64);
  return RouterSync{reinterpret_cast<unsigned long long*>(scratch), flags, flags + group, flags + 2 * group,
                    h_groups};
}
// A token's expert ids in its ids_ready word (8 bits each, slot s at bit 8 s) when they fit: a routed block then
// has its expert id from the load it polls with. Else (more than 4 slots) the payload is 0 and blocks read ids[].
#ifndef TM_IDS_IN_FLAG  // a measurement knob: 0 packs none (blocks read ids[], the same bits)
#define TM_IDS_IN_FLAG 4
#endif
constexpr int64_t kIdsInFlag = TM_IDS_IN_FLAG;
__device__ __forceinline__ uint32_t packed_ids(const Pick* list, int64_t top_k) {
  uint32_t w = 0;
  for (int64_t r = 0; r < top_k; ++r) w |= (static_cast<uint32_t>(list[r].id) & 0xffu) << (8 * r);
  return w;
}
__host__ __device__ inline int64_t router_blocks_per_token(int64_t rows) {
  return ceil_div(rows, kRowsPerBlock);
}
// Dynamic shared memory: h (hidden rounded up to 4 floats), the norm scratch, top_k picks, then (16-byte aligned)
// h's int8 groups in the q8act layout, which a shared block of tiled rows multiplies its rows with.
__host__ __device__ inline int64_t router_q8_offset(int64_t hidden, int64_t top_k) {
  return ceil_div((router_h_floats(hidden) + kNormWarps + 4) * 4 + top_k * static_cast<int64_t>(sizeof(Pick)), 16) *
         16;
}
__host__ __device__ inline int64_t router_gate_up_smem(int64_t hidden, int64_t top_k) {
  return router_q8_offset(hidden, top_k) + q8act_bytes(hidden);
}

// with_groups: block 0 also stores h's int8 groups (sy.hq) for the routed blocks of tiled rows.
__device__ __forceinline__ void router_block(const RouterArgs& ra, int mode, float* h, int64_t hidden, int64_t t,
                                             int64_t j, const RouterSync& sy, uint32_t raised, float* smem,
                                             bool with_groups) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned long long* logits = sy.logits + t * ra.n_experts;
  float* hbuf = smem;
  float* norm = hbuf + router_h_floats(hidden);
  Pick* list = reinterpret_cast<Pick*>(norm + kNormWarps + 4);
  block_rmsnorm(ra.x + t * hidden, ra.norm_w, hidden, ra.eps, hbuf, j == 0 ? h + t * hidden : nullptr, norm);
  const int64_t e = j * kRowsPerBlock + warp;
  // One dot call for both kinds of row, the gate's value being shared_gate's (sigmoid of the same dot): with a
  // second call the tiled kernel spilled 24/104 bytes (12/68 before the gate row), with one it spills none.
  const bool gate_row = e == ra.n_experts && ra.gate_inp != nullptr;
  if (e < ra.n_experts || gate_row) {
    const float* row = gate_row ? ra.gate_inp : ra.w_router + e * hidden;
    const float v = warp_dot_f32_row(gate_row ? ra.gate_mode : mode, row, hbuf, hidden);
    if (lane == 0) {
      if (gate_row)
        ra.gate[t] = sigmoid_f32(v);
      else
        tagged_store(logits + e, raised, __float_as_uint(v));
    }
  }
  stamp(3);
  if (j != 0) return;
  const bool ids_in_flag = ra.top_k <= kIdsInFlag;
  if (with_groups) store_q8act_vector(hbuf, sy.hq + t * q8act_bytes(hidden), hidden, kNormThreads);
  __syncthreads();  // block 0's h (and groups) stored by all its threads: released here, by a warp the top-k does
                    // not hold up
  if (ids_in_flag && warp == 1 && lane == 0) flag_release(sy.h_ready + t, raised, 0);
  if (warp != 0) return;
  TM_TOPK_STAMP(0);
  // The token's logits, once every router block of it has stored its own (they hold lower tickets: running).
  float l[2];
  wait_tagged_logits(logits, ra.n_experts, raised, l);
  TM_TOPK_STAMP(1);
  router_topk_warp(l[0], l[1], ra.n_experts, ra.top_k, ra.normalize, list, ra.ids + t * ra.top_k,
                   ra.weights + t * ra.top_k);
  if (lane == 0) {  // lane 0 wrote ids and weights (for the down, after this launch) and the picks
    if (ids_in_flag)
      tagged_store(sy.ids_ready + t, raised, packed_ids(list, ra.top_k));
    else
      flag_release(sy.h_ready + t, raised, 0);  // h and ids
  }
  TM_TOPK_STAMP(4);
}

// A routed block's wait for its token: the ids word (when the ids fit in it) and h_ready, polled together (the
// relaxed load first, so both are in flight at once). Returns the ids word's payload; every thread of the block
// sees h (and ids[]) after it.
__device__ __forceinline__ uint32_t routed_wait(const RouterSync& sy, uint32_t t, uint32_t raised, bool ids_in_flag) {
  __shared__ uint32_t s_ids;
  if (threadIdx.x == 0) {
    for (;;) {
      const unsigned long long w = ids_in_flag ? ld_relaxed_u64(sy.ids_ready + t) : tagged(raised, 0);
      const unsigned long long f = ld_acquire_u64(sy.h_ready + t);
      if (tag_of(w) == raised && tag_of(f) == raised) {
        s_ids = static_cast<uint32_t>(w);
        break;
      }
      __nanosleep(TM_FLAG_SPIN_NS);
    }
  }
  __syncthreads();
  return s_ids;
}

template <Fmt F, bool V>
__global__ void __launch_bounds__(kRowsPerBlock * 32, router_gate_up_min_blocks(F))
    router_experts_gate_up_kernel(const RouterArgs ra, int router_mode, const GateUpArgs sh, const GateUpArgs rt,
                                  float* h, int64_t n_tokens, int64_t hidden, int64_t nblocks, uint32_t* sync,
                                  uint8_t* h_groups) {
  static_assert(kRowsPerBlock * 32 == kNormThreads, "router and shared blocks compute norm.cuh's tree");
  extern __shared__ __align__(16) float rg_smem[];
  __shared__ uint32_t s_ticket, s_raised;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t per_token = static_cast<uint32_t>(router_blocks_per_token(router_rows(ra.n_experts, ra.gate_inp)));
  const uint32_t router_blocks = static_cast<uint32_t>(n_tokens) * per_token;
  const uint32_t sh_blocks = shared_gate_up_blocks(sh, n_tokens);
  stamp(0);
  const bool shared_block = blockIdx.x >= router_blocks && blockIdx.x < router_blocks + sh_blocks;
  float wv[kNormHeld];  // a shared block's norm weights, loaded before pdl_wait: only x is read after it
  if (shared_block) load_norm_weights(ra.norm_w, hidden, wv);
  if (blockIdx.x < router_blocks) {  // most likely a router block: its router row and the norm weights into L2
    const int64_t e = (blockIdx.x % per_token) * kRowsPerBlock + warp;
    if (e < ra.n_experts) prefetch_row_l2(ra.w_router + e * hidden, hidden * 4, lane);
    else if (e == ra.n_experts && ra.gate_inp != nullptr) prefetch_row_l2(ra.gate_inp, hidden * 4, lane);
    if (warp == 0) prefetch_row_l2(ra.norm_w, hidden * 4, lane);
  }
  pdl_begin();
  stamp(1);
  if (shared_block) {
    stamp_role(1);
    stamp(2);
    const PairTile p = experts_gate_up_tile(sh, rt, n_tokens, blockIdx.x - router_blocks);  // p.pair: the token
    float* hbuf = rg_smem;
    if constexpr (TM_RGU_SHARED_L1_LINES > 0) {
      const int64_t r = static_cast<int64_t>(p.tile) * kRowsPerBlock + warp;
      if (r < sh.ffn) {
        prefetch_row_l1(sh.w_gate + r * sh.row_bytes, sh.row_bytes, TM_RGU_SHARED_L1_LINES, lane);
        prefetch_row_l1(sh.w_up + r * sh.row_bytes, sh.row_bytes, TM_RGU_SHARED_L1_LINES, lane);
      }
    }
#if TM_RGU_NORM_PROBE  // timing only: x in place of h (wrong results)
    (void)hbuf;
    gate_up_block<F, V>(sh, ra.x, hidden, nblocks, p.pair, p.tile);
#else
    block_rmsnorm_held(ra.x + p.pair * hidden, ra.norm_w, wv, hidden, ra.eps, hbuf, nullptr,
                       hbuf + router_h_floats(hidden));
    if constexpr (fmt_tiled(F)) {  // h's int8 groups once for the block's 8 warps (tiled rows: hidden % 128 == 0)
      uint8_t* hq = reinterpret_cast<uint8_t*>(rg_smem) + router_q8_offset(hidden, ra.top_k);
      if constexpr (TM_PROBE_SH_Q8) {
        store_q8act_vector(hbuf, hq, hidden, kNormThreads);
        __syncthreads();
      }
      stamp(3);
      gate_up_block<F, V>(sh, static_cast<const uint8_t*>(hq), 0, nblocks, p.pair, p.tile);
    } else {
      stamp(3);
      gate_up_block<F, V>(sh, static_cast<const float*>(hbuf), 0, nblocks, p.pair, p.tile);
    }
#endif
    stamp_end();
    return;
  }
  const RouterSync sy = router_sync(sync, h_groups, n_tokens);
  if (threadIdx.x == 0) {
    const unsigned long long v = atomicAdd(sy.ticket, 1ull);
    const uint32_t epoch = static_cast<uint32_t>(v >> 32), b = static_cast<uint32_t>(v);
    // Every other ticketed block of this call has its ticket: the next call's epoch, from count 0.
    if (b == gridDim.x - sh_blocks - 1) *sy.ticket = static_cast<unsigned long long>(epoch + 1) << 32;
    s_ticket = b;
    s_raised = epoch + 1;
  }
  __syncthreads();
  const uint32_t b = s_ticket, raised = s_raised;
  stamp_role(b < router_blocks ? 0 : 2);
  stamp(2);
  if (b < router_blocks) {
    router_block(ra, router_mode, h, hidden, b / per_token, b % per_token, sy, raised, rg_smem, fmt_tiled(F));
    stamp_end();
    return;
  }
  const PairTile p = experts_gate_up_tile(sh, rt, n_tokens, sh_blocks + (b - router_blocks));  // a routed tile
  const uint32_t slots = static_cast<uint32_t>(rt.slot_count), t = p.pair / slots;
  const bool ids_in_flag = rt.top_k <= kIdsInFlag;
#if TM_RGU_IDS_PROBE  // timing only: h awaited, the ids not (slot s takes expert s: wrong results)
  routed_wait(sy, t, raised, false);
  const int e = static_cast<int>(p.pair - t * slots);
#else
  const uint32_t ids = routed_wait(sy, t, raised, ids_in_flag);
  stamp(3);
  const int e = ids_in_flag ? static_cast<int>((ids >> (8 * (p.pair - t * slots))) & 0xffu) : -1;
#endif
  if constexpr (fmt_tiled(F))
    gate_up_block<F, V>(rt, static_cast<const uint8_t*>(sy.hq), q8act_bytes(hidden), nblocks, p.pair, p.tile, e);
  else
    gate_up_block<F, V>(rt, static_cast<const float*>(h), hidden, nblocks, p.pair, p.tile, e);
  stamp_end();
}

struct DownArgs {
  const uint8_t* w_down;
  const float* act;
  const int32_t* ids;
  const float* weights;
  int64_t top_k, n_experts, hidden, ffn, row_bytes, nblocks;
  const uint8_t* act_q;  // nullable: act's int8 groups as the gate-up stored them (q8act layout), act_q_stride
  int64_t act_q_stride;  // bytes a slot row; read by the Q instantiations instead of act
};
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

// acc + sum over slots [s, s + NR) in order of w_eff * dot(W_down[e][r], act[t, s]).
template <Fmt F, int NR, bool V>
__device__ __forceinline__ float down_group(const DownArgs& a, int64_t t, int64_t r, int64_t s, bool gated,
                                            float gate, float acc) {
  float d[NR][1], w_eff[NR];
  down_dots<F, NR, V>(a, t, r, s, gated, gate, d, w_eff);
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
  for_slot_groups(slot_begin, slot_begin + slot_count, [&](int64_t s, auto n) {
    acc = down_group<F, decltype(n)::value, V>(a, t, r, s, gated, gate, acc);
  });
  if (lane == 0) *xo = acc;
}

// The dot products dot(W_down[e][ra], act[t, s]) and dot(W_down[e][ra + 1], act[t, s]) of slot s (expert e):
// two rows of one expert share the slot's activations (one warp_dot with NR = 2, as a gate-up pair), and the
// slot's factor w_eff (NaN for an expert id out of range), through down_dots' lookups (slot_expert, slot_weight);
// not folded into down_dots itself: this code is what the H200 measured, and a shared body changes the compiler's
// register allocation. rb is ra + 1, or ra itself at the last row of an odd hidden size (computed twice, stored
// once). The slot's id is read before the dot and its weight after it (loading both ahead measured slower on the
// H100: results/NOTES.md lesson 121).
template <Fmt F, bool V, bool Q>
__device__ __forceinline__ void down_row_pair(const DownArgs& a, int64_t t, int64_t ra, int64_t rb, int64_t s,
                                              float (&d)[2][1], float& w_eff) {
  const int64_t slot = t * a.top_k + s;
  int64_t e = slot_expert(a, slot);
  const bool bad = e < 0 || e >= a.n_experts;
  if (bad) e = 0;
  const uint8_t* base = a.w_down + e * a.hidden * a.row_bytes;
  const uint8_t* wr[2] = {base + ra * a.row_bytes, base + rb * a.row_bytes};
  if constexpr (Q) {
    const uint8_t* xq[1] = {a.act_q + slot * a.act_q_stride};
    warp_dot_q8act<F, 2, 1, true, false, TM_DOWN_PF>(wr, xq, a.nblocks, d);
  } else {
    const float* xs[1] = {a.act + slot * a.ffn};
    warp_dot<F, 2, 1, true, V>(wr, xs, a.nblocks, d);
  }
  w_eff = bad ? kNaN : slot_weight(a, slot);
}

// tm_experts_down_accumulate: blocks of 8 warps for kSplitRows = 4 output rows r0 .. r0 + 3 of one token.
//   Warp w < 4 computes the shared expert's term for row r0 + w (after the gate, which each of them computes: the
//   same bits; one routed warp computing it for the block was slower on the H200, results/NOTES.md v4h).
//   Warp 4 + j computes the routed terms of the row pair r0 + 2 (j / 2), + 1 for the slots s = j % 2, j % 2 + 2, ..:
//   the pair shares each slot's activation loads, and with the slots split over two warps a routed warp reads as
//   many bytes (2 rows x 2 of 4 slots x 1408 values) as a shared warp (one 5632-value row). So no warp of a block
//   idles while the others finish, and the loads fit 64 registers: 4 blocks per SM on tiled rows, a token's grid
//   (hidden / 4 blocks) resident in one wave. In the decode chain this is 1.5 us per layer faster than v4j's shape
//   (one row x 4 slots per routed warp, 126-128 registers, 2 blocks per SM), though slower launched back to back
//   alone (kernel_bench 14.0 against 12.7 us); twice the warps did not double the throughput (results/NOTES.md,
//   v4l, lesson 23).
//   With SM (tiled rows of a multiple of 256 values, when shared memory allows) a shared warp has its row copied
//   into shared memory by the copy engine before pdl_wait and reads it there (common.cuh's bulk_row_to_smem):
//   one round trip instead of 11 dependent ones from L2 for a 5632-value row (H200, that shape alone: 7.19 ->
//   5.92 us, results/NOTES.md v4o and lesson 37); else it prefetches the row into L2.
//   Terms go to shared memory; after one barrier lane 0 of warp w adds them to x[t, r0 + w] in the order of the
//   two launches this replaces: the shared term, then the slots in order, each a rounded multiply then a rounded
//   add, from the float32 x read once; with xw it also writes the next norm's factor, and the four rows' sum of
//   squares (one group of norm.cuh's grouped sum) after a named barrier, and with xw_q xw's int8 group of the
//   block's four rows for the next qkv_rope. Q: every warp multiplies the gate-up's int8 groups (act_q) instead of
//   rounding act itself, with the reader's L2 prefetch TM_DOWN_PF batches ahead. No term's bits depend on the
//   grouping (qdot.cuh: a row's result does not depend on how many rows a warp reads at once).
constexpr int kSplitRows = kRowsPerBlock / 2;
static_assert(kSplitRows == kNormGroup, "a down block's rows are one group of the deferred norm's grouped sum");
constexpr int down_min_blocks(Fmt s, Fmt r) {
  return fmt_tiled(s) && fmt_tiled(r) ? TM_DOWN_TILED_MIN_BLOCKS : TM_WEIGHT_MIN_BLOCKS;
}

// Whether experts_down_kernel's shared warps read their rows from copies in shared memory (a measurement knob: 0
// prefetches them into L2 instead, the same bits). qkv_rope does not copy its rows: on the H200 it measured slower
// that way end to end (745.3 against 771.7 tok/s for the down's copies alone; results/NOTES.md v4o, lesson 37).
#ifndef TM_DOWN_ROWS_IN_SMEM
#define TM_DOWN_ROWS_IN_SMEM 1
#endif
// Bytes of experts_down_kernel's dynamic shared memory before the shared rows' copies (16-byte aligned).
__host__ __device__ inline int64_t down_rows_offset(int64_t top_k) {
  return ceil_div((kSplitRows * top_k + kSplitRows) * 4, 16) * 16;
}

// xw = x * w and x's group sums xss over [n_tokens, hidden] (the two-launch form's; norm.cuh's operations, so the
// fused kernel's bits), and with xw_q xw's int8 groups: one thread a group.
__global__ void __launch_bounds__(256) norm_factor_kernel(const float* x, const float* __restrict__ w, float* xw,
                                                          float* xss, uint8_t* xw_q, int64_t n_tokens,
                                                          int64_t hidden) {
  static_assert(kNormGroup == 4, "a norm group is one int8 group");
  pdl_begin();
  const int64_t groups = norm_groups(hidden);
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n_tokens * groups;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = k / groups, g = k % groups;
    const float* xt = x + t * hidden;
    float v[kNormGroup] = {};
    for (int64_t i = g * kNormGroup; i < (g + 1) * kNormGroup && i < hidden; ++i)
      xw[t * hidden + i] = v[i - g * kNormGroup] = norm_factor_xw(xt[i], __ldg(w + i));
    xss[k] = group_sum_sq([&](int64_t i) { return xt[i]; }, g, hidden);
    if (xw_q != nullptr) store_q8act(xw_q + t * q8act_bytes(hidden), g, tm_act::q8_group(v[0], v[1], v[2], v[3]));
  }
}

// The int8 groups of rows x[rows, n] (n a multiple of 4) into the q8act layout at q (q8act_bytes(n) a row), one
// thread a group: where tm_router_experts_gate_up falls back to separate launches, its groups are still written.
__global__ void __launch_bounds__(256) act_groups_kernel(const float* x, uint8_t* q, int64_t rows, int64_t n) {
  pdl_begin();
  const int64_t per_row = n / 4;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < rows * per_row;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / per_row, j = k % per_row;
    const float* p = x + r * n + 4 * j;
    store_q8act(q + r * q8act_bytes(n), j, tm_act::q8_group(p[0], p[1], p[2], p[3]));
  }
}
int launch_act_groups(const Limits& lim, const char* fn, const float* x, uint8_t* q, int64_t rows, int64_t n,
                      cudaStream_t s) {
  const int64_t blocks = ceil_div(rows * (n / 4), 256);
  return launch(lim, fn, act_groups_kernel, dim3(static_cast<unsigned>(blocks < 65535 ? blocks : 65535)), dim3(256),
                0, s, x, q, rows, n);
}

template <Fmt FS, bool VS, Fmt FR, bool VR, bool SM, bool Q>
__global__ void __launch_bounds__(kRowsPerBlock * 32, down_min_blocks(FS, FR))
    experts_down_kernel(DownArgs sh, DownArgs rt, const float* __restrict__ gate_inp, const float* __restrict__ h,
                        float* x, const float* __restrict__ next_norm_w, float* xw, float* xss, uint8_t* xw_q,
                        int gate_mode, int64_t tok0) {
  // [kSplitRows][top_k] routed terms, [kSplitRows] shared terms, then (SM) the shared warps' row copies
  extern __shared__ __align__(16) float down_smem[];
  __shared__ uint64_t rows_landed[kSplitRows];
  __shared__ float s_next_w[kSplitRows];  // next_norm_w of the rows lane 0 of each shared warp writes
  float* s_routed = down_smem;
  float* s_shared = down_smem + kSplitRows * rt.top_k;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = tok0 + blockIdx.y;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kSplitRows;
  const bool shared_warp = warp < kSplitRows;
  // (SM) this shared warp's row copy, formed at each use (the SASS the H200 measured)
  auto row_copy = [&]() {
    return reinterpret_cast<uint8_t*>(down_smem) + down_rows_offset(rt.top_k) + warp * sh.row_bytes;
  };
  stamp(0, kDownTimelineRow0);
  if constexpr (SM) {  // the shared expert's rows are known up front
    if (shared_warp && r0 + warp < sh.hidden && lane == 0)
      bulk_row_to_smem(row_copy(), sh.w_down + (r0 + warp) * sh.row_bytes, static_cast<uint32_t>(sh.row_bytes),
                       &rows_landed[warp]);
  } else if (shared_warp && r0 + warp < sh.hidden && t == 0) {
    prefetch_row_l2(sh.w_down + (r0 + warp) * sh.row_bytes, sh.row_bytes, lane);
  }
  // xw's weights (immutable) into shared memory before the wait: no register held across the dot, no load after it
  if (xw != nullptr && shared_warp && lane == 0 && r0 + warp < sh.hidden)
    s_next_w[warp] = __ldg(next_norm_w + r0 + warp);
  pdl_begin();
  stamp(1, kDownTimelineRow0);
  stamp_role(3, kDownTimelineRow0);
  if (shared_warp) {
    const int64_t r = r0 + warp;
    if (r < sh.hidden) {
      float gate = 1.0f;
      if (gate_mode != kGateNone) gate = shared_gate(gate_inp, h + t * sh.hidden, sh.hidden, gate_mode);
      float d[1][1], w_eff[1];
      if constexpr (SM) {
        __syncwarp();  // lane 0's barrier init before the other lanes poll it
        bulk_wait(&rows_landed[warp]);
        down_dots<FS, 1, VS, true, Q>(sh, t, r, 0, gate_mode != kGateNone, gate, d, w_eff, row_copy());
      } else {
        down_dots<FS, 1, VS, false, Q>(sh, t, r, 0, gate_mode != kGateNone, gate, d, w_eff);
      }
      if (lane == 0) s_shared[warp] = __fmul_rn(w_eff[0], d[0][0]);
    }
    stamp_latest(3, kDownTimelineRow0);
  } else {
    const int j = warp - kSplitRows, pair = 2 * (j >> 1);  // the pair's first row, relative to r0
    const int64_t ra = r0 + pair, rb = ra + 1 < rt.hidden ? ra + 1 : ra;
    if (ra < rt.hidden) {
      for (int64_t s = j & 1; s < rt.top_k; s += 2) {
        float d[2][1], w_eff;
        down_row_pair<FR, VR, Q>(rt, t, ra, rb, s, d, w_eff);
        if (lane == 0) {
          s_routed[pair * rt.top_k + s] = __fmul_rn(w_eff, d[0][0]);
          if (rb != ra) s_routed[(pair + 1) * rt.top_k + s] = __fmul_rn(w_eff, d[1][0]);
        }
      }
    }
  }
  if (!shared_warp) stamp_latest(2, kDownTimelineRow0);
  __syncthreads();
  // Lane 0 of shared warp w adds row r0 + w's terms to x; the block's rows are one group of the next
  // normalisation's grouped sum (kNormGroup == kSplitRows): with xss the four meet at a named barrier and warp 0
  // writes the group's sum beside xw. (Lane j of warp 0 adding row j instead ran 1.3 us a layer slower on the
  // H200: results/NOTES.md v12.)
  __shared__ float s_rows[kSplitRows], s_xw[kSplitRows];
  if (!shared_warp) return;
  const int64_t r = r0 + warp;
  if (lane == 0 && r < sh.hidden) {
    float* xo = x + t * sh.hidden + r;
    float acc = __fadd_rn(__ldcg(xo), s_shared[warp]);  // in place: read around L1 (common.cuh)
    for (int64_t s = 0; s < rt.top_k; ++s) acc = __fadd_rn(acc, s_routed[warp * rt.top_k + s]);
    *xo = acc;
    if (xw != nullptr) {
      s_xw[warp] = norm_factor_xw(acc, s_next_w[warp]);
      xw[t * sh.hidden + r] = s_xw[warp];
    }
    s_rows[warp] = acc;
  }
  if (xss != nullptr) {  // the block's rows are also one int8 group of xw (hidden % 4 == 0 when xw_q is given)
    named_barrier<kSplitRows * 32>(1);
    if (warp == 0 && lane == 0)
      xss[t * norm_groups(sh.hidden) + blockIdx.x] =
          group_sum_sq([&](int64_t i) { return s_rows[i - r0]; }, blockIdx.x, sh.hidden);
    if (xw_q != nullptr && warp == 0 && lane == 1)
      store_q8act(xw_q + t * q8act_bytes(sh.hidden), blockIdx.x,
                  tm_act::q8_group(s_xw[0], s_xw[1], s_xw[2], s_xw[3]));
  }
  stamp_end(kDownTimelineRow0);
}

// The gate-up kernels index blocks with 32 bits (gate_up_block says why).
int check_gate_up_blocks(const char* fn, int64_t blocks, int64_t n_tokens) {
  if (blocks < (int64_t{1} << 31)) return TM_OK;
  return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: n_tokens = %lld needs 2^31 or more blocks", fn,
                      static_cast<long long>(n_tokens));
}

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

// Both weight sets of an experts gate-up launch: the shared expert's (expert 0 of one, no ids) and the slots'.
int experts_gate_up_args(const char* fn, int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                         int64_t ffn_sh, const void* w_gate, const void* w_up, const int32_t* ids, float* act,
                         int64_t top_k, int64_t n_experts, int64_t ffn, int64_t hidden, const float* h,
                         GateUpArgs* sh, GateUpArgs* rt, bool* v) {
  TM_TRY(check_f32_alignment(fn, "h", h));
  *v = true;
  TM_TRY(gate_up_args(fn, qtype, w_gate_sh, w_up_sh, nullptr, act_sh, 1, 0, 1, 1, ffn_sh, hidden, h, sh, v));
  return gate_up_args(fn, qtype, w_gate, w_up, ids, act, top_k, 0, top_k, n_experts, ffn, hidden, h, rt, v);
}

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
                tm_qtype_row_bytes(qtype, ffn), ffn / fmt_vals(f)};
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
    for (int64_t t0 = 0; t0 < n_tokens; t0 += lim.max_grid_yz) {
      const int64_t gy = n_tokens - t0 < lim.max_grid_yz ? n_tokens - t0 : lim.max_grid_yz;
      TM_TRY(launch(lim, fn, moe_down_kernel<F, V>, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                    dim3(kRowsPerBlock * 32), 0, s, a, gate_inp, h, x, slot_begin, slot_count, gate_mode, t0));
    }
    return TM_OK;
  });
}

// Row layouts one experts_down_kernel instantiation may pair (the shared and routed rows differ in length, so a
// tiled format may differ in load width; any other format must match): the other pairs take two launches.
constexpr bool down_pair_ok(Fmt s, Fmt r) { return s == r || (fmt_tiled(s) && fmt_tiled(r)); }

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

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
  TM_TRY(check_gate_up_blocks(fn, n_pairs * n_tiles, n_tokens));
  const cudaStream_t s = as_stream(stream);
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    if (grouped_gate_up_fits(lim, n_tokens, n_pairs, n_tiles, n_experts))
      return launch_grouped_gate_up<F, V>(lim, fn, a, h, nullptr, n_tokens, hidden, nblocks, s);
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

// tm_experts_gate_up, with hq (nullable): h's int8 groups, which the grouped GEMMs of tiled rows then read.
static int experts_gate_up(const char* fn, int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
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

extern "C" int tm_cuda_experts_gate_up(int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                                       int64_t ffn_sh, const void* w_gate, const void* w_up, const float* h,
                                       const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k,
                                       int64_t n_experts, int64_t ffn, int64_t hidden, void* stream) {
  return experts_gate_up("tm_experts_gate_up", qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, h, nullptr,
                         ids, act, n_tokens, top_k, n_experts, ffn, hidden, as_stream(stream));
}

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

extern "C" int tm_cuda_experts_down_accumulate(int qtype, const void* w_down_sh, const float* act_sh,
                                               const float* gate_inp_sh, const float* gate_sh, int64_t ffn_sh,
                                               const void* w_down, const float* act, const int32_t* ids,
                                               const float* weights, const float* h, float* x,
                                               const float* next_norm_w, float* xw, float* xss, int64_t n_tokens,
                                               int64_t top_k, int64_t n_experts, int64_t hidden, int64_t ffn,
                                               const uint8_t* act_groups_sh, const uint8_t* act_groups,
                                               uint8_t* xw_groups, void* stream) {
  const char* fn = "tm_experts_down_accumulate";
  TM_TRY(check_f32_alignment(fn, "x", x));
  TM_TRY(check_f32_alignment(fn, "next_norm_w", next_norm_w));
  TM_TRY(check_f32_alignment(fn, "xw", xw));
  TM_TRY(check_f32_alignment(fn, "xss", xss));
  TM_TRY(check_f32_alignment(fn, "gate_sh", gate_sh));
  DownArgs sh, rt;
  int gate_mode, no_gate;
  bool vs, vr;
  // A given gate_sh is the shared term's slot weight: w_eff = gate_sh[t], the bits of the gated path's
  // 1 * sigmoid(z) (down_dots), with one float read instead of the gate's dot in every shared warp.
  TM_TRY(down_args(fn, qtype, w_down_sh, act_sh, nullptr, gate_sh, gate_inp_sh, h, 1, 1, hidden, ffn_sh, &sh,
                   &gate_mode, &vs));
  TM_TRY(down_args(fn, qtype, w_down, act, ids, weights, nullptr, nullptr, top_k, n_experts, hidden, ffn, &rt,
                   &no_gate, &vr));
  sh.act_q = act_groups_sh;
  sh.act_q_stride = q8act_bytes(ffn_sh);
  rt.act_q = act_groups;
  rt.act_q_stride = q8act_bytes(ffn);
  Limits lim;
  TM_TRY(get_limits(&lim));
  const cudaStream_t s = as_stream(stream);
  const int64_t smem = (kSplitRows * top_k + kSplitRows) * static_cast<int64_t>(sizeof(float));
  const int64_t tiles = ceil_div(hidden, kSplitRows);
  auto two_launches = [&]() -> int {
    TM_TRY(launch_moe_down(lim, fn, qtype, sh, vs, gate_inp_sh, h, x, n_tokens, 0, 1, gate_mode, s));
    TM_TRY(launch_moe_down(lim, fn, qtype, rt, vr, nullptr, nullptr, x, n_tokens, 0, top_k, kGateNone, s));
    if (xw == nullptr) return TM_OK;
    const int64_t blocks = ceil_div(n_tokens * norm_groups(hidden), 256);
    return launch(lim, fn, norm_factor_kernel, dim3(static_cast<unsigned>(blocks < 65535 ? blocks : 65535)), dim3(256),
                  0, s, x, next_norm_w, xw, xss, xw_groups, n_tokens, hidden);
  };
  // Thousands of slots (or a test cap on shared memory): the two launches this one stands for.
  if (smem > 48 * 1024 || smem > lim.smem_block || tiles > lim.max_grid_x) return two_launches();
  return dispatch_fmt(fmt_for(qtype, ffn_sh), vs, [&](auto fstag, auto vstag) -> int {
    return dispatch_fmt(fmt_for(qtype, ffn), vr, [&](auto frtag, auto vrtag) -> int {
      constexpr Fmt FS = decltype(fstag)::value, FR = decltype(frtag)::value;
      constexpr bool VS = decltype(vstag)::value, VR = decltype(vrtag)::value;
      if constexpr (down_pair_ok(FS, FR)) {
        auto run = [&](auto kernel, int64_t bytes) -> int {
          TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes, fn));
          for (int64_t t0 = 0; t0 < n_tokens; t0 += lim.max_grid_yz) {
            const int64_t gy = n_tokens - t0 < lim.max_grid_yz ? n_tokens - t0 : lim.max_grid_yz;
            TM_TRY(launch(lim, fn, kernel, dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(gy)),
                          dim3(kRowsPerBlock * 32), static_cast<size_t>(bytes), s, sh, rt, gate_inp_sh, h, x,
                          next_norm_w, xw, xss, xw_groups, gate_mode, t0));
          }
          return TM_OK;
        };
        // The int8 groups the gate-up stored, where both weight sets are tiled rows (the same bits as the floats)
        constexpr bool kTiled = fmt_tiled(FS) && fmt_tiled(FR);
        const bool q = kTiled && act_groups_sh != nullptr;
        if constexpr (FS == Fmt::Q8_0T16 && TM_DOWN_ROWS_IN_SMEM) {  // when the copies fit (the same bits)
          const int64_t smem_rows = down_rows_offset(top_k) + kSplitRows * sh.row_bytes;
          if (smem_rows <= lim.smem_block)
            return q ? run(experts_down_kernel<FS, VS, FR, VR, true, kTiled>, smem_rows)
                     : run(experts_down_kernel<FS, VS, FR, VR, true, false>, smem_rows);
        }
        return q ? run(experts_down_kernel<FS, VS, FR, VR, false, kTiled>, smem)
                 : run(experts_down_kernel<FS, VS, FR, VR, false, false>, smem);
      } else {
        return two_launches();
      }
    });
  });
}

extern "C" int tm_cuda_router_experts_gate_up(const float* x, const float* norm_w, float eps, float* h,
                                              const float* w_router, int32_t* ids, float* weights, int qtype,
                                              const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                                              int64_t ffn_sh, const float* gate_inp_sh, float* gate_sh,
                                              const void* w_gate, const void* w_up, float* act, int64_t n_tokens,
                                              int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                                              int64_t ffn, int32_t* scratch, uint8_t* act_groups_sh,
                                              uint8_t* act_groups, void* stream) {
  const char* fn = "tm_router_experts_gate_up";
  for (const auto& [name, p] : {std::pair<const char*, const void*>{"x", x}, {"norm_w", norm_w},
                                {"w_router", w_router}, {"weights", weights}, {"gate_inp_sh", gate_inp_sh},
                                {"gate_sh", gate_sh}})
    TM_TRY(check_f32_alignment(fn, name, p));
  if (!aligned(scratch, 16))  // the ticket word is one 64-bit atomic; h's groups are read as 16-byte words
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: scratch must be 16-byte aligned", fn);
  GateUpArgs sh, rt;
  bool v;
  TM_TRY(experts_gate_up_args(fn, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, ids, act, top_k,
                              n_experts, ffn, hidden, h, &sh, &rt, &v));
  sh.act_q = act_groups_sh;
  sh.act_q_stride = q8act_bytes(ffn_sh);
  rt.act_q = act_groups;
  rt.act_q_stride = q8act_bytes(ffn);
  Limits lim;
  TM_TRY(get_limits(&lim));
  // h's int8 groups in the scratch (tiled rows): the routed blocks' or the grouped GEMMs' activations
  uint8_t* h_groups = reinterpret_cast<uint8_t*>(scratch + tm_router_gate_up_groups_word(n_tokens, n_experts));
  const int64_t smem = router_gate_up_smem(hidden, top_k);
  const int64_t total = n_tokens * (router_blocks_per_token(router_rows(n_experts, gate_inp_sh)) +
                                    ceil_div(ffn_sh, kRowsPerBlock) + top_k * ceil_div(ffn, kRowsPerBlock));
  // More experts than one warp ranks, a grid beyond the limits, or a step of several tokens whose gate-ups fit the
  // grouped kernel (faster than the fused launch's pair per block): the launches this one stands for.
  if (n_experts > 64 || smem > lim.smem_block || total > lim.max_grid_x ||
      grouped_experts_gate_up_fits(lim, n_tokens, top_k, n_experts, ffn_sh, ffn)) {
    TM_TRY(tm_cuda_rmsnorm_router_topk(x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts, hidden, top_k,
                                       normalize, stream));
    if (gate_inp_sh != nullptr) {
      const int64_t blocks = ceil_div(n_tokens, kRowsPerBlock);
      TM_TRY(launch(lim, fn, shared_gate_kernel,
                    dim3(static_cast<unsigned>(blocks < lim.max_grid_x ? blocks : lim.max_grid_x)),
                    dim3(kRowsPerBlock * 32), 0, as_stream(stream), gate_inp_sh, h, gate_sh, n_tokens, hidden,
                    f32_row_mode(hidden, aligned(gate_inp_sh, 16) && aligned(h, 16))));
    }
    // A step of several tokens on tiled rows: h's int8 groups once (into the scratch) for the grouped GEMMs, which
    // would otherwise round each token's h in every warp and lane step.
    const uint8_t* hq = nullptr;
    if (fmt_tiled(fmt_for(qtype, hidden)) &&
        grouped_experts_gate_up_fits(lim, n_tokens, top_k, n_experts, ffn_sh, ffn)) {
      TM_TRY(launch_act_groups(lim, fn, h, h_groups, n_tokens, hidden, as_stream(stream)));
      hq = h_groups;
    }
    TM_TRY(experts_gate_up(fn, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, h, hq, ids, act, n_tokens,
                           top_k, n_experts, ffn, hidden, as_stream(stream)));
    if (act_groups_sh == nullptr) return TM_OK;
    TM_TRY(launch_act_groups(lim, fn, act_sh, act_groups_sh, n_tokens, ffn_sh, as_stream(stream)));
    return launch_act_groups(lim, fn, act, act_groups, n_tokens * top_k, ffn, as_stream(stream));
  }
  // h sits in shared memory, as in router.cu: the rows' alignment alone picks the vector loads (not the bits)
  const RouterArgs ra{x, norm_w, eps, w_router, ids, weights, n_experts, top_k, normalize, gate_inp_sh, gate_sh,
                      f32_row_mode(hidden, aligned(gate_inp_sh, 16))};
  const int router_mode = f32_row_mode(hidden, aligned(w_router, 16));
  const Fmt f = fmt_for(qtype, hidden);
  const int64_t nblocks = hidden / fmt_vals(f);
  uint32_t* sync = reinterpret_cast<uint32_t*>(scratch);
  const cudaStream_t s = as_stream(stream);
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(&router_experts_gate_up_kernel<F, V>), smem, fn));
    return launch(lim, fn, router_experts_gate_up_kernel<F, V>, dim3(static_cast<unsigned>(total)),
                  dim3(kRowsPerBlock * 32), static_cast<size_t>(smem), s, ra, router_mode, sh, rt, h, n_tokens,
                  hidden, nblocks, sync, h_groups);
  });
}

#if TM_RGU_TIMELINE
// The measurement build's timeline rows (see TM_RGU_TIMELINE above): up to `rows` of them into host memory
// (TimelineRow: t[5], role, SM), then every row zeroed (rows no later launch stamps, e.g. a prefill's larger
// grid, would otherwise look like the next launch's). Returns the rows copied, or -1.
extern "C" TM_API int64_t tm_cuda_rgu_timeline(void* host, int64_t rows) {
  const int64_t n = rows < kTimelineRows ? rows : kTimelineRows;
  void* dev = nullptr;
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(host, rgu_timeline, static_cast<size_t>(n) * sizeof(TimelineRow)) != cudaSuccess ||
      cudaGetSymbolAddress(&dev, rgu_timeline) != cudaSuccess ||
      cudaMemset(dev, 0, sizeof(rgu_timeline)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    return -1;
  return n;
}
#endif
