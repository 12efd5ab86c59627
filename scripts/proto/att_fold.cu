// Experiment (not part of the product; results/NOTES.md lesson 152 a): what would folding attention into qkv_rope
// save? In the product attention is its own launch between qkv_rope and attn_output (3.5 us a layer in the chain,
// on the H100 and the H200 alike), although at the bench's contexts its work is one block's per head. Folded, the
// last of a head's 24 qkv blocks to finish (q, k and v: 8 blocks each) would run that head's attention: a fence
// and an integer atomic at the end of every qkv block instead of a launch boundary.
// (Never run: the fold was built in the product instead and measured 10-12% slower on an H100, results/NOTES.md
// lesson 154; kept as the pattern for pricing a per-block fence before a fold, lesson 157.)
//
// Each phase here has the product's shape with pure reads (proto.cuh's 16-byte streaming loads and checksum):
//   qkv       : 384 blocks of 256 threads, each reading its own contiguous 34.8 KB (a block's 16 Q8_0 rows of
//               2,048 values), its chunk asked into L2 before pdl_wait (weights never change);
//   attention : per head, 4 warps, warp w reading tile w's 32 key rows (16 KB), then, after a warp reduction, the
//               same tile's 32 value rows; a block merge behind __syncthreads; 128 positions of a 16-head cache;
//   attn_out  : 4.46 MB over one wave of resident blocks, asked into L2 before pdl_wait.
// Variants, 24 layers in a CUDA graph, every layer's regions fresh (no L2 reuse across layers):
//   launches : qkv, attention (8 blocks a head, 128 threads, ranks 1-7 leave after the wait, rank 0 asks its
//              head's rows into L2 before the wait, as the product), attn_out: 3 launches a layer;
//   fold     : qkv whose last block of each head (an arrival counter a head) runs that head's attention with 4 of
//              its warps (its rows asked into L2 by the head's blocks at their start), then attn_out: 2 launches;
//   no-att   : qkv, attn_out: the floor of both (no attention at all).
// The checksums of launches and fold (every byte read once, each head's attention exactly once) must be the host's.
//
// Build and run on the GPU machine, from the repository root (device_run.sh's stage proto does it: PROTO=this file):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -DTM_WITH_CUDA=1 -I scripts/proto -I csrc/include
//        -I csrc/common -I csrc/cuda scripts/proto/att_fold.cu -o /tmp/att_fold && /tmp/att_fold
#include <cstdint>
#include <cstdio>
#include <vector>

#include "proto.cuh"

namespace {

constexpr int kHeads = 16, kQkvThreads = 256, kAttWarps = 4, kTile = 32, kRowBytes = 512;  // head_dim 128, fp32
constexpr int kQkvBlocks = 384, kBlocksPerHead = kQkvBlocks / kHeads;                       // 24: q, k and v
constexpr int64_t kQkvBytes = 13369344, kOutBytes = 4456448;
constexpr int64_t kQkvChunk16 = kQkvBytes / 16 / kQkvBlocks;                                 // 16-byte words a block
constexpr int64_t kHeadKvBytes = 2 * kAttWarps * kTile * kRowBytes;                          // keys, then values
constexpr int64_t kPool = int64_t{1} << 30;
static_assert(kQkvBytes % (16 * kQkvBlocks) == 0, "whole 16-byte words a qkv block");

struct Layer {
  const uint4* qkv;
  const uint4* kv;  // head h's keys at h * kHeadKvBytes, its values kHeadKvBytes / 2 further
  const uint4* out;
};

// This block's contiguous chunk of n16 words at p, 8 loads in flight a thread.
__device__ __forceinline__ uint32_t chunk_sum(const uint4* p, int64_t n16) {
  uint32_t acc = 0;
  int64_t i = threadIdx.x;
  for (; i + 7 * blockDim.x < n16; i += 8 * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = ld_stream(p + i + u * blockDim.x);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc += mix(v[u]);
  }
  for (; i < n16; i += blockDim.x) acc += mix(ld_stream(p + i));
  return acc;
}

__device__ __forceinline__ void prefetch_bytes_l2(const void* p, int64_t bytes, int part, int parts) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (int64_t off = 128 * (static_cast<int64_t>(part) * blockDim.x + threadIdx.x); off < bytes;
       off += 128 * static_cast<int64_t>(parts) * blockDim.x)
    tm_cuda::prefetch_l2(b + off);
}

