/*
 * attention.cu - tm_rope_kv_append and tm_attention on CUDA.
 *
 * rope_kv_append: a grid-stride loop (256 threads a block) over T * (n_heads + n_kv_heads) * head_dim/2 rotation
 *   items (one thread rotates one pair of one q or k head) followed by T * n_kv_heads * head_dim v copies.
 *   The rotation is rope.cuh's (theta in double, cos/sin rounded to float32, rounded products and adds, as the CPU
 *   kernel). pos is read from device memory; a cache row outside [0, max_ctx) is not written (the device cannot
 *   report it).
 * attention: one thread-block cluster of 8 blocks x 4 warps per (token, head) (grid x = 8 * T * n_heads; pairs
 *   beyond max_grid_x / 8 go to further launches). The context 0 .. pos[0] + t (clamped to max_ctx) is cut into
 *   tiles of 32 positions; the 32 warps of the cluster are the workers g = rank * 4 + warp, and worker g handles
 *   tiles g, g + 32, g + 64, ... in increasing order with an online softmax (running max m, sum l and a float32
 *   accumulator of head_dim values, lane d owning dims d, d + 32, ...). Inside a tile: lane-partial dot products
 *   of q with the 32 keys (fma over the lane's dims in increasing order) are summed by a fixed transpose-butterfly
 *   (lane j ends with position j's score), s_j = dot * (1 / sqrt(head_dim)); e_j = exp(s_j - m_new); the tile sum
 *   of e_j is warp_sum; the tile's value sum is sum_j e_j v_j in increasing j (the value rows asked for in L1
 *   before the scores); then l = l * c + sum_e and acc = acc * c + tile_acc with c = exp(m_old - m_new).
 *   Partials (m, l, acc) are combined in two fixed levels:
 *   each block merges its 4 warps in warp order (M = max m_w, L = sum_w l_w exp(m_w - M), A = sum_w acc_w
 *   exp(m_w - M)), then block 0 of the cluster merges the 8 block partials in block order, read through
 *   distributed shared memory, and writes out = A / L (a context of at most 4 tiles is all block 0's: it writes out
 *   itself with the same arithmetic and no block waits at a cluster barrier). The number of workers and the tile
 *   size are constants, so the result depends only on the inputs, never on the launch or on graph capture.
 *   Shared memory: 5 x (head_dim + 2) floats per block, independent of the context length.
 */
#include <cooperative_groups.h>

#include <cmath>

#include "rope.cuh"

namespace cg = cooperative_groups;

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

constexpr int kAttWarps = 4;
// A timing probe only: TM_ATT_CLUSTER=1 launches plain blocks (clusters of one) to price the cluster launch; beyond
// kAttWarps tiles its workers then take other tiles, so contexts above 128 positions round differently.
#ifndef TM_ATT_CLUSTER
#define TM_ATT_CLUSTER 8
#endif
constexpr int kAttCluster = TM_ATT_CLUSTER;
constexpr int kAttTile = 32;
constexpr int kAttWorkers = kAttWarps * kAttCluster;
// The value prefetch (below) only for tiles of at least this many positions: at a short context (a partial tile)
// it cost more than it saved on the H200 (attention's chain at 4-12 positions: 115.7 -> 109.8 us a token without
// it; results/NOTES.md lesson 34). 0: every tile.
#ifndef TM_ATT_V_PREFETCH_MIN
#define TM_ATT_V_PREFETCH_MIN kAttTile
#endif
constexpr int kAttVPrefetchMin = TM_ATT_V_PREFETCH_MIN;
// Rank 0 alone writes a context of at most kAttWarps * kAttTile positions (see the kernel). A measurement knob:
// 0 takes the cluster merge at every length (the same bits).
#ifndef TM_ATT_ONE_BLOCK
#define TM_ATT_ONE_BLOCK 1
#endif
// A measurement knob: 1 asks for a whole tile's key rows in L1 (lane j: row j's lines) before its scores, ahead
// of the value rows, so that the score loop's 4 x 32 loads a lane hit L1 instead of queueing as dependent L2 round
// trips (the same bits). 0: the product's loop.
#ifndef TM_ATT_K_L1
#define TM_ATT_K_L1 0
#endif

