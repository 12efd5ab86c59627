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
 *
 * Folded form (tm_qkv_rope_attention, one token): the kernel above, then each block counts itself done for its kv
 * head (an integer counter in the attention scratch, after a fence), and the last of a kv head's blocks (its q
 * heads' q items, its k and v items) runs the attention of that kv head's q heads with attention.cuh's arithmetic:
 * warps 0-3 and 4-7 are two ranks of tm_attention's schedule at a time, their partials merged in shared memory in
 * rank order, so the result is tm_attention's bits without its launch. It reads what other blocks of the grid
 * wrote through L2 only (attention.cuh's COHERENT form).
 */
#include "attention.cuh"
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
// The folded form's attention, after those at a 16-byte boundary: two rank areas (warps 0-3, 4-7), then the
// kAttBlocks rank partials of head_dim + 2 floats.
constexpr int kFoldRanks = kQkvWarps / kAttWarps;  // ranks run at a time
__host__ __device__ inline int64_t qkv_fold_offset(int64_t hidden, bool computes_xw) {
  return (qkv_smem_floats(hidden, computes_xw) + 3) / 4 * 4;
}
__host__ __device__ inline int64_t qkv_fold_smem_floats(int64_t hidden, bool computes_xw, int64_t head_dim) {
  return qkv_fold_offset(hidden, computes_xw) + kFoldRanks * att_rank_area_floats(head_dim) +
         kAttBlocks * (head_dim + 2);
}
// The folded form's attention instantiation: head_dim 128 in the vector layout (the Qwen and Llama heads), value
// rows 8 positions at a time (the same sum order as tm_attention's 16; under qkv's register cap ptxas spills 268
// bytes with 8, 144 with 4 and 404 with 16).
constexpr int kFoldDpl = 4;
constexpr int kFoldHeadDim = 32 * kFoldDpl;
#ifndef TM_QKV_FOLD_VGROUP
#define TM_QKV_FOLD_VGROUP 8
#endif
constexpr int kFoldVGroup = TM_QKV_FOLD_VGROUP;
#ifndef TM_QKV_FOLD
#define TM_QKV_FOLD 1  // 0: tm_qkv_rope_attention is always the two launches (a measurement build)
#endif
// Blocks per SM the kernel is compiled for: 3 for tiled rows (the tiled reader's whole-batch path takes more
// registers and 2 blocks per SM when left alone; results/NOTES.md); 0, the compiler's own choice, for the others
// (80 registers for Q8_0: the 384 blocks of a Qwen layer in one wave).
#ifndef TM_QKV_MIN_BLOCKS
#define TM_QKV_MIN_BLOCKS 3
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
  // the folded form's attention (tm_attention's arguments)
  float* att_out;
  uint8_t* att_out_q;
  AttScratch att_scratch;
  float att_scale;
};

// Where a work item's rows are: q, k or v (which) and the head and pair index i in it.
struct QkvItem {
  int which;
  int64_t head, i;
  bool active;
};
__device__ __forceinline__ QkvItem qkv_item(const QkvArgs& a, int64_t rest) {
  const int64_t half = a.head_dim / 2;
  QkvItem it{0, 0, 0, rest < (a.n_heads + 2 * a.n_kv) * half};
  if (rest >= a.n_heads * half) {
    rest -= a.n_heads * half;
    it.which = 1;
    if (rest >= a.n_kv * half) {
      rest -= a.n_kv * half;
      it.which = 2;
    }
  }
  it.head = rest / half;
  it.i = rest % half;
  return it;
}

