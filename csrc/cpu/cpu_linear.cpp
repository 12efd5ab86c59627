// cpu_linear.cpp - CPU kernels that read quantized weights: embedding, matmul, routed-expert gate-up and
// down-accumulate. Each output value is computed by exactly one thread, with the reductions of cpu_math.h, so the
// results do not depend on the thread count; weight rows are decoded in tiles of kRowTile rows and each decoded
// tile serves every token (and every (token, slot) pair routed to that expert) while it is in cache.
#include <algorithm>
#include <cinttypes>
#include <vector>

#include "act_quant.h"
#include "backends.h"
#include "cpu_math.h"
#include "quant_blocks.h"

using namespace tm_cpu;

namespace {

// The activations a dot product with weights of qtype multiplies: for Q8_0 (either layout) the values of their
// int8 groups (act_quant.h, as the CUDA reader takes them), rounded once into buf; x itself for every other type.
const float* dot_input(int qtype, const float* x, int64_t n, std::vector<float>& buf) {
  if (qtype != TM_Q8_0 && qtype != TM_Q8_0_TILED) return x;
  buf.resize(static_cast<size_t>(n));
  tm_act::q8_round(x, buf.data(), n);
  return buf.data();
}

// (token, slot) pairs of a call grouped by expert, in (token, slot) order inside each group.
struct ExpertGroups {
  std::vector<int64_t> experts;  // distinct experts used, ascending
  std::vector<int64_t> start;    // group g holds pairs[start[g] .. start[g + 1])
  std::vector<int64_t> pairs;    // pair index t * slot_count + (s - slot_begin)
};

// Groups the pairs of slots [slot_begin, slot_begin + slot_count) by expert; fails on an expert id out of range.
int group_by_expert(const char* fn, const int32_t* ids, int64_t n_tokens, int64_t top_k, int64_t slot_begin,
                    int64_t slot_count, int64_t n_experts, ExpertGroups* g) {
  const int64_t n_pairs = n_tokens * slot_count;
  std::vector<int64_t> expert_of(static_cast<size_t>(n_pairs), 0);
  if (ids != nullptr) {
    for (int64_t t = 0; t < n_tokens; ++t) {
      for (int64_t s = 0; s < slot_count; ++s) {
        const int32_t e = ids[t * top_k + slot_begin + s];
        if (e < 0 || e >= n_experts)
          return tm_set_error(TM_ERR_INVALID_ARGUMENT,
                              "%s: ids[token %" PRId64 ", slot %" PRId64 "] = %d is out of range [0, n_experts=%" PRId64
                              ")",
                              fn, t, slot_begin + s, e, n_experts);
        expert_of[static_cast<size_t>(t * slot_count + s)] = e;
      }
    }
  }
  std::vector<int64_t> count(static_cast<size_t>(n_experts) + 1, 0);
  for (int64_t p = 0; p < n_pairs; ++p) ++count[static_cast<size_t>(expert_of[p]) + 1];
  g->experts.clear();
  g->start.assign(1, 0);
  std::vector<int64_t> offset(static_cast<size_t>(n_experts), 0);
  int64_t running = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    offset[e] = running;
    const int64_t c = count[static_cast<size_t>(e) + 1];
    if (c > 0) {
      g->experts.push_back(e);
      running += c;
      g->start.push_back(running);
    }
  }
  g->pairs.assign(static_cast<size_t>(n_pairs), 0);
  for (int64_t p = 0; p < n_pairs; ++p) g->pairs[static_cast<size_t>(offset[expert_of[p]]++)] = p;
  return TM_OK;
}

}  // namespace

extern "C" int tm_cpu_embedding(int qtype, const void* table, const int32_t* ids, float* out, int64_t n_tokens,
                                int64_t vocab, int64_t dim, void* stream) {
  for (int64_t t = 0; t < n_tokens; ++t)
    if (ids[t] < 0 || ids[t] >= vocab)
      return tm_set_error(TM_ERR_INVALID_ARGUMENT, "tm_embedding: ids[%" PRId64 "] = %d is out of range [0, vocab=%" PRId64 ")",
                          t, ids[t], vocab);
  const uint8_t* base = static_cast<const uint8_t*>(table);
  const int64_t row_bytes = tm_qtype_row_bytes(qtype, dim);
#pragma omp parallel for schedule(static) if (n_tokens * dim > kParallelWork)
  for (int64_t t = 0; t < n_tokens; ++t) decode_row(qtype, base + ids[t] * row_bytes, dim, out + t * dim);
  return TM_OK;
}

