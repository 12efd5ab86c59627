/*
 * attention.cu - tm_rope_kv_append and tm_attention on CUDA.
 *
 * rope_kv_append: a grid-stride loop (256 threads a block) over T * (n_heads + n_kv_heads) * head_dim/2 rotation
 *   items (one thread rotates one pair of one q or k head) followed by T * n_kv_heads * head_dim v copies.
 *   The rotation is rope.cuh's (theta in double, cos/sin rounded to float32, rounded products and adds, as the CPU
 *   kernel). pos is read from device memory; a cache row outside [0, max_ctx) is not written (the device cannot
 *   report it).
 * attention: 8 blocks x 4 warps per (token, head) (grid x = 8 * T * n_heads; pairs beyond max_grid_x / 8 go to
 *   further launches). The context 0 .. pos[0] + t (clamped to max_ctx) is cut into tiles of 32 positions; the 32
 *   warps of a pair's blocks are the workers g = rank * 4 + warp (rank: the block's index among the pair's 8), and
 *   worker g handles tiles g, g + 32, g + 64, ... in increasing order with an online softmax (running max m, sum l
 *   and a float32 accumulator of head_dim values, lane d owning dims d, d + 32, ...). Inside a tile: lane-partial
 *   dot products of q with the 32 keys (fma over the lane's dims in increasing order) are summed by a fixed
 *   transpose-butterfly (lane j ends with position j's score), s_j = dot * (1 / sqrt(head_dim)); e_j =
 *   exp(s_j - m_new); the tile sum of e_j is warp_sum; the tile's value sum is sum_j e_j v_j in increasing j (the
 *   value rows asked for in L1 before the scores); then l = l * c + sum_e and acc = acc * c + tile_acc with
 *   c = exp(m_old - m_new). Partials (m, l, acc) are combined in two fixed levels: each block merges its 4 warps in
 *   warp order (M = max m_w, L = sum_w l_w exp(m_w - M), A = sum_w acc_w exp(m_w - M)), then the 8 block partials
 *   are merged in block order and out = A / L. A block without tiles holds an empty partial (m = -inf, l = 0,
 *   acc = +0), whose terms are +0 added to sums that start at +0: the merge skips those blocks with the same bits.
 *   So a context of at most 4 tiles is all block 0's, which writes out itself (no other block has work); a longer
 *   one has its non-empty blocks store their partials in the scratch, and the last of them to arrive (an integer
 *   counter per pair, reset by that block) merges them. The number of workers and the tile size are constants, so
 *   the result depends only on the inputs, never on the launch, the arrival order or graph capture.
 *   Plain blocks, not thread-block clusters: a cluster launch of 8 blocks cost the H200 decode ~0.6% (it waits
 *   for 8 free slots in one GPC; results/NOTES.md v13), and the cluster's distributed shared memory served only
 *   contexts above 128 positions. Shared memory: 5 x (head_dim + 2) floats per block.
 *   With out_groups the block that writes out also writes its int8 groups (act_quant.h) for the output projection:
 *   dims d .. d + 3 are 4 lanes of one warp, gathered by shuffles.
 */
#include <cmath>
#include <type_traits>

#include "attention.cuh"
#include "rope.cuh"

