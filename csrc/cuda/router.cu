/*
 * router.cu - tm_router_topk and tm_rmsnorm_router_topk on CUDA (one kernel; the fused entry first normalises x).
 *
 * Launch shape: one thread-block cluster of 8 blocks x 8 warps per token (grid x = 8 * tokens; tokens beyond
 * max_grid_x / 8 go to further launches). Every block first puts the token's h into its shared memory: h[t] as
 * given, or rmsnorm(x[t]) computed with norm.cuh's tree (the bits tm_rmsnorm writes; block 0 also stores it to h).
 * The experts are processed in chunks of C experts (C a multiple of 32, as many as block 0's shared memory holds
 * within the opt-in limit and the test cap, at most 16384): the 64 warps of the cluster compute the chunk's logits
 * (warp w of block b takes experts b * 8 + w, + 64, ...; each logit is qdot.cuh's warp_dot of the F32 router row
 * with h, the same bits whichever warp computes it) and write them into block 0's shared memory (distributed shared
 * memory); block 0 then does the rest:
 *   pass 1: M = max logit (exact, order-free);
 *   pass 2: Z = sum of exp(logit - M): 32-expert groups (absolute expert ids 32g .. 32g + 31) summed with
 *           warp_sum, group sums added one after the other in increasing g by one thread;
 *   pass 3: p = exp(logit - M) / Z; the running top-k list is merged with the chunk by top_k rounds of a block
 *           arg-best under the strict total order (p descending, NaN lowest, then expert id ascending), each round
 *           taking the best candidate ranked after the previous pick.
 * One chunk of at most 64 experts takes a shortcut with the same arithmetic: warp 0 of block 0 runs the three
 * passes in registers (see the kernel). With one chunk the logits are computed once; with several (thousands of
 * experts or a small test cap) every pass recomputes them chunk by chunk. Chunks start at multiples of C (itself a multiple of 32), so every
 * reduction has the same order whatever C is: the result does not depend on the limits. Outputs in pick order
 * (descending p): ids[t, i], weights[t, i] = p, or p / S with S the serial sum of the picked p when normalizing.
 * Before pdl_wait each warp prefetches its first router rows into L2.
 */
#include <cooperative_groups.h>

#include "norm.cuh"
#include "router.cuh"

namespace cg = cooperative_groups;

