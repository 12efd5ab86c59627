/*
 * qkv_rope.cu - tm_qkv_rope on CUDA: the attention input of a layer in one launch, bitwise the result of
 * tm_rmsnorm_factors, tm_matmul (q, k, v, scaled by inv, with bias) and tm_rope_kv_append in sequence.
 *
 * Launch shape: blocks of 256 threads (8 warps), each for one token and 8 consecutive work items of it; a work
 * item is one rotation pair i of one q, k or v head: rows a = i, b = i + head_dim/2 (NEOX) or a = 2i, b = 2i + 1.
 * Right after pdl_wait each warp multiplies its item's two rows with xw = x * norm_w (qdot.cuh's warp_dot, the dot
 * product of tm_matmul, which does not depend on how many rows a warp takes or where the activations live), then
 * evaluates inv alone from x's partial sums of squares (norm.cuh's deferred form: no norm before the first weight
 * load, no block barrier after the last). xw and the sums as the previous layer's down wrote them, or computed here
 * into shared memory when none did. Lane 0 scales both values by inv, adds the bias (v = dot * inv + bias, as
 * tm_matmul) and rotates them with rope.cuh's factors, as tm_rope_kv_append does. q goes to `q`, k and v (v
 * unrotated) to the cache rows pos[0] + t; rows outside [0, max_ctx) are not written. Before pdl_wait each warp
 * prefetches its two weight rows into L2, and lane 0 computes its item's rotation factors from the position it
 * finds then (checked against pos[0] after the dot product; see the kernel). With xw's int8 groups (the down
 * stored them beside xw), tiled rows multiply those instead of rounding xw in every warp: the same bits.
 */
#include "norm.cuh"
#include "qdot.cuh"
#include "rope.cuh"

