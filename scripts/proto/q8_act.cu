// Experiment (not part of the product; results/NOTES.md lessons 59-60): how much faster is a Q8_0 x q8 dot product
// (activations quantised to int8 in 32-value blocks with a float32 scale, multiplied four codes at a time by IDP4A)
// than the production reader's exact float32 one, at the expert kernels' shapes and block structure?
//
// The production reader (qdot.cuh's warp_dot_q8t) spends 64 of a batch's 140 instructions on the exact conversion
// of weight codes to float (PRMT + FADD per value; lesson 59). Here the same tiled rows (TM_Q8_0_TILED, codes stored
// as q + 128) are read the same way, one group of 4 steps per row and batch, and each step's 4 codes of a row meet
// 4 activation codes in one IDP4A: per step and row a LOP3 (the codes' bias), IDP4A, I2F, the fp16 scale's
// conversion, FMUL (weight scale x activation scale) and FFMA. The activations sit in the rows' own tiled order
// (a lane's 16 codes of a group are one 16-byte word, its lane group's 4 scales one float4), so a group costs a lane
// two activation loads instead of four.
// Variants, each a grid of 8-warp blocks with one row pair (NR = 2) or one row a warp, launched under programmatic
// dependent launch as the product does and timed over weight copies that rotate through more than the L2:
//   f32_l1 / q8_l1   : activations read from global memory (through L1), as the routed gate-up blocks read h;
//   f32_smem / q8_smem: the block first copies the activations into shared memory, as the shared blocks hold h;
//   q8_smem2          : q8_smem with two groups of a row in flight a batch (the registers the float ones free).
// The float variants are checked against a float64 dot product of the float activations, the q8 ones against a
// float64 dot product of the quantised activations (their own arithmetic), and the quantisation error against the
// float activations is printed beside them: what the logit bounds would have to absorb.
//
// Build and run on the GPU machine (from the repository root; device_run.sh's stage proto does it):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -DTM_WITH_CUDA=1 -I scripts/proto -I csrc/include
//        -I csrc/common -I csrc/cuda scripts/proto/q8_act.cu -o /tmp/q8_act && /tmp/q8_act
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
enum Mode : int { kF32L1, kF32Smem, kQ8L1, kQ8Smem, kQ8Smem2 };
const char* const kModeNames[] = {"f32_l1", "f32_smem", "q8_l1", "q8_smem", "q8_smem2"};
constexpr bool is_q8(int m) { return m >= kQ8L1; }

