/*
 * norm.cuh - internal to csrc/cuda: THE RMSNorm reduction tree, shared by tm_rmsnorm and by every kernel that
 * normalises its own input (the fused attention input, the fused router), so a fused kernel sees bitwise the h
 * that tm_rmsnorm would have written.
 *
 * The tree (for a row of `dim` values): 256 "threads" i = 32 w + l (8 warps w of 32 lanes l); thread i accumulates
 * x[i], x[i + 256], ... as ss = fma(v, v, ss) in increasing index; each warp sums its 32 threads with warp_sum;
 * the 8 warp totals sit in lanes 0..7 of one warp (lanes 8..31 hold +0) and are summed with warp_sum;
 * inv = 1 / sqrt(ss / dim + eps) (IEEE division and square root); y = (x * inv) * w, each a rounded product.
 * block_rms_inv evaluates it with a block of 256 threads (every warp sums the warp totals itself: one barrier);
 * block_rmsnorm writes y with it (tm_rmsnorm, the fused attention input, the router and both kinds of fused
 * gate-up block all normalise through it).
 */
#ifndef TORNADO_MOE_CUDA_NORM_CUH
#define TORNADO_MOE_CUDA_NORM_CUH

#include "common.cuh"

namespace tm_cuda {

constexpr int kNormThreads = 256;
constexpr int kNormWarps = kNormThreads / 32;

__device__ __forceinline__ float rms_inv_from_sum(float ss, int64_t dim, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(dim)), eps)));
}

__device__ __forceinline__ float rms_apply(float x, float inv, float w) { return __fmul_rn(__fmul_rn(x, inv), w); }

// The per-thread part of the tree: ss over x[i] of this thread's indices (threadIdx.x + k * kNormThreads, in
// increasing order), the first kNormHeld of them kept in `held` for the caller (no second read after the reduction).
constexpr int kNormHeld = 8;
__device__ __forceinline__ float thread_sum_sq(const float* x, int64_t dim, float (&held)[kNormHeld]) {
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormHeld; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kNormThreads;
    held[k] = i < dim ? x[i] : 0.0f;
  }
#pragma unroll
  for (int k = 0; k < kNormHeld; ++k) ss = __fmaf_rn(held[k], held[k], ss);  // +0 past dim: fma(0, 0, ss) == ss
  for (int64_t i = threadIdx.x + kNormHeld * kNormThreads; i < dim; i += kNormThreads) {
    const float v = x[i];
    ss = __fmaf_rn(v, v, ss);
  }
  return ss;
}

// The barrier of the threads that normalise: the whole block (a block of kNormThreads threads), or threads
// 0 .. kNormThreads - 1 of a larger block alone (named barrier `id`; a block whose other warps have other roles).
struct BlockBarrier {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
template <int kId>
struct NormWarpsBarrier {
  __device__ __forceinline__ void operator()() const { named_barrier<kNormThreads>(kId); }
};

// inv from every thread's ss, by threads 0 .. kNormThreads - 1, with one barrier: each warp sums the 8
// warp totals itself (the same lanes, the same butterfly, so the same bits in every warp) instead of warp 0 summing
// them for the block behind two more barriers. `scratch` holds kNormWarps floats; the caller must pass a barrier
// before it writes them again (block_rmsnorm's closing one).
template <class Barrier = BlockBarrier>
__device__ __forceinline__ float block_rms_inv(float ss, int64_t dim, float eps, float* scratch,
                                               Barrier barrier = {}) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  ss = warp_sum(ss);
  if (lane == 0) scratch[warp] = ss;
  barrier();
  return rms_inv_from_sum(warp_sum(lane < kNormWarps ? scratch[lane] : 0.0f), dim, eps);
}

// The weights block_rmsnorm keeps in registers (this thread's first kNormHeld indices). They never change, so a
// kernel may load them before pdl_wait and pass them to block_rmsnorm_held (the same bits: only the time differs).
__device__ __forceinline__ void load_norm_weights(const float* w, int64_t dim, float (&wv)[kNormHeld]) {
#pragma unroll
  for (int k = 0; k < kNormHeld; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kNormThreads;
    wv[k] = i < dim ? __ldg(w + i) : 0.0f;
  }
}

