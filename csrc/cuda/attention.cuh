/*
 * attention.cuh - internal to csrc/cuda: THE arithmetic of one (token, head) pair's attention, shared by
 * tm_attention's kernel (attention.cu) and qkv_rope's folded form (qkv_rope.cu: the last block of a head's q, k
 * and v products runs that head's attention), so both write the same bits. The schedule it fixes (attention.cu's
 * header has the whole of it): 32 workers (kAttBlocks ranks of kAttWarps warps), worker g walks tiles g, g + 32,
 * ... of 32 positions with an online softmax; a rank merges its 4 warps in warp order (att_block_merge), and the
 * ranks' partials are merged in rank order (att_final_merge). Who runs a worker (which block, which warp of it)
 * does not enter any sum.
 */
#ifndef TORNADO_MOE_CUDA_ATTENTION_CUH
#define TORNADO_MOE_CUDA_ATTENTION_CUH

#include <cmath>

#include "qdot.cuh"

namespace tm_cuda {

constexpr int kAttWarps = 4;   // warps of a rank
constexpr int kAttBlocks = 8;  // ranks of a pair (tm_attention: one block each)
constexpr int kAttTile = 32;
constexpr int kAttWorkers = kAttWarps * kAttBlocks;
constexpr int kAttRankThreads = kAttWarps * 32;
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

// The head dim of a lane's i-th value (TM_ATT_VEC above).
template <bool VEC>
__device__ __forceinline__ int att_dim(int i, int lane) {
  return VEC ? 128 * (i >> 2) + 4 * lane + (i & 3) : lane + 32 * i;
}

// The context a pair attends to: positions 0 .. p0 + t, clamped to the cache.
__device__ __forceinline__ int64_t att_context(int64_t p0, int64_t t, int64_t max_ctx) {
  const int64_t n = p0 + t + 1;
  return n > max_ctx ? max_ctx : (n < 0 ? 0 : n);
}

// Ranks that hold tiles (worker g = rank * 4 + warp takes tile g first); the others' partials would be empty,
// which the merge may skip (attention.cu's header).
__device__ __forceinline__ int att_busy_ranks(int64_t n_pos) {
  const int64_t n_tiles = (n_pos + kAttTile - 1) / kAttTile;
  return static_cast<int>(n_tiles >= kAttWorkers ? kAttBlocks : (n_tiles + kAttWarps - 1) / kAttWarps);
}

// One pair's inputs: q's head_dim values, key and value row 0 of its kv head, rows row_stride floats apart.
struct AttPair {
  const float* q;
  const float* kb;
  const float* vb;
  int64_t row_stride, head_dim, n_pos;
  float scale;
};

// Worker `worker`'s online-softmax partial (m, l, acc) over its tiles. COHERENT: q and the cache rows were written
// by other blocks of the running grid (the folded form), so they are read through L2 (__ldcg: no line of this
// multiprocessor's L1 can predate them) and not asked into L1 ahead; the arithmetic is the same.
// VGROUP: value rows loaded together (a divisor of kAttTile; the sum order is j = 0, 1, ... whatever it is).
template <int DPL, bool VEC, bool COHERENT, int VGROUP = (DPL <= 4 ? 16 : 64 / DPL)>
__device__ __forceinline__ void att_worker(const AttPair& a, int worker, int lane, float& m, float& l,
                                           float (&acc)[DPL]) {
  static_assert(!VEC || DPL % 4 == 0, "whole float4s a lane");
  auto ld = [](const float* p) { return COHERENT ? __ldcg(p) : *p; };
  auto ld4 = [](const float4* p) { return COHERENT ? __ldcg(p) : *p; };
  const int64_t head_dim = a.head_dim, n_pos = a.n_pos, row_stride = a.row_stride;
  const int64_t n_tiles = (n_pos + kAttTile - 1) / kAttTile;
  float qr[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = att_dim<VEC>(i, lane);
    qr[i] = d < head_dim ? ld(a.q + d) : 0.0f;
    acc[i] = 0.0f;
  }
  m = -INFINITY;
  l = 0.0f;
  for (int64_t tile = worker; tile < n_tiles; tile += kAttWorkers) {
    const int64_t base = tile * kAttTile;
    const int nvalid = static_cast<int>(n_pos - base < kAttTile ? n_pos - base : kAttTile);
    // The tile's values do not depend on its scores: lane j asks for value row j's lines now, so that the loads
    // after the softmax find them in L1 instead of making a second round trip to L2 (the bits are the same).
    if (!COHERENT && lane < nvalid && nvalid >= kAttVPrefetchMin) {
      const float* vr = a.vb + (base + lane) * row_stride;
      for (int64_t c = 0; c < (head_dim * 4 + 127) / 128; ++c) prefetch_l1(vr + 32 * c);
    }
    // (VEC) lane's first float4 of the tile's row j (past the end: row 0, as below), by 32-bit offsets
    const float4* kt = reinterpret_cast<const float4*>(a.kb + base * row_stride) + lane;
    const float4* vt = reinterpret_cast<const float4*>(a.vb + base * row_stride) + lane;
    const int32_t rs4 = static_cast<int32_t>(row_stride / 4);
    auto row4 = [&](const float4* t, int j) { return t + (j < nvalid ? j : 0) * rs4; };
    float part[kAttTile];
#pragma unroll
    for (int j = 0; j < kAttTile; ++j) {
      const float* kr = a.kb + (base + (j < nvalid ? j : 0)) * row_stride;  // past the end: re-read a valid row
      float sacc = 0.0f;
      if constexpr (VEC) {
#pragma unroll
        for (int c = 0; c < DPL / 4; ++c) {
          const float4 kv = ld4(row4(kt, j) + 32 * c);
          sacc = __fmaf_rn(qr[4 * c], kv.x, sacc);
          sacc = __fmaf_rn(qr[4 * c + 1], kv.y, sacc);
          sacc = __fmaf_rn(qr[4 * c + 2], kv.z, sacc);
          sacc = __fmaf_rn(qr[4 * c + 3], kv.w, sacc);
        }
      } else {
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
          const int d = lane + 32 * i;
          if (d < head_dim) sacc = __fmaf_rn(qr[i], ld(kr + d), sacc);
        }
      }
      part[j] = sacc;
    }
    const float dot = transpose_reduce32(part, lane);
    const float sc = lane < nvalid ? __fmul_rn(dot, a.scale) : -INFINITY;
    const float m_new = fmaxf(m, warp_max(sc));
    const float corr = m == -INFINITY ? 0.0f : expf(__fsub_rn(m, m_new));
    const float e = lane < nvalid ? expf(__fsub_rn(sc, m_new)) : 0.0f;
    l = __fadd_rn(__fmul_rn(l, corr), warp_sum(e));
    float tacc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) tacc[i] = 0.0f;
    // Groups of kVGroup positions, unrolled, so that their rows of values are in flight together; rows past the
    // tile end re-read a valid row and are not added (the order stays j = 0, 1, ...).
    constexpr int kVGroup = VGROUP;
    static_assert(kAttTile % kVGroup == 0, "whole value groups a tile");
#pragma unroll
    for (int j0 = 0; j0 < kAttTile; j0 += kVGroup) {
      if (j0 < nvalid) {
        float vv[kVGroup][DPL];
#pragma unroll
        for (int jj = 0; jj < kVGroup; ++jj) {
          const int j = j0 + jj;
          const float* vr = a.vb + (base + (j < nvalid ? j : 0)) * row_stride;
          if constexpr (VEC) {
#pragma unroll
            for (int c = 0; c < DPL / 4; ++c) {
              const float4 v4 = ld4(row4(vt, j) + 32 * c);
              vv[jj][4 * c] = v4.x;
              vv[jj][4 * c + 1] = v4.y;
              vv[jj][4 * c + 2] = v4.z;
              vv[jj][4 * c + 3] = v4.w;
            }
          } else {
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
              const int d = lane + 32 * i;
              vv[jj][i] = d < head_dim ? ld(vr + d) : 0.0f;
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
}

// The scratch of tm_attention (tm_attention_scratch_words): a record per pair, at a place that depends on the pair
// alone (a decode step's and a prefill step's calls share one scratch: were the counters' area sized by the call's
// pairs, one call's partials would land on another's counters): two arrival counters (kAttRecordHead words), then
// kAttBlocks block partials of head_dim + 2 floats (m, l, acc). The partials are stored by all of a block's threads
// before a __syncthreads and thread 0's fence and arrival (the fence is cumulative: it orders the block's stores
// before the count the last block reads).
static_assert(kAttBlocks == 8, "tm_attention_scratch_words counts 8 partials a pair");
constexpr int64_t kAttRecordHead = 4;  // the counters' words: tm_attention's arrival, then qkv_rope's (folded form)
struct AttScratch {
  int32_t* base;
  int64_t part;  // floats of a block partial: head_dim + 2
  __device__ int64_t record() const { return kAttRecordHead + kAttBlocks * part; }
  __device__ uint32_t* arrival(int64_t pair) const { return reinterpret_cast<uint32_t*>(base + pair * record()); }
  // the folded form's count of a head's finished q, k and v blocks (qkv_rope.cu)
  __device__ uint32_t* fold_arrival(int64_t pair) const { return arrival(pair) + 1; }
  __device__ float* partial(int64_t pair, int block) const {
    return reinterpret_cast<float*>(base + pair * record() + kAttRecordHead) + block * part;
  }
};
__host__ __device__ inline AttScratch att_scratch_of(int32_t* scratch, int64_t head_dim) {
  return AttScratch{scratch, head_dim + 2};
}
// The scores' scale, as the CPU kernel computes it.
inline float att_scale(int64_t head_dim) { return 1.0f / sqrtf(static_cast<float>(head_dim)); }

// A rank's shared memory: its warps' partials m[4], l[4], acc[4][head_dim] (att_store_warp), merged in warp order
// into a rank partial m, l, acc[head_dim] (att_block_merge).
__host__ __device__ constexpr int64_t att_rank_area_floats(int64_t head_dim) { return kAttWarps * (head_dim + 2); }

template <int DPL, bool VEC>
__device__ __forceinline__ void att_store_warp(float* area, int warp, int lane, float m, float l,
                                               const float (&acc)[DPL], int64_t head_dim) {
  if (lane == 0) {
    area[warp] = m;
    area[kAttWarps + warp] = l;
  }
  float* my_acc = area + 2 * kAttWarps + warp * head_dim;
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = att_dim<VEC>(i, lane);
    if (d < head_dim) my_acc[d] = acc[i];
  }
}

// The rank's 4 warp partials (area, complete) -> its partial blk (m, l, acc), by the rank's 128 threads (tid).
template <int DPL>
__device__ __forceinline__ void att_block_merge(const float* area, float* blk, int tid, int64_t head_dim) {
  constexpr int kDimsPerThread = (DPL * 32 + kAttRankThreads - 1) / kAttRankThreads;
  float bm = -INFINITY;
#pragma unroll
  for (int w = 0; w < kAttWarps; ++w) bm = fmaxf(bm, area[w]);
  float wg[kAttWarps];
  float bl = 0.0f;
#pragma unroll
  for (int w = 0; w < kAttWarps; ++w) {
    const float mw = area[w];
    wg[w] = mw == -INFINITY ? 0.0f : expf(__fsub_rn(mw, bm));
    bl = __fadd_rn(bl, __fmul_rn(area[kAttWarps + w], wg[w]));
  }
#pragma unroll
  for (int k = 0; k < kDimsPerThread; ++k) {
    const int d = tid + kAttRankThreads * k;
    if (d < head_dim) {
      float a = 0.0f;
#pragma unroll
      for (int w = 0; w < kAttWarps; ++w) a = __fadd_rn(a, __fmul_rn(area[2 * kAttWarps + w * head_dim + d], wg[w]));
      blk[2 + d] = a;
    }
  }
  if (tid == 0) {
    blk[0] = bm;
    blk[1] = bl;
  }
}

// The n_part busy ranks' partials, merged in rank order, -> out (the pair's head_dim values) and, with out_q, their
// int8 groups (act_quant.h) in out_q's row, whose value first_value + d out[d] is: dims d .. d + 3 are 4 lanes of
// one warp, gathered by shuffles. Run by the 128 threads of whole warps (tid), each reading part through ld. A rank
// that is not busy would add +0 terms to sums that are never -0 (each starts at +0), so stopping at n_part leaves
// every bit as the merge of all kAttBlocks.
template <int DPL, class Ld>
__device__ __forceinline__ void att_final_merge(const float* const (&part)[kAttBlocks], int n_part, Ld ld, float* out,
                                                uint8_t* out_q, int64_t first_value, int tid, int64_t head_dim) {
  constexpr int kDimsPerThread = (DPL * 32 + kAttRankThreads - 1) / kAttRankThreads;
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
    const int d = tid + kAttRankThreads * k;
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
      out[d] = o;
    }
    if (out_q != nullptr) {  // every lane of the warp takes part in the shuffles (head_dim % 4 == 0)
      const float o1 = __shfl_down_sync(kFullMask, o, 1), o2 = __shfl_down_sync(kFullMask, o, 2);
      const float o3 = __shfl_down_sync(kFullMask, o, 3);
      if (d < head_dim && (d & 3) == 0) store_q8act(out_q, (first_value + d) / 4, tm_act::q8_group(o, o1, o2, o3));
    }
  }
}

}  // namespace tm_cuda

#endif  // TORNADO_MOE_CUDA_ATTENTION_CUH
