/*
 * matmul.cu - tm_matmul on CUDA: y[t, r] = dot(W[r, :], x[t, :]) (* scale[t]) (+ bias[r]) (y[t, r] + that when
 * accumulating).
 *
 * With x_sums instead of scale (x = tm_rmsnorm_factors' xw, x_sums its xss) each warp computes the token's inv
 * from the sums itself after its dot products, as qkv_rope does (norm.cuh's deferred form; the same bits as scale =
 * tm_rmsnorm_factors' inv), so that the output head needs no norm launch before it.
 * Launch shape: blocks of 8 warps; a warp computes 1 weight row (2 rows for decode calls with at least 64 rows
 * per SM, e.g. the output head, so that the activation loads are shared) for 1 token (n_tokens = 1) or a tile of
 * 4 tokens (so a weight row is read once per 4 tokens; the last tile repeats its last token in the unused slots
 * and does not store them); grid x = row groups, grid y = token tiles, more than max_grid_yz token tiles are split
 * into several launches.
 * Reduction order: qdot.cuh's warp_dot (fixed per format and row length), then v = dot * scale, v = v + bias,
 * y = y + v, each a rounded operation as in the CPU kernel. The scale is a template flag (S): the kernels without
 * it are unchanged, as the output head's timing is sensitive to its code (results/NOTES.md lessons 26, 30). A (token, row) value is bitwise the same for any n_tokens and any chunking.
 * Before pdl_wait each warp prefetches its weight rows into L2 (common.cuh's protocol).
 */
#include "norm.cuh"
#include "qdot.cuh"

namespace tm_cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kTokenTile = 4;

// TM_MATMUL_NORM_PROBE=1 (timing only; results/NOTES.md lesson 180): the one-row, one-token matmul (attn_output in
// decode) also does the epilogue a deferred FFN norm would give it: each warp's new value into shared memory, one
// barrier, then per group of 4 rows its sum of squares and its int8 group, stored to a scratch of the probe's own
// (the norm weight taken as 1). Needs rows % 8 == 0 (every warp of a block reaches the barrier).
#ifndef TM_MATMUL_NORM_PROBE
#define TM_MATMUL_NORM_PROBE 0
#endif
#if TM_MATMUL_NORM_PROBE
__device__ float g_norm_probe_sums[1 << 14];
__device__ __align__(16) uint8_t g_norm_probe_groups[1 << 15];
#endif
// Decode calls with at least this many rows per SM give each warp 2 rows: the activation loads (4 bytes per
// weight value, the larger part of the L1 traffic) are then shared by two rows.
constexpr int64_t kPairRowsPerSm = 64;

// Blocks per SM on tiled Q8_0 rows at one token: 4 for two rows per warp (the output head: 56 registers before the
// reader's whole-batch path, which left alone takes 95 and halves the blocks), TM_MATMUL_ROW_MIN_BLOCKS for one
// row; the compiler's 2-block bound otherwise (results/NOTES.md lesson 6).
#ifndef TM_MATMUL_ROW_MIN_BLOCKS
#define TM_MATMUL_ROW_MIN_BLOCKS 3
#endif
template <Fmt F, int NR, int NT>
constexpr int matmul_min_blocks() {
  if constexpr (!fmt_tiled(F)) return TM_WEIGHT_MIN_BLOCKS;
  return NR * NT == 2 ? 4 : (NR * NT == 1 ? TM_MATMUL_ROW_MIN_BLOCKS : TM_WEIGHT_MIN_BLOCKS);
}

// Q: the products read x's int8 groups xq (tiled rows) instead of rounding x (the same bits).
// S: the products are scaled, by scale[t] or (scale null) by the inv that token t's sums x_sums give.
template <Fmt F, int NR, int NT, bool V, bool S, bool Q>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, matmul_min_blocks<F, NR, NT>())
    matmul_kernel(const uint8_t* __restrict__ w, const float* __restrict__ x, const float* __restrict__ bias, float* y,
                  int64_t n_tokens, int64_t rows, int64_t cols, int64_t row_bytes, int64_t nblocks, int accumulate,
                  const float* __restrict__ scale, int64_t tile0, const uint8_t* __restrict__ xq,
                  const float* __restrict__ x_sums, float eps) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp) * NR;
  const uint8_t* wr[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) wr[i] = w + (r0 + i < rows ? r0 + i : rows - 1) * row_bytes;  // tail: repeat a row
  if (r0 < rows && tile0 + blockIdx.y == 0)