// One halving exchange of transpose_reduce32: lanes with bit HALF set keep positions [HALF, 2*HALF) of the
// current list, the others [0, HALF); each receives its partner's partial sums of the positions it keeps.
template <int HALF>
__device__ __forceinline__ void transpose_stage(float (&part)[32], int lane) {
  const int upper = (lane & HALF) != 0;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float lo = part[i], hi = part[i + HALF];
    // selp keeps the selection on values (a ?: on the elements could become a run-time array index)
    float send, keep;
    asm("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, %4, 0;\n\tselp.f32 %0, %2, %3, p;\n\tselp.f32 %1, %3, %2, p;\n\t}"
        : "=f"(send), "=f"(keep)
        : "f"(lo), "f"(hi), "r"(upper));
    part[i] = __fadd_rn(keep, __shfl_xor_sync(kFullMask, send, HALF));
  }
}

// part[j] (lane-partial sums for the 32 positions of a tile) -> the full sum of position `lane` (a fixed tree
// per position: 31 shuffles for the whole tile instead of 5 per position).
__device__ __forceinline__ float transpose_reduce32(float (&part)[32], int lane) {
  transpose_stage<16>(part, lane);
  transpose_stage<8>(part, lane);
  transpose_stage<4>(part, lane);
  transpose_stage<2>(part, lane);
  transpose_stage<1>(part, lane);
  return part[0];
}