// One block's work items. Q: the products read xw's int8 groups (a.xw_q) instead of rounding xw itself (tiled rows;
// the same bits).
template <Fmt F, bool V, bool Q>
__device__ __forceinline__ void qkv_rope_items(const QkvArgs& a, int64_t block0, float* qkv_smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = block0 + blockIdx.x;
  const int64_t t = b / a.blocks_per_token;
  const int64_t half = a.head_dim / 2;
  const QkvItem it = qkv_item(a, (b % a.blocks_per_token) * kQkvWarps + warp);
  const bool active = it.active;
  const int which = it.which;
  const int64_t head = it.head, i = it.i;
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
  float out[2][1] = {{0.0f}, {0.0f}};
  const uint8_t* rows[2] = {a.w[which] + ra * a.row_bytes, a.w[which] + rb * a.row_bytes};
  if constexpr (Q) {
    const uint8_t* xq[1] = {a.xw_q + t * q8act_bytes(a.hidden)};
    warp_dot_q8act<F, 2, 1, true>(rows, xq, a.nblocks, out);
  } else {
    const float* xs[1] = {act};
    warp_dot<F, 2, 1, true, V>(rows, xs, a.nblocks, out);
  }
  // inv by this warp alone, after its dot products, from the sums in shared memory or through L1 (2 KB for a
  // 2048-value row; written before pdl_wait returned, never during this grid)
  const float inv = a.xw == nullptr ? warp_grouped_inv([&](int64_t g) { return sums[g]; }, a.hidden, a.eps)
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

// The folded form's tail (one token; every block's 8 items in one q, k or v head: (head_dim / 2) % 8 == 0): the
// block counts itself done for its kv head, and the last one runs the attention of that kv head's q heads.
template <int VGROUP>
__device__ __forceinline__ void qkv_fold_attention(const QkvArgs& a, int64_t block0, float* fold) {
  __shared__ bool s_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t group = a.n_heads / a.n_kv;
  const QkvItem it = qkv_item(a, (block0 + blockIdx.x) * kQkvWarps);
  const int64_t kvh = it.which == 0 ? it.head / group : it.head;
  // a kv head's blocks: its q heads' q items, its k items and its v items, 8 a block
  const uint32_t blocks_of_kvh = static_cast<uint32_t>((group + 2) * (a.head_dim / 2) / kQkvWarps);
  __syncthreads();  // every warp's rows stored
  if (threadIdx.x == 0) {
    __threadfence();  // this block's q, k and v before its arrival (cumulative over the block's stores)
    const uint32_t before = atomicAdd(a.att_scratch.fold_arrival(kvh), 1u);
    s_last = before == blocks_of_kvh - 1;
    if (s_last) {
      *a.att_scratch.fold_arrival(kvh) = 0;  // for the next call (every block of the kv head has arrived)
      __threadfence();                        // the other blocks' rows after their arrivals
    }
  }
  __syncthreads();
  if (!s_last) return;
  const int64_t hd = a.head_dim;
  const int64_t n_pos = att_context(static_cast<int64_t>(a.pos[0]), 0, a.max_ctx);
  const int n_part = att_busy_ranks(n_pos) > 0 ? att_busy_ranks(n_pos) : 1;
  const int half_rank = warp / kAttWarps, wr = warp % kAttWarps;  // which of the two ranks, the warp in it
  float* area = fold + half_rank * att_rank_area_floats(hd);
  float* parts = fold + kFoldRanks * att_rank_area_floats(hd);
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    const AttPair ap{a.q + h * hd, a.k_cache + kvh * hd, a.v_cache + kvh * hd, a.n_kv * hd, hd, n_pos, a.att_scale};
    for (int r0 = 0; r0 < n_part; r0 += kFoldRanks) {
      const int rank = r0 + half_rank;
      if (rank < n_part) {
        float acc[kFoldDpl], m, l;
        att_worker<kFoldDpl, true, true, VGROUP>(ap, rank * kAttWarps + wr, lane, m, l, acc);
        att_store_warp<kFoldDpl, true>(area, wr, lane, m, l, acc, hd);
      }
      __syncthreads();
      if (rank < n_part) att_block_merge<kFoldDpl>(area, parts + rank * (hd + 2), threadIdx.x % kAttRankThreads, hd);
      __syncthreads();
    }
    if (warp < kAttWarps) {
      const float* part[kAttBlocks];
#pragma unroll
      for (int c = 0; c < kAttBlocks; ++c) part[c] = parts + c * (hd + 2);
      att_final_merge<kFoldDpl>(part, n_part, [](const float* p) { return *p; }, a.att_out + h * hd, a.att_out_q,
                                h * hd, threadIdx.x, hd);
    }
    __syncthreads();  // the areas free for the next head
  }
}

