// Experiment (not part of the product; results/NOTES.md lesson 43): how fast can a kernel of each decode kernel's
// size read its bytes on this GPU, launched the way the product launches (programmatic dependent launch, captured
// in a CUDA graph, over memory that left the L2 long ago)? The notes' floors divide bytes by the copy bandwidth of
// a 512 MB copy; a 4-49 MB kernel also pays its ramp-up, its tail and the launch boundary. This measures that
// realistic floor per size, and the floor of a whole token with the product's launch structure (5 kernels a layer
// of the layer's sizes, then the output head), with two readers that compute nothing but a checksum:
//   ld<U>    : a grid-stride loop of 16-byte read-only loads, U of them in flight per thread, B blocks per SM;
//   bulk<S,C>: persistent blocks whose thread 0 keeps S chunks of C bytes in flight by the copy engine
//              (cp.async.bulk into a shared-memory ring, one mbarrier a stage) while the block reads the landed
//              chunks from shared memory: bytes in flight no longer bounded by registers.
// Every reader's checksum is compared with the host's, so a reader that skipped bytes fails loudly.
//
// Build and run on the GPU machine (from the repository root; device_run.sh's stage proto does it):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -DTM_WITH_CUDA=1 -I scripts/proto -I csrc/include
//        -I csrc/common -I csrc/cuda scripts/proto/read_floor.cu -o /tmp/read_floor && /tmp/read_floor
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "common.cuh"
#include "proto.cuh"