extern "C" int tm_cpu_matmul(int qtype, const void* w, const float* x, const float* bias, float* y,
                             int64_t n_tokens, int64_t rows, int64_t cols, int accumulate, const float* scale,
                             const uint8_t* /*x_groups: the values x rounds to here*/, const float* x_sums, float eps,
                             const float* next_norm_w, float* y_w, float* y_ss, uint8_t* y_w_groups, void* stream) {
  std::vector<float> sums_inv;
  if (x_sums != nullptr) {  // the inv tm_rmsnorm_factors computes from these sums
    sums_inv = grouped_rms_invs(x_sums, n_tokens, cols, eps);
    scale = sums_inv.data();
  }
  const uint8_t* base = static_cast<const uint8_t*>(w);
  const int64_t row_bytes = tm_qtype_row_bytes(qtype, cols);
  const int64_t n_tiles = (rows + kRowTile - 1) / kRowTile;
  std::vector<float> x_q;
  x = dot_input(qtype, x, n_tokens * cols, x_q);
#pragma omp parallel if (n_tokens * rows * cols > kParallelWork)
  {
    std::vector<float> tile(static_cast<size_t>(kRowTile * cols));
#pragma omp for schedule(static)
    for (int64_t tile_i = 0; tile_i < n_tiles; ++tile_i) {
      const int64_t r0 = tile_i * kRowTile;
      const int64_t nr = std::min(kRowTile, rows - r0);
      for (int64_t i = 0; i < nr; ++i) decode_row(qtype, base + (r0 + i) * row_bytes, cols, tile.data() + i * cols);
      for (int64_t t = 0; t < n_tokens; ++t) {
        const float* xt = x + t * cols;
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t r = r0 + i;
          float v = dot_f32(tile.data() + i * cols, xt, cols);
          if (scale != nullptr) v = v * scale[t];
          if (bias != nullptr) v = v + bias[r];
          float* o = y + t * rows + r;
          *o = accumulate ? *o + v : v;
        }
      }
    }
  }
  return y_w == nullptr ? TM_OK : write_norm_factors(y, next_norm_w, y_w, y_ss, y_w_groups, n_tokens, rows, stream);
}

// act[t, s, r] = silu(dot(W_gate[e][r], h[t])) * dot(W_up[e][r], h[t]) for every pair (t, s) of the slot range.
// The value of one (t, s, r) depends only on e, r and h[t]: per-slot and fused calls agree bit for bit.
extern "C" int tm_cpu_moe_gate_up(int qtype, const void* w_gate, const void* w_up, const float* h, const int32_t* ids,
                                  float* act, int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                  int64_t n_experts, int64_t ffn, int64_t hidden, const float* scale, void* stream) {
  ExpertGroups g;
  int status = group_by_expert("tm_moe_gate_up", ids, n_tokens, top_k, slot_begin, slot_count, n_experts, &g);
  if (status != TM_OK) return status;
  const uint8_t* gate_base = static_cast<const uint8_t*>(w_gate);
  const uint8_t* up_base = static_cast<const uint8_t*>(w_up);
  const int64_t row_bytes = tm_qtype_row_bytes(qtype, hidden);
  const int64_t expert_bytes = ffn * row_bytes;
  const int64_t n_tiles = (ffn + kRowTile - 1) / kRowTile;
  const int64_t n_items = static_cast<int64_t>(g.experts.size()) * n_tiles;
  std::vector<float> h_q;
  h = dot_input(qtype, h, n_tokens * hidden, h_q);
#pragma omp parallel if (2 * n_tokens * slot_count * ffn * hidden > kParallelWork)
  {
    std::vector<float> gate_tile(static_cast<size_t>(kRowTile * hidden));
    std::vector<float> up_tile(static_cast<size_t>(kRowTile * hidden));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < n_items; ++item) {
      const int64_t gi = item / n_tiles;
      const int64_t e = g.experts[static_cast<size_t>(gi)];
      const int64_t r0 = (item % n_tiles) * kRowTile;
      const int64_t nr = std::min(kRowTile, ffn - r0);
      for (int64_t i = 0; i < nr; ++i) {
        decode_row(qtype, gate_base + e * expert_bytes + (r0 + i) * row_bytes, hidden, gate_tile.data() + i * hidden);
        decode_row(qtype, up_base + e * expert_bytes + (r0 + i) * row_bytes, hidden, up_tile.data() + i * hidden);
      }
      for (int64_t k = g.start[static_cast<size_t>(gi)]; k < g.start[static_cast<size_t>(gi) + 1]; ++k) {
        const int64_t p = g.pairs[static_cast<size_t>(k)];
        const int64_t t = p / slot_count;
        const int64_t s = slot_begin + p % slot_count;
        const float* ht = h + t * hidden;
        float* out = act + (t * top_k + s) * ffn + r0;
        for (int64_t i = 0; i < nr; ++i) {
          float gv = dot_f32(gate_tile.data() + i * hidden, ht, hidden);
          float uv = dot_f32(up_tile.data() + i * hidden, ht, hidden);
          if (scale != nullptr) {  // the deferred norm's inv (h = xw)
            gv = gv * scale[t];
            uv = uv * scale[t];
          }
          out[i] = silu(gv) * uv;
        }
      }
    }
  }
  return TM_OK;
}

