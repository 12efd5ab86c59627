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

#include "qdot.cuh"
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

constexpr int kAttWarps = 4;
constexpr int kAttBlocks = 8;  // blocks per (token, head)
constexpr int kAttTile = 32;
constexpr int kAttWorkers = kAttWarps * kAttBlocks;
// The value prefetch (below) only for tiles of at least this many positions: at a short context (a partial tile)
// it cost more than it saved on the H200 (attention's chain at 4-12 positions: 115.7 -> 109.8 us a token without
// it; results/NOTES.md lesson 34). 0: every tile.
#ifndef TM_ATT_V_PREFETCH_MIN
#define TM_ATT_V_PREFETCH_MIN kAttTile
#endif
constexpr int kAttVPrefetchMin = TM_ATT_V_PREFETCH_MIN;
// The vector layout (results/NOTES.md lesson 106; 0: the scalar layout everywhere): a head_dim of exactly 32 * DPL
// (DPL a multiple of 4, e.g. 128) gives lane l the dims 128 c + 4 l + i (i < 4) instead of l + 32 i, so that each
// key and value row is read with DPL / 4 float4 loads a lane instead of DPL scalar ones, each with its own address:
// a quarter of a tile's load instructions on the one warp that walks it (H100: 752.4 against 742.4 tok/s for the
// scalar layout in one call, lesson 121). The value sums keep their bits (each dim's sum is the same wherever it
// lives); the scores' lane partials add other dims, so the scores' bits are the layout's own: every route runs
// this one kernel, and other head sizes keep the scalar layout.
#ifndef TM_ATT_VEC
#define TM_ATT_VEC 1
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

// The scratch of tm_attention (tm_attention_scratch_words): a record per pair, at a place that depends on the pair
// alone (a decode step's and a prefill step's calls share one scratch: were the counters' area sized by the call's
// pairs, one call's partials would land on another's counters): an arrival counter (kAttRecordHead words), then
// kAttBlocks block partials of head_dim + 2 floats (m, l, acc). The partials are stored by all of a block's threads
// before a __syncthreads and thread 0's fence and arrival (the fence is cumulative: it orders the block's stores
// before the count the last block reads).
static_assert(kAttBlocks == 8, "tm_attention_scratch_words counts 8 partials a pair");
constexpr int64_t kAttRecordHead = 4;  // the counter's words
struct AttScratch {
  int32_t* base;
  int64_t part;  // floats of a block partial: head_dim + 2
  __device__ int64_t record() const { return kAttRecordHead + kAttBlocks * part; }
  __device__ uint32_t* arrival(int64_t pair) const { return reinterpret_cast<uint32_t*>(base + pair * record()); }
  __device__ float* partial(int64_t pair, int block) const {
    return reinterpret_cast<float*>(base + pair * record() + kAttRecordHead) + block * part;
  }
};
__host__ __device__ inline AttScratch att_scratch(int32_t* scratch, int64_t head_dim) {
  return AttScratch{scratch, head_dim + 2};
}