namespace tm_cuda {
namespace {

// ---- RoPE + KV append -------------------------------------------------------------------------------------

__global__ void __launch_bounds__(256)
    rope_kv_kernel(float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                   float* __restrict__ k_cache, float* __restrict__ v_cache, const int32_t* __restrict__ pos,
                   int64_t n_tokens, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t max_ctx,
                   float freq_base, int neox) {
  const int64_t half = head_dim / 2;
  const int64_t heads = n_heads + n_kv;
  const int64_t n_rot = n_tokens * heads * half;
  const int64_t total = n_rot + n_tokens * n_kv * head_dim;
  pdl_begin();
  const int64_t p0 = pos[0];
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (idx < n_rot) {
      const int64_t i = idx % half;
      const int64_t rest = idx / half;
      const int64_t hh = rest % heads;
      const int64_t t = rest / heads;
      const int64_t p = p0 + t;
      const int64_t ia = neox ? i : 2 * i;
      const int64_t ib = neox ? i + half : 2 * i + 1;
      if (hh < n_heads) {
        float* qh = q + (t * n_heads + hh) * head_dim;
        float a = __ldcg(qh + ia), b = __ldcg(qh + ib);  // in place: read around L1 (see common.cuh)
        rope_rotate(p, i, head_dim, freq_base, a, b);
        qh[ia] = a;
        qh[ib] = b;
      } else if (p >= 0 && p < max_ctx) {
        const int64_t kh = hh - n_heads;
        const float* src = k + (t * n_kv + kh) * head_dim;
        float* dst = k_cache + (p * n_kv + kh) * head_dim;
        float a = src[ia], b = src[ib];
        rope_rotate(p, i, head_dim, freq_base, a, b);
        dst[ia] = a;
        dst[ib] = b;
      }
    } else {
      const int64_t j = idx - n_rot;
      const int64_t rest = j / head_dim;
      const int64_t kh = rest % n_kv;
      const int64_t t = rest / n_kv;
      const int64_t p = p0 + t;
      if (p >= 0 && p < max_ctx) v_cache[(p * n_kv + kh) * head_dim + j % head_dim] = v[j];
    }
  }
}

// ---- attention --------------------------------------------------------------------------------------------
// (the pair's arithmetic: attention.cuh)

template <int DPL, bool VEC>
__global__ void __launch_bounds__(kAttRankThreads)
    attention_kernel(const float* __restrict__ q, const float* __restrict__ k_cache,
                     const float* __restrict__ v_cache, float* __restrict__ out, const int32_t* __restrict__ pos,
                     int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t max_ctx, float scale, int64_t pair0,
                     AttScratch scratch, uint8_t* __restrict__ out_q) {
  extern __shared__ float att_smem[];  // a rank area (att_rank_area_floats), then the block partial m, l, acc
  __shared__ bool s_last;
  const int rank = static_cast<int>(blockIdx.x % kAttBlocks);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t pair = pair0 + blockIdx.x / kAttBlocks;  // = t * n_heads + h
  const int64_t t = pair / n_heads, h = pair % n_heads;
  const int64_t kvh = h / (n_heads / n_kv);
  const int64_t row_stride = n_kv * head_dim;
  const float* kb = k_cache + kvh * head_dim;
  const float* vb = v_cache + kvh * head_dim;
  {
    // Before pdl_wait: pull this worker's cache rows towards L2 (a hint; a stale position only misses).
    const int64_t n_guess = att_context(static_cast<int64_t>(peek_before_wait(pos)), t, max_ctx);
    const int64_t lines = (head_dim * 4 + 127) / 128;
    for (int64_t tile = rank * kAttWarps + warp; tile * kAttTile < n_guess; tile += kAttWorkers) {
      const int64_t j = tile * kAttTile + lane;
      if (j < n_guess) {
        for (int64_t c = 0; c < lines; ++c) {
          prefetch_l2(kb + j * row_stride + 32 * c);
          prefetch_l2(vb + j * row_stride + 32 * c);
        }
      }
    }
  }
  pdl_begin();
  const AttPair ap{q + pair * head_dim, kb, vb, row_stride, head_dim,
                   att_context(static_cast<int64_t>(pos[0]), t, max_ctx), scale};
  // With one busy rank its block writes out itself.
  const int busy = att_busy_ranks(ap.n_pos);
  if (rank >= (busy > 0 ? busy : 1)) return;

  float acc[DPL], m, l;
  att_worker<DPL, VEC, false>(ap, rank * kAttWarps + warp, lane, m, l, acc);
  att_store_warp<DPL, VEC>(att_smem, warp, lane, m, l, acc, head_dim);
  __syncthreads();
  float* blk = att_smem + att_rank_area_floats(head_dim);
  att_block_merge<DPL>(att_smem, blk, threadIdx.x, head_dim);
  __syncthreads();
  // The busy blocks' partials: block 0's own in shared memory when it is the only one, else every busy block's in
  // the scratch, merged by the last to arrive (the integer counter's order decides who merges, never the sums).
  const float* part[kAttBlocks] = {};
  if (busy <= 1) {
    part[0] = blk;
  } else {
    float* mine = scratch.partial(pair, rank);
    for (int64_t i = threadIdx.x; i < head_dim + 2; i += blockDim.x) mine[i] = blk[i];
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();  // this block's partial before its arrival
      const uint32_t before = atomicAdd(scratch.arrival(pair), 1u);
      s_last = before == static_cast<uint32_t>(busy - 1);
      if (s_last) {
        *scratch.arrival(pair) = 0;  // for the next call (every busy block has arrived)
        __threadfence();             // the other partials after their arrivals
      }
    }
    __syncthreads();
    if (!s_last) return;
#pragma unroll
    for (int c = 0; c < kAttBlocks; ++c) part[c] = scratch.partial(pair, c);
  }
  const int n_part = busy > 0 ? busy : 1;
  // shared memory, or the scratch read around L1 (other blocks wrote it)
  auto ld = [&](const float* p) { return n_part == 1 ? *p : __ldcg(p); };
  uint8_t* row_q = out_q == nullptr ? nullptr : out_q + t * q8act_bytes(n_heads * head_dim);
  att_final_merge<DPL>(part, n_part, ld, out + pair * head_dim, row_q, h * head_dim, threadIdx.x, head_dim);
}

