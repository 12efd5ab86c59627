/*
 * sampling.cu - tm_argmax and tm_sample on CUDA.
 *
 * argmax: one cluster of 8 blocks of 1024 threads per token; block r, thread i scans ids r * 1024 + i, + 8192,
 *   ... (rows of a multiple of 4 ids at a 16-byte boundary: the 4-id quads at those indices, one 16-byte load
 *   each); the block reductions, then block 0's merge of the 8 (distributed shared memory), keep the best
 *   (value, id) under "larger value, then lower id" with NaN never winning (an all-NaN row gives 0, as the CPU
 *   kernel). The order of a maximum does not matter: the result is exact. tm_argmax_advance's launch (one token)
 *   then moves the position on in the same thread that stores the token (common.cuh's advance_position_from), with
 *   pos[0] read at the start, after pdl_wait, so that no load follows the merge.
 * sample: one thread-block cluster of 8 blocks x 512 threads; block b owns the contiguous ids
 *   [b * ceil(V/8), (b+1) * ceil(V/8)), thread i of a block the ids base + i, base + i + 512, ...
 *   It follows the rule written out in csrc/common/sampling_rng.h (same u from tm_sample_uniform(seed, step[0])):
 *   z = logit / T; m = max non-NaN z (none above -inf: out = 0, the device cannot report an error);
 *   e = 0 for NaN, 1 where z == m, else expf(z - m); S = sum e; p = e / S. Sums over the vocabulary use a fixed
 *   tree (per-thread serial in id order, warp_sum, the 16 warp sums by warp_sum, the 8 block sums in block order),
 *   so they are deterministic but not the CPU's serial sum: results agree with the CPU except in near-ties.
 *   The order "p descending, ties to the lower id" is the order of the 64-bit key (bits(p) << 32) | ~id.
 *   The kept set and the draw are found by walking that order: chunks of the order are extracted (radix select of
 *   the chunk's last key, 8 bits per pass over the whole vocabulary with shared-memory count histograms combined
 *   across the cluster, then a gather into block 0 and a bitonic sort there), and thread 0 of block 0 walks each
 *   chunk with a serial running sum, exactly as the CPU kernel walks its sorted array:
 *     kept mass M_k = serial sum of the first top_k (all ids: the tree sum of p);
 *     top_p < 1: n = first count whose running sum reaches top_p * M_k, K = that sum (n = n_k, K = M_k if never);
 *     target = u * K; out = first id whose running sum exceeds target (the n-th id if none does).
 *   Chunk 0 (the top min(512, top_k, cap) ids) stays in block 0's buffer between walks; later chunks grow to the
 *   buffer capacity (a power of two of 8-byte keys within the shared-memory limit and test cap, at most 16384).
 *   Chunk sizes never change a result: the walks add the same p in the same order whatever the chunking.
 */
#include <cooperative_groups.h>

#include <climits>
#include <cmath>

#include "common.cuh"
#include "sampling_rng.h"

namespace cg = cooperative_groups;