// dot(W[r], x) for NR tiled rows (cols a multiple of 512) with q8 activations in the rows' tiled order: codes xq
// (int8, at tm_q8t_code_offset) and float32 scales xd (at the weights' scale order). kGroups groups a batch.
template <int NR, int kGroups>
__device__ __forceinline__ void warp_dot_q8x(const uint8_t* const (&w)[NR], const uint8_t* xq, const float* xd,
                                             int nb, float (&out)[NR]) {
  const int lane = threadIdx.x & 31, sub = lane >> 3;
  const int ngroups = nb / 16;
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
  const uint8_t* code[NR];
  const uint8_t* scale[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    code[r] = w[r] + 16 * lane;
    scale[r] = w[r] + nb * 32 + 8 * sub;
  }
  const uint8_t* xc = xq + 16 * lane;
  const float* xs = xd + 4 * sub;
  for (int g0 = 0; g0 < ngroups; g0 += kGroups) {
    uint4 c[kGroups][NR], a[kGroups];
    uint2 s[kGroups][NR];
    float4 ad[kGroups];
#pragma unroll
    for (int v = 0; v < kGroups; ++v) {
      const int g = g0 + v < ngroups ? g0 + v : ngroups - 1;  // a short last batch re-reads (unused)
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        c[v][r] = __ldg(reinterpret_cast<const uint4*>(code[r] + g * 512));
        s[v][r] = __ldg(reinterpret_cast<const uint2*>(scale[r] + g * 32));
      }
      a[v] = *reinterpret_cast<const uint4*>(xc + g * 512);
      ad[v] = *reinterpret_cast<const float4*>(xs + g * 16);
    }
#pragma unroll
    for (int v = 0; v < kGroups; ++v) {
      if (g0 + v >= ngroups) break;
      const uint32_t av[4] = {a[v].x, a[v].y, a[v].z, a[v].w};
      const float dx[4] = {ad[v].x, ad[v].y, ad[v].z, ad[v].w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          const uint32_t cw = (u == 0 ? c[v][r].x : u == 1 ? c[v][r].y : u == 2 ? c[v][r].z : c[v][r].w);
          const uint32_t sw = (u >> 1) ? s[v][r].y : s[v][r].x;
          const float dw = tm_cuda::fp16_bits_to_f32((u & 1) ? sw >> 16 : sw & 0xFFFFu);
          const int dp = __dp4a(static_cast<int>(cw ^ 0x80808080u), static_cast<int>(av[u]), 0);
          acc[r] = __fmaf_rn(__fmul_rn(dw, dx[u]), __int2float_rn(dp), acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = tm_cuda::warp_sum(acc[r]);
}

// Warp g computes rows g * NR .. g * NR + NR - 1: y[r] = dot(W[r], x) (x float32, or xq / xd).
template <int NR, int M>
__global__ void __launch_bounds__(kWarps * 32, 4)
    matvec(const uint8_t* __restrict__ w, const float* __restrict__ x, const uint8_t* __restrict__ xq,
           const float* __restrict__ xd, float* __restrict__ y, int groups, int cols, int64_t row_bytes) {
  extern __shared__ __align__(16) uint8_t act_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = blockIdx.x * kWarps + warp;
  const int nb = cols / 32;
  tm_cuda::pdl_begin();
  const float* xa = x;
  const uint8_t* xqa = xq;
  const float* xda = xd;
  if constexpr (M == kF32Smem) {
    float* sx = reinterpret_cast<float*>(act_smem);
    for (int i = threadIdx.x; i < cols / 4; i += kWarps * 32)
      reinterpret_cast<float4*>(sx)[i] = reinterpret_cast<const float4*>(x)[i];
    __syncthreads();
    xa = sx;
  } else if constexpr (M == kQ8Smem || M == kQ8Smem2) {
    uint8_t* sq = act_smem;
    float* sd = reinterpret_cast<float*>(act_smem + cols);
    for (int i = threadIdx.x; i < cols / 16; i += kWarps * 32)
      reinterpret_cast<uint4*>(sq)[i] = reinterpret_cast<const uint4*>(xq)[i];
    for (int i = threadIdx.x; i < nb / 4; i += kWarps * 32)
      reinterpret_cast<float4*>(sd)[i] = reinterpret_cast<const float4*>(xd)[i];
    __syncthreads();
    xqa = sq;
    xda = sd;
  }
  if (g >= groups) return;
  const uint8_t* wr[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) wr[i] = w + static_cast<int64_t>(g * NR + i) * row_bytes;
  float out[NR];
  if constexpr (is_q8(M)) {
    warp_dot_q8x<NR, M == kQ8Smem2 ? 2 : 1>(wr, xqa, xda, nb, out);
  } else {
    const float* xs[1] = {xa};
    float o[NR][1];
    tm_cuda::warp_dot_q8t<true, NR, 1, true, true>(wr, xs, nb, o);
#pragma unroll
    for (int i = 0; i < NR; ++i) out[i] = o[i][0];
  }
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < NR; ++i) y[g * NR + i] = out[i];
}

using Kernel = void (*)(const uint8_t*, const float*, const uint8_t*, const float*, float*, int, int, int64_t);

template <int NR>
Kernel kernel_for(int mode) {
  switch (mode) {
    case kF32L1: return matvec<NR, kF32L1>;
    case kF32Smem: return matvec<NR, kF32Smem>;
    case kQ8L1: return matvec<NR, kQ8L1>;
    case kQ8Smem: return matvec<NR, kQ8Smem>;
    default: return matvec<NR, kQ8Smem2>;
  }
}

// The quantiser a product would run in its norm: per 32-value block d = amax / 127, q = rint(x / d) (ties to even).
void quantize(const std::vector<float>& x, int cols, std::vector<uint8_t>& xq, std::vector<float>& xd,
              std::vector<float>& dequant) {
  const int nb = cols / 32;
  xq.assign(cols, 0);
  xd.assign(nb, 0.0f);
  dequant.assign(cols, 0.0f);
  for (int b = 0; b < nb; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[32 * b + i]));
    const float d = amax / 127.0f;
    xd[(tm_q8t_scale_offset(cols, b) - cols) / 2] = d;  // the weights' scale order, one float a block
    for (int i = 0; i < 32; ++i) {
      const int c = 32 * b + i;
      const int q = d == 0.0f ? 0 : static_cast<int>(std::nearbyint(x[c] / d));
      xq[tm_q8t_code_offset(cols, c)] = static_cast<uint8_t>(static_cast<int8_t>(q));
      dequant[c] = static_cast<float>(q) * d;
    }
  }
}

