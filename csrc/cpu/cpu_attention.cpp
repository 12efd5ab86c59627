// cpu_attention.cpp - CPU kernels on float32 activations: rmsnorm, RoPE + KV-cache append, causal attention.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <vector>

#include "act_quant.h"
#include "backends.h"
#include "cpu_math.h"

using namespace tm_cpu;

namespace {

// pos[0] + n_tokens rows must fit the cache (CPU kernels check; the CUDA ones cannot fail mid-graph).
int check_positions(const char* fn, const int32_t* pos, int64_t n_tokens, int64_t max_ctx) {
  const int64_t p0 = pos[0];
  if (p0 < 0 || p0 + n_tokens > max_ctx)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT,
                        "%s: positions [pos[0]=%" PRId64 ", %" PRId64 ") do not fit the KV cache of max_ctx=%" PRId64,
                        fn, p0, p0 + n_tokens, max_ctx);
  return TM_OK;
}

// The deferred form's grouped sum of squares (cpu_math.h's grouped_sum), each group's sum also into xss (when
// given).
float grouped_sum_sq(const float* x, int64_t dim, float* xss) {
  return grouped_sum(
      [&](int64_t g) {
        float ss = 0.0f;
        for (int64_t i = g * TM_NORM_GROUP; i < (g + 1) * TM_NORM_GROUP && i < dim; ++i) ss = ss + x[i] * x[i];
        if (xss != nullptr) xss[g] = ss;
        return ss;
      },
      dim);
}

}  // namespace

// y = (x * (1 / sqrt(ss / dim + eps))) * w with ss = dot_f32(x, x): every value read before y is written, so x and
// y may alias.
extern "C" int tm_cpu_rmsnorm(const float* x, const float* w, float* y, int64_t n_tokens, int64_t dim, float eps,
                              void* stream) {
#pragma omp parallel for schedule(static) if (n_tokens * dim > kParallelWork)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* xt = x + t * dim;
    float* yt = y + t * dim;
    const float ss = dot_f32(xt, xt, dim);
    const float inv = rms_inv(ss, dim, eps);
    for (int64_t i = 0; i < dim; ++i) yt[i] = (xt[i] * inv) * w[i];
  }
  return TM_OK;
}


// inv = 1 / sqrt(ss / dim + eps) over the grouped sum; xw = x * w.
extern "C" int tm_cpu_rmsnorm_factors(const float* x, const float* w, float* xw, float* xss, float* inv,
                                      int64_t n_tokens, int64_t dim, float eps, void* stream) {
  const int64_t groups = tm_norm_groups(dim);
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* xt = x + t * dim;
    float* ot = xw + t * dim;
    const float ss = grouped_sum_sq(xt, dim, xss != nullptr ? xss + t * groups : nullptr);
    inv[t] = rms_inv(ss, dim, eps);
    for (int64_t i = 0; i < dim; ++i) ot[i] = xt[i] * w[i];
  }
  return TM_OK;
}

// Rotation of pair (a, b) by theta: a' = a cos - b sin, b' = a sin + b cos (float32). theta_i = p * base^(-2i/d)
// and its cos/sin are evaluated in double, then rounded to float32 (accurate at long positions).
extern "C" int tm_cpu_rope_kv_append(float* q, const float* k, const float* v, float* k_cache, float* v_cache,
                                     const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,
                                     int64_t head_dim, int64_t max_ctx, float freq_base, int neox, void* stream) {
  int status = check_positions("tm_rope_kv_append", pos, n_tokens, max_ctx);
  if (status != TM_OK) return status;
  const int64_t p0 = pos[0];
  const int64_t half = head_dim / 2;
  // Pair i is (i, i + half) for NEOX, (2i, 2i + 1) for the interleaved ("normal") layout.
  const int64_t first_step = neox ? 1 : 2;
  const int64_t second_offset = neox ? half : 1;
#pragma omp parallel if (n_tokens * (n_heads + n_kv_heads) * head_dim > kParallelWork)
  {
    std::vector<float> cs(static_cast<size_t>(2 * half));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tokens; ++t) {
      const double p = static_cast<double>(p0 + t);
      for (int64_t i = 0; i < half; ++i) {
        const double theta =
            p * std::pow(static_cast<double>(freq_base), -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
        cs[2 * i] = static_cast<float>(std::cos(theta));
        cs[2 * i + 1] = static_cast<float>(std::sin(theta));
      }
      auto rotate = [&](const float* src, float* dst) {
        for (int64_t i = 0; i < half; ++i) {
          const int64_t ia = i * first_step;
          const int64_t ib = ia + second_offset;
          const float a = src[ia], b = src[ib], c = cs[2 * i], s = cs[2 * i + 1];
          dst[ia] = a * c - b * s;
          dst[ib] = a * s + b * c;
        }
      };
      for (int64_t hh = 0; hh < n_heads; ++hh) {
        float* qh = q + (t * n_heads + hh) * head_dim;
        rotate(qh, qh);
      }
      const int64_t row = (p0 + t) * n_kv_heads * head_dim;
      for (int64_t hh = 0; hh < n_kv_heads; ++hh) {
        const int64_t off = (t * n_kv_heads + hh) * head_dim;
        rotate(k + off, k_cache + row + hh * head_dim);
      }
      std::memcpy(v_cache + row, v + t * n_kv_heads * head_dim,
                  static_cast<size_t>(n_kv_heads * head_dim) * sizeof(float));
    }
  }
  return TM_OK;
}

// For each (t, head): s_j = dot_f32(q, k_j) * (1 / sqrt(head_dim)) for j = 0 .. pos[0] + t; m = max s_j;
// e_j = exp(s_j - m); l = e_0 + e_1 + ... (serial); o = sum_j e_j * v_j (serial in j, per element); out = o / l.
extern "C" int tm_cpu_attention(const float* q, const float* k_cache, const float* v_cache, float* out,
                                const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,
                                int64_t head_dim, int64_t max_ctx, int32_t* /*scratch: the CUDA kernel's*/,
                                uint8_t* out_groups, void* stream) {
  int status = check_positions("tm_attention", pos, n_tokens, max_ctx);
  if (status != TM_OK) return status;
  const int64_t p0 = pos[0];
  const int64_t group = n_heads / n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t n_items = n_tokens * n_heads;
#pragma omp parallel if (n_items * (p0 + n_tokens) * head_dim > kParallelWork)
  {
    std::vector<float> score(static_cast<size_t>(p0 + n_tokens));
    std::vector<float> acc(static_cast<size_t>(head_dim));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < n_items; ++item) {
      const int64_t t = item / n_heads;
      const int64_t hh = item % n_heads;
      const int64_t kvh = hh / group;
      const int64_t n_ctx = p0 + t + 1;
      const float* qh = q + item * head_dim;
      float m = -INFINITY;
      for (int64_t j = 0; j < n_ctx; ++j) {
        score[j] = dot_f32(qh, k_cache + (j * n_kv_heads + kvh) * head_dim, head_dim) * scale;
        m = std::max(m, score[j]);
      }
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n_ctx; ++j) {
        const float e = std::exp(score[j] - m);
        l = l + e;
        const float* vj = v_cache + (j * n_kv_heads + kvh) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] = acc[d] + e * vj[d];
      }
      float* o = out + item * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[d] / l;
    }
  }
  if (out_groups != nullptr) tm_act::store_row_groups(out, out_groups, n_tokens, n_heads * head_dim);
  return TM_OK;
}
