/*
 * cpu_math.h - internal: the float32 reductions and activations every CPU kernel shares, so that one quantity
 * (a dot product, a gate) is computed by one piece of code wherever it appears (fused or per-slot kernels give
 * bitwise identical results because they call these same functions on the same inputs).
 *
 * Dot-product order (all CPU dot products, sums of squares included): eight partial sums; partial j accumulates,
 * in increasing column order, the products a[c] * b[c] of the columns c with c % 8 == j (each a rounded multiply
 * then a rounded add: the library is built with -ffp-contract=off); the result is
 * ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)). The order depends only on the length, never on threads.
 */
#ifndef TORNADO_MOE_CPU_MATH_H
#define TORNADO_MOE_CPU_MATH_H

#include <cmath>
#include <cstdint>
#include <vector>

#include "tornado_moe.h"

namespace tm_cpu {

inline float dot_f32(const float* a, const float* b, int64_t n) {
  float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    for (int j = 0; j < 8; ++j) p[j] = p[j] + a[c + j] * b[c + j];
  }
  for (int j = 0; c + j < n; ++j) p[j] = p[j] + a[c + j] * b[c + j];
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// silu(g) = g / (1 + exp(-g)), as the header states.
inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// The qwen2moe shared-expert gate of one token: sigmoid(dot(gate_inp, h_t)).
inline float shared_gate(const float* gate_inp, const float* ht, int64_t hidden) {
  return sigmoid(dot_f32(gate_inp, ht, hidden));
}

// The deferred norm's grouped sum (tornado_moe.h, tm_rmsnorm_factors: the CUDA kernels' order, so the same bits):
// group_sum(g) for the groups of TM_NORM_GROUP values, lane l's sum of its chunk of ceil(groups / 32) consecutive
// groups, then the warp's butterfly over the 32 lane sums.
template <class GroupSum>
float grouped_sum(GroupSum group_sum, int64_t dim) {
  constexpr int kLanes = 32;
  const int64_t groups = (dim + TM_NORM_GROUP - 1) / TM_NORM_GROUP, chunk = (groups + kLanes - 1) / kLanes;
  float lanes[kLanes] = {};
  for (int64_t g = 0; g < groups; ++g) lanes[g / chunk] = lanes[g / chunk] + group_sum(g);
  for (int m = kLanes / 2; m >= 1; m /= 2) {
    float next[kLanes];
    for (int l = 0; l < kLanes; ++l) next[l] = lanes[l] + lanes[l ^ m];
    for (int l = 0; l < kLanes; ++l) lanes[l] = next[l];
  }
  return lanes[0];
}

// inv = 1 / sqrt(ss / dim + eps), the norm's factor from its sum of squares.
inline float rms_inv(float ss, int64_t dim, float eps) { return 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps); }

// The inv tm_rmsnorm_factors computes for each of n_tokens rows of dim values from their group sums (xss).
inline std::vector<float> grouped_rms_invs(const float* sums, int64_t n_tokens, int64_t dim, float eps) {
  std::vector<float> inv;
  for (int64_t t = 0; t < n_tokens; ++t)
    inv.push_back(rms_inv(grouped_sum([&](int64_t g) { return sums[t * tm_norm_groups(dim) + g]; }, dim), dim, eps));
  return inv;
}

// The next normalisation's factors of rows x [n_tokens, dim] as tm_rmsnorm_factors writes them (xw = x * w and
// the group sums xss), and with xw_groups xw's int8 groups: what a kernel that writes x leaves for the next product
// (cpu_fused.cpp).
int write_norm_factors(const float* x, const float* w, float* xw, float* xss, uint8_t* xw_groups, int64_t n_tokens,
                       int64_t dim, void* stream);

// Below this many multiply-adds a kernel runs on the calling thread: waking the OpenMP team costs more.
constexpr int64_t kParallelWork = 1 << 15;

// Rows decoded together: every decoded tile is reused for all tokens while it is in cache.
constexpr int64_t kRowTile = 8;

}  // namespace tm_cpu

#endif