template <int DPL, bool VEC>
__global__ void __launch_bounds__(kAttWarps * 32)
    attention_kernel(const float* __restrict__ q, const float* __restrict__ k_cache,
                     const float* __restrict__ v_cache, float* __restrict__ out, const int32_t* __restrict__ pos,
                     int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t max_ctx, float scale, int64_t pair0,
                     AttScratch scratch, uint8_t* __restrict__ out_q) {
  static_assert(!VEC || DPL % 4 == 0, "whole float4s a lane");
  extern __shared__ float att_smem[];  // m[kAttWarps], l[kAttWarps], acc[kAttWarps][head_dim]
  __shared__ bool s_last;
  const int rank = static_cast<int>(blockIdx.x % kAttBlocks);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // the head dim of this lane's i-th value (TM_ATT_VEC above)
  auto dim_of = [&](int i) { return VEC ? 128 * (i >> 2) + 4 * lane + (i & 3) : lane + 32 * i; };
  const int64_t pair = pair0 + blockIdx.x / kAttBlocks;  // = t * n_heads + h
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
  // Blocks 0 .. busy - 1 hold tiles (worker g = rank * 4 + warp takes tile g first); the others' partials would be
  // empty, which the merge may skip (see the top of this file). With one busy block it writes out itself.
  const int64_t n_tiles = (n_pos + kAttTile - 1) / kAttTile;
  const int busy = static_cast<int>(n_tiles >= kAttWorkers ? kAttBlocks : (n_tiles + kAttWarps - 1) / kAttWarps);
  if (rank >= (busy > 0 ? busy : 1)) return;

  float qr[DPL], acc[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = dim_of(i);
    qr[i] = d < head_dim ? q[pair * head_dim + d] : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t tile = rank * kAttWarps + warp; tile < n_tiles; tile += kAttWorkers) {
    const int64_t base = tile * kAttTile;
    const int nvalid = static_cast<int>(n_pos - base < kAttTile ? n_pos - base : kAttTile);
    // The tile's values do not depend on its scores: lane j asks for value row j's lines now, so that the loads
    // after the softmax find them in L1 instead of making a second round trip to L2 (the bits are the same).
    if (lane < nvalid && nvalid >= kAttVPrefetchMin) {
      const float* vr = vb + (base + lane) * row_stride;
      for (int64_t c = 0; c < (head_dim * 4 + 127) / 128; ++c) prefetch_l1(vr + 32 * c);
    }
    // (VEC) lane's first float4 of the tile's row j (past the end: row 0, as below), by 32-bit offsets
    const float4* kt = reinterpret_cast<const float4*>(kb + base * row_stride) + lane;
    const float4* vt = reinterpret_cast<const float4*>(vb + base * row_stride) + lane;
    const int32_t rs4 = static_cast<int32_t>(row_stride / 4);
    auto row4 = [&](const float4* t, int j) { return t + (j < nvalid ? j : 0) * rs4; };
    float part[kAttTile];
#pragma unroll
    for (int j = 0; j < kAttTile; ++j) {
      const float* kr = kb + (base + (j < nvalid ? j : 0)) * row_stride;  // past the end: re-read a valid row
      float sacc = 0.0f;
      if constexpr (VEC) {
#pragma unroll
        for (int c = 0; c < DPL / 4; ++c) {
          const float4 kv = row4(kt, j)[32 * c];
          sacc = __fmaf_rn(qr[4 * c], kv.x, sacc);
          sacc = __fmaf_rn(qr[4 * c + 1], kv.y, sacc);
          sacc = __fmaf_rn(qr[4 * c + 2], kv.z, sacc);
          sacc = __fmaf_rn(qr[4 * c + 3], kv.w, sacc);
        }
      } else {
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
          const int d = lane + 32 * i;
          if (d < head_dim) sacc = __fmaf_rn(qr[i], kr[d], sacc);
        }
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
          if constexpr (VEC) {
#pragma unroll
            for (int c = 0; c < DPL / 4; ++c) {
              const float4 v4 = row4(vt, j)[32 * c];
              vv[jj][4 * c] = v4.x;
              vv[jj][4 * c + 1] = v4.y;
              vv[jj][4 * c + 2] = v4.z;
              vv[jj][4 * c + 3] = v4.w;
            }
          } else {
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
              const int d = lane + 32 * i;
              vv[jj][i] = d < head_dim ? vr[d] : 0.0f;
            }
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

  // Worker partials to shared memory; each block combines its 4 warps in warp order into a block partial, then the
  // busy blocks' partials are combined in block order.
  // Layout: warp partials m[4], l[4], acc[4][head_dim]; block partial m, l, acc[head_dim].
  float* blk = att_smem + kAttWarps * (head_dim + 2);
  if (lane == 0) {
    att_smem[warp] = m;
    att_smem[kAttWarps + warp] = l;
  }
  float* my_acc = att_smem + 2 * kAttWarps + warp * head_dim;
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = dim_of(i);
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
  __syncthreads();
  // The busy blocks' partials: block 0's own in shared memory when it is the only one, else every busy block's in
  // the scratch, merged by the last to arrive (the integer counter's order decides who merges, never the sums).
  const float* part[kAttBlocks];
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
  // Block order; a block that is not busy would add +0 terms to sums that are never -0 (each starts at +0), so
  // stopping at `busy` leaves every bit as the merge of all kAttBlocks.
  const int n_part = busy > 0 ? busy : 1;
  // shared memory, or the scratch read around L1 (other blocks wrote it)
  auto ld = [&](const float* p) { return n_part == 1 ? *p : __ldcg(p); };
  float mc[kAttBlocks], lc[kAttBlocks];
#pragma unroll
  for (int c = 0; c < kAttBlocks; ++c) {
    mc[c] = c < n_part ? ld(part[c]) : -INFINITY;
    lc[c] = c < n_part ? ld(part[c] + 1) : 0.0f;
  }
  float big_m = -INFINITY;
#pragma unroll
  for (int c = 0; c < kAttBlocks; ++c) big_m = fmaxf(big_m, mc[c]);
  float wc[kAttBlocks];
  float big_l = 0.0f;
#pragma unroll
  for (int c = 0; c < kAttBlocks; ++c) {
    if (c < n_part) {
      wc[c] = mc[c] == -INFINITY ? 0.0f : expf(__fsub_rn(mc[c], big_m));
      big_l = __fadd_rn(big_l, __fmul_rn(lc[c], wc[c]));
    }
  }
#pragma unroll
  for (int k = 0; k < kDimsPerThread; ++k) {
    const int d = threadIdx.x + kAttWarps * 32 * k;
    float o = 0.0f;
    if (d < head_dim) {
      float v[kAttBlocks];
#pragma unroll
      for (int c = 0; c < kAttBlocks; ++c) v[c] = c < n_part ? ld(part[c] + 2 + d) : 0.0f;  // in flight together
      float a = 0.0f;
#pragma unroll
      for (int c = 0; c < kAttBlocks; ++c)
        if (c < n_part) a = __fadd_rn(a, __fmul_rn(v[c], wc[c]));
      o = __fdiv_rn(a, big_l);
      out[pair * head_dim + d] = o;
    }
    if (out_q != nullptr) {  // every lane of the warp takes part in the shuffles (head_dim % 4 == 0)
      const float o1 = __shfl_down_sync(0xFFFFFFFFu, o, 1), o2 = __shfl_down_sync(0xFFFFFFFFu, o, 2);
      const float o3 = __shfl_down_sync(0xFFFFFFFFu, o, 3);
      if (d < head_dim && (d & 3) == 0) {  // the group of dims d .. d + 3 of row t = pair / n_heads
        const int64_t t = pair / n_heads, cols = n_heads * head_dim;
        store_q8act(out_q + t * q8act_bytes(cols), ((pair - t * n_heads) * head_dim + d) / 4,
                    tm_act::q8_group(o, o1, o2, o3));
      }
    }
  }
}

template <int DPL, bool VEC>
int launch_attention(const Limits& lim, cudaStream_t s, const float* q, const float* k_cache, const float* v_cache,
                     float* out, const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv,
                     int64_t head_dim, int64_t max_ctx, int32_t* scratch, uint8_t* out_q) {
  const int64_t smem = static_cast<int64_t>(sizeof(float)) * (kAttWarps + 1) * (head_dim + 2);
  if (smem > lim.smem_block)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT,
                        "tm_attention: head_dim = %lld needs %lld bytes of shared memory per block, above the limit %lld",
                        static_cast<long long>(head_dim), static_cast<long long>(smem),
                        static_cast<long long>(lim.smem_block));
  TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(&attention_kernel<DPL, VEC>), smem, "tm_attention"));
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));  // as the CPU kernel
  const int64_t n_pairs = n_tokens * n_heads;
  const int64_t max_pairs = lim.max_grid_x / kAttBlocks;
  const AttScratch sc = att_scratch(scratch, head_dim);
  for (int64_t p0 = 0; p0 < n_pairs; p0 += max_pairs) {
    const int64_t np = n_pairs - p0 < max_pairs ? n_pairs - p0 : max_pairs;
    TM_TRY(launch(lim, "tm_attention", attention_kernel<DPL, VEC>, dim3(static_cast<unsigned>(np * kAttBlocks)),
                  dim3(kAttWarps * 32), static_cast<size_t>(smem), s, q, k_cache, v_cache, out, pos, n_heads, n_kv,
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