#pragma unroll
    for (int i = 0; i < NR; ++i) prefetch_row_l2(wr[i], row_bytes, lane);
  pdl_begin();
  if (r0 >= rows) return;  // whole warps leave; no block-wide barrier follows
  const int64_t t0 = (tile0 + blockIdx.y) * NT;
  const float* xs[NT];
  const uint8_t* xqs[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int64_t row = t0 + t < n_tokens ? t0 + t : n_tokens - 1;
    xs[t] = x + row * cols;
    xqs[t] = xq + row * q8act_bytes(cols);
  }
  const auto dot = [&](float (&out)[NR][NT]) {
    if constexpr (Q)
      warp_dot_q8act<F, NR, NT, true>(wr, xqs, nblocks, out);
    else
      warp_dot<F, NR, NT, true, V>(wr, xs, nblocks, out);
  };
  // Token t's scale; with x_sums every lane of the warp must call it (warp_sum). The sums were written before this
  // grid started: read through L1, which the block's warps share.
  const auto token_scale = [&](int t) -> float {
    if (scale != nullptr) return scale[t0 + t < n_tokens ? t0 + t : n_tokens - 1];
    const float* sums = x_sums + (t0 + t < n_tokens ? t0 + t : n_tokens - 1) * norm_groups(cols);
    return grouped_inv_vector_ok(sums, cols) ? warp_grouped_inv_ldg(sums, cols, eps)
                                             : warp_grouped_inv([&](int64_t g) { return __ldg(sums + g); }, cols, eps);
  };
  if constexpr (NR == 1 && NT == 1) {
    // One row, one token (attn_output in decode): lane 0's bias and the residual it adds to are loaded before the
    // dot product (ld_ahead), so their round trip is not the kernel's last. Only this instantiation: a change to
    // the two-row matmul's code cost the output head 1.5-6 us on the H200 (results/NOTES.md, lessons 26, 30).
    const bool owner = lane == 0 && t0 < n_tokens;
    float* o = y + t0 * rows + r0;
    const float b = owner && bias != nullptr ? ld_ahead(bias + r0) : 0.0f;
    const float y_in = owner && accumulate ? ld_ahead(o) : 0.0f;  // in place: read around L1 (common.cuh)
    float out[1][1];
    dot(out);
    float sc = 1.0f;
    if constexpr (S) sc = token_scale(0);
    const auto y_new = [&]() {  // lane 0's result: the dot, scaled, plus the bias, added to y when accumulating
      float v = out[0][0];
      if constexpr (S) v = __fmul_rn(v, sc);
      if (bias != nullptr) v = __fadd_rn(v, b);
      return accumulate ? __fadd_rn(y_in, v) : v;
    };
#if TM_MATMUL_NORM_PROBE
    __shared__ float s_rows[kWarpsPerBlock];
    if (lane == 0) {
      const float yn = y_new();
      if (owner) *o = yn;
      s_rows[warp] = yn;
    }
    __syncthreads();
    if (warp == 0 && lane < 2) {
      const float* q = s_rows + 4 * lane;
      const int64_t g = static_cast<int64_t>(blockIdx.x) * 2 + lane;
      g_norm_probe_sums[g & ((1 << 14) - 1)] = group_sum_sq([&](int64_t i) { return q[i - 4 * g]; }, g, rows);
      store_q8act(g_norm_probe_groups, g & ((1 << 12) - 1), tm_act::q8_group(q[0], q[1], q[2], q[3]));
    }
    return;
#endif
    if (!owner) return;
    *o = y_new();
    return;
  }
  float out[NR][NT];
  dot(out);
  float sc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) sc[t] = S ? token_scale(t) : 1.0f;
