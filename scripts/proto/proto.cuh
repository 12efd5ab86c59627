// proto.cuh - what the standalone experiments in scripts/proto share: a CUDA call check that exits on failure,
// and a launch under programmatic dependent launch as the product's kernels are launched (common.cuh's
// configuration; the product's launch() itself reports through the library's error state, which they do not link).
#ifndef TORNADO_MOE_PROTO_CUH
#define TORNADO_MOE_PROTO_CUH

#include <cstdio>
#include <cstdlib>

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

#endif
