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
 * block_rmsnorm writes y with it (tm_rmsnorm, the router and both kinds of fused gate-up block normalise through
 * it). The deferred form (tm_rmsnorm_factors: the attention input) sums in another order, the grouped one, below.
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
//
// Its inv has a tree of its own, the grouped sum (tornado_moe.h, tm_rmsnorm_factors), so that it needs neither a
// copy of x nor a block barrier in the consumer: the kernel that writes x also writes the sums of squares of groups
// of kNormGroup consecutive values (xss; experts_down_kernel's blocks own kNormGroup rows each), and any one warp
// adds them up alone, reading 2 KB through L1 (results/NOTES.md v11: from L2, every warp of 384 blocks asking for the
// same lines, it cost ~3 us a layer; through L1 0.2-0.4).

__device__ __forceinline__ float norm_factor_xw(float x, float w) { return __fmul_rn(x, w); }

constexpr int kNormGroup = TM_NORM_GROUP;
__host__ __device__ inline int64_t norm_groups(int64_t dim) { return (dim + kNormGroup - 1) / kNormGroup; }

// Group g's sum of squares: ((x0 * x0 + x1 * x1) + x2 * x2) + x3 * x3 over value(4 g + j) < dim, each rounded.
template <class Value>
__device__ __forceinline__ float group_sum_sq(Value value, int64_t g, int64_t dim) {
  float ss = 0.0f;  // +0 + v * v is v * v exactly
#pragma unroll
  for (int j = 0; j < kNormGroup; ++j) {
    const int64_t i = g * kNormGroup + j;
    if (i < dim) {
      const float v = value(i);
      ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
  }
  return ss;
}

// inv from the group sums partial(g), g < norm_groups(dim), by one warp (every lane gets it): lane l adds its chunk
// of ceil(groups / 32) consecutive groups in increasing order, warp_sum adds the 32 lane sums.
__host__ __device__ inline int64_t norm_lane_chunk(int64_t dim) { return (norm_groups(dim) + 31) / 32; }
template <class Partial>
__device__ __forceinline__ float warp_grouped_inv(Partial partial, int64_t dim, float eps) {
  const int64_t groups = norm_groups(dim), chunk = norm_lane_chunk(dim);
  const int64_t g0 = (threadIdx.x & 31) * chunk, g1 = g0 + chunk < groups ? g0 + chunk : groups;
  float ss = 0.0f;
#pragma unroll 4
  for (int64_t g = g0; g < g1; ++g) ss = __fadd_rn(ss, partial(g));
  return rms_inv_from_sum(warp_sum(ss), dim, eps);
}
// The same from sums in global memory that no thread of this grid writes, through L1 (the block's warps and the
// SM's blocks share the lines; results/NOTES.md v11) 16 bytes at a time, one round trip: every lane's chunk whole
// and 16-byte aligned (grouped_inv_vector_ok).
__host__ __device__ inline bool grouped_inv_vector_ok(const float* sums, int64_t dim) {
  return norm_groups(dim) % 128 == 0 && reinterpret_cast<uintptr_t>(sums) % 16 == 0;
}
// One quad of sums added to a lane's running sum, in order.
__device__ __forceinline__ float add_quad(float ss, float4 v) {
  return __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(ss, v.x), v.y), v.z), v.w);
}
// A lane's part of it (its chunk's sum, in order), so that a caller may add its chunk before its dot products and
// hold one register across them instead of the chunk's 16 (results/NOTES.md lesson 184).
__device__ __forceinline__ float lane_grouped_sum_ldg(const float* sums, int64_t dim) {
  const int64_t quads = norm_lane_chunk(dim) / 4;
  const float4* p = reinterpret_cast<const float4*>(sums) + (threadIdx.x & 31) * quads;
  float ss = 0.0f;
#pragma unroll 4
  for (int64_t k = 0; k < quads; ++k) ss = add_quad(ss, __ldg(p + k));
  return ss;
}
__device__ __forceinline__ float warp_grouped_inv_ldg(const float* sums, int64_t dim, float eps) {
  return rms_inv_from_sum(warp_sum(lane_grouped_sum_ldg(sums, dim)), dim, eps);
}
// A lane's chunk sum from sums in global memory of any alignment and length (the same order: the same bits).
__device__ __forceinline__ float lane_grouped_sum(const float* sums, int64_t dim) {
  if (grouped_inv_vector_ok(sums, dim)) return lane_grouped_sum_ldg(sums, dim);
  const int64_t groups = norm_groups(dim), chunk = norm_lane_chunk(dim);
  const int64_t g0 = (threadIdx.x & 31) * chunk, g1 = g0 + chunk < groups ? g0 + chunk : groups;
  float ss = 0.0f;
  for (int64_t g = g0; g < g1; ++g) ss = __fadd_rn(ss, __ldg(sums + g));
  return ss;
}
__device__ __forceinline__ float warp_grouped_inv_any(const float* sums, int64_t dim, float eps) {
  return rms_inv_from_sum(warp_sum(lane_grouped_sum(sums, dim)), dim, eps);
}

// The next normalisation's factors of rows x [n_tokens, dim] in one launch, one thread a group of kNormGroup values:
// xw = x * w, the group sums xss and (xw_q nullable) xw's int8 groups, as tm_rmsnorm_factors and the kernels that
// write them in their epilogues do (defined in moe_experts_down.cu; the down's and the matmul's launch for the
// shapes whose own kernel does not write them).
int launch_norm_factors(const Limits& lim, const char* fn, const float* x, const float* w, float* xw, float* xss,
                        uint8_t* xw_q, int64_t n_tokens, int64_t dim, cudaStream_t s);
// The same inv with the sums loaded ahead of a warp's dot products and held in registers across them (16 a lane at
// dim 2,048), added after them: their round trip overlaps the dots instead of following them (results/NOTES.md
// lesson 181). Held where a lane's chunk is at most kAheadQuads whole quads.
constexpr int kAheadQuads = 4;
struct SumsAhead {
  float4 q[kAheadQuads];
};
__device__ __forceinline__ bool sums_ahead_ok(const float* sums, int64_t dim) {
  return grouped_inv_vector_ok(sums, dim) && norm_lane_chunk(dim) <= 4 * kAheadQuads;
}
__device__ __forceinline__ SumsAhead load_sums_ahead(const float* sums, int64_t dim) {
  const int64_t quads = norm_lane_chunk(dim) / 4;
  const float4* p = reinterpret_cast<const float4*>(sums) + (threadIdx.x & 31) * quads;
  SumsAhead s;
#pragma unroll
  for (int k = 0; k < kAheadQuads; ++k) s.q[k] = k < quads ? __ldg(p + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  return s;
}
__device__ __forceinline__ float warp_grouped_inv_ahead(const SumsAhead& s, int64_t dim, float eps) {
  const int64_t quads = norm_lane_chunk(dim) / 4;
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kAheadQuads; ++k)
    if (k < quads) ss = add_quad(ss, s.q[k]);
  return rms_inv_from_sum(warp_sum(ss), dim, eps);
}

}  // namespace tm_cuda

#endif
