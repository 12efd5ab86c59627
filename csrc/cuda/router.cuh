/*
 * router.cuh - internal to csrc/cuda: THE router arithmetic, shared by router_kernel (router.cu) and the router
 * phase of the fused router + expert gate-up kernel (moe_router_gate_up.cu), so both give the same ids and weights
 * bit for bit.
 *
 *   logit e = qdot.cuh's warp_dot_f32_row of router row e with h (its layout chosen by f32_row_mode);
 *   the pick order: p descending, NaN lowest, then expert id ascending (a strict total order on distinct ids);
 *   router_topk_warp: softmax and top-k of at most 64 logits by one warp (router.cu's file comment gives the
 *   passes; this is their single-chunk form in registers).
 */
#ifndef TORNADO_MOE_CUDA_ROUTER_CUH
#define TORNADO_MOE_CUDA_ROUTER_CUH

#include <climits>
#include <cmath>

#include "qdot.cuh"

namespace tm_cuda {

// A measurement hook: the timeline build (-DTM_RGU_TIMELINE=1) defines it in rgu_timeline.cuh, included before this
// file, to stamp the steps of router_topk_warp; empty otherwise.
#ifndef TM_TOPK_STAMP
#define TM_TOPK_STAMP(k)
#endif

struct Pick {
  float p;
  int id;
};

// Ranking key: NaN below every probability (NaN never wins over a number).
__device__ __forceinline__ float pick_key(float p) { return isnan(p) ? -1.0f : p; }

// a ranks before b: larger key, then lower id. A strict total order on distinct ids.
__device__ __forceinline__ bool ranks_before(float ka, int ia, float kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// Warp-wide best (key, id) under ranks_before; every lane returns the winner (unique: the order is total).
__device__ __forceinline__ void warp_best(float& key, int& id) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    const float ok = __shfl_xor_sync(kFullMask, key, m);
    const int oi = __shfl_xor_sync(kFullMask, id, m);
    if (ranks_before(ok, oi, key, id)) {
      key = ok;
      id = oi;
    }
  }
}

// Floats of a token's h in shared memory (rounded up to 4, so what follows stays 16-byte aligned).
__host__ __device__ inline int64_t router_h_floats(int64_t hidden) { return (hidden + 3) / 4 * 4; }

// ids[r], weights[r] (r < top_k) of one token from s.list-style picks: p, or p / S with S the serial sum of the
// picked p when normalizing. One thread.
__device__ __forceinline__ void write_picks(const Pick* list, int64_t top_k, int normalize, int32_t* ids,
                                            float* weights) {
  float sum = 0.0f;
  if (normalize)
    for (int64_t r = 0; r < top_k; ++r) sum = __fadd_rn(sum, list[r].p);
  for (int64_t r = 0; r < top_k; ++r) {
    ids[r] = list[r].id;
    weights[r] = normalize ? __fdiv_rn(list[r].p, sum) : list[r].p;
  }
}

// One warp, n_experts <= 64: waits until each of a token's tagged logit words (common.cuh: tag << 32 | the float's
// bits, relaxed stores by the blocks that computed them) carries `tag`, and returns lane l's logits of experts l
// and 32 + l in l[0], l[1] (router_topk_warp's operands; past n_experts: 0).
__device__ __forceinline__ void wait_tagged_logits(const unsigned long long* logits, int64_t n_experts, uint32_t tag,
                                                   float (&l)[2]) {
  const int lane = threadIdx.x & 31;
  l[0] = l[1] = 0.0f;
  for (;;) {
    bool ok = true;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t e = lane + 32 * k;
      if (e < n_experts) {
        const unsigned long long w = ld_relaxed_u64(logits + e);
        ok = ok && tag_of(w) == tag;
        l[k] = __uint_as_float(static_cast<uint32_t>(w));
      }
    }
    if (__all_sync(kFullMask, ok)) return;
    __nanosleep(TM_FLAG_SPIN_NS);
  }
}

// One warp, n_experts <= 64: lane l holds the logits of experts l (l0) and 32 + l (l1; either may be anything
// past n_experts). Passes 1-3 of router.cu in registers: M = max (order-free), Z = the 32-expert group sums
// (warp_sum) added in increasing group order, p = exp(l - M) / Z, then top_k rounds of warp_best, each taking the
// best candidate ranked after the previous pick. The same operations on the same values as router.cu's block
// passes, so the same bits. list: top_k Picks of scratch (shared memory); ids, weights: the token's outputs.
__device__ __forceinline__ void router_topk_warp(float l0, float l1, int64_t n_experts, int64_t top_k, int normalize,
                                                 Pick* list, int32_t* ids, float* weights) {
  const int lane = threadIdx.x & 31;
  float l[2] = {l0, l1}, e[2], p[2];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (lane + 32 * j >= n_experts) l[j] = -INFINITY;
    m = fmaxf(m, l[j]);
  }
  m = warp_max(m);
  float z = 0.0f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    e[j] = lane + 32 * j < n_experts ? expf(__fsub_rn(l[j], m)) : 0.0f;
    const float gs = warp_sum(e[j]);
    if (32 * j < n_experts) z = __fadd_rn(z, gs);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) p[j] = __fdiv_rn(e[j], z);  // e[j]: the same expf of the same value
  TM_TOPK_STAMP(2);
  float last_key = INFINITY;
  int last_id = -1;  // nothing ranks before (+inf, -1)
  for (int64_t r = 0; r < top_k; ++r) {
    float bk = -2.0f;  // below every key: any candidate beats it
    int bi = INT_MAX;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int id = lane + 32 * j;
      const float k = pick_key(p[j]);
      if (id < n_experts && ranks_before(last_key, last_id, k, id) && ranks_before(k, id, bk, bi)) {
        bk = k;
        bi = id;
      }
    }
    warp_best(bk, bi);
    const float pw = __shfl_sync(kFullMask, bi < 32 ? p[0] : p[1], bi & 31);
    if (lane == 0) list[r] = Pick{pw, bi};
    last_key = bk;
    last_id = bi;
  }
  TM_TOPK_STAMP(3);
  if (lane == 0) write_picks(list, top_k, normalize, ids, weights);
}

}  // namespace tm_cuda

#endif