// block_rmsnorm(_held): out[i] = rms_apply(x[i], inv, w[i]) (and copy[i], unless copy is nullptr) for a row of
// `dim` values by threads 0 .. kNormThreads - 1 (the whole block, or with NormWarpsBarrier the first 8 warps of a
// larger one), then a barrier: the tree above, so the bits tm_rmsnorm writes. x is read with plain loads (it may be
// the output of the previous kernel), once: the first kNormHeld * kNormThreads values stay in registers, as do
// their weights (wv: block_rmsnorm loads them before the reduction so that their round trip overlaps x's; a kernel
// may load them before pdl_wait and call block_rmsnorm_held). Each thread writes only indices it read, after the
// reduction's barrier, so out may alias x. Two barriers in all (there were four, and a second read of x: each is a
// round trip on the path of every block that normalises its input).
template <class Barrier = BlockBarrier>
__device__ __forceinline__ void block_rmsnorm_held(const float* x, const float* w, const float (&wv)[kNormHeld],
                                                   int64_t dim, float eps, float* out, float* copy, float* scratch,
                                                   Barrier barrier = {}) {
  float xv[kNormHeld];
  const float inv = block_rms_inv(thread_sum_sq(x, dim, xv), dim, eps, scratch, barrier);
  auto put = [&](int64_t i, float v) {
    out[i] = v;
    if (copy != nullptr) copy[i] = v;
  };
#pragma unroll
  for (int k = 0; k < kNormHeld; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kNormThreads;
    if (i < dim) put(i, rms_apply(xv[k], inv, wv[k]));
  }
  for (int64_t i = threadIdx.x + kNormHeld * kNormThreads; i < dim; i += kNormThreads)
    put(i, rms_apply(x[i], inv, __ldg(w + i)));
  barrier();
}

template <class Barrier = BlockBarrier>
__device__ __forceinline__ void block_rmsnorm(const float* x, const float* w, int64_t dim, float eps, float* out,
                                              float* copy, float* scratch, Barrier barrier = {}) {
  float wv[kNormHeld];
  load_norm_weights(w, dim, wv);
  block_rmsnorm_held(x, w, wv, dim, eps, out, copy, scratch, barrier);
}

// ---- the deferred form (tm_rmsnorm_factors) --------------------------------------------------------------------
// A normalised product dot(W, y) with y = rms_apply(x, inv, w) is computed as dot(W, xw) * inv, xw = x * w: xw
// needs no reduction (the kernel that writes x writes it as well), so a consumer streams its weights from its first
// instruction and needs inv only after its dot products (results/NOTES.md v10: the norm at the start of qkv_rope's
// and the gate-up's blocks held every resident block for ~1.4 us).

__device__ __forceinline__ float norm_factor_xw(float x, float w) { return __fmul_rn(x, w); }

// inv for a row of x, in two halves that need no registers in between: rms_stage issues asynchronous copies of
// this thread's tree indices (threadIdx.x + k * kNormThreads) of x into `sx` (shared memory, dim floats);
// rms_staged_inv, later, waits for them and evaluates the tree (thread_sum_sq's order, block_rms_inv's barrier:
// the bits of block_rms_inv over x). Threads 0 .. kNormThreads - 1 call both.
__device__ __forceinline__ void rms_stage(const float* x, int64_t dim, float* sx) {
  for (int64_t i = threadIdx.x; i < dim; i += kNormThreads)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(sx + i)), "l"(x + i) : "memory");
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <class Barrier = BlockBarrier>
__device__ __forceinline__ float rms_staged_inv(const float* sx, int64_t dim, float eps, float* scratch,
                                                Barrier barrier = {}) {
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // this thread's own copies: no barrier needed to read them
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) {
    const float v = sx[i];
    ss = __fmaf_rn(v, v, ss);
  }
  return block_rms_inv(ss, dim, eps, scratch, barrier);
}

// rms_stage with its copies tracked by `bar` (an mbarrier initialised for kNormThreads arrivals): a warp can wait
// for x to have landed (mbar_wait(bar, 0)) without waiting for the other warps, and evaluate the tree alone with
// warp_rms_inv.
__device__ __forceinline__ void rms_stage_tracked(const float* x, int64_t dim, float* sx, uint64_t* bar) {
  for (int64_t i = threadIdx.x; i < dim; i += kNormThreads)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(sx + i)), "l"(x + i) : "memory");
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// block_rms_inv's tree over a staged row, evaluated by one warp alone (every lane gets the result): lane l sums
// the squares of thread 32 w + l's indices for each of the 8 warps w in thread_sum_sq's order, warp_sum gives warp
// w's total, lane w keeps it, and the 8 totals in lanes 0..7 are summed as block_rms_inv sums them: the same bits,
// with no barrier (each warp of a block may evaluate it whenever x has landed).
__device__ __forceinline__ float warp_rms_inv(const float* sx, int64_t dim, float eps) {
  const int lane = threadIdx.x & 31;
  float mine = 0.0f;
#pragma unroll
  for (int w = 0; w < kNormWarps; ++w) {
    float ss = 0.0f;
    for (int64_t i = 32 * w + lane; i < dim; i += kNormThreads) {
      const float v = sx[i];
      ss = __fmaf_rn(v, v, ss);
    }
    const float total = warp_sum(ss);
    if (lane == w) mine = total;
  }
  return rms_inv_from_sum(warp_sum(mine), dim, eps);
}

}  // namespace tm_cuda

#endif