namespace tm_cuda {
namespace {

// ---- argmax -----------------------------------------------------------------------------------------------

constexpr int kArgThreads = 1024;
constexpr int kArgBatch = 8;  // 16-byte loads a thread has in flight (rows of a multiple of 4 ids)
constexpr int kArgCluster = 8;

__device__ __forceinline__ bool arg_better(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);  // NaN compares false: never better
}
__device__ __forceinline__ void arg_merge(float v, int i, float& bv, int& bi) {
  if (arg_better(v, i, bv, bi)) {
    bv = v;
    bi = i;
  }
}

// One cluster of kArgCluster blocks per token (grid x = kArgCluster * tokens of this launch): block r scans ids
// r * 1024 + i, + 8192, ...; its best (value, id) goes to its shared memory, and block 0 merges the blocks'
// through distributed shared memory. A maximum under "larger value, then lower id" does not depend on the order
// it is taken in: the result is exact, whatever the split.
// With pos (one token): then tm_advance_position(pos, delta, out, log, log_len).
__global__ void __cluster_dims__(kArgCluster, 1, 1) __launch_bounds__(kArgThreads)
    argmax_kernel(const float* __restrict__ logits, int32_t* __restrict__ out, int64_t vocab, int64_t tok0,
                  int32_t* pos, int32_t delta, int32_t* log, int64_t log_len) {
  __shared__ float s_val[kArgThreads / 32];
  __shared__ int s_id[kArgThreads / 32];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = tok0 + blockIdx.x / kArgCluster;
  pdl_begin();
  const bool advances = pos != nullptr && rank == 0 && threadIdx.x == 0;
  const int32_t pos_old = advances ? pos[0] : 0;  // in flight during the scan
  const float* row = logits + t * vocab;
  float bv = -INFINITY;
  int bi = INT_MAX;
  constexpr int64_t kStride = static_cast<int64_t>(kArgCluster) * kArgThreads;
  const int64_t first = static_cast<int64_t>(rank) * kArgThreads + threadIdx.x;
  if (vocab % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    // 16-byte loads, ids 4 q .. 4 q + 3 a load, kArgBatch loads issued before the first merge: a 152k vocabulary
    // is one L2 round trip a thread (the scalar loop, unrolled by 16, took two).
    const float4* quads = reinterpret_cast<const float4*>(row);
    const int64_t n_quads = vocab / 4;
    for (int64_t q0 = first; q0 < n_quads; q0 += kArgBatch * kStride) {
      float4 v[kArgBatch];
#pragma unroll
      for (int k = 0; k < kArgBatch; ++k)
        if (q0 + k * kStride < n_quads) v[k] = __ldcg(quads + q0 + k * kStride);  // the head's output: around L1
#pragma unroll
      for (int k = 0; k < kArgBatch; ++k) {
        const int64_t q = q0 + k * kStride;
        if (q >= n_quads) break;
        const int i = static_cast<int>(4 * q);
        arg_merge(v[k].x, i, bv, bi);
        arg_merge(v[k].y, i + 1, bv, bi);
        arg_merge(v[k].z, i + 2, bv, bi);
        arg_merge(v[k].w, i + 3, bv, bi);
      }
    }
  } else {
    for (int64_t i = first; i < vocab; i += kStride) arg_merge(row[i], static_cast<int>(i), bv, bi);
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1)
    arg_merge(__shfl_xor_sync(kFullMask, bv, m), __shfl_xor_sync(kFullMask, bi, m), bv, bi);
  if (lane == 0) {
    s_val[warp] = bv;
    s_id[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgThreads / 32; ++w) arg_merge(s_val[w], s_id[w], bv, bi);
    s_val[0] = bv;
    s_id[0] = bi;
  }
  cluster.sync();
  if (rank == 0 && threadIdx.x == 0) {
    for (int c = 1; c < kArgCluster; ++c)
      arg_merge(cluster.map_shared_rank(s_val, c)[0], cluster.map_shared_rank(s_id, c)[0], bv, bi);
    const int32_t token = bi == INT_MAX ? 0 : bi;
    out[t] = token;
    if (advances) advance_position_from(pos, pos_old, delta, token, log, log_len);
  }
  cluster.sync();  // a block's shared memory must outlive block 0's reads of it
}

// ---- sample -----------------------------------------------------------------------------------------------

constexpr int kSmCluster = 8;
constexpr int kSmThreads = 512;  // 128 registers a thread: no spills
constexpr int kSmWarps = kSmThreads / 32;
constexpr int64_t kSmFirstChunk = 512;
constexpr int64_t kSmMaxCap = 16384;

enum WalkMode : int { kWalkMass = 0, kWalkCut = 1, kWalkDraw = 2 };

// What thread 0 of block 0 publishes after walking a chunk.
struct WalkCtrl {
  unsigned long long last_key;  // the chunk's last (smallest) key: the next chunk starts below it
  float c;                      // running sum so far
  float mass;                   // kCut: K
  int count;                    // ids walked so far
  int stop;                     // 1 when the walk has its answer
  int n;                        // kCut: kept count
  int chosen;                   // kDraw: the token
};

struct SampleSmem {
  unsigned long long* buf;  // [cap] chunk keys (block 0)
  int* hist;                // [2][256] this block's digit counts (double-buffered across passes)
  int* tot;                 // [256] cluster totals
  float* red;               // [kSmWarps] block reduction scratch
  float* slots;             // [4] block partials read by the other blocks: 0 max, 1 sum e, 2 sum p
  WalkCtrl* ctrl;           // [2] published walk state (block 0), double-buffered
  int* misc;                // [8] 0 gather counter (block 0), 1 boundary bin, 2 count above it, 3 count in it
};

static_assert(sizeof(WalkCtrl) == 32, "kSmFixedBytes counts two 32-byte WalkCtrl");
constexpr int64_t kSmFixedBytes = 2 * 256 * 4 + 256 * 4 + kSmWarps * 4 + 4 * 4 + 2 * 32 + 8 * 4;

__host__ __device__ inline int64_t sample_smem_bytes(int64_t cap) { return cap * 8 + kSmFixedBytes; }

__device__ __forceinline__ SampleSmem sample_smem(unsigned char* base, int64_t cap) {
  SampleSmem s;
  s.buf = reinterpret_cast<unsigned long long*>(base);
  s.ctrl = reinterpret_cast<WalkCtrl*>(s.buf + cap);
  s.hist = reinterpret_cast<int*>(s.ctrl + 2);
  s.tot = s.hist + 2 * 256;
  s.red = reinterpret_cast<float*>(s.tot + 256);
  s.slots = s.red + kSmWarps;
  s.misc = reinterpret_cast<int*>(s.slots + 4);
  return s;
}

// Block sum in a fixed tree (warp_sum, then warp 0 sums the 32 warp totals); every thread gets it.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = warp_sum((threadIdx.x & 31) < kSmWarps ? red[threadIdx.x & 31] : 0.0f);
  __syncthreads();
  return v;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = warp_max((threadIdx.x & 31) < kSmWarps ? red[threadIdx.x & 31] : -INFINITY);
  __syncthreads();
  return v;
}