namespace {

constexpr int64_t kPool = int64_t{1} << 30;  // regions walked in order: one is read again only after ~1 GB of others

template <int U>
__global__ void __launch_bounds__(256) read_ld(const uint4* __restrict__ p, int64_t n16, unsigned long long* sum) {
  tm_cuda::pdl_begin();
  const uint32_t acc = stream_share<U>(p, n16);
  if (sum != nullptr) atomicAdd(sum, static_cast<unsigned long long>(acc));  // checks only (integer: exact)
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int S, int C>
__global__ void __launch_bounds__(128, 1) read_bulk(const uint8_t* __restrict__ p, int64_t bytes,
                                                    unsigned long long* sum) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ uint64_t full[S];
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  tm_cuda::pdl_begin();
  const int64_t chunks = (bytes + C - 1) / C;
  const int64_t mine = chunks > blockIdx.x ? (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto chunk_bytes = [&](int64_t j) {
    const int64_t off = (blockIdx.x + j * gridDim.x) * static_cast<int64_t>(C);
    return static_cast<uint32_t>(bytes - off < C ? bytes - off : C);
  };
  auto issue = [&](int64_t j) {
    const int s = static_cast<int>(j % S);
    const uint32_t n = chunk_bytes(j), bar = smem_u32(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(n) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_u32(ring + s * C)),
        "l"(p + (blockIdx.x + j * gridDim.x) * static_cast<int64_t>(C)), "r"(n), "r"(bar)
        : "memory");
  };
  if (tid == 0)
    for (int64_t j = 0; j < S && j < mine; ++j) issue(j);
  uint32_t acc = 0;
  for (int64_t j = 0; j < mine; ++j) {
    const int s = static_cast<int>(j % S);
    const uint32_t parity = static_cast<uint32_t>((j / S) & 1), bar = smem_u32(&full[s]);
    uint32_t done = 0;
    do {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    } while (!done);
    const uint4* q = reinterpret_cast<const uint4*>(ring + s * C);
    const int n16 = static_cast<int>(chunk_bytes(j) / 16);
    for (int k = tid; k < n16; k += 128) acc += mix(q[k]);
    __syncthreads();  // every thread is done with stage s: it may be refilled
    if (tid == 0 && j + S < mine) issue(j + S);
  }
  if (sum != nullptr) atomicAdd(sum, static_cast<unsigned long long>(acc));
}

// A reader: launches one read of `bytes` at `src` (sum nullable).
using Reader = std::function<void(const uint8_t* src, int64_t bytes, unsigned long long* sum, cudaStream_t)>;
struct NamedReader {
  std::string name;
  Reader read;
};

int g_sms = 0;

template <int U>
NamedReader ld_reader(int blocks_per_sm) {
  return {"ld" + std::to_string(U) + "x" + std::to_string(blocks_per_sm),
          [blocks_per_sm](const uint8_t* src, int64_t bytes, unsigned long long* sum, cudaStream_t st) {
            launch_pdl(read_ld<U>, g_sms * blocks_per_sm, 256, 0, st, reinterpret_cast<const uint4*>(src),
                       bytes / 16, sum);
          }};
}

template <int S, int C>
NamedReader bulk_reader(int blocks_per_sm) {
  const size_t smem = static_cast<size_t>(S) * C;
  CHECK(cudaFuncSetAttribute(read_bulk<S, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  return {"bulk" + std::to_string(S) + "x" + std::to_string(C / 1024) + "k/" + std::to_string(blocks_per_sm),
          [blocks_per_sm, smem](const uint8_t* src, int64_t bytes, unsigned long long* sum, cudaStream_t st) {
            launch_pdl(read_bulk<S, C>, g_sms * blocks_per_sm, 128, smem, st, src, bytes, sum);
          }};
}

}  // namespace

int main() {
  CHECK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  uint8_t* pool;
  CHECK(cudaMalloc(&pool, kPool));
  fill<<<g_sms * 8, 256>>>(reinterpret_cast<uint32_t*>(pool), kPool / 4);
  CHECK(cudaDeviceSynchronize());
  unsigned long long* dsum;
  CHECK(cudaMalloc(&dsum, 8));
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

  // The copy bandwidth (read + write), as tornado-moe profile measures it: a 256 MB device-to-device copy.
  const int64_t cbytes = int64_t{256} << 20;
  const double copy_us = time_graph(
      [&](cudaStream_t s) {
        for (int i = 0; i < 4; ++i)
          CHECK(cudaMemcpyAsync(pool + (i % 2) * cbytes * 2, pool + cbytes + (i % 2) * cbytes * 2, cbytes,
                                cudaMemcpyDeviceToDevice, s));
      },
      st) / 4;
  const double copy_gbs = 2.0 * cbytes / copy_us / 1e3;
  std::printf("%s, %d SMs; copy bandwidth (read + write) %.1f GB/s\n", prop.name, g_sms, copy_gbs);

  std::vector<NamedReader> readers = {ld_reader<4>(2),          ld_reader<4>(4),          ld_reader<4>(8),
                                      ld_reader<8>(4),          ld_reader<8>(8),          ld_reader<16>(2),
                                      bulk_reader<8, 16384>(1), bulk_reader<6, 16384>(2), bulk_reader<4, 32768>(1),
                                      bulk_reader<12, 8192>(2)};
  // Checksums first (on the pool as the copies above left it): every reader must give the host's sum.
  std::vector<uint32_t> host(kPool / 4);
  CHECK(cudaMemcpy(host.data(), pool, kPool, cudaMemcpyDeviceToHost));
  const int64_t cb = 24510464;
  const uint32_t want = host_sum(host, 4096, cb);
  for (const NamedReader& r : readers) {
    CHECK(cudaMemsetAsync(dsum, 0, 8, st));  // on the readers' stream (a non-blocking one)
    r.read(pool + 4096, cb, dsum, st);
    CHECK(cudaStreamSynchronize(st));
    unsigned long long got = 0;
    CHECK(cudaMemcpy(&got, dsum, 8, cudaMemcpyDeviceToHost));
    if (static_cast<uint32_t>(got) != want) {
      std::printf("%s: checksum %llx, want %llx: WRONG\n", r.name.c_str(), got, static_cast<unsigned long long>(want));
      return 1;
    }
  }
  std::printf("checksums: all %zu readers agree with the host\n", readers.size());

  struct Size {
    const char* name;
    int64_t bytes;
  };
  // Bytes of each decode kernel of the Qwen1.5-MoE-A2.7B shape in Q8_0 (results/NOTES.md "The two numbers").
  const Size sizes[] = {{"attn_output", 4456448},   {"down (shared + routed)", 24510464}, {"qkv", 13369344},
                        {"gate-up (shared + routed)", 49020928}, {"output head", 330612736}};
  int64_t cursor = 0;
  auto next_region = [&](int64_t bytes) {
    const int64_t step = (bytes + 4095) / 4096 * 4096;
    if (cursor + step > kPool) cursor = 0;
    const int64_t off = cursor;
    cursor += step;
    return pool + off;
  };
  std::vector<int> best(sizeof(sizes) / sizeof(sizes[0]));
  std::printf("\nus per launch inside a graph of launches reading successive regions (>= 256 MB a graph)\n%-26s",
              "kernel (MB)");
  for (const NamedReader& r : readers) std::printf(" %11s", r.name.c_str());
  std::printf("   best: us  GB/s  %%copy\n");
  for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); ++k) {
    const Size& z = sizes[k];
    const int n = static_cast<int>(std::max<int64_t>(20, (int64_t{256} << 20) / z.bytes + 1));
    std::printf("%-20s %5.1f", z.name, z.bytes / 1e6);
    double best_us = 1e30;
    for (size_t i = 0; i < readers.size(); ++i) {
      const double us = time_graph(
          [&](cudaStream_t s) {
            for (int j = 0; j < n; ++j) readers[i].read(next_region(z.bytes), z.bytes, nullptr, s);
          },
          st) / n;
      std::printf(" %11.2f", us);
      if (us < best_us) best_us = us, best[k] = static_cast<int>(i);
    }
    std::printf("   %s %.2f %6.0f %5.1f\n", readers[best[k]].name.c_str(), best_us, z.bytes / best_us / 1e3,
                100.0 * z.bytes / best_us / 1e3 / copy_gbs);
  }

