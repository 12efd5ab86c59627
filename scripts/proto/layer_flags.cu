// Experiment (not part of the product; results/NOTES.md lesson 62 a): what would a layer in ONE launch keep of the
// 5.25 us that read_floor.cu measured between a layer of pure reads in the product's five launches (27.05 us) and
// the same bytes in one launch (21.80), once the launch boundaries it drops become grid-wide barriers?
//
// A layer's dependencies are grid-wide: q, k, v -> attention -> attn_output -> the FFN norm's x -> the gate-up's
// act -> the down. Here every phase is a pure read of that kernel's bytes (read_floor.cu's 16-byte streaming loads
// and checksum), and a phase may start only once every block of the grid has finished the previous one: a grid
// barrier (each block's thread 0 arrives with a fence and an integer atomic on a 64-bit counter, then polls it with
// acquire loads; the counter only grows, so a barrier's target is the next multiple of the grid size). The grid is
// made of resident blocks only (as many as the occupancy calculator allows, at most 4 a SM), each reading its
// grid-stride share of every phase. Variants, 24 layers in a CUDA graph, each layer's regions fresh:
//   launches    : 5 launches a layer (the product's structure), each the same reader;
//   one         : one launch a layer, no barriers (the floor of read_floor.cu's last line);
//   barriers    : one launch a layer, 4 grid barriers;
//   barriers+pf : the same, each block asking for its first 16 KB of the next phase in L2 before it waits.
// Every variant's checksum of all the bytes it read must be the host's.
//
// Build and run on the GPU machine (from the repository root; device_run.sh's stage proto does it):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -DTM_WITH_CUDA=1 -I scripts/proto -I csrc/include
//        -I csrc/common -I csrc/cuda scripts/proto/layer_flags.cu -o /tmp/layer_flags && /tmp/layer_flags
#include <cstdint>
#include <cstdio>
#include <vector>

#include "proto.cuh"

namespace {

constexpr int kPhases = 5, kU = 8, kThreads = 256;
// Bytes of each decode kernel of a Qwen1.5-MoE-A2.7B layer in Q8_0 (results/NOTES.md), attention a 64 KB read.
constexpr int64_t kPhaseBytes[kPhases] = {13369344, 65536, 4456448, 49020928, 24510464};
constexpr int64_t kPool = int64_t{1} << 30;

struct Phases {
  const uint4* p[kPhases];
  int64_t n16[kPhases];  // 16-byte words of each phase
};

// Every block of the grid has arrived: thread 0 arrives (fence, atomic) and polls; the block waits behind it.
__device__ __forceinline__ void grid_barrier(unsigned long long* count) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long g = gridDim.x, old = atomicAdd(count, 1ull);
    const unsigned long long target = (old / g + 1) * g;
    for (;;) {
      unsigned long long v;
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(count) : "memory");
      if (v >= target) break;
      __nanosleep(32);
    }
  }
  __syncthreads();
}

// One phase per launch (the product's structure).
__global__ void __launch_bounds__(kThreads) read_phase(const uint4* p, int64_t n16, unsigned long long* sum) {
  tm_cuda::pdl_begin();
  const uint32_t acc = stream_share<kU>(p, n16);
  if (sum != nullptr) atomicAdd(sum, static_cast<unsigned long long>(acc));
}

// A whole layer in one launch; kBarriers: a grid barrier between phases; kPrefetch: the next phase's first 16 KB
// of this block asked into L2 before the barrier.
template <bool kBarriers, bool kPrefetch>
__global__ void __launch_bounds__(kThreads) read_layer(Phases ph, unsigned long long* count,
                                                       unsigned long long* sum) {
  tm_cuda::pdl_begin();
  uint32_t acc = 0;
#pragma unroll 1
  for (int k = 0; k < kPhases; ++k) {
    acc += stream_share<kU>(ph.p[k], ph.n16[k]);
    if (k + 1 < kPhases) {
      if constexpr (kPrefetch) {
        const uint8_t* next = reinterpret_cast<const uint8_t*>(ph.p[k + 1]) + int64_t(blockIdx.x) * 16384;
        if (threadIdx.x < 128 && int64_t(blockIdx.x) * 1024 + threadIdx.x * 8 < ph.n16[k + 1])
          tm_cuda::prefetch_l2(next + threadIdx.x * 128);
      }
      if constexpr (kBarriers) grid_barrier(count);
    }
  }
  if (sum != nullptr) atomicAdd(sum, static_cast<unsigned long long>(acc));
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int fit_phase = 0, fit_layer = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit_phase, read_phase, kThreads, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit_layer, read_layer<true, true>, kThreads, 0));
  const int per_sm = fit_layer < 4 ? fit_layer : 4, grid = sms * per_sm;  // resident blocks only (barriers)
  uint8_t* pool;
  CHECK(cudaMalloc(&pool, kPool));
  fill<<<sms * 8, 256>>>(reinterpret_cast<uint32_t*>(pool), kPool / 4);
  unsigned long long* dcount;
  CHECK(cudaMalloc(&dcount, 8));
  CHECK(cudaMemset(dcount, 0, 8));
  CHECK(cudaDeviceSynchronize());
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::printf("%d SMs, %d blocks of %d threads (%d a SM; the phase kernel fits %d, the layer kernel %d)\n", sms,
              grid, kThreads, per_sm, fit_phase, fit_layer);

  int64_t layer_bytes = 0;
  for (int64_t b : kPhaseBytes) layer_bytes += (b + 4095) / 4096 * 4096;
  int64_t cursor = 0;
  auto next_layer = [&]() {  // regions of one layer, walked through the pool so that nothing is read from L2
    if (cursor + layer_bytes > kPool) cursor = 0;
    Phases ph;
    for (int k = 0; k < kPhases; ++k) {
      ph.p[k] = reinterpret_cast<const uint4*>(pool + cursor);
      ph.n16[k] = kPhaseBytes[k] / 16;
      cursor += (kPhaseBytes[k] + 4095) / 4096 * 4096;
    }
    return ph;
  };
  enum { kLaunches, kOne, kBarriers, kBarriersPf, kVariants };
  const char* names[kVariants] = {"launches", "one", "barriers", "barriers+pf"};
  auto run = [&](int v, bool first, unsigned long long* sum, cudaStream_t s) {  // check_then_time's
    if (first) cursor = 0;
    const Phases ph = next_layer();
    if (v == kLaunches) {
      for (int k = 0; k < kPhases; ++k) launch_pdl(read_phase, grid, kThreads, 0, s, ph.p[k], kPhaseBytes[k] / 16, sum);
    } else if (v == kOne) {
      launch_pdl(read_layer<false, false>, grid, kThreads, 0, s, ph, dcount, sum);
    } else if (v == kBarriers) {
      launch_pdl(read_layer<true, false>, grid, kThreads, 0, s, ph, dcount, sum);
    } else {
      launch_pdl(read_layer<true, true>, grid, kThreads, 0, s, ph, dcount, sum);
    }
  };

  auto want = [&](int, const std::vector<uint32_t>& host) {  // every variant reads every phase of the layer
    cursor = 0;
    const Phases ph = next_layer();
    uint32_t sum = 0;
    for (int k = 0; k < kPhases; ++k)
      sum += host_sum(host, reinterpret_cast<const uint8_t*>(ph.p[k]) - pool, kPhaseBytes[k]);
    return sum;
  };
  return check_then_time(kVariants, names, pool, kPool, layer_bytes / 1e6, run, want, st);
}
