/*
 * norm.cuh - internal to csrc/cuda: THE RMSNorm reduction tree, shared by tm_rmsnorm and by every kernel that
 * normalises its own input (the fused attention input, the fused router), so a fused kernel sees bitwise the h
 * that tm_rmsnorm would have written.
 *
 * The tree (for a row of `dim` values): 256 "threads" i = 32 w + l (8 warps w of 32 lanes l); thread i accumulates
 * x[i], x[i + 256], ... as ss = fma(v, v, ss) in increasing index; each warp sums its 32 threads with warp_sum;
 * the 8 warp totals sit in lanes 0..7 of one warp (lanes 8..31 hold +0) and are summed with warp_sum;
 * inv = 1 / sqrt(ss / dim + eps) (IEEE division and square root); y = (x * inv) * w, each a rounded product.
 * block_rms_inv evaluates it with a block of 256 threads, warp_rms_inv with one warp playing all 256 threads.
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

// The same value computed by one warp (every lane returns it): lane l plays threads l, l + 32, ..., l + 224. The
// row is read in rounds of 2048 values (64 independent loads per lane in flight), each value added to the sum of
// its thread in increasing index, as in the block version.
__device__ __forceinline__ float warp_rms_inv(const float* x, int64_t dim, float eps) {
  const int lane = threadIdx.x & 31;
  float ss[kNormWarps];
#pragma unroll
  for (int w = 0; w < kNormWarps; ++w) ss[w] = 0.0f;
  for (int64_t base = 0; base < dim; base += 64 * 32) {
    float v[64];
#pragma unroll
    for (int m = 0; m < 64; ++m) {
      const int64_t i = base + 32 * m + lane;
      v[m] = i < dim ? x[i] : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < 64; ++m)  // value i belongs to thread i % 256, i.e. warp (i / 32) % 8
      if (base + 32 * m + lane < dim) ss[m % kNormWarps] = __fmaf_rn(v[m], v[m], ss[m % kNormWarps]);
  }
  float total = 0.0f;  // lane w < kNormWarps ends with warp w's sum, the other lanes with +0
#pragma unroll
  for (int w = 0; w < kNormWarps; ++w) {
    const float t = warp_sum(ss[w]);
    if (lane == w) total = t;
  }
  return rms_inv_from_sum(warp_sum(total), dim, eps);
}

}  // namespace tm_cuda

#endif
