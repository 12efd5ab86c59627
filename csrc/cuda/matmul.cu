/*
 * matmul.cu - tm_matmul on CUDA: y[t, r] = dot(W[r, :], x[t, :]) (* scale[t]) (+ bias[r]) (y[t, r] + that when
 * accumulating).
 *
 * With x_sums instead of scale (x = tm_rmsnorm_factors' xw, x_sums its xss) each warp computes the token's inv
 * from the sums itself after its dot products, as qkv_rope does (norm.cuh's deferred form; the same bits as scale =
 * tm_rmsnorm_factors' inv), so that the output head needs no norm launch before it. With next_norm_w the launch
 * for one token and one row a warp (attn_output in decode) also writes the next norm's factors of the rows it stores
 * (y_w = y * next_norm_w, y's group sums and y_w's int8 groups: the shared expert's deferred FFN norm, NOTES lesson
 * 186): each warp's row goes to shared memory, one barrier, then warp 0 writes the block's two groups, as the down
 * does for qkv; other shapes write them in a second launch (launch_norm_factors, the same bits).
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

static_assert(kWarpsPerBlock == 2 * kNormGroup, "the factors' epilogue: a block's rows are two norm groups");
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
// NF (NR = NT = 1, one token, rows % kWarpsPerBlock == 0): the next norm's factors of y too (the file's comment).
template <Fmt F, int NR, int NT, bool V, bool S, bool Q, bool NF = false>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, matmul_min_blocks<F, NR, NT>())
    matmul_kernel(const uint8_t* __restrict__ w, const float* __restrict__ x, const float* __restrict__ bias, float* y,
                  int64_t n_tokens, int64_t rows, int64_t cols, int64_t row_bytes, int64_t nblocks, int accumulate,
                  const float* __restrict__ scale, int64_t tile0, const uint8_t* __restrict__ xq,
                  const float* __restrict__ x_sums, float eps, const float* __restrict__ next_norm_w, float* y_w,
                  float* y_ss, uint8_t* y_w_q) {
  static_assert(!NF || (NR == 1 && NT == 1 && !S), "the factors' epilogue is the one-row decode shape's");
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
    return warp_grouped_inv_any(x_sums + (t0 + t < n_tokens ? t0 + t : n_tokens - 1) * norm_groups(cols), cols, eps);
  };
  if constexpr (NR == 1 && NT == 1) {
    // One row, one token (attn_output in decode): lane 0's bias and the residual it adds to are loaded before the
    // dot product (ld_ahead), so their round trip is not the kernel's last. Only this instantiation: a change to
    // the two-row matmul's code cost the output head 1.5-6 us on the H200 (results/NOTES.md, lessons 26, 30).
    const bool owner = lane == 0 && t0 < n_tokens;
    float* o = y + t0 * rows + r0;
    const float b = owner && bias != nullptr ? ld_ahead(bias + r0) : 0.0f;
    const float y_in = owner && accumulate ? ld_ahead(o) : 0.0f;  // in place: read around L1 (common.cuh)
    const float nw = NF && owner ? __ldg(next_norm_w + r0) : 0.0f;
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
    if constexpr (NF) {  // every warp of the block has a row (rows % 8 == 0) and reaches the barrier
      __shared__ float s_y[kWarpsPerBlock], s_yw[kWarpsPerBlock];
      if (owner) {
        const float yn = y_new();
        *o = yn;
        s_y[warp] = yn;
        s_yw[warp] = norm_factor_xw(yn, nw);
        y_w[r0] = s_yw[warp];
      }
      __syncthreads();
      if (warp == 0 && lane < 2) {  // lane j: the group of the block's rows 4j .. 4j + 3
        const int64_t g = static_cast<int64_t>(blockIdx.x) * 2 + lane;
        const float* q = s_y + 4 * lane;
        const float* qw = s_yw + 4 * lane;
        y_ss[g] = group_sum_sq([&](int64_t i) { return q[i - 4 * g]; }, g, rows);
        if (y_w_q != nullptr) store_q8act(y_w_q, g, tm_act::q8_group(qw[0], qw[1], qw[2], qw[3]));
      }
      return;
    }
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
                  const float* scale, const uint8_t* xq, const float* x_sums, float eps, const float* next_norm_w,
                  float* y_w, float* y_ss, uint8_t* y_w_q) {
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
                    cols, row_bytes, nblocks, accumulate, scale, y0, xq, x_sums, eps, next_norm_w, y_w, y_ss, y_w_q);
    };
    // x's int8 groups where the tiled reader takes them
    constexpr bool kReadsGroups = fmt_tiled(F);
    const bool scaled = scale != nullptr || x_sums != nullptr;
    if constexpr (NR == 1 && NT == 1) {  // the next norm's factors in this launch's epilogue
      if (y_w != nullptr && !scaled && n_tokens == 1 && rows % kWarpsPerBlock == 0)
        return kReadsGroups && xq != nullptr ? run(matmul_kernel<F, 1, 1, V, false, kReadsGroups, true>)
                                             : run(matmul_kernel<F, 1, 1, V, false, false, true>);
    }
    if (kReadsGroups && xq != nullptr)
      TM_TRY(scaled ? run(matmul_kernel<F, NR, NT, V, true, kReadsGroups>)
                    : run(matmul_kernel<F, NR, NT, V, false, kReadsGroups>));
    else
      TM_TRY(scaled ? run(matmul_kernel<F, NR, NT, V, true, false>) : run(matmul_kernel<F, NR, NT, V, false, false>));
  }
  if (y_w == nullptr) return TM_OK;
  return launch_norm_factors(lim, "tm_matmul", y, next_norm_w, y_w, y_ss, y_w_q, n_tokens, rows, s);
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_matmul(int qtype, const void* w, const float* x, const float* bias, float* y, int64_t n_tokens,
                              int64_t rows, int64_t cols, int accumulate, const float* scale, const uint8_t* x_groups,
                              const float* x_sums, float eps, const float* next_norm_w, float* y_w, float* y_ss,
                              uint8_t* y_w_groups, void* stream) {
  const char* fn = "tm_matmul";
  TM_TRY(check_weight_alignment(fn, "w", qtype, w));
  TM_TRY(check_f32_alignment(fn, "x", x));
  TM_TRY(check_f32_alignment(fn, "bias", bias));
  TM_TRY(check_f32_alignment(fn, "y", y));
  TM_TRY(check_f32_alignment(fn, "scale", scale));
  TM_TRY(check_f32_alignment(fn, "x_sums", x_sums));
  TM_TRY(check_f32_alignment(fn, "next_norm_w", next_norm_w));
  TM_TRY(check_f32_alignment(fn, "y_w", y_w));
  TM_TRY(check_f32_alignment(fn, "y_ss", y_ss));
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
                                         scale, x_groups, x_sums, eps, next_norm_w, y_w, y_ss, y_w_groups);
      return launch_matmul<F, 1, 1, V>(lim, s, wb, x, bias, y, n_tokens, rows, cols, row_bytes, nblocks, accumulate,
                                       scale, x_groups, x_sums, eps, next_norm_w, y_w, y_ss, y_w_groups);
    }
    return launch_matmul<F, 1, kTokenTile, V>(lim, s, wb, x, bias, y, n_tokens, rows, cols, row_bytes, nblocks,
                                              accumulate, scale, x_groups, x_sums, eps, next_norm_w, y_w, y_ss,
                                              y_w_groups);
  });
}
