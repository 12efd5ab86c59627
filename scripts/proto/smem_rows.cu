// Experiment (branch exp/smem-rows, not part of the product; results/NOTES.md lead 36): are the one-wave weight
// kernels (qkv_rope, the downs) slow because each warp walks its rows in many dependent round trips?
//
// The production reader (qdot.cuh's warp_dot_q8t) keeps one 512-value group per row in flight per warp (12
// registers a lane): a shared-down warp reads its 5,632-value row in 11 round trips, a qkv warp its row pair in 4,
// each trip a load's latency plus the group's arithmetic, while hot-L2 runs (NOTES v4h, d6ff4ec) showed the
// latency is not DRAM's. Here the same reader and arithmetic read the rows from shared memory, where the warp's
// lane 0 had the copy engine put them in one bulk copy (common.cuh's bulk_row_to_smem): one round trip a warp,
// and no registers for the bytes in flight. Variants, each launched under programmatic dependent launch as the
// product does and timed over weight copies that rotate through more than the L2:
//   base     : the production reader from global memory (pdl_wait first);
//   l2pre    : the same after an L2 prefetch of the warp's rows before pdl_wait (what qkv_rope and the shared
//              down do in the product);
//   smem_pre : the bulk copy issued before pdl_wait (weights never change), the dot after it, from shared memory;
//   smem_post: the bulk copy issued after pdl_wait (what a routed expert's rows, known only then, would do).
// Each result is checked against a float64 reference, and every variant must give base's bits exactly.
//
// Build and run on the GPU machine (from the repository root; device_run.sh's stage proto does it):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -DTM_WITH_CUDA=1 -I scripts/proto -I csrc/include
//        -I csrc/common -I csrc/cuda scripts/proto/smem_rows.cu -o /tmp/smem_rows && /tmp/smem_rows
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "proto.cuh"
#include "qdot.cuh"

