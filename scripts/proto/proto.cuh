// proto.cuh - what the standalone experiments in scripts/proto share: a CUDA call check that exits on failure,
// a launch under programmatic dependent launch as the product's kernels are launched (common.cuh's
// configuration; the product's launch() itself reports through the library's error state, which they do not link),
// a timer over rotating weight copies, and random tiled Q8_0 rows with their float64 values.
#ifndef TORNADO_MOE_PROTO_CUH
#define TORNADO_MOE_PROTO_CUH

#include <cuda_fp16.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common.cuh"

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// common.cuh's launch configuration, with PDL always on.
template <class K, class... Args>
void launch_pdl(K kernel, int blocks, int threads, size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr;
  const dim3 grid(static_cast<unsigned>(blocks)), block(static_cast<unsigned>(threads));
  const cudaLaunchConfig_t cfg = tm_cuda::launch_config(grid, block, smem, stream, true, &attr);
  CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// Microseconds per launch of launch(copy) over `copies` rotating weight copies (events around `iters` launches).
template <class F>
double time_us(F&& launch, int copies, int iters) {
  for (int i = 0; i < copies; ++i) launch(i);
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) launch(i % copies);
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaGetLastError());
  return 1e3 * ms / iters;
}

// `rows` random TM_Q8_0_TILED rows of `cols` values (codes uniform, scales 0.005-0.015), row_bytes apart.
template <class Rng>
std::vector<uint8_t> random_tiled_rows(int64_t rows, int64_t cols, Rng& rng) {
  const int64_t row_bytes = tm_qtype_row_bytes(TM_Q8_0, cols), nb = cols / 32;
  std::vector<uint8_t> w(row_bytes * rows);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> unit(0.5f, 1.5f);
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = w.data() + r * row_bytes;
    for (int64_t c = 0; c < cols; ++c) row[tm_q8t_code_offset(cols, c)] = static_cast<uint8_t>(byte(rng));
    for (int64_t b = 0; b < nb; ++b) {
      const __half h = __float2half(0.01f * unit(rng));
      std::memcpy(row + tm_q8t_scale_offset(cols, b), &h, 2);
    }
  }
  return w;
}

// Enough device copies of the weights w to rotate through more than the L2 (256 MB), back to back; their count.
inline uint8_t* rotating_copies(const std::vector<uint8_t>& w, int* copies) {
  const size_t bytes = w.size();
  *copies = static_cast<int>((256ull << 20) / bytes + 1);
  uint8_t* d = nullptr;
  CHECK(cudaMalloc(&d, bytes * *copies));
  for (int i = 0; i < *copies; ++i) CHECK(cudaMemcpy(d + bytes * i, w.data(), bytes, cudaMemcpyHostToDevice));
  return d;
}

// max |y - ref| / max |ref| (infinite where y holds a NaN, e.g. a row no kernel wrote).
inline double rel_err(const std::vector<float>& y, const std::vector<double>& ref) {
  double worst = 0, scale = 0;
  for (size_t r = 0; r < ref.size(); ++r) {
    worst = std::isnan(y[r]) ? INFINITY : std::fmax(worst, std::fabs(y[r] - ref[r]));
    scale = std::fmax(scale, std::fabs(ref[r]));
  }
  return worst / scale;
}

// Value c of tiled row `row` (float64, for references).
inline double tiled_value(const uint8_t* row, int64_t cols, int64_t c) {
  __half h;
  std::memcpy(&h, row + tm_q8t_scale_offset(cols, c / 32), 2);
  return double(tm_q8t_code(row[tm_q8t_code_offset(cols, c)])) * double(__half2float(h));
}

// ---- pure reads (read_floor.cu, layer_flags.cu) ----
// A 16-byte read-only load as its own volatile instruction: the U loads of a batch stay issued before their uses
// (plain __ldg loads were interleaved with the sums by ptxas: 32 registers at U = 16).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__host__ __device__ __forceinline__ uint32_t mix(uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  return (x ^ (y * 3u)) + (z ^ (w * 5u));
}
__device__ __forceinline__ uint32_t mix(uint4 v) { return mix(v.x, v.y, v.z, v.w); }