// A: the folded form (qkv_fold_attention after the items).
template <Fmt F, bool V, bool Q, bool A>
__global__ void __launch_bounds__(kNormThreads, qkv_min_blocks<F>()) qkv_rope_kernel(const QkvArgs a, int64_t block0) {
  extern __shared__ __align__(16) float qkv_smem[];  // qkv_smem_floats' layout (A: then qkv_fold_smem_floats')
  qkv_rope_items<F, V, Q>(a, block0, qkv_smem);
  if constexpr (A) qkv_fold_attention<kFoldVGroup>(a, block0, qkv_smem + qkv_fold_offset(a.hidden, a.xw == nullptr));
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

namespace {

// tm_qkv_rope's launch; with att_out, the folded form (the caller checked qkv_folds_attention).
int launch_qkv_rope(int qtype, const float* x, const float* xw, const float* xss, const float* norm_w, float eps,
                    const void* w_q, const void* w_k, const void* w_v, const float* b_q, const float* b_k,
                    const float* b_v, float* q, float* k_cache, float* v_cache, const int32_t* pos, int64_t n_tokens,
                    int64_t hidden, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx,
                    float freq_base, int neox, const uint8_t* xw_groups, float* att_out, int32_t* att_scratch,
                    uint8_t* att_out_q, void* stream) {
  const char* fn = att_out != nullptr ? "tm_qkv_rope_attention" : "tm_qkv_rope";
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
  const bool fold = att_out != nullptr;
  const int64_t smem = (fold ? qkv_fold_smem_floats(hidden, xw == nullptr, head_dim)
                             : qkv_smem_floats(hidden, xw == nullptr)) * static_cast<int64_t>(sizeof(float));
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
  a.att_out = att_out;
  a.att_out_q = att_out_q;
  a.att_scratch = att_scratch_of(att_scratch, head_dim);
  a.att_scale = att_scale(head_dim);
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
      if (xw_groups != nullptr)
        return fold ? run(qkv_rope_kernel<F, V, true, true>) : run(qkv_rope_kernel<F, V, true, false>);
      if (fold) return run(qkv_rope_kernel<F, V, false, true>);
    }
    return run(qkv_rope_kernel<F, V, false, false>);
  });
}

// Whether tm_qkv_rope_attention is one launch for these shapes: one token in one grid, every block's items in one
// q, k or v head, the attention instantiation's head size, and 32-bit row offsets for its vector loads.
bool qkv_folds_attention(const Limits& lim, int qtype, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,
                         int64_t head_dim) {
  const int64_t blocks = ceil_div((n_heads + 2 * n_kv_heads) * (head_dim / 2), kQkvWarps);
  return TM_QKV_FOLD && TM_ATT_VEC && qtype == TM_Q8_0_TILED && n_tokens == 1 && head_dim == kFoldHeadDim &&
         (head_dim / 2) % kQkvWarps == 0 && n_heads % n_kv_heads == 0 && blocks <= lim.max_grid_x &&
         n_kv_heads * head_dim * kAttTile < (int64_t{1} << 31);
}

}  // namespace

extern "C" int tm_cuda_qkv_rope(int qtype, const float* x, const float* xw, const float* xss, const float* norm_w,
                                float eps, const void* w_q, const void* w_k, const void* w_v, const float* b_q, const float* b_k,
                                const float* b_v, float* q, float* k_cache, float* v_cache, const int32_t* pos,
                                int64_t n_tokens, int64_t hidden, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                int64_t max_ctx, float freq_base, int neox, const uint8_t* xw_groups,
                                void* stream) {
  return launch_qkv_rope(qtype, x, xw, xss, norm_w, eps, w_q, w_k, w_v, b_q, b_k, b_v, q, k_cache, v_cache, pos,
                         n_tokens, hidden, n_heads, n_kv_heads, head_dim, max_ctx, freq_base, neox, xw_groups, nullptr,
                         nullptr, nullptr, stream);
}

extern "C" int tm_cuda_qkv_rope_attention(int qtype, const float* x, const float* xw, const float* xss,
                                          const float* norm_w, float eps, const void* w_q, const void* w_k,
                                          const void* w_v, const float* b_q, const float* b_k, const float* b_v,
                                          float* q, float* k_cache, float* v_cache, const int32_t* pos,
                                          int64_t n_tokens, int64_t hidden, int64_t n_heads, int64_t n_kv_heads,
                                          int64_t head_dim, int64_t max_ctx, float freq_base, int neox,
                                          const uint8_t* xw_groups, float* out, int32_t* scratch,
                                          uint8_t* out_groups, void* stream) {
  Limits lim;
  TM_TRY(get_limits(&lim));
  if (!qkv_folds_attention(lim, qtype, n_tokens, n_heads, n_kv_heads, head_dim) || !aligned(q, 16) ||
      !aligned(k_cache, 16) || !aligned(v_cache, 16))
    return TM_NOT_APPLICABLE;
  return launch_qkv_rope(qtype, x, xw, xss, norm_w, eps, w_q, w_k, w_v, b_q, b_k, b_v, q, k_cache, v_cache, pos,
                         n_tokens, hidden, n_heads, n_kv_heads, head_dim, max_ctx, freq_base, neox, xw_groups, out,
                         scratch, out_groups, stream);
}

extern "C" int tm_cuda_qkv_rope_attention_launches(int qtype, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,
                                                   int64_t head_dim) {
  Limits lim;
  TM_TRY(get_limits(&lim));
  return qkv_folds_attention(lim, qtype, n_tokens, n_heads, n_kv_heads, head_dim) ? 1 : 2;
}