#pragma unroll
  for (int i = 0; i < NR; ++i) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int64_t r = r0 + i;
      if (lane == i * NT + t && r < rows && t0 + t < n_tokens) {
        float v = out[i][t];
        if constexpr (S) v = __fmul_rn(v, sc[t]);
        if (bias != nullptr) v = __fadd_rn(v, __ldg(bias + r));
        float* o = y + (t0 + t) * rows + r;
        *o = accumulate ? __fadd_rn(__ldcg(o), v) : v;  // in place: read around L1 (common.cuh)
      }
    }
  }
}

template <Fmt F, int NR, int NT, bool V>
int launch_matmul(const Limits& lim, cudaStream_t s, const uint8_t* w, const float* x, const float* bias, float* y,
                  int64_t n_tokens, int64_t rows, int64_t cols, int64_t row_bytes, int64_t nblocks, int accumulate,
                  const float* scale, const uint8_t* xq, const float* x_sums, float eps) {
  const int64_t gx = ceil_div(rows, kWarpsPerBlock * NR);
  const int64_t ny = ceil_div(n_tokens, NT);
  if (gx > lim.max_grid_x)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "tm_matmul: rows = %lld needs more blocks than the grid allows",
                        static_cast<long long>(rows));
  for (int64_t y0 = 0; y0 < ny; y0 += lim.max_grid_yz) {
    const int64_t gy = ny - y0 < lim.max_grid_yz ? ny - y0 : lim.max_grid_yz;
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
    auto run = [&](auto kernel) {
      return launch(lim, "tm_matmul", kernel, grid, dim3(kWarpsPerBlock * 32), 0, s, w, x, bias, y, n_tokens, rows,
                    cols, row_bytes, nblocks, accumulate, scale, y0, xq, x_sums, eps);
    };
    // x's int8 groups where the tiled reader takes them
    constexpr bool kReadsGroups = fmt_tiled(F);
    const bool scaled = scale != nullptr || x_sums != nullptr;
    if (kReadsGroups && xq != nullptr)
      TM_TRY(scaled ? run(matmul_kernel<F, NR, NT, V, true, kReadsGroups>)
                    : run(matmul_kernel<F, NR, NT, V, false, kReadsGroups>));
    else
      TM_TRY(scaled ? run(matmul_kernel<F, NR, NT, V, true, false>) : run(matmul_kernel<F, NR, NT, V, false, false>));
  }
  return TM_OK;
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_matmul(int qtype, const void* w, const float* x, const float* bias, float* y, int64_t n_tokens,
                              int64_t rows, int64_t cols, int accumulate, const float* scale, const uint8_t* x_groups,
                              const float* x_sums, float eps, void* stream) {
  const char* fn = "tm_matmul";
  TM_TRY(check_weight_alignment(fn, "w", qtype, w));
  TM_TRY(check_f32_alignment(fn, "x", x));
  TM_TRY(check_f32_alignment(fn, "bias", bias));
  TM_TRY(check_f32_alignment(fn, "y", y));
  TM_TRY(check_f32_alignment(fn, "scale", scale));
  TM_TRY(check_f32_alignment(fn, "x_sums", x_sums));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const Fmt f = fmt_for(qtype, cols);
  const int64_t nblocks = cols / fmt_vals(f);
  const int64_t row_bytes = tm_qtype_row_bytes(qtype, cols);
  const bool v = fmt_vector_ok(f, w, aligned(x, 16));
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  const cudaStream_t s = as_stream(stream);
  const bool pair_rows = n_tokens == 1 && rows >= kPairRowsPerSm * lim.sm_count;
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    if (n_tokens == 1) {
      if (pair_rows)
        return launch_matmul<F, 2, 1, V>(lim, s, wb, x, bias, y, n_tokens, rows, cols, row_bytes, nblocks, accumulate,
                                         scale, x_groups, x_sums, eps);
      return launch_matmul<F, 1, 1, V>(lim, s, wb, x, bias, y, n_tokens, rows, cols, row_bytes, nblocks, accumulate,
                                       scale, x_groups, x_sums, eps);
    }
    return launch_matmul<F, 1, kTokenTile, V>(lim, s, wb, x, bias, y, n_tokens, rows, cols, row_bytes, nblocks,
                                              accumulate, scale, x_groups, x_sums, eps);
  });
}