// For every output row r and token t, in increasing slot order:
//   w_eff = (weights ? weights[t, s] : 1) ; if gate_inp: w_eff = w_eff * sigmoid(dot(gate_inp, h[t]))
//   acc = x[t, r] (once) ; acc = acc + w_eff * dot(W_down[e][r], act[t, s]) ; x[t, r] = acc (once)
// A per-slot call starts from the x the previous slot wrote, which is the fused accumulator rounded to float32 as
// it already is: per-slot and fused calls agree bit for bit.
extern "C" int tm_cpu_moe_down_accumulate(int qtype, const void* w_down, const float* act, const int32_t* ids,
                                          const float* weights, const float* gate_inp, const float* h, float* x,
                                          int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                          int64_t n_experts, int64_t hidden, int64_t ffn, void* stream) {
  ExpertGroups g;
  int status =
      group_by_expert("tm_moe_down_accumulate", ids, n_tokens, top_k, slot_begin, slot_count, n_experts, &g);
  if (status != TM_OK) return status;
  const int64_t n_pairs = n_tokens * slot_count;

  // Effective slot weights, computed once per (t, s) with the shared gate.
  std::vector<float> w_eff(static_cast<size_t>(n_pairs));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float gate = gate_inp != nullptr ? shared_gate(gate_inp, h + t * hidden, hidden) : 1.0f;
    for (int64_t s = 0; s < slot_count; ++s) {
      float w = weights != nullptr ? weights[t * top_k + slot_begin + s] : 1.0f;
      if (gate_inp != nullptr) w = w * gate;
      w_eff[static_cast<size_t>(t * slot_count + s)] = w;
    }
  }

  const uint8_t* base = static_cast<const uint8_t*>(w_down);
  const int64_t row_bytes = tm_qtype_row_bytes(qtype, ffn);
  std::vector<float> act_q;
  act = dot_input(qtype, act, n_tokens * top_k * ffn, act_q);
  const int64_t expert_bytes = hidden * row_bytes;
  const int64_t n_tiles = (hidden + kRowTile - 1) / kRowTile;
#pragma omp parallel if (n_pairs * hidden * ffn > kParallelWork)
  {
    std::vector<float> tile(static_cast<size_t>(kRowTile * ffn));
    std::vector<float> dots(static_cast<size_t>(n_pairs * kRowTile));  // dots[p * kRowTile + i]
#pragma omp for schedule(static)
    for (int64_t tile_i = 0; tile_i < n_tiles; ++tile_i) {
      const int64_t r0 = tile_i * kRowTile;
      const int64_t nr = std::min(kRowTile, hidden - r0);
      for (size_t gi = 0; gi < g.experts.size(); ++gi) {
        const int64_t e = g.experts[gi];
        for (int64_t i = 0; i < nr; ++i)
          decode_row(qtype, base + e * expert_bytes + (r0 + i) * row_bytes, ffn, tile.data() + i * ffn);
        for (int64_t k = g.start[gi]; k < g.start[gi + 1]; ++k) {
          const int64_t p = g.pairs[static_cast<size_t>(k)];
          const int64_t t = p / slot_count;
          const int64_t s = slot_begin + p % slot_count;
          const float* a = act + (t * top_k + s) * ffn;
          for (int64_t i = 0; i < nr; ++i) dots[static_cast<size_t>(p * kRowTile + i)] = dot_f32(tile.data() + i * ffn, a, ffn);
        }
      }
      for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t i = 0; i < nr; ++i) {
          float acc = x[t * hidden + r0 + i];
          for (int64_t s = 0; s < slot_count; ++s) {
            const int64_t p = t * slot_count + s;
            acc = acc + w_eff[static_cast<size_t>(p)] * dots[static_cast<size_t>(p * kRowTile + i)];
          }
          x[t * hidden + r0 + i] = acc;
        }
      }
    }
  }
  return TM_OK;
}