__global__ void __cluster_dims__(kSmCluster, 1, 1) __launch_bounds__(kSmThreads)
    sample_kernel(const float* __restrict__ logits, int32_t* __restrict__ out, int64_t vocab, float temperature,
                  float top_p, int64_t top_k, uint64_t seed, const int32_t* __restrict__ step, int64_t cap) {
  extern __shared__ __align__(16) unsigned char sample_raw[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const SampleSmem s = sample_smem(sample_raw, cap);
  pdl_begin();
  const int64_t per = (vocab + kSmCluster - 1) / kSmCluster;
  const int64_t lo = rank * per < vocab ? rank * per : vocab;
  const int64_t hi = lo + per < vocab ? lo + per : vocab;

  // ---- max of z = logit / T ----
  float mx = -INFINITY;
  for (int64_t i = lo + tid; i < hi; i += kSmThreads) {
    const float z = __fdiv_rn(logits[i], temperature);
    if (!isnan(z)) mx = fmaxf(mx, z);
  }
  mx = block_max(mx, s.red);
  if (tid == 0) s.slots[0] = mx;
  cluster.sync();
  float m = -INFINITY;
#pragma unroll
  for (int c = 0; c < kSmCluster; ++c) m = fmaxf(m, cluster.map_shared_rank(s.slots, c)[0]);
  if (m == -INFINITY) {  // no logit above -inf: nothing to sample
    if (rank == 0 && tid == 0) out[0] = 0;
    cluster.sync();
    return;
  }
  auto e_of = [&](int64_t i) {
    const float z = __fdiv_rn(logits[i], temperature);
    return isnan(z) ? 0.0f : (z == m ? 1.0f : expf(__fsub_rn(z, m)));
  };

  // ---- S = sum e ----
  float part = 0.0f;
  for (int64_t i = lo + tid; i < hi; i += kSmThreads) part = __fadd_rn(part, e_of(i));
  part = block_sum(part, s.red);
  if (tid == 0) s.slots[1] = part;
  cluster.sync();
  float total = 0.0f;
#pragma unroll
  for (int c = 0; c < kSmCluster; ++c) total = __fadd_rn(total, cluster.map_shared_rank(s.slots, c)[1]);
  const float sum_e = total;
  auto key_of = [&](int64_t i) {
    const float p = __fdiv_rn(e_of(i), sum_e);
    return (static_cast<unsigned long long>(__float_as_uint(p)) << 32) |
           static_cast<unsigned long long>(0xFFFFFFFFu - static_cast<uint32_t>(i));
  };

  int* const counter0 = cluster.map_shared_rank(s.misc, 0);
  unsigned long long* const buf0 = cluster.map_shared_rank(s.buf, 0);
  int hist_par = 0, ctrl_par = 0;

  // Extracts the `want` largest keys below `kappa` (of the `remaining` there are) into block 0's buffer, sorted
  // descending. Every block calls it (it synchronises the cluster).
  auto extract = [&](unsigned long long kappa, int64_t want, int64_t remaining) {
    unsigned long long theta = 0;
    if (remaining > want) {
      unsigned long long prefix = 0;
      int bits = 0;
      int64_t need = want;
      while (true) {
        int* h = s.hist + 256 * hist_par;
        if (tid < 256) h[tid] = 0;
        __syncthreads();
        const int shift = 56 - bits;
        for (int64_t i0 = lo + warp * 32; i0 < hi; i0 += kSmThreads) {
          const int64_t i = i0 + lane;
          int d = -1;
          if (i < hi) {
            const unsigned long long k = key_of(i);
            if (k < kappa && (bits == 0 || (k >> (64 - bits)) == prefix)) d = static_cast<int>((k >> shift) & 0xFFu);
          }
          const unsigned peers = __match_any_sync(kFullMask, d);
          if (d >= 0 && lane == __ffs(peers) - 1) atomicAdd(h + d, __popc(peers));  // integer counts: exact
        }
        __syncthreads();
        cluster.sync();
        if (tid < 256) {
          int t = 0;
#pragma unroll
          for (int c = 0; c < kSmCluster; ++c) t += cluster.map_shared_rank(h, c)[tid];
          s.tot[tid] = t;
        }
        __syncthreads();
        if (warp == 0) {
          // bins from 255 down: lane l sums bins 255 - 8l .. 248 - 8l, then an inclusive scan over lanes
          int ls = 0;
#pragma unroll
          for (int j = 0; j < 8; ++j) ls += s.tot[255 - 8 * lane - j];
          int incl = ls;
#pragma unroll
          for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(kFullMask, incl, o);
            if (lane >= o) incl += v;
          }
          int cum = incl - ls;
          if (cum < need && need <= incl) {
            for (int j = 0; j < 8; ++j) {
              const int b = 255 - 8 * lane - j;
              if (cum + s.tot[b] >= need) {
                s.misc[1] = b;
                s.misc[2] = cum;
                s.misc[3] = s.tot[b];
                break;
              }
              cum += s.tot[b];
            }
          }
        }
        __syncthreads();
        const int bin = s.misc[1], above = s.misc[2], in_bin = s.misc[3];
        __syncthreads();  // misc is rewritten by the next pass
        hist_par ^= 1;
        need -= above;
        prefix = (prefix << 8) | static_cast<unsigned long long>(bin);
        bits += 8;
        if (in_bin == need || bits == 64) {
          theta = bits == 64 ? prefix : prefix << (64 - bits);
          break;
        }
      }
    }
    // gather every key in [theta, kappa) into block 0's buffer
    if (rank == 0 && tid == 0) s.misc[0] = 0;
    cluster.sync();
    for (int64_t i0 = lo + warp * 32; i0 < hi; i0 += kSmThreads) {
      const int64_t i = i0 + lane;
      unsigned long long k = 0;
      bool take = false;
      if (i < hi) {
        k = key_of(i);
        take = k >= theta && k < kappa;
      }
      const unsigned mask = __ballot_sync(kFullMask, take);
      if (mask != 0) {
        const int leader = __ffs(mask) - 1;
        int base = 0;
        if (lane == leader) base = atomicAdd(counter0, __popc(mask));
        base = __shfl_sync(kFullMask, base, leader);
        if (take) buf0[base + __popc(mask & ((1u << lane) - 1u))] = k;
      }
    }
    cluster.sync();
    if (rank == 0) {
      const int64_t n = want < remaining ? want : remaining;
      int64_t p2 = 1;
      while (p2 < n) p2 <<= 1;
      for (int64_t i = n + tid; i < p2; i += kSmThreads) s.buf[i] = 0;  // below every real key
      __syncthreads();
      for (int64_t k = 2; k <= p2; k <<= 1) {
        for (int64_t j = k >> 1; j > 0; j >>= 1) {
          for (int64_t i = tid; i < p2; i += kSmThreads) {
            const int64_t ixj = i ^ j;
            if (ixj > i) {
              const unsigned long long a = s.buf[i], b = s.buf[ixj];
              const bool descending = (i & k) == 0;
              if (descending ? a < b : a > b) {
                s.buf[i] = b;
                s.buf[ixj] = a;
              }
            }
          }
          __syncthreads();
        }
      }
    }
  };

  const int64_t n_k = (top_k > 0 && top_k < vocab) ? top_k : vocab;
  int64_t first_chunk = cap < kSmFirstChunk ? cap : kSmFirstChunk;
  if (n_k < first_chunk) first_chunk = n_k;
  bool chunk0_cached = false;  // block 0's buffer holds chunk 0 (the same in every walk)

  // Walks the order from the top until the mode's answer; returns block 0's published state (all blocks).
  auto walk = [&](int mode, int64_t limit, float bound, float fallback_mass) {
    unsigned long long kappa = ~0ull;
    int64_t processed = 0;
    float c = 0.0f;  // thread 0 of block 0 only
    int count = 0;
    WalkCtrl result;
    int64_t size = first_chunk;  // chunk sizes double up to the buffer capacity
    for (int64_t j = 0;; ++j) {
      if (j > 0) size = size * 2 < cap ? size * 2 : cap;
      const int64_t want = size < n_k - processed ? size : n_k - processed;
      const int64_t remaining = vocab - processed;
      const int64_t n = want < remaining ? want : remaining;
      if (!(j == 0 && chunk0_cached)) extract(kappa, want, remaining);
      chunk0_cached = j == 0;
      if (rank == 0 && tid == 0) {
        WalkCtrl w;
        w.stop = 0;
        w.n = 0;
        w.mass = 0.0f;
        w.chosen = 0;
        for (int64_t q = 0; q < n; ++q) {
          const unsigned long long key = s.buf[q];
          const float p = __uint_as_float(static_cast<uint32_t>(key >> 32));
          const int id = static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(key));
          c = __fadd_rn(c, p);
          ++count;
          if (mode == kWalkMass) {
            if (count >= limit) w.stop = 1;
          } else if (mode == kWalkCut) {
            if (c >= bound) {
              w.stop = 1;
              w.n = count;
              w.mass = c;
            } else if (count >= limit) {
              w.stop = 1;
              w.n = static_cast<int>(limit);
              w.mass = fallback_mass;
            }
          } else {
            if (c > bound || count >= limit) {
              w.stop = 1;
              w.chosen = id;
            }
          }
          if (w.stop) break;
        }
        w.last_key = s.buf[n - 1];
        w.c = c;
        w.count = count;
        s.ctrl[ctrl_par] = w;
      }
      cluster.sync();
      result = cluster.map_shared_rank(s.ctrl, 0)[ctrl_par];
      ctrl_par ^= 1;
      processed += n;
      kappa = result.last_key;
      if (result.stop || processed >= vocab) break;
    }
    return result;
  };

  // ---- kept mass of the top-k ----
  float kept_mass;
  if (n_k == vocab) {
    float pp = 0.0f;
    for (int64_t i = lo + tid; i < hi; i += kSmThreads) pp = __fadd_rn(pp, __fdiv_rn(e_of(i), sum_e));
    pp = block_sum(pp, s.red);
    if (tid == 0) s.slots[2] = pp;
    cluster.sync();
    kept_mass = 0.0f;
#pragma unroll
    for (int c = 0; c < kSmCluster; ++c) kept_mass = __fadd_rn(kept_mass, cluster.map_shared_rank(s.slots, c)[2]);
  } else {
    kept_mass = walk(kWalkMass, n_k, 0.0f, 0.0f).c;
  }
  // ---- top-p cut ----
  int64_t n_keep = n_k;
  float mass = kept_mass;
  if (top_p < 1.0f) {
    const WalkCtrl cut = walk(kWalkCut, n_k, __fmul_rn(top_p, kept_mass), kept_mass);
    n_keep = cut.n;
    mass = cut.mass;
  }
  // ---- draw ----
  const float u = tm_sample_uniform(seed, step[0]);
  const WalkCtrl draw = walk(kWalkDraw, n_keep, __fmul_rn(u, mass), 0.0f);
  if (rank == 0 && tid == 0) out[0] = draw.chosen;
  cluster.sync();  // block 0's published state and buffers are read remotely until here
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_argmax(const float* logits, int32_t* out, int64_t n_tokens, int64_t vocab, void* stream) {
  const char* fn = "tm_argmax";
  TM_TRY(check_f32_alignment(fn, "logits", logits));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const int64_t per_launch = lim.max_grid_x / kArgCluster;  // tokens (clusters) per launch
  for (int64_t t0 = 0; t0 < n_tokens; t0 += per_launch) {
    const int64_t n = n_tokens - t0 < per_launch ? n_tokens - t0 : per_launch;
    TM_TRY(launch(lim, fn, argmax_kernel, dim3(static_cast<unsigned>(n * kArgCluster)), dim3(kArgThreads), 0,
                  as_stream(stream), logits, out, vocab, t0, nullptr, 0, nullptr, int64_t{0}));
  }
  return TM_OK;
}

