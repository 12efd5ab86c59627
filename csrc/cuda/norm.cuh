/*
 * norm.cuh - internal to csrc/cuda: THE RMSNorm reduction tree, shared by tm_rmsnorm and by every kernel that
 * normalises its own input (the fused attention input, the fused router), so a fused kernel sees bitwise the h
 * that tm_rmsnorm would have written.
 *
 * The tree (for a row of `dim` values): 256 "threads" i = 32 w + l (8 warps w of 32 lanes l); thread i accumulates
 * x[i], x[i + 256], ... as ss = fma(v, v, ss) in increasing index; each warp sums its 32 threads with warp_sum;
 * the 8 warp totals sit in lanes 0..7 of one warp (lanes 8..31 hold +0) and are summed with warp_sum;
 * inv = 1 / sqrt(ss / dim + eps) (IEEE division and square root); y = (x * inv) * w, each a rounded product.
 * block_rms_inv evaluates it with a block of 256 threads; block_rmsnorm writes y with it (tm_rmsnorm, the fused
 * attention input, the router and both kinds of fused gate-up block all normalise through it).
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

// A block of exactly kNormThreads threads; every thread returns inv. `scratch` holds kNormWarps + 1 floats and is
// free again when the function returns. x is read with plain loads (it may be the output of the previous kernel).
__device__ __forceinline__ float block_rms_inv(const float* x, int64_t dim, float eps, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float ss = 0.0f;
#pragma unroll 8
  for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) {
    const float v = x[i];
    ss = __fmaf_rn(v, v, ss);
  }
  ss = warp_sum(ss);
  if (lane == 0) scratch[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    float v = lane < kNormWarps ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    if (lane == 0) scratch[kNormWarps] = rms_inv_from_sum(v, dim, eps);
  }
  __syncthreads();
  const float inv = scratch[kNormWarps];
  __syncthreads();  // scratch may be reused by the caller
  return inv;
}

// out[i] = rms_apply(x[i], inv, w[i]) (and copy[i], unless copy is nullptr) for a row of `dim` values by a block of
// kNormThreads threads, then a barrier: block_rms_inv's tree, so the bits tm_rmsnorm writes. The weights of the
// first 8 * kNormThreads values are loaded before the reduction, so that their round trip overlaps x's.
__device__ __forceinline__ void block_rmsnorm(const float* x, const float* w, int64_t dim, float eps, float* out,
                                              float* copy, float* scratch) {
  constexpr int kHeld = 8;
  float wv[kHeld];
#pragma unroll
  for (int k = 0; k < kHeld; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kNormThreads;
    wv[k] = i < dim ? __ldg(w + i) : 0.0f;
  }
  const float inv = block_rms_inv(x, dim, eps, scratch);
  auto put = [&](int64_t i, float wi) {
    const float v = rms_apply(x[i], inv, wi);
    out[i] = v;
    if (copy != nullptr) copy[i] = v;
  };
#pragma unroll
  for (int k = 0; k < kHeld; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kNormThreads;
    if (i < dim) put(i, wv[k]);
  }
  for (int64_t i = threadIdx.x + kHeld * kNormThreads; i < dim; i += kNormThreads) put(i, __ldg(w + i));
  __syncthreads();
}

}  // namespace tm_cuda

#endif