namespace tm_cuda {
namespace {

constexpr int kRtCluster = 8;
constexpr int kRtWarps = 8;
constexpr int kRtThreads = kRtWarps * 32;
constexpr int64_t kRtMaxChunk = 16384;

struct RouterSmem {
  float* hbuf;      // [hidden rounded up to 4] the token's h
  float* norm;      // [kNormWarps + 1] norm scratch
  float* buf;       // [C] logits, then probabilities, of the current chunk
  float* gsum;      // [C / 32] group sums
  Pick* list;       // [top_k] picks so far
  Pick* next;       // [top_k] picks being built
  float* red_key;   // [kRtWarps] block arg-best scratch
  int* red_id;      // [kRtWarps]
  float* scalars;   // [0] M, [1] Z
};

__host__ __device__ inline int64_t router_smem_bytes(int64_t chunk, int64_t top_k, int64_t hidden) {
  return (router_h_floats(hidden) + kNormWarps + 4) * 4 + chunk * 4 + (chunk / 32) * 4 +
         2 * top_k * static_cast<int64_t>(sizeof(Pick)) + kRtWarps * 8 + 16;
}

__device__ __forceinline__ RouterSmem router_smem(unsigned char* base, int64_t chunk, int64_t top_k, int64_t hidden) {
  RouterSmem s;
  s.hbuf = reinterpret_cast<float*>(base);
  s.norm = s.hbuf + router_h_floats(hidden);
  s.buf = s.norm + kNormWarps + 4;
  s.gsum = s.buf + chunk;
  s.list = reinterpret_cast<Pick*>(s.gsum + chunk / 32);
  s.next = s.list + top_k;
  s.red_key = reinterpret_cast<float*>(s.next + top_k);
  s.red_id = reinterpret_cast<int*>(s.red_key + kRtWarps);
  s.scalars = reinterpret_cast<float*>(s.red_id + kRtWarps);
  return s;
}

// Block-wide best (key, id) under ranks_before; every thread returns the winner.
__device__ __forceinline__ void block_best(const RouterSmem& s, float& key, int& id) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_best(key, id);
  if (lane == 0) {
    s.red_key[warp] = key;
    s.red_id[warp] = id;
  }
  __syncthreads();
  key = s.red_key[0];
  id = s.red_id[0];
  for (int w = 1; w < kRtWarps; ++w) {
    if (ranks_before(s.red_key[w], s.red_id[w], key, id)) {
      key = s.red_key[w];
      id = s.red_id[w];
    }
  }
  __syncthreads();  // scratch reused by the next call
}

// x == nullptr: h is the input; otherwise h = rmsnorm(x, norm_w, eps) is computed here and stored to h.
template <bool X4, bool V>
__global__ void __cluster_dims__(kRtCluster, 1, 1) __launch_bounds__(kRtThreads, 1)
    router_kernel(const float* x, const float* __restrict__ norm_w, float eps, float* h,
                  const float* __restrict__ w_router, int32_t* __restrict__ ids, float* __restrict__ weights,
                  int64_t n_experts, int64_t hidden, int64_t top_k, int normalize, int64_t chunk, int64_t tok0) {
  static_assert(kRtThreads == kNormThreads, "the block computes norm.cuh's tree");
  extern __shared__ __align__(16) unsigned char router_raw[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = tok0 + blockIdx.x / kRtCluster;
  const RouterSmem s = router_smem(router_raw, chunk, top_k, hidden);
  float* buf0 = cluster.map_shared_rank(s.buf, 0);
  const int64_t n_chunks = (n_experts + chunk - 1) / chunk;

  for (int64_t e = rank * kRtWarps + warp; e < n_experts && e < chunk; e += kRtCluster * kRtWarps)
    for (int64_t b = 32 * lane; b < hidden; b += 32 * 32) prefetch_l2(w_router + e * hidden + b);
  pdl_begin();

  // The token's h into shared memory.
  float* ht = h + t * hidden;
  if (x != nullptr) {
    block_rmsnorm(x + t * hidden, norm_w, hidden, eps, s.hbuf, rank == 0 ? ht : nullptr, s.norm);
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += kRtThreads) s.hbuf[i] = ht[i];
    __syncthreads();
  }

  // Distributed shared memory may be written only once every block of the cluster has started: each block
  // arrives here and waits (in the first compute_chunk) after its first dot product, before its first remote write.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");

  // Logits of chunk c into block 0's buffer (every block of the cluster takes part).
  auto logit_of = [&](int64_t e) { return warp_dot_f32_row<X4, V>(w_router + e * hidden, s.hbuf, hidden); };
  auto compute_chunk = [&](int64_t c, bool first_call) {
    const int64_t e0 = c * chunk;
    const int64_t n = n_experts - e0 < chunk ? n_experts - e0 : chunk;
    int64_t i = rank * kRtWarps + warp;
    if (first_call) {
      const float v = i < n ? logit_of(e0 + i) : 0.0f;
      asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
      if (i < n && lane == 0) buf0[i] = v;
      i += kRtCluster * kRtWarps;
    }
    for (; i < n; i += kRtCluster * kRtWarps) {
      const float v = logit_of(e0 + i);
      if (lane == 0) buf0[i] = v;
    }
  };
  auto chunk_len = [&](int64_t c) { return n_experts - c * chunk < chunk ? n_experts - c * chunk : chunk; };

  // ---- one chunk of at most 64 experts (qwen2moe's 60): warp 0 of block 0 runs passes 1-3 in registers
  // (router.cuh's router_topk_warp: the same bits, without the block's ~15 barriers).
  if (n_chunks == 1 && n_experts <= 64) {
    compute_chunk(0, true);
    cluster.sync();
    if (rank != 0 || warp != 0) return;  // no remote access to block 0 follows
    router_topk_warp(s.buf[lane], lane + 32 < n_experts ? s.buf[lane + 32] : 0.0f, n_experts, top_k, normalize,
                     s.list, ids + t * top_k, weights + t * top_k);
    return;
  }

  // ---- pass 1: M ----
  if (rank == 0 && threadIdx.x == 0) s.scalars[0] = -INFINITY;
  for (int64_t c = 0; c < n_chunks; ++c) {
    compute_chunk(c, c == 0);
    cluster.sync();
    if (rank == 0) {
      const int64_t n = chunk_len(c);
      float mx = -INFINITY;
      for (int64_t i = threadIdx.x; i < n; i += kRtThreads) mx = fmaxf(mx, s.buf[i]);
      mx = warp_max(mx);
      if (lane == 0) s.red_key[warp] = mx;
      __syncthreads();
      if (threadIdx.x == 0) {
        float m = s.scalars[0];
        for (int w = 0; w < kRtWarps; ++w) m = fmaxf(m, s.red_key[w]);
        s.scalars[0] = m;
      }
      __syncthreads();
    }
    if (n_chunks > 1) cluster.sync();  // block 0 is done with the buffer
  }

  // ---- pass 2: Z ----
  if (rank == 0 && threadIdx.x == 0) s.scalars[1] = 0.0f;
  for (int64_t c = 0; c < n_chunks; ++c) {
    if (n_chunks > 1) {
      compute_chunk(c, false);
      cluster.sync();
    }
    if (rank == 0) {
      const int64_t n = chunk_len(c);
      const float m = s.scalars[0];
      const int64_t n_groups = (n + 31) / 32;
      for (int64_t g = warp; g < n_groups; g += kRtWarps) {
        const int64_t i = g * 32 + lane;
        const float e = i < n ? expf(__fsub_rn(s.buf[i], m)) : 0.0f;
        const float gs = warp_sum(e);
        if (lane == 0) s.gsum[g] = gs;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        float z = s.scalars[1];
        for (int64_t g = 0; g < n_groups; ++g) z = __fadd_rn(z, s.gsum[g]);
        s.scalars[1] = z;
      }
      __syncthreads();
    }
    if (n_chunks > 1) cluster.sync();
  }

  // ---- pass 3: probabilities and the top-k merge ----
  int64_t cnt = 0;  // picks in s.list (block 0)
  for (int64_t c = 0; c < n_chunks; ++c) {
    if (n_chunks > 1) {
      compute_chunk(c, false);
      cluster.sync();
    }
    if (rank == 0) {
      const int64_t e0 = c * chunk;
      const int64_t n = chunk_len(c);
      const float m = s.scalars[0], z = s.scalars[1];
      for (int64_t i = threadIdx.x; i < n; i += kRtThreads) s.buf[i] = __fdiv_rn(expf(__fsub_rn(s.buf[i], m)), z);
      __syncthreads();
      const int64_t new_cnt = cnt + n < top_k ? cnt + n : top_k;
      float last_key = INFINITY;
      int last_id = -1;  // nothing ranks before (+inf, -1)
      for (int64_t r = 0; r < new_cnt; ++r) {
        float bk = -2.0f;  // below every key: any candidate beats it
        int bi = INT_MAX;
        for (int64_t i = threadIdx.x; i < n; i += kRtThreads) {
          const float k = pick_key(s.buf[i]);
          const int id = static_cast<int>(e0 + i);
          if (ranks_before(last_key, last_id, k, id) && ranks_before(k, id, bk, bi)) {
            bk = k;
            bi = id;
          }
        }
        for (int64_t i = threadIdx.x; i < cnt; i += kRtThreads) {
          const float k = pick_key(s.list[i].p);
          const int id = s.list[i].id;
          if (ranks_before(last_key, last_id, k, id) && ranks_before(k, id, bk, bi)) {
            bk = k;
            bi = id;
          }
        }
        block_best(s, bk, bi);
        if (threadIdx.x == 0) {
          // the winner's probability: from the chunk or from the previous list
          float p;
          if (bi >= e0 && bi < e0 + n) {
            p = s.buf[bi - e0];
          } else {
            p = 0.0f;
            for (int64_t i = 0; i < cnt; ++i)
              if (s.list[i].id == bi) p = s.list[i].p;
          }
          s.next[r] = Pick{p, bi};
        }
        last_key = bk;
        last_id = bi;
      }
      __syncthreads();
      for (int64_t i = threadIdx.x; i < new_cnt; i += kRtThreads) s.list[i] = s.next[i];
      __syncthreads();
      cnt = new_cnt;
    }
    if (n_chunks > 1) cluster.sync();
  }

  if (rank == 0 && threadIdx.x == 0) write_picks(s.list, top_k, normalize, ids + t * top_k, weights + t * top_k);
}

template <bool X4, bool V>
int launch_router(const Limits& lim, cudaStream_t st, const char* fn, const float* x, const float* norm_w, float eps,
                  float* h, const float* w_router, int32_t* ids, float* weights, int64_t n_tokens, int64_t n_experts,
                  int64_t hidden, int64_t top_k, int normalize) {
  int64_t chunk = ((n_experts + 31) / 32) * 32;
  if (chunk > kRtMaxChunk) chunk = kRtMaxChunk;
  if (router_smem_bytes(chunk, top_k, hidden) > lim.smem_block) {
    // 32 experts cost 132 bytes (logits and their group sum): the largest multiple of 32 that fits
    const int64_t fit = (lim.smem_block - router_smem_bytes(0, top_k, hidden)) / 132 * 32;
    chunk = fit < 32 ? 32 : fit;
  }
  const int64_t smem = router_smem_bytes(chunk, top_k, hidden);
  if (smem > lim.smem_block)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT,
                        "%s: top_k = %lld and hidden = %lld need %lld bytes of shared memory per block, above the "
                        "limit %lld",
                        fn, static_cast<long long>(top_k), static_cast<long long>(hidden),
                        static_cast<long long>(smem), static_cast<long long>(lim.smem_block));
  TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(&router_kernel<X4, V>), smem, fn));
  const int64_t max_tokens = lim.max_grid_x / kRtCluster;
  for (int64_t t0 = 0; t0 < n_tokens; t0 += max_tokens) {
    const int64_t nt = n_tokens - t0 < max_tokens ? n_tokens - t0 : max_tokens;
    TM_TRY(launch(lim, fn, router_kernel<X4, V>, dim3(static_cast<unsigned>(nt * kRtCluster)),
                         dim3(kRtThreads), static_cast<size_t>(smem), st, x, norm_w, eps, h, w_router, ids, weights,
                         n_experts, hidden, top_k, normalize, chunk, t0));
  }
  return TM_OK;
}

