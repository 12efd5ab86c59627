/*
 * rope.cuh - internal to csrc/cuda: THE rotation of one RoPE pair, shared by tm_rope_kv_append and tm_qkv_rope so
 * the fused kernel is bitwise the unfused one: theta = p * freq_base^(-2i/head_dim) evaluated in double, its cos
 * and sin rounded to float32, then a' = a c - b s and b' = a s + b c as rounded products and adds (as the CPU
 * kernel does).
 */
#ifndef TORNADO_MOE_CUDA_ROPE_CUH
#define TORNADO_MOE_CUDA_ROPE_CUH

#include <cmath>

#include "common.cuh"

namespace tm_cuda {

// The rotation's factors (cos, sin) for pair i of a head at position p.
struct RopeFactors {
  float c, s;
};
__device__ __forceinline__ RopeFactors rope_factors(int64_t p, int64_t i, int64_t head_dim, float freq_base) {
  const double theta = static_cast<double>(p) *
                       pow(static_cast<double>(freq_base), -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  double sd, cd;
  sincos(theta, &sd, &cd);
  return RopeFactors{static_cast<float>(cd), static_cast<float>(sd)};
}

// Rotates (a, b) by the factors f.
__device__ __forceinline__ void rope_apply(RopeFactors f, float& a, float& b) {
  const float a2 = __fsub_rn(__fmul_rn(a, f.c), __fmul_rn(b, f.s));
  b = __fadd_rn(__fmul_rn(a, f.s), __fmul_rn(b, f.c));
  a = a2;
}

// Rotates (a, b), the pair i of a head, for position p.
__device__ __forceinline__ void rope_rotate(int64_t p, int64_t i, int64_t head_dim, float freq_base, float& a,
                                            float& b) {
  rope_apply(rope_factors(p, i, head_dim, freq_base), a, b);
}

}  // namespace tm_cuda

#endif