// The checksum of this thread's grid-stride share of n16 16-byte words at p (U loads in flight): a wrapping sum of
// mix(word), order-free, so every reader of the same bytes must give host_sum's.
template <int U>
__device__ __forceinline__ uint32_t stream_share(const uint4* p, int64_t n16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_stream(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc += mix(v[u]);
  }
  for (; i < n16; i += stride) acc += mix(ld_stream(p + i));
  return acc;
}

// The host's checksum of the bytes [off, off + bytes) of `pool` (mix over 16-byte words, wrapping).
inline uint32_t host_sum(const std::vector<uint32_t>& pool, int64_t off, int64_t bytes) {
  uint32_t acc = 0;
  for (int64_t i = off / 4; i < (off + bytes) / 4; i += 4) acc += mix(pool[i], pool[i + 1], pool[i + 2], pool[i + 3]);
  return acc;
}

// Pseudo-random words into p[0, n) (a hash of the index).
static __global__ void fill(uint32_t* p, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u;
    x ^= x >> 15;
    p[i] = x * 2246822519u + static_cast<uint32_t>(i >> 32);
  }
}

// Microseconds per replay of a graph that runs `body` (launches reading successive pool regions), median of 7.
inline double time_graph(const std::function<void(cudaStream_t)>& body, cudaStream_t st) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  body(st);
  CHECK(cudaStreamEndCapture(st, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  CHECK(cudaGraphLaunch(ge, st));  // warm-up
  CHECK(cudaStreamSynchronize(st));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms(7);
  for (float& m : ms) {
    CHECK(cudaEventRecord(a, st));
    CHECK(cudaGraphLaunch(ge, st));
    CHECK(cudaEventRecord(b, st));
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaEventElapsedTime(&m, a, b));
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  return 1e3 * ms[3];
}

// The driver of the layered pure-read protos (layer_flags.cu, att_fold.cu). run(v, first, sum, s) enqueues one
// layer of variant v (first: on the pool's first layer of regions, else on the next fresh ones) adding its
// checksum to sum when not null; want(v, host) is the host's checksum of what variant v reads of the first layer.
// Every variant's checksum first, then microseconds per layer of 24 layers in a CUDA graph. The exit code.
using LayerRun = std::function<void(int, bool, unsigned long long*, cudaStream_t)>;
using LayerWant = std::function<uint32_t(int, const std::vector<uint32_t>&)>;
inline int check_then_time(int variants, const char* const* names, const uint8_t* pool, int64_t pool_bytes,
                           double layer_mb, const LayerRun& run, const LayerWant& want, cudaStream_t st) {
  std::vector<uint32_t> host(pool_bytes / 4);
  CHECK(cudaMemcpy(host.data(), pool, pool_bytes, cudaMemcpyDeviceToHost));
  unsigned long long* dsum;
  CHECK(cudaMalloc(&dsum, 8));
  for (int v = 0; v < variants; ++v) {
    CHECK(cudaMemsetAsync(dsum, 0, 8, st));
    run(v, true, dsum, st);
    CHECK(cudaStreamSynchronize(st));
    unsigned long long got = 0;
    CHECK(cudaMemcpy(&got, dsum, 8, cudaMemcpyDeviceToHost));
    const uint32_t expected = want(v, host);
    if (static_cast<uint32_t>(got) != expected) {
      std::printf("%s: checksum %x, want %x: WRONG\n", names[v], static_cast<uint32_t>(got), expected);
      return 1;
    }
  }
  CHECK(cudaFree(dsum));
  std::printf("checksums: all %d variants agree with the host\n", variants);
  std::printf("us per layer (24 layers in a graph, %.1f MB a layer):\n", layer_mb);
  for (int v = 0; v < variants; ++v) {
    const double us = time_graph(
        [&](cudaStream_t s) {
          for (int l = 0; l < 24; ++l) run(v, false, nullptr, s);
        },
        st) / 24;
    std::printf("  %-12s %7.2f\n", names[v], us);
  }
  return 0;
}

#endif