namespace {

constexpr int kWarps = 8;
enum Mode : int { kBase, kL2Pre, kSmemPre, kSmemPost };
const char* const kModeNames[] = {"base", "l2pre", "smem_pre", "smem_post"};

// Warp g computes rows g * NR .. g * NR + NR - 1 (contiguous, so one bulk copy): y[r] = dot(W[r], x).
template <int NR, bool W16, int M>
__global__ void __launch_bounds__(kWarps * 32, 4)
    matvec(const uint8_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int groups,
           int64_t nblocks, int64_t row_bytes) {
  extern __shared__ __align__(128) uint8_t rows_smem[];
  __shared__ uint64_t bars[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = blockIdx.x * kWarps + warp;
  const bool active = g < groups;
  const uint8_t* src = w + static_cast<int64_t>(g) * NR * row_bytes;
  uint8_t* mine = rows_smem + warp * NR * row_bytes;
  const uint32_t bytes = static_cast<uint32_t>(NR * row_bytes);
  if (M == kL2Pre && active) tm_cuda::prefetch_row_l2(src, bytes, lane);
  if (M == kSmemPre && active && lane == 0) tm_cuda::bulk_row_to_smem(mine, src, bytes, &bars[warp]);
  tm_cuda::pdl_begin();
  if (!active) return;
  if (M == kSmemPost && lane == 0) tm_cuda::bulk_row_to_smem(mine, src, bytes, &bars[warp]);
  const float* xs[1] = {x};
  float out[NR][1];
  if constexpr (M == kSmemPre || M == kSmemPost) {
    __syncwarp();
    tm_cuda::bulk_wait(&bars[warp]);
    const uint8_t* wr[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) wr[i] = mine + i * row_bytes;
    tm_cuda::warp_dot_q8t<W16, NR, 1, true, true, true>(wr, xs, nblocks, out);
  } else {
    const uint8_t* wr[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) wr[i] = src + i * row_bytes;
    tm_cuda::warp_dot_q8t<W16, NR, 1, true, true, false>(wr, xs, nblocks, out);
  }
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < NR; ++i) y[g * NR + i] = out[i][0];
}

using Kernel = void (*)(const uint8_t*, const float*, float*, int, int64_t, int64_t);

template <int NR, bool W16>
Kernel kernel_for(int mode) {
  switch (mode) {
    case kBase: return matvec<NR, W16, kBase>;
    case kL2Pre: return matvec<NR, W16, kL2Pre>;
    case kSmemPre: return matvec<NR, W16, kSmemPre>;
    default: return matvec<NR, W16, kSmemPost>;
  }
}

template <int NR, bool W16>
void run(const char* name, int rows, int cols) {
  std::mt19937 rng(1);
  const int64_t row_bytes = tm_qtype_row_bytes(TM_Q8_0, cols), nb = cols / 32;
  const int64_t bytes = row_bytes * rows;
  const std::vector<uint8_t> w = random_tiled_rows(rows, cols, rng);
  std::uniform_real_distribution<float> unit(0.5f, 1.5f);
  std::vector<float> x(cols);
  for (float& v : x) v = unit(rng) - 1.0f;
  std::vector<double> ref(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += tiled_value(w.data() + r * row_bytes, cols, c) * double(x[c]);
    ref[r] = sum;
  }
  int copies = 0;
  uint8_t* dw = rotating_copies(w, &copies);
  float *dx, *dy;
  CHECK(cudaMalloc(&dx, cols * 4));
  CHECK(cudaMalloc(&dy, rows * 4));
  CHECK(cudaMemcpy(dx, x.data(), cols * 4, cudaMemcpyHostToDevice));
  const int groups = rows / NR, blocks = (groups + kWarps - 1) / kWarps;
  const size_t smem = static_cast<size_t>(kWarps) * NR * row_bytes;
  std::printf("%s: %d x %d, %.2f MB, %d copies, %d rows a warp, %d blocks, %zu bytes of rows per block\n", name,
              rows, cols, bytes / 1e6, copies, NR, blocks, smem);
  std::vector<float> base_y;
  for (int mode = kBase; mode <= kSmemPost; ++mode) {
    const Kernel k = kernel_for<NR, W16>(mode);
    const size_t dyn = mode >= kSmemPre ? smem : 0;
    CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn)));
    int fit = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, k, kWarps * 32, dyn));
    CHECK(cudaMemset(dy, 0xff, rows * 4));  // NaN: a row not written fails the check
    const double us = time_us(
        [&](int i) {
          launch_pdl(k, blocks, kWarps * 32, dyn, nullptr, dw + bytes * i, dx, dy, groups, nb, row_bytes);
        },
        copies, 400);
    std::vector<float> y(rows);
    CHECK(cudaMemcpy(y.data(), dy, rows * 4, cudaMemcpyDeviceToHost));
    if (mode == kBase) base_y = y;
    const bool same = std::memcmp(y.data(), base_y.data(), rows * 4) == 0;
    const double err = rel_err(y, ref);
    std::printf("  %-10s %d blocks/SM  %7.2f us  %6.0f GB/s  err %.1e  %s%s\n", kModeNames[mode], fit, us,
                bytes / us / 1e3, err, same ? "bits = base" : "BITS DIFFER", err < 1e-5 ? "" : "  WRONG");
  }
  CHECK(cudaFree(dw));
  CHECK(cudaFree(dx));
  CHECK(cudaFree(dy));
}

}  // namespace

int main() {
  run<2, true>("gate-up pairs (shared expert, both matrices)", 2 * 5632, 2048);
  run<2, true>("attn q, k, v (6144 rows)", 6144, 2048);
  run<2, true>("attn output (2048 rows, pairs)", 2048, 2048);
  run<1, true>("shared-expert down (one row a warp)", 2048, 5632);
  run<2, true>("shared-expert down (row pairs)", 2048, 5632);
  run<2, false>("routed down (4 experts x 2048 rows of 1408, pairs)", 4 * 2048, 1408);
  return 0;
}