template <int DPL>
__global__ void __cluster_dims__(kAttCluster, 1, 1) __launch_bounds__(kAttWarps * 32)
    attention_kernel(const float* __restrict__ q, const float* __restrict__ k_cache,
                     const float* __restrict__ v_cache, float* __restrict__ out, const int32_t* __restrict__ pos,
                     int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t max_ctx, float scale, int64_t pair0) {
  extern __shared__ float att_smem[];  // m[kAttWarps], l[kAttWarps], acc[kAttWarps][head_dim]
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t pair = pair0 + blockIdx.x / kAttCluster;  // = t * n_heads + h
  const int64_t t = pair / n_heads, h = pair % n_heads;
  const int64_t kvh = h / (n_heads / n_kv);
  const int64_t row_stride = n_kv * head_dim;
  const float* kb = k_cache + kvh * head_dim;
  const float* vb = v_cache + kvh * head_dim;
  auto context = [&](int64_t p0) {
    int64_t n = p0 + t + 1;
    return n > max_ctx ? max_ctx : (n < 0 ? 0 : n);
  };
  {
    // Before pdl_wait: pull this worker's cache rows towards L2 (a hint; a stale position only misses).
    const int64_t n_guess = context(static_cast<int64_t>(peek_before_wait(pos)));
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
  const int64_t n_pos = context(static_cast<int64_t>(pos[0]));
  // Every tile in rank 0 (worker g = rank * 4 + warp takes tile g first): the other blocks' partials would be
  // empty (m = -inf, l = 0, acc = +0), so no block needs the cluster barriers or the remote reads.
  const bool one_block = TM_ATT_ONE_BLOCK && n_pos <= static_cast<int64_t>(kAttWarps) * kAttTile;
  if (one_block && rank != 0) return;

  float qr[DPL], acc[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = lane + 32 * i;
    qr[i] = d < head_dim ? q[pair * head_dim + d] : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int64_t n_tiles = (n_pos + kAttTile - 1) / kAttTile;
  for (int64_t tile = rank * kAttWarps + warp; tile < n_tiles; tile += kAttWorkers) {
    const int64_t base = tile * kAttTile;
    const int nvalid = static_cast<int>(n_pos - base < kAttTile ? n_pos - base : kAttTile);
    if (TM_ATT_K_L1 && lane < nvalid) {
      const float* kr = kb + (base + lane) * row_stride;
      for (int64_t c = 0; c < (head_dim * 4 + 127) / 128; ++c) prefetch_l1(kr + 32 * c);
    }
    // The tile's values do not depend on its scores: lane j asks for value row j's lines now, so that the loads
    // after the softmax find them in L1 instead of making a second round trip to L2 (the bits are the same).
    if (lane < nvalid && nvalid >= kAttVPrefetchMin) {
      const float* vr = vb + (base + lane) * row_stride;
      for (int64_t c = 0; c < (head_dim * 4 + 127) / 128; ++c) prefetch_l1(vr + 32 * c);
    }
    float part[kAttTile];
#pragma unroll
    for (int j = 0; j < kAttTile; ++j) {
      const float* kr = kb + (base + (j < nvalid ? j : 0)) * row_stride;  // past the end: re-read a valid row
      float sacc = 0.0f;
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) sacc = __fmaf_rn(qr[i], kr[d], sacc);
      }
      part[j] = sacc;
    }
    const float dot = transpose_reduce32(part, lane);
    const float sc = lane < nvalid ? __fmul_rn(dot, scale) : -INFINITY;
    const float m_new = fmaxf(m, warp_max(sc));
    const float corr = m == -INFINITY ? 0.0f : expf(__fsub_rn(m, m_new));
    const float e = lane < nvalid ? expf(__fsub_rn(sc, m_new)) : 0.0f;
    l = __fadd_rn(__fmul_rn(l, corr), warp_sum(e));
    float tacc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) tacc[i] = 0.0f;
    // Groups of kVGroup positions, unrolled, so that their rows of values are in flight together; rows past the
    // tile end re-read a valid row and are not added (the order stays j = 0, 1, ...).
    constexpr int kVGroup = DPL <= 4 ? 16 : 64 / DPL;
#pragma unroll
    for (int j0 = 0; j0 < kAttTile; j0 += kVGroup) {
      if (j0 < nvalid) {
        float vv[kVGroup][DPL];
#pragma unroll
        for (int jj = 0; jj < kVGroup; ++jj) {
          const int j = j0 + jj;
          const float* vr = vb + (base + (j < nvalid ? j : 0)) * row_stride;
#pragma unroll
          for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            vv[jj][i] = d < head_dim ? vr[d] : 0.0f;
          }
        }
#pragma unroll
        for (int jj = 0; jj < kVGroup; ++jj) {
          const int j = j0 + jj;
          const float ej = __shfl_sync(kFullMask, e, j);
#pragma unroll
          for (int i = 0; i < DPL; ++i)
            if (j < nvalid) tacc[i] = __fmaf_rn(ej, vv[jj][i], tacc[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = __fadd_rn(__fmul_rn(acc[i], corr), tacc[i]);
    m = m_new;
  }

  // Worker partials to shared memory; each block combines its 4 warps in warp order into a block partial, then
  // block 0 combines the 8 block partials in block order (reading them through distributed shared memory).
  // Layout: warp partials m[4], l[4], acc[4][head_dim]; block partial m, l, acc[head_dim].
  float* blk = att_smem + kAttWarps * (head_dim + 2);
  if (lane == 0) {
    att_smem[warp] = m;
    att_smem[kAttWarps + warp] = l;
  }
  float* my_acc = att_smem + 2 * kAttWarps + warp * head_dim;
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = lane + 32 * i;
    if (d < head_dim) my_acc[d] = acc[i];
  }
  __syncthreads();
  constexpr int kDimsPerThread = (DPL * 32 + kAttWarps * 32 - 1) / (kAttWarps * 32);
  {
    float bm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttWarps; ++w) bm = fmaxf(bm, att_smem[w]);
    float wg[kAttWarps];
    float bl = 0.0f;
#pragma unroll
    for (int w = 0; w < kAttWarps; ++w) {
      const float mw = att_smem[w];
      wg[w] = mw == -INFINITY ? 0.0f : expf(__fsub_rn(mw, bm));
      bl = __fadd_rn(bl, __fmul_rn(att_smem[kAttWarps + w], wg[w]));
    }
#pragma unroll
    for (int k = 0; k < kDimsPerThread; ++k) {
      const int d = threadIdx.x + kAttWarps * 32 * k;
      if (d < head_dim) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < kAttWarps; ++w) a = __fadd_rn(a, __fmul_rn(att_smem[2 * kAttWarps + w * head_dim + d], wg[w]));
        blk[2 + d] = a;
      }
    }
    if (threadIdx.x == 0) {
      blk[0] = bm;
      blk[1] = bl;
    }
  }
  if (one_block) {
    // The cluster merge below with block 0's term alone: the empty blocks' terms are +0 products added to sums
    // that are never -0 (each starts at +0), which leaves every bit as it is, so this is that merge's result.
    __syncthreads();
    const float m0 = blk[0];
    const float w0 = m0 == -INFINITY ? 0.0f : expf(__fsub_rn(m0, m0));
    const float big_l = __fadd_rn(0.0f, __fmul_rn(blk[1], w0));
#pragma unroll
    for (int k = 0; k < kDimsPerThread; ++k) {
      const int d = threadIdx.x + kAttWarps * 32 * k;
      if (d < head_dim) out[pair * head_dim + d] = __fdiv_rn(__fadd_rn(0.0f, __fmul_rn(blk[2 + d], w0)), big_l);
    }
    return;
  }
  cluster.sync();
  if (rank == 0) {
    const float* rb[kAttCluster];
#pragma unroll
    for (int c = 0; c < kAttCluster; ++c) rb[c] = cluster.map_shared_rank(blk, c);
    float mc[kAttCluster], lc[kAttCluster];
#pragma unroll
    for (int c = 0; c < kAttCluster; ++c) {
      mc[c] = rb[c][0];
      lc[c] = rb[c][1];
    }
    float big_m = -INFINITY;
#pragma unroll
    for (int c = 0; c < kAttCluster; ++c) big_m = fmaxf(big_m, mc[c]);
    float wc[kAttCluster];
    float big_l = 0.0f;
#pragma unroll
    for (int c = 0; c < kAttCluster; ++c) {
      wc[c] = mc[c] == -INFINITY ? 0.0f : expf(__fsub_rn(mc[c], big_m));
      big_l = __fadd_rn(big_l, __fmul_rn(lc[c], wc[c]));
    }
#pragma unroll
    for (int k = 0; k < kDimsPerThread; ++k) {
      const int d = threadIdx.x + kAttWarps * 32 * k;
      if (d < head_dim) {
        float v[kAttCluster];
#pragma unroll
        for (int c = 0; c < kAttCluster; ++c) v[c] = rb[c][2 + d];  // the 8 remote loads in flight together
        float a = 0.0f;
#pragma unroll
        for (int c = 0; c < kAttCluster; ++c) a = __fadd_rn(a, __fmul_rn(v[c], wc[c]));
        out[pair * head_dim + d] = __fdiv_rn(a, big_l);
      }
    }
  }
  cluster.sync();  // the other blocks' shared memory must outlive block 0's reads
}