__device__ __forceinline__ uint32_t warp_add(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// A head's attention as the product's rank 0 runs it at <= 128 positions, as reads: warp w (< kAttWarps) takes
// tile w's key rows (each lane one 16-byte word a row), a warp reduction (the scores' softmax), then the value
// rows, and the block merges the warps' partials behind a barrier. All threads of the block call it.
__device__ __forceinline__ uint32_t attend(const uint4* kv, uint32_t* smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint32_t part = 0;
  if (warp < kAttWarps) {
    const uint4* keys = kv + warp * kTile * (kRowBytes / 16) + lane;
    const uint4* vals = keys + kHeadKvBytes / 2 / 16;
    uint32_t s = 0;
#pragma unroll 8
    for (int j = 0; j < kTile; ++j) s += mix(ld_stream(keys + j * (kRowBytes / 16)));
    s = warp_add(s);  // the scores' reduction: the value loads wait for it, as after the softmax
    uint32_t zero;    // 0 that the compiler cannot see through: the value addresses depend on the reduction
    asm volatile("and.b32 %0, %1, 0;\n" : "=r"(zero) : "r"(s));
    vals += zero;
    uint32_t v = 0;
#pragma unroll 8
    for (int j = 0; j < kTile; ++j) v += mix(ld_stream(vals + j * (kRowBytes / 16)));
    part = warp_add(v) + s;
    if (lane == 0) smem[warp] = part;
  }
  __syncthreads();
  uint32_t total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kAttWarps; ++w) total += smem[w];
  return total;  // thread 0's: the other lanes' keys and values are in it through the warp sums
}

// The qkv phase; FOLD: the head's last block runs its attention. Every block asks its chunk into L2 before the
// wait (weights), FOLD's blocks also their 1/24 of the head's cache rows.
template <bool FOLD>
__global__ void __launch_bounds__(kQkvThreads) qkv_phase(Layer L, uint32_t* arrivals, unsigned long long* sum) {
  __shared__ uint32_t smem[kAttWarps];
  __shared__ bool last;
  // blocks [0, 128) q, [128, 256) k, [256, 384) v, 8 consecutive blocks a head in each; part: the block's index
  // among its head's 24
  const int head = (blockIdx.x / 8) % kHeads, part = blockIdx.x / (8 * kHeads) * 8 + blockIdx.x % 8;
  const uint4* chunk = L.qkv + static_cast<int64_t>(blockIdx.x) * kQkvChunk16;
  const uint4* kv = L.kv + static_cast<int64_t>(head) * (kHeadKvBytes / 16);
  prefetch_bytes_l2(chunk, kQkvChunk16 * 16, 0, 1);
  if constexpr (FOLD) prefetch_bytes_l2(kv, kHeadKvBytes, part, kBlocksPerHead);
  tm_cuda::pdl_begin();
  uint32_t acc = chunk_sum(chunk, kQkvChunk16);
  if constexpr (FOLD) {
    __syncthreads();  // the block's results written (the product: lane 0 of each warp) before the arrival
    if (threadIdx.x == 0) {
      __threadfence();
      const uint32_t before = atomicAdd(arrivals + head, 1u);  // only grows: the last is every 24th
      last = before % kBlocksPerHead == kBlocksPerHead - 1;
      if (last) __threadfence();  // the other blocks' results after their arrivals
    }
    __syncthreads();
    if (last) {
      const uint32_t a = attend(kv, smem);
      if (threadIdx.x == 0) acc += a;
    }
  }
  acc = warp_add(acc);
  if (sum != nullptr && (threadIdx.x & 31) == 0) atomicAdd(sum, static_cast<unsigned long long>(acc));
}

