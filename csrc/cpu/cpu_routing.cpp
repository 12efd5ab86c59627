// cpu_routing.cpp - CPU kernels that choose: router top-k, greedy argmax, sampling, and the position update.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <numeric>
#include <vector>

#include "backends.h"
#include "cpu_math.h"
#include "sampling_rng.h"

using namespace tm_cpu;

// logits[e] = dot_f32(w_router[e], h[t]); p = exp(logit - max) / (serial sum in id order); top_k by repeated
// selection of the largest remaining p (strictly greater wins, so ties go to the lowest id; NaN never wins over a
// number); normalize: w = p / (serial sum of the selected p in slot order).
extern "C" int tm_cpu_router_topk(const float* w_router, const float* h, int32_t* ids, float* weights,
                                  int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                                  void* stream) {
#pragma omp parallel if (n_tokens * n_experts * hidden > kParallelWork)
  {
    std::vector<float> p(static_cast<size_t>(n_experts));
    std::vector<char> taken(static_cast<size_t>(n_experts));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* ht = h + t * hidden;
      float m = -INFINITY;
      for (int64_t e = 0; e < n_experts; ++e) {
        p[e] = dot_f32(w_router + e * hidden, ht, hidden);
        m = std::max(m, p[e]);
      }
      float sum = 0.0f;
      for (int64_t e = 0; e < n_experts; ++e) {
        p[e] = std::exp(p[e] - m);
        sum = sum + p[e];
      }
      for (int64_t e = 0; e < n_experts; ++e) p[e] = p[e] / sum;

      std::fill(taken.begin(), taken.end(), 0);
      int32_t* ids_t = ids + t * top_k;
      float* w_t = weights + t * top_k;
      for (int64_t s = 0; s < top_k; ++s) {
        int64_t best = -1;
        for (int64_t e = 0; e < n_experts; ++e) {
          if (taken[e]) continue;
          if (best < 0 || (!std::isnan(p[e]) && (std::isnan(p[best]) || p[e] > p[best]))) best = e;
        }
        taken[best] = 1;
        ids_t[s] = static_cast<int32_t>(best);
        w_t[s] = p[best];
      }
      if (normalize) {
        float selected = 0.0f;
        for (int64_t s = 0; s < top_k; ++s) selected = selected + w_t[s];
        for (int64_t s = 0; s < top_k; ++s) w_t[s] = w_t[s] / selected;
      }
    }
  }
  return TM_OK;
}

extern "C" int tm_cpu_argmax(const float* logits, int32_t* out, int64_t n_tokens, int64_t vocab, void* stream) {
#pragma omp parallel for schedule(static) if (n_tokens * vocab > kParallelWork)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* row = logits + t * vocab;
    int64_t best = 0;  // an all-NaN row gives 0
    bool found = false;
    for (int64_t v = 0; v < vocab; ++v) {
      if (std::isnan(row[v])) continue;
      if (!found || row[v] > row[best]) {
        best = v;
        found = true;
      }
    }
    out[t] = static_cast<int32_t>(best);
  }
  return TM_OK;
}

// The selection rule and its float32 evaluation are written out in csrc/common/sampling_rng.h.
extern "C" int tm_cpu_sample(const float* logits, int32_t* out, int64_t vocab, float temperature, float top_p,
                             int64_t top_k, uint64_t seed, const int32_t* step, void* stream) {
  std::vector<float> p(static_cast<size_t>(vocab));
  float m = -INFINITY;
  for (int64_t v = 0; v < vocab; ++v) {
    p[v] = logits[v] / temperature;
    if (!std::isnan(p[v])) m = std::max(m, p[v]);
  }
  if (m == -INFINITY)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "tm_sample: no logit is a number above -inf (vocab=%" PRId64 ")",
                        vocab);
  float sum = 0.0f;
  for (int64_t v = 0; v < vocab; ++v) {
    const float z = p[v];
    // z == m also covers a +inf maximum (inf - inf would be NaN)
    p[v] = std::isnan(z) ? 0.0f : (z == m ? 1.0f : std::exp(z - m));
    sum = sum + p[v];
  }
  for (int64_t v = 0; v < vocab; ++v) p[v] = p[v] / sum;

  const int64_t n_keep = (top_k > 0 && top_k < vocab) ? top_k : vocab;
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  auto before = [&p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
  if (n_keep < vocab)
    std::partial_sort(order.begin(), order.begin() + n_keep, order.end(), before);
  else
    std::sort(order.begin(), order.end(), before);

  float kept_mass = 0.0f;
  for (int64_t i = 0; i < n_keep; ++i) kept_mass = kept_mass + p[order[i]];
  int64_t n = n_keep;
  float mass = kept_mass;
  if (top_p < 1.0f) {
    const float threshold = top_p * kept_mass;
    float c = 0.0f;
    for (int64_t i = 0; i < n_keep; ++i) {
      c = c + p[order[i]];
      if (c >= threshold) {
        n = i + 1;
        mass = c;
        break;
      }
    }
  }
  const float target = tm_sample_uniform(seed, step[0]) * mass;
  int32_t chosen = order[n - 1];
  float c = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    c = c + p[order[i]];
    if (c > target) {
      chosen = order[i];
      break;
    }
  }
  out[0] = chosen;
  return TM_OK;
}

extern "C" int tm_cpu_advance_position(int32_t* pos, int32_t delta, const int32_t* token, int32_t* log,
                                       int64_t log_len, void* stream) {
  // two's-complement wrap instead of signed-overflow UB
  const int32_t p = static_cast<int32_t>(static_cast<uint32_t>(pos[0]) + static_cast<uint32_t>(delta));
  pos[0] = p;
  if (log != nullptr && p >= 0 && p < log_len) log[p] = token[0];
  return TM_OK;
}

extern "C" int tm_cpu_argmax_advance(const float* logits, int32_t* out, int64_t vocab, int32_t* pos, int32_t delta,
                                     int32_t* log, int64_t log_len, void* stream) {
  TM_TRY(tm_cpu_argmax(logits, out, 1, vocab, stream));
  return tm_cpu_advance_position(pos, delta, out, log, log_len, stream);
}