template <int DPL>
int launch_attention(const Limits& lim, cudaStream_t s, const float* q, const float* k_cache, const float* v_cache,
                     float* out, const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv,
                     int64_t head_dim, int64_t max_ctx) {
  const int64_t smem = static_cast<int64_t>(sizeof(float)) * (kAttWarps + 1) * (head_dim + 2);
  if (smem > lim.smem_block)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT,
                        "tm_attention: head_dim = %lld needs %lld bytes of shared memory per block, above the limit %lld",
                        static_cast<long long>(head_dim), static_cast<long long>(smem),
                        static_cast<long long>(lim.smem_block));
  TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(&attention_kernel<DPL>), smem, "tm_attention"));
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));  // as the CPU kernel
  const int64_t n_pairs = n_tokens * n_heads;
  const int64_t max_pairs = lim.max_grid_x / kAttCluster;
  for (int64_t p0 = 0; p0 < n_pairs; p0 += max_pairs) {
    const int64_t np = n_pairs - p0 < max_pairs ? n_pairs - p0 : max_pairs;
    TM_TRY(launch(lim, "tm_attention", attention_kernel<DPL>, dim3(static_cast<unsigned>(np * kAttCluster)),
                         dim3(kAttWarps * 32), static_cast<size_t>(smem), s, q, k_cache, v_cache, out, pos, n_heads,
                         n_kv, head_dim, max_ctx, scale, p0));
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
                                 int64_t head_dim, int64_t max_ctx, void* stream) {
  const char* fn = "tm_attention";
  TM_TRY(check_f32_alignment(fn, "q", q));
  TM_TRY(check_f32_alignment(fn, "k_cache", k_cache));
  TM_TRY(check_f32_alignment(fn, "v_cache", v_cache));
  TM_TRY(check_f32_alignment(fn, "out", out));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const cudaStream_t s = as_stream(stream);
  if (head_dim <= 32) return launch_attention<1>(lim, s, q, k_cache, v_cache, out, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx);
  if (head_dim <= 64) return launch_attention<2>(lim, s, q, k_cache, v_cache, out, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx);
  if (head_dim <= 128) return launch_attention<4>(lim, s, q, k_cache, v_cache, out, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx);
  if (head_dim <= 256) return launch_attention<8>(lim, s, q, k_cache, v_cache, out, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx);
  if (head_dim <= 512) return launch_attention<16>(lim, s, q, k_cache, v_cache, out, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx);
  return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: head_dim = %lld is above the CUDA kernel's maximum of 512", fn,
                      static_cast<long long>(head_dim));
}