// The product's attention launch: 8 blocks a head of 128 threads, rank 0 alone busy at <= 128 positions.
__global__ void __launch_bounds__(kAttWarps * 32) attention_phase(Layer L, unsigned long long* sum) {
  __shared__ uint32_t smem[kAttWarps];
  const int head = blockIdx.x / 8, rank = blockIdx.x % 8;
  const uint4* kv = L.kv + static_cast<int64_t>(head) * (kHeadKvBytes / 16);
  if (rank == 0) prefetch_bytes_l2(kv, kHeadKvBytes, 0, 1);
  tm_cuda::pdl_begin();
  if (rank != 0) return;
  const uint32_t a = attend(kv, smem);
  if (sum != nullptr && threadIdx.x == 0) atomicAdd(sum, static_cast<unsigned long long>(a));
}

// attn_output: one wave of resident blocks, each its grid-stride share, the whole region asked into L2 first.
__global__ void __launch_bounds__(256) out_phase(Layer L, unsigned long long* sum) {
  prefetch_bytes_l2(L.out, kOutBytes, blockIdx.x, gridDim.x);
  tm_cuda::pdl_begin();
  uint32_t acc = warp_add(stream_share<8>(L.out, kOutBytes / 16));
  if (sum != nullptr && (threadIdx.x & 31) == 0) atomicAdd(sum, static_cast<unsigned long long>(acc));
}

}  // namespace

int main() {
  int sms = 0, fit_out = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit_out, out_phase, 256, 0));
  const int out_grid = sms * (fit_out < 4 ? fit_out : 4);
  uint8_t* pool;
  CHECK(cudaMalloc(&pool, kPool));
  fill<<<sms * 8, 256>>>(reinterpret_cast<uint32_t*>(pool), kPool / 4);
  uint32_t* arrivals;
  CHECK(cudaMalloc(&arrivals, kHeads * sizeof(uint32_t)));
  CHECK(cudaMemset(arrivals, 0, kHeads * sizeof(uint32_t)));
  CHECK(cudaDeviceSynchronize());
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf("%d SMs; qkv %d blocks, attention %d blocks, attn_out %d blocks\n", sms, kQkvBlocks, 8 * kHeads,
              out_grid);

  const int64_t sizes[3] = {kQkvBytes, kHeads * kHeadKvBytes, kOutBytes};
  int64_t layer_bytes = 0;
  for (int64_t b : sizes) layer_bytes += (b + 4095) / 4096 * 4096;
  int64_t cursor = 0;
  auto next_layer = [&]() {  // one layer's regions, walked through the pool so that nothing is read from L2
    if (cursor + layer_bytes > kPool) cursor = 0;
    const uint4* p[3];
    for (int k = 0; k < 3; ++k) {
      p[k] = reinterpret_cast<const uint4*>(pool + cursor);
      cursor += (sizes[k] + 4095) / 4096 * 4096;
    }
    return Layer{p[0], p[1], p[2]};
  };
  enum { kLaunches, kFold, kNoAtt, kVariants };
  const char* names[kVariants] = {"launches", "fold", "no-att"};
  auto run = [&](int v, bool first, unsigned long long* sum, cudaStream_t s) {  // check_then_time's
    if (first) cursor = 0;
    const Layer L = next_layer();
    if (v == kFold) {
      launch_pdl(qkv_phase<true>, kQkvBlocks, kQkvThreads, 0, s, L, arrivals, sum);
    } else {
      launch_pdl(qkv_phase<false>, kQkvBlocks, kQkvThreads, 0, s, L, arrivals, sum);
      if (v == kLaunches) launch_pdl(attention_phase, 8 * kHeads, kAttWarps * 32, 0, s, L, sum);
    }
    launch_pdl(out_phase, out_grid, 256, 0, s, L, sum);
  };

  auto want = [&](int v, const std::vector<uint32_t>& host) {  // no-att reads no cache rows
    cursor = 0;
    const Layer L = next_layer();
    auto at = [&](const uint4* p) { return reinterpret_cast<const uint8_t*>(p) - pool; };
    const uint32_t sum = host_sum(host, at(L.qkv), kQkvBytes) + host_sum(host, at(L.out), kOutBytes);
    return v == kNoAtt ? sum : sum + host_sum(host, at(L.kv), kHeads * kHeadKvBytes);
  };
  return check_then_time(kVariants, names, pool, kPool, layer_bytes / 1e6, run, want, st);
}
