/*
 * moe_router_gate_up.cu - tm_router_experts_gate_up: the router and the gate-up of the shared expert and of every
 * routed slot in one grid, ordered by integer flags (moe.cuh describes the kernels; the kernel's grid below).
 */
#include <vector>

#include "rgu_timeline.cuh"
#include "router.cuh"
#include "moe.cuh"

namespace tm_cuda {
namespace {

// Timing probes of router_experts_gate_up (wrong results; results/NOTES.md v7): TM_RGU_IDS_PROBE=1 lets the
// routed blocks start once h is out, without the router's ids (the bound of a router off the launch's path), and
// TM_RGU_IDS_PROBE=2 without waiting for h either (the bound of a router whose norm is off the path too), 3 waiting
// as the product does but taking expert s for slot s as 1 and 2 do (what their fixed experts alone change);
// TM_RGU_NORM_PROBE=1 lets the shared blocks read x as h (the bound of h computed before the launch).
#ifndef TM_RGU_IDS_PROBE
#define TM_RGU_IDS_PROBE 0
#endif
#ifndef TM_RGU_NORM_PROBE
#define TM_RGU_NORM_PROBE 0
#endif
// The shared blocks ask for the first TM_RGU_SHARED_L1_LINES 128-byte lines of each warp's gate and up rows in L1
// right after pdl_wait: prefetches hold no register and return nothing to the warp, unlike the loads of
// results/NOTES.md lesson 56. H200 (NOTES v8, when the asks overlapped each block's norm of x): 8 lines 826.0
// tok/s, the whole row (17) 817.5, none 819.7, in one call. H100 since the deferred norm (lesson 199): none -1.0%,
// the same asks before pdl_wait +0.5% (not kept). 0: none.
#ifndef TM_RGU_SHARED_L1_LINES
#define TM_RGU_SHARED_L1_LINES 8
#endif

// tm_router_experts_gate_up's per-token factors where it makes separate launches, one warp a token (lane 0
// stores), each where its output is given: gate[t] = shared_gate(h[t]), and inv[t] = the deferred norm's inv of
// xss[t] (tm_rmsnorm_factors'), the shared gate-up's scale, once a token rather than in every warp of the
// prompt's grouped GEMMs. One launch for both: one launch a layer fewer in a prompt step (NOTES lesson 191).
__global__ void __launch_bounds__(kRowsPerBlock * 32)
    shared_factors_kernel(const float* __restrict__ gate_inp, const float* __restrict__ h, float* gate,
                          const float* __restrict__ xss, float* inv, int64_t n_tokens, int64_t hidden,
                          int gate_mode, float eps) {
  pdl_begin();
  const bool store = (threadIdx.x & 31) == 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5); t < n_tokens;
       t += stride) {
    if (gate != nullptr) {
      const float g = shared_gate(gate_inp, h + t * hidden, hidden, gate_mode);
      if (store) gate[t] = g;
    }
    if (inv != nullptr) {
      const float v = warp_grouped_inv_any(xss + t * norm_groups(hidden), hidden, eps);
      if (store) inv[t] = v;
    }
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
//     With the deferred norm (D: xw and xss given) it multiplies xw (its int8 groups on tiled rows) at once and
//     scales by the inv of xss (gate_up_block's DN = 2): no norm of x, no barrier before its first weight load
//     (results/NOTES.md lesson 186: +3% decode on the H200).
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

template <Fmt F, bool V, bool D>
__global__ void __launch_bounds__(kRowsPerBlock * 32, gate_up_min_blocks(F))
    router_experts_gate_up_kernel(const RouterArgs ra, int router_mode, const GateUpArgs sh, const GateUpArgs rt,
                                  float* h, int64_t n_tokens, int64_t hidden, int64_t nblocks, uint32_t* sync,
                                  uint8_t* h_groups, const float* xw, const uint8_t* xw_groups) {
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
  if (shared_block && !D) load_norm_weights(ra.norm_w, hidden, wv);
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
    gate_up_block<F, V, float, 0>(sh, ra.x, hidden, nblocks, p.pair, p.tile);
#else
    if constexpr (D) {  // the deferred norm: xw's groups (tiled rows) or floats, scaled by the inv of xss
      stamp(3);  // its inputs are ready at once
      if constexpr (fmt_tiled(F))
        gate_up_block<F, V, uint8_t, 2>(sh, xw_groups, q8act_bytes(hidden), nblocks, p.pair, p.tile);
      else
        gate_up_block<F, V, float, 2>(sh, xw, hidden, nblocks, p.pair, p.tile);
      stamp_end();
      return;
    }
    block_rmsnorm_held(ra.x + p.pair * hidden, ra.norm_w, wv, hidden, ra.eps, hbuf, nullptr,
                       hbuf + router_h_floats(hidden));
    if constexpr (fmt_tiled(F)) {  // h's int8 groups once for the block's 8 warps (tiled rows: hidden % 128 == 0)
      uint8_t* hq = reinterpret_cast<uint8_t*>(rg_smem) + router_q8_offset(hidden, ra.top_k);
      if constexpr (TM_PROBE_SH_Q8) {
        store_q8act_vector(hbuf, hq, hidden, kNormThreads);
        __syncthreads();
      }
      stamp(3);
      gate_up_block<F, V, uint8_t, 0>(sh, static_cast<const uint8_t*>(hq), 0, nblocks, p.pair, p.tile);
    } else {
      stamp(3);
      gate_up_block<F, V, float, 0>(sh, static_cast<const float*>(hbuf), 0, nblocks, p.pair, p.tile);
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
#if TM_RGU_IDS_PROBE  // timing only: h awaited (1, 3) or not (2), the ids (3) or not; expert s for slot s
  if (TM_RGU_IDS_PROBE != 2) routed_wait(sy, t, raised, TM_RGU_IDS_PROBE == 3 && ids_in_flag);
  const int e = static_cast<int>(p.pair - t * slots);
#else
  const uint32_t ids = routed_wait(sy, t, raised, ids_in_flag);
  stamp(3);
  const int e = ids_in_flag ? static_cast<int>((ids >> (8 * (p.pair - t * slots))) & 0xffu) : -1;
#endif
  if constexpr (fmt_tiled(F))
    gate_up_block<F, V, uint8_t, 0>(rt, static_cast<const uint8_t*>(sy.hq), q8act_bytes(hidden), nblocks, p.pair,
                                    p.tile, e);
  else
    gate_up_block<F, V, float, 0>(rt, static_cast<const float*>(h), hidden, nblocks, p.pair, p.tile, e);
  stamp_end();
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

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_router_experts_gate_up(const float* x, const float* norm_w, float eps, float* h,
                                              const float* w_router, int32_t* ids, float* weights, int qtype,
                                              const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                                              int64_t ffn_sh, const float* gate_inp_sh, float* gate_sh,
                                              const void* w_gate, const void* w_up, float* act, int64_t n_tokens,
                                              int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                                              int64_t ffn, int32_t* scratch, uint8_t* act_groups_sh,
                                              uint8_t* act_groups, const float* xw, const float* xss,
                                              const uint8_t* xw_groups, void* stream) {
  const char* fn = "tm_router_experts_gate_up";
  for (const auto& [name, p] : {std::pair<const char*, const void*>{"x", x}, {"norm_w", norm_w},
                                {"w_router", w_router}, {"weights", weights}, {"gate_inp_sh", gate_inp_sh},
                                {"gate_sh", gate_sh}, {"xw", xw}, {"xss", xss}})
    TM_TRY(check_f32_alignment(fn, name, p));
  if (!aligned(scratch, 16))  // the ticket word is one 64-bit atomic; h's groups are read as 16-byte words
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: scratch must be 16-byte aligned", fn);
  GateUpArgs sh, rt;
  bool v;
  TM_TRY(experts_gate_up_args(fn, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, ids, act, top_k,
                              n_experts, ffn, hidden, h, &sh, &rt, &v));
  set_act_groups(&sh, act_groups_sh, ffn_sh);
  set_act_groups(&rt, act_groups, ffn);
  sh.h_sums = xss;  // the shared expert's deferred norm, or none
  sh.eps = eps;
  const Fmt f = fmt_for(qtype, hidden);
  // The one launch's shared blocks multiply xw's groups on tiled rows (gate_up_block's DN = 2), xw's floats with the
  // vector loads h's alignment chose otherwise
  const bool deferred_fits = aligned(xw, 16) && (!fmt_tiled(f) || xw_groups != nullptr);
  Limits lim;
  TM_TRY(get_limits(&lim));
  // h's int8 groups in the scratch (tiled rows): the routed blocks' or the grouped GEMMs' activations
  uint8_t* h_groups = reinterpret_cast<uint8_t*>(scratch + tm_router_gate_up_groups_word(n_tokens, n_experts));
  const int64_t smem = router_gate_up_smem(hidden, top_k);
  const int64_t total = n_tokens * (router_blocks_per_token(router_rows(n_experts, gate_inp_sh)) +
                                    ceil_div(ffn_sh, kRowsPerBlock) + top_k * ceil_div(ffn, kRowsPerBlock));
  // More experts than one warp ranks, a grid beyond the limits, or a step of several tokens whose gate-ups fit the
  // grouped kernel (faster than the fused launch's pair per block): the launches this one stands for.
  if (n_experts > 64 || smem > lim.smem_block || total > lim.max_grid_x || (xw != nullptr && !deferred_fits) ||
      grouped_experts_gate_up_fits(lim, n_tokens, top_k, n_experts, ffn_sh, ffn)) {
    TM_TRY(tm_cuda_rmsnorm_router_topk(x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts, hidden, top_k,
                                       normalize, stream));
    const int64_t warp_blocks = ceil_div(n_tokens, kRowsPerBlock);  // a warp a token
    const dim3 warp_grid(static_cast<unsigned>(warp_blocks < lim.max_grid_x ? warp_blocks : lim.max_grid_x));
    // the deferred form's inv goes into the scratch, past h's groups
    float* inv = xw != nullptr ? reinterpret_cast<float*>(h_groups + n_tokens * q8act_bytes(hidden)) : nullptr;
    if (gate_sh != nullptr || inv != nullptr)  // gate_inp_sh and gate_sh go together (tm_router_experts_gate_up)
      TM_TRY(launch(lim, fn, shared_factors_kernel, warp_grid, dim3(kRowsPerBlock * 32), 0, as_stream(stream),
                    gate_inp_sh, h, gate_sh, xss, inv, n_tokens, hidden,
                    f32_row_mode(hidden, aligned(gate_inp_sh, 16) && aligned(h, 16)), eps));
    // A step of several tokens on tiled rows: h's int8 groups once (into the scratch) for the grouped GEMMs, which
    // would otherwise round each token's h in every warp and lane step.
    const uint8_t* hq = nullptr;
    if (fmt_tiled(f) && grouped_experts_gate_up_fits(lim, n_tokens, top_k, n_experts, ffn_sh, ffn)) {
      TM_TRY(launch_act_groups(lim, fn, h, h_groups, n_tokens, hidden, as_stream(stream)));
      hq = h_groups;
    }
    if (xw != nullptr) {  // the shared expert's deferred form (scaled by inv), then the slots on h
      TM_TRY(moe_gate_up(fn, qtype, w_gate_sh, w_up_sh, xw, xw_groups, nullptr, act_sh, n_tokens, 1, 0, 1, 1, ffn_sh,
                         hidden, inv, as_stream(stream)));
      TM_TRY(moe_gate_up(fn, qtype, w_gate, w_up, h, hq, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden,
                         nullptr, as_stream(stream)));
    } else {
      TM_TRY(experts_gate_up(fn, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, h, hq, ids, act, n_tokens,
                             top_k, n_experts, ffn, hidden, as_stream(stream)));
    }
    if (act_groups_sh == nullptr) return TM_OK;
    TM_TRY(launch_act_groups(lim, fn, act_sh, act_groups_sh, n_tokens, ffn_sh, as_stream(stream)));
    return launch_act_groups(lim, fn, act, act_groups, n_tokens * top_k, ffn, as_stream(stream));
  }
  // h sits in shared memory, as in router.cu: the rows' alignment alone picks the vector loads (not the bits)
  const RouterArgs ra{x, norm_w, eps, w_router, ids, weights, n_experts, top_k, normalize, gate_inp_sh, gate_sh,
                      f32_row_mode(hidden, aligned(gate_inp_sh, 16))};
  const int router_mode = f32_row_mode(hidden, aligned(w_router, 16));
  const int64_t nblocks = hidden / fmt_vals(f);
  uint32_t* sync = reinterpret_cast<uint32_t*>(scratch);
  const cudaStream_t s = as_stream(stream);
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    auto run = [&](auto kernel) -> int {
      TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, fn));
      return launch(lim, fn, kernel, dim3(static_cast<unsigned>(total)), dim3(kRowsPerBlock * 32),
                    static_cast<size_t>(smem), s, ra, router_mode, sh, rt, h, n_tokens, hidden, nblocks, sync,
                    h_groups, xw, xw_groups);
    };
    return xw != nullptr ? run(router_experts_gate_up_kernel<F, V, true>)
                         : run(router_experts_gate_up_kernel<F, V, false>);
  });
}

#if TM_RGU_TIMELINE
// The measurement build's timeline rows (rgu_timeline.cuh): up to `rows` of them into host memory (TimelineRow:
// t[5], role, SM), this source's rows joined with the down's (a row the down stamped is the down's), then every
// row of both zeroed. Returns the rows copied, or -1.
extern "C" TM_API int64_t tm_cuda_rgu_timeline(void* host, int64_t rows) {
  const int64_t n = rows < kTimelineRows ? rows : kTimelineRows;
  auto* out = static_cast<TimelineRow*>(host);
  std::vector<TimelineRow> down(static_cast<size_t>(n));
  if (!take_timeline_rows(out, n) || !take_down_timeline_rows(down.data(), n)) return -1;
  for (int64_t i = 0; i < n; ++i) {
    const TimelineRow& d = down[static_cast<size_t>(i)];
    if (d.t[0] != 0 || d.t[1] != 0 || d.t[2] != 0 || d.t[3] != 0 || d.t[4] != 0) out[i] = d;
  }
  return n;
}
#endif