template <int NR>
void run(const char* name, int rows, int cols) {
  std::mt19937 rng(1);
  const int64_t row_bytes = tm_qtype_row_bytes(TM_Q8_0, cols), nb = cols / 32;
  const int64_t bytes = row_bytes * rows;
  const std::vector<uint8_t> w = random_tiled_rows(rows, cols, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(cols), dequant, xd;
  std::vector<uint8_t> xq;
  for (float& v : x) v = normal(rng);  // an RMS-normalised activation: unit scale
  quantize(x, cols, xq, xd, dequant);
  std::vector<double> ref(rows), ref_q(rows);
  double worst_q = 0, scale = 0;  // the quantisation's own error, against the largest output
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0, sum_q = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double wv = tiled_value(w.data() + r * row_bytes, cols, c);
      sum += wv * double(x[c]);
      sum_q += wv * double(dequant[c]);
    }
    ref[r] = sum;
    ref_q[r] = sum_q;
    worst_q = std::fmax(worst_q, std::fabs(sum_q - sum));
    scale = std::fmax(scale, std::fabs(sum));
  }
  const double quant = worst_q / scale;
  int copies = 0;
  uint8_t* dw = rotating_copies(w, &copies);
  uint8_t* dxq;
  float *dx, *dxd, *dy;
  CHECK(cudaMalloc(&dx, cols * 4));
  CHECK(cudaMalloc(&dxq, cols));
  CHECK(cudaMalloc(&dxd, nb * 4));
  CHECK(cudaMalloc(&dy, rows * 4));
  CHECK(cudaMemcpy(dx, x.data(), cols * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dxq, xq.data(), cols, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dxd, xd.data(), nb * 4, cudaMemcpyHostToDevice));
  const int groups = rows / NR, blocks = (groups + kWarps - 1) / kWarps;
  std::printf("%s: %d x %d, %.2f MB, %d copies, %d rows a warp, %d blocks\n", name, rows, cols, bytes / 1e6, copies,
              NR, blocks);
  double base_us = 0;
  for (int mode = kF32L1; mode <= kQ8Smem2; ++mode) {
    const Kernel k = kernel_for<NR>(mode);
    const size_t dyn = mode == kF32Smem ? cols * 4 : (mode >= kQ8Smem ? cols + nb * 4 : 0);
    CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn)));
    int fit = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, k, kWarps * 32, dyn));
    CHECK(cudaMemset(dy, 0xff, rows * 4));  // NaN: a row not written fails the check
    const double us = time_us(
        [&](int i) {
          launch_pdl(k, blocks, kWarps * 32, dyn, nullptr, dw + bytes * i, dx, dxq, dxd, dy, groups, cols,
                     row_bytes);
        },
        copies, 400);
    if (mode == kF32L1) base_us = us;
    std::vector<float> y(rows);
    CHECK(cudaMemcpy(y.data(), dy, rows * 4, cudaMemcpyDeviceToHost));
    const double err = rel_err(y, is_q8(mode) ? ref_q : ref);
    std::printf("  %-9s %d blocks/SM  %7.2f us (%.2fx)  %6.0f GB/s  err %.1e%s", kModeNames[mode], fit, us,
                base_us / us, bytes / us / 1e3, err, err < 1e-5 ? "" : "  WRONG");
    if (is_q8(mode)) std::printf("  (quantisation: %.1e of the largest |y|)", quant);
    std::printf("\n");
  }
  CHECK(cudaFree(dw));
  CHECK(cudaFree(dx));
  CHECK(cudaFree(dxq));
  CHECK(cudaFree(dxd));
  CHECK(cudaFree(dy));
}

}  // namespace

int main() {
  run<2>("gate-up pairs (the shared expert's gate and up, 704 blocks as the product's)", 2 * 5632, 2048);
  run<2>("attn q, k, v (6144 rows, pairs)", 6144, 2048);
  run<2>("attn output (2048 rows, pairs)", 2048, 2048);
  run<1>("shared-expert down (one 5632-value row a warp)", 2048, 5632);
  run<2>("output head (151936 rows, pairs)", 151936, 2048);
  return 0;
}