extern "C" int tm_cuda_argmax_advance(const float* logits, int32_t* out, int64_t vocab, int32_t* pos, int32_t delta,
                                      int32_t* log, int64_t log_len, void* stream) {
  const char* fn = "tm_argmax_advance";
  TM_TRY(check_f32_alignment(fn, "logits", logits));
  Limits lim;
  TM_TRY(get_limits(&lim));
  return launch(lim, fn, argmax_kernel, dim3(kArgCluster), dim3(kArgThreads), 0, as_stream(stream), logits, out,
                vocab, int64_t{0}, pos, delta, log, log_len);
}

extern "C" int tm_cuda_sample(const float* logits, int32_t* out, int64_t vocab, float temperature, float top_p,
                              int64_t top_k, uint64_t seed, const int32_t* step, void* stream) {
  const char* fn = "tm_sample";
  TM_TRY(check_f32_alignment(fn, "logits", logits));
  Limits lim;
  TM_TRY(get_limits(&lim));
  int64_t cap = kSmMaxCap;
  while (cap > 1 && sample_smem_bytes(cap) > lim.smem_block) cap >>= 1;
  const int64_t smem = sample_smem_bytes(cap);
  if (smem > lim.smem_block)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: needs %lld bytes of shared memory per block, above the limit %lld",
                        fn, static_cast<long long>(smem), static_cast<long long>(lim.smem_block));
  TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(&sample_kernel), smem, fn));
  return launch(lim, fn, sample_kernel, dim3(kSmCluster), dim3(kSmThreads), static_cast<size_t>(smem),
                as_stream(stream), logits, out, vocab, temperature, top_p, top_k, seed, step, cap);
}