namespace tm_cuda {
namespace {

constexpr int kQkvWarps = kNormThreads / 32;
constexpr int kRopeSlotWords = 3;  // shared memory per warp for lane 0: the rotation's c, s, the position
// Dynamic shared memory, in floats: the warps' rope slots, then (xw not given) xw [hidden] at a 16-byte boundary
// and x's partial sums [norm_groups(hidden)].
constexpr int64_t kQkvXwOffset = (kRopeSlotWords * kQkvWarps + 3) / 4 * 4;
__host__ __device__ inline int64_t qkv_smem_floats(int64_t hidden, bool computes_xw) {
  return computes_xw ? kQkvXwOffset + hidden + norm_groups(hidden) : kRopeSlotWords * kQkvWarps;
}
// Blocks per SM the kernel is compiled for: 3 for tiled rows (the tiled reader's whole-batch path takes more
// registers and 2 blocks per SM when left alone; results/NOTES.md); 0, the compiler's own choice, for the others
// (80 registers for Q8_0: the 384 blocks of a Qwen layer in one wave).
#ifndef TM_QKV_MIN_BLOCKS
#define TM_QKV_MIN_BLOCKS 3
#endif
// TM_QKV_SUMS_AHEAD=0: inv's sums loaded after the dot products (v22 and before). (Each lane's chunk added before
// the dots instead, the shared gate-up's form, measured 0.24% slower here: results/NOTES.md lesson 190.)
#ifndef TM_QKV_SUMS_AHEAD
#define TM_QKV_SUMS_AHEAD 1
#endif
template <Fmt F>
constexpr int qkv_min_blocks() {
  return fmt_tiled(F) ? TM_QKV_MIN_BLOCKS : 0;
}

struct QkvArgs {
  const float* x;
  const float* xw;   // nullable (with xss): x * norm_w computed in the kernel
  const float* xss;  // x's partial sums of squares (norm.cuh's grouped sum)
  const uint8_t* xw_q;  // with xw (Q instantiations): xw's int8 groups as the down stored them (q8act layout)
  const float* norm_w;
  const uint8_t* w[3];  // q, k, v
  const float* bias[3];
  float* q;
  float* k_cache;
  float* v_cache;
  const int32_t* pos;
  int64_t hidden, n_heads, n_kv, head_dim, max_ctx, row_bytes, nblocks, blocks_per_token;
  float eps, freq_base;
  int neox;
};

// Q: the products read xw's int8 groups (a.xw_q) instead of rounding xw itself (tiled rows; the same bits).
template <Fmt F, bool V, bool Q>
__global__ void __launch_bounds__(kNormThreads, qkv_min_blocks<F>()) qkv_rope_kernel(const QkvArgs a, int64_t block0) {
  extern __shared__ __align__(16) float qkv_smem[];  // qkv_smem_floats' layout
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = block0 + blockIdx.x;
  const int64_t t = b / a.blocks_per_token;
  const int64_t half = a.head_dim / 2;
  int64_t rest = (b % a.blocks_per_token) * kQkvWarps + warp;
  const bool active = rest < (a.n_heads + 2 * a.n_kv) * half;
  int which = 0;
  if (rest >= a.n_heads * half) {
    rest -= a.n_heads * half;
    which = 1;
    if (rest >= a.n_kv * half) {
      rest -= a.n_kv * half;
      which = 2;
    }
  }
  const int64_t head = rest / half, i = rest % half;
  const int64_t da = a.neox ? i : 2 * i, db = a.neox ? i + half : 2 * i + 1;
  const int64_t ra = head * a.head_dim + da, rb = head * a.head_dim + db;
  if (active && t == 0) {  // weights only: before pdl_wait
    prefetch_row_l2(a.w[which] + ra * a.row_bytes, a.row_bytes, lane);
    prefetch_row_l2(a.w[which] + rb * a.row_bytes, a.row_bytes, lane);
  }
  // The rotation's factors depend on the position only, and their double-precision evaluation is long: lane 0
  // computes them before pdl_wait from the position the previous step left (peek_before_wait: a guess, checked
  // after the dot product, and computed again if it moved), into shared memory, so that they are off the path
  // that follows the dot product. The factors are the same bits either way.
  float* rope_slot = qkv_smem + kRopeSlotWords * warp;
  if (active && which < 2 && lane == 0) {
    const int32_t guess = peek_before_wait(a.pos);
    const RopeFactors f = rope_factors(static_cast<int64_t>(guess) + t, i, a.head_dim, a.freq_base);
    rope_slot[0] = f.c;
    rope_slot[1] = f.s;
    rope_slot[2] = __int_as_float(guess);
  }
  pdl_begin();
  const float* xt = a.x + t * a.hidden;
  const float* act = a.xw != nullptr ? a.xw + t * a.hidden : nullptr;
  const float* sums = a.xss != nullptr ? a.xss + t * norm_groups(a.hidden) : nullptr;
  if (act == nullptr) {  // no kernel wrote xw and the sums: computed here (the same bits; x's round trip first)
    float* sxw = qkv_smem + kQkvXwOffset;
    float* sss = sxw + a.hidden;
    for (int64_t j = threadIdx.x; j < a.hidden; j += kNormThreads) sxw[j] = norm_factor_xw(xt[j], __ldg(a.norm_w + j));
    for (int64_t g = threadIdx.x; g < norm_groups(a.hidden); g += kNormThreads)
      sss[g] = group_sum_sq([&](int64_t j) { return xt[j]; }, g, a.hidden);
    __syncthreads();
    act = sxw;
    sums = sss;
  }
  if (!active) return;
  // xw's sums ahead of the dot products where they fit in registers (norm.cuh: the same inv, the round trip off
  // the warp's tail; results/NOTES.md lesson 181)
  const bool ahead = TM_QKV_SUMS_AHEAD && a.xw != nullptr && sums_ahead_ok(sums, a.hidden);
  SumsAhead held;
  if (ahead) held = load_sums_ahead(sums, a.hidden);
  float out[2][1] = {{0.0f}, {0.0f}};
  const uint8_t* rows[2] = {a.w[which] + ra * a.row_bytes, a.w[which] + rb * a.row_bytes};
  if constexpr (Q) {
    const uint8_t* xq[1] = {a.xw_q + t * q8act_bytes(a.hidden)};
    warp_dot_q8act<F, 2, 1, true>(rows, xq, a.nblocks, out);
  } else {
    const float* xs[1] = {act};
    warp_dot<F, 2, 1, true, V>(rows, xs, a.nblocks, out);
  }
  // inv by this warp alone, after its dot products: from the sums held since before them, or from the sums in
  // shared memory or through L1 (2 KB for a 2048-value row; written before pdl_wait returned, never during this
  // grid)
  const float inv = ahead ? warp_grouped_inv_ahead(held, a.hidden, a.eps)
                    : a.xw == nullptr ? warp_grouped_inv([&](int64_t g) { return sums[g]; }, a.hidden, a.eps)
                    : grouped_inv_vector_ok(sums, a.hidden)
                        ? warp_grouped_inv_ldg(sums, a.hidden, a.eps)
                        : warp_grouped_inv([&](int64_t g) { return __ldg(sums + g); }, a.hidden, a.eps);
  if (lane != 0) return;
  float va = __fmul_rn(out[0][0], inv), vb = __fmul_rn(out[1][0], inv);
  if (a.bias[which] != nullptr) {
    va = __fadd_rn(va, __ldg(a.bias[which] + ra));
    vb = __fadd_rn(vb, __ldg(a.bias[which] + rb));
  }
  const int32_t p0 = a.pos[0];
  const int64_t p = static_cast<int64_t>(p0) + t;
  if (which < 2) {
    RopeFactors f{rope_slot[0], rope_slot[1]};
    if (__float_as_int(rope_slot[2]) != p0) f = rope_factors(p, i, a.head_dim, a.freq_base);
    rope_apply(f, va, vb);
  }
  float* dst;
  if (which == 0) {
    dst = a.q + (t * a.n_heads + head) * a.head_dim;
  } else {
    if (p < 0 || p >= a.max_ctx) return;
    dst = (which == 1 ? a.k_cache : a.v_cache) + (p * a.n_kv + head) * a.head_dim;
  }
  dst[da] = va;
  dst[db] = vb;
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_qkv_rope(int qtype, const float* x, const float* xw, const float* xss, const float* norm_w,
                                float eps, const void* w_q, const void* w_k, const void* w_v, const float* b_q, const float* b_k,
                                const float* b_v, float* q, float* k_cache, float* v_cache, const int32_t* pos,
                                int64_t n_tokens, int64_t hidden, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                int64_t max_ctx, float freq_base, int neox, const uint8_t* xw_groups,
                                void* stream) {
  const char* fn = "tm_qkv_rope";
  TM_TRY(check_f32_alignment(fn, "x", x));
  TM_TRY(check_f32_alignment(fn, "xw", xw));
  TM_TRY(check_f32_alignment(fn, "xss", xss));
  TM_TRY(check_f32_alignment(fn, "norm_w", norm_w));
  TM_TRY(check_weight_alignment(fn, "w_q", qtype, w_q));
  TM_TRY(check_weight_alignment(fn, "w_k", qtype, w_k));
  TM_TRY(check_weight_alignment(fn, "w_v", qtype, w_v));
  TM_TRY(check_f32_alignment(fn, "b_q", b_q));
  TM_TRY(check_f32_alignment(fn, "b_k", b_k));
  TM_TRY(check_f32_alignment(fn, "b_v", b_v));
  TM_TRY(check_f32_alignment(fn, "q", q));
  TM_TRY(check_f32_alignment(fn, "k_cache", k_cache));
  TM_TRY(check_f32_alignment(fn, "v_cache", v_cache));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const int64_t smem = qkv_smem_floats(hidden, xw == nullptr) * static_cast<int64_t>(sizeof(float));
  if (smem > lim.smem_block)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT,
                        "%s: hidden = %lld needs %lld bytes of shared memory per block, above the limit %lld", fn,
                        static_cast<long long>(hidden), static_cast<long long>(smem),
                        static_cast<long long>(lim.smem_block));
  const Fmt f = fmt_for(qtype, hidden);
  QkvArgs a{};
  a.x = x;
  a.xw = xw;
  a.xss = xss;
  a.xw_q = xw_groups;
  a.norm_w = norm_w;
  a.w[0] = static_cast<const uint8_t*>(w_q);
  a.w[1] = static_cast<const uint8_t*>(w_k);
  a.w[2] = static_cast<const uint8_t*>(w_v);
  a.bias[0] = b_q;
  a.bias[1] = b_k;
  a.bias[2] = b_v;
  a.q = q;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.pos = pos;
  a.hidden = hidden;
  a.n_heads = n_heads;
  a.n_kv = n_kv_heads;
  a.head_dim = head_dim;
  a.max_ctx = max_ctx;
  a.row_bytes = tm_qtype_row_bytes(qtype, hidden);
  a.nblocks = hidden / fmt_vals(f);
  a.blocks_per_token = ceil_div((n_heads + 2 * n_kv_heads) * (head_dim / 2), kQkvWarps);
  a.eps = eps;
  a.freq_base = freq_base;
  a.neox = neox;
  // the activations: xw rows in global memory, or the copy at a 16-byte boundary of shared memory
  const bool x16 = xw == nullptr || (aligned(xw, 16) && hidden % 4 == 0);
  const bool v = fmt_vector_ok(f, w_q, x16) && fmt_vector_ok(f, w_k, x16) && fmt_vector_ok(f, w_v, x16);
  const int64_t total = n_tokens * a.blocks_per_token;
  const cudaStream_t s = as_stream(stream);
  return dispatch_fmt(f, v, [&](auto ftag, auto vtag) -> int {
    constexpr Fmt F = decltype(ftag)::value;
    constexpr bool V = decltype(vtag)::value;
    auto run = [&](auto kernel) -> int {
      TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, fn));
      for (int64_t b0 = 0; b0 < total; b0 += lim.max_grid_x) {
        const int64_t nb = total - b0 < lim.max_grid_x ? total - b0 : lim.max_grid_x;
        TM_TRY(launch(lim, fn, kernel, dim3(static_cast<unsigned>(nb)), dim3(kNormThreads),
                      static_cast<size_t>(smem), s, a, b0));
      }
      return TM_OK;
    };
    if constexpr (fmt_tiled(F)) {
      if (xw_groups != nullptr) return run(qkv_rope_kernel<F, V, true>);
    }
    return run(qkv_rope_kernel<F, V, false>);
  });
}