template <int DPL, bool VEC>
int launch_attention(const Limits& lim, cudaStream_t s, const float* q, const float* k_cache, const float* v_cache,
                     float* out, const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv,
                     int64_t head_dim, int64_t max_ctx, int32_t* scratch, uint8_t* out_q) {
  const int64_t smem = static_cast<int64_t>(sizeof(float)) * (att_rank_area_floats(head_dim) + head_dim + 2);
  if (smem > lim.smem_block)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT,
                        "tm_attention: head_dim = %lld needs %lld bytes of shared memory per block, above the limit %lld",
                        static_cast<long long>(head_dim), static_cast<long long>(smem),
                        static_cast<long long>(lim.smem_block));
  TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(&attention_kernel<DPL, VEC>), smem, "tm_attention"));
  const float scale = att_scale(head_dim);
  const int64_t n_pairs = n_tokens * n_heads;
  const int64_t max_pairs = lim.max_grid_x / kAttBlocks;
  const AttScratch sc = att_scratch_of(scratch, head_dim);
  for (int64_t p0 = 0; p0 < n_pairs; p0 += max_pairs) {
    const int64_t np = n_pairs - p0 < max_pairs ? n_pairs - p0 : max_pairs;
    TM_TRY(launch(lim, "tm_attention", attention_kernel<DPL, VEC>, dim3(static_cast<unsigned>(np * kAttBlocks)),
                  dim3(kAttRankThreads), static_cast<size_t>(smem), s, q, k_cache, v_cache, out, pos, n_heads, n_kv,
                  head_dim, max_ctx, scale, p0, sc, out_q));
  }
  return TM_OK;
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_rope_kv_append(float* q, const float* k, const float* v, float* k_cache, float* v_cache,
                                      const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,
                                      int64_t head_dim, int64_t max_ctx, float freq_base, int neox, void* stream) {
  const char* fn = "tm_rope_kv_append";
  TM_TRY(check_f32_alignment(fn, "q", q));
  TM_TRY(check_f32_alignment(fn, "k", k));
  TM_TRY(check_f32_alignment(fn, "v", v));
  TM_TRY(check_f32_alignment(fn, "k_cache", k_cache));
  TM_TRY(check_f32_alignment(fn, "v_cache", v_cache));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const int64_t total = n_tokens * (n_heads + n_kv_heads) * (head_dim / 2) + n_tokens * n_kv_heads * head_dim;
  int64_t blocks = ceil_div(total, 256);
  const int64_t max_blocks = static_cast<int64_t>(lim.sm_count) * 8;
  if (blocks > max_blocks) blocks = max_blocks;
  return launch(lim, fn, rope_kv_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, as_stream(stream), q, k, v,
                k_cache, v_cache, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx, freq_base, neox);
}

extern "C" int tm_cuda_attention(const float* q, const float* k_cache, const float* v_cache, float* out,
                                 const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,
                                 int64_t head_dim, int64_t max_ctx, int32_t* scratch, uint8_t* out_groups,
                                 void* stream) {
  const char* fn = "tm_attention";
  TM_TRY(check_f32_alignment(fn, "q", q));
  TM_TRY(check_f32_alignment(fn, "k_cache", k_cache));
  TM_TRY(check_f32_alignment(fn, "v_cache", v_cache));
  TM_TRY(check_f32_alignment(fn, "out", out));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const cudaStream_t s = as_stream(stream);
  // DPL: head dims per lane, the smallest power of two that covers head_dim
  auto go = [&](auto dpl) {
    constexpr int DPL = decltype(dpl)::value;
    if constexpr (TM_ATT_VEC && DPL % 4 == 0) {
      if (head_dim == 32 * DPL && n_kv_heads * head_dim * kAttTile < (int64_t{1} << 31) && aligned(q, 16) &&
          aligned(k_cache, 16) && aligned(v_cache, 16))
        return launch_attention<DPL, true>(lim, s, q, k_cache, v_cache, out, pos, n_tokens, n_heads, n_kv_heads,
                                           head_dim, max_ctx, scratch, out_groups);
    }
    return launch_attention<DPL, false>(lim, s, q, k_cache, v_cache, out, pos, n_tokens, n_heads, n_kv_heads,
                                        head_dim, max_ctx, scratch, out_groups);
  };
  if (head_dim <= 32) return go(std::integral_constant<int, 1>{});
  if (head_dim <= 64) return go(std::integral_constant<int, 2>{});
  if (head_dim <= 128) return go(std::integral_constant<int, 4>{});
  if (head_dim <= 256) return go(std::integral_constant<int, 8>{});
  if (head_dim <= 512) return go(std::integral_constant<int, 16>{});
  return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: head_dim = %lld is above the CUDA kernel's maximum of 512", fn,
                      static_cast<long long>(head_dim));
}