  // A token with the product's launch structure: per layer qkv, attention (a 64 KB read), attn_output, gate-up,
  // down; 24 layers; then the output head. Each kernel by the best reader of its size.
  auto reader_of = [&](int64_t bytes) -> const NamedReader& {
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); ++k)
      if (sizes[k].bytes == bytes) return readers[best[k]];
    return readers[1];
  };
  const int64_t layer[] = {13369344, 65536, 4456448, 49020928, 24510464};
  int64_t token_bytes = 330612736;
  for (int64_t b : layer) token_bytes += 24 * b;
  const double token_us = time_graph(
      [&](cudaStream_t s) {
        for (int l = 0; l < 24; ++l)
          for (int64_t b : layer) reader_of(b).read(next_region(b), b, nullptr, s);
        reader_of(330612736).read(next_region(330612736), 330612736, nullptr, s);
      },
      st);
  std::printf("\na token of pure reads, 5 launches a layer (121 launches, %.1f MB): %.1f us = %.0f tok/s (%.1f%% of "
              "copy bandwidth)\n",
              token_bytes / 1e6, token_us, 1e6 / token_us, 100.0 * token_bytes / token_us / 1e3 / copy_gbs);
  const double layer_us = time_graph(
      [&](cudaStream_t s) {
        for (int l = 0; l < 24; ++l)
          for (int64_t b : layer) reader_of(b).read(next_region(b), b, nullptr, s);
      },
      st) / 24;
  std::printf("a layer of pure reads (qkv, attention, attn_output, gate-up, down): %.2f us\n", layer_us);
  std::printf("the same bytes as one launch a layer: %.2f us\n",
              time_graph(
                  [&](cudaStream_t s) {
                    int64_t b = 0;
                    for (int64_t x : layer) b += x;
                    for (int l = 0; l < 24; ++l) reader_of(49020928).read(next_region(b), b, nullptr, s);
                  },
                  st) / 24);
  return 0;
}