int router_entry(const char* fn, const float* x, const float* norm_w, float eps, float* h, const float* w_router,
                 int32_t* ids, float* weights, int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k,
                 int normalize, void* stream) {
  TM_TRY(check_f32_alignment(fn, "x", x));
  TM_TRY(check_f32_alignment(fn, "norm_w", norm_w));
  TM_TRY(check_f32_alignment(fn, "w_router", w_router));
  TM_TRY(check_f32_alignment(fn, "h", h));
  TM_TRY(check_f32_alignment(fn, "weights", weights));
  Limits lim;
  TM_TRY(get_limits(&lim));
  const cudaStream_t st = as_stream(stream);
  switch (f32_row_mode(hidden, aligned(w_router, 16))) {  // h sits in shared memory, 16-byte aligned
    case kF32Row:
      return launch_router<false, false>(lim, st, fn, x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts,
                                         hidden, top_k, normalize);
    case kF32RowX4Vec:
      return launch_router<true, true>(lim, st, fn, x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts,
                                       hidden, top_k, normalize);
    default:
      return launch_router<true, false>(lim, st, fn, x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts,
                                        hidden, top_k, normalize);
  }
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_router_topk(const float* w_router, const float* h, int32_t* ids, float* weights,
                                   int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                                   void* stream) {
  // h is only read when x is null.
  return router_entry("tm_router_topk", nullptr, nullptr, 0.0f, const_cast<float*>(h), w_router, ids, weights,
                      n_tokens, n_experts, hidden, top_k, normalize, stream);
}

extern "C" int tm_cuda_rmsnorm_router_topk(const float* x, const float* norm_w, float eps, float* h,
                                           const float* w_router, int32_t* ids, float* weights, int64_t n_tokens,
                                           int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                                           void* stream) {
  return router_entry("tm_rmsnorm_router_topk", x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts,
                      hidden, top_k, normalize, stream);
}
