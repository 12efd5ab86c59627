/*
 * sampling_rng.h - internal: the counter-based random generator of tm_sample, shared by the CPU and CUDA
 * kernels (include it from .cpp and .cu files alike) so that both backends draw the same u for a (seed, step).
 *
 * Generator: SplitMix64's output function (Steele, Lea, Flood 2014; constants 0xBF58476D1CE4E5B9,
 * 0x94D049BB133111EB, shifts 30/27/31) applied twice:
 *     bits = mix(mix(seed) + 0x9E3779B97F4A7C15 * (uint64)(int64)(step + 1))     (all arithmetic mod 2^64)
 *     u    = (float)(bits >> 40) * 2^-24                                          (exact, u in [0, 1))
 * i.e. the element step+1 of the SplitMix64 stream started at state mix(seed). No state is kept: a captured
 * CUDA graph that reads `step` from device memory draws a new u on every replay, and the same (seed, step)
 * always gives the same u.
 *
 * Selection (tm_sample, as evaluated by the CPU kernel, in float32; the CUDA kernel follows the same rule):
 *     z_v = logits[v] / temperature ; m = max over non-NaN z_v (none above -inf: error)
 *     e_v = 0 for NaN z_v, 1 where z_v == m, else expf(z_v - m)
 *     S = e_0 + e_1 + ... (serial, id order) ; p_v = e_v / S
 *     order = ids sorted by p descending, ties to the lower id
 *     top-k: keep the first n_k = top_k ids of order (top_k <= 0 or >= vocab: all) ; M = their p summed in order
 *     top-p (top_p < 1): the mass is relative to the top-k survivors, as in HF transformers and llama.cpp, which
 *         renormalise after top-k: keep the first n ids, n the smallest with running sum c_n >= top_p * M
 *         (running sums serial in order; n = n_k if rounding never gets there) ; K = c_n (K = M without top-p)
 *     target = u * K ; out = the first kept id whose running sum exceeds target (the last kept id if none does).
 */
#ifndef TORNADO_MOE_SAMPLING_RNG_H
#define TORNADO_MOE_SAMPLING_RNG_H

#include <stdint.h>

#include "host_device.h"

static inline TM_HOST_DEVICE uint64_t tm_splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* 64 random bits for (seed, step). */
static inline TM_HOST_DEVICE uint64_t tm_sample_bits(uint64_t seed, int32_t step) {
  uint64_t counter = (uint64_t)((int64_t)step + 1);
  return tm_splitmix64_mix(tm_splitmix64_mix(seed) + 0x9E3779B97F4A7C15ull * counter);
}

/* u in [0, 1) with 24 random bits (every value exactly representable in float32). */
static inline TM_HOST_DEVICE float tm_sample_uniform(uint64_t seed, int32_t step) {
  return (float)(tm_sample_bits(seed, step) >> 40) * (1.0f / 16777216.0f);
}

#endif
