// Experiment (not part of the product; results/NOTES.md lesson 60 a): can the experts' down start its terms while
// the gate-up's last wave still runs, if the gate-up's blocks count their finished tiles per term and the down's
// warps wait for the counter of the term they start instead of for the whole grid (pdl_wait)?
//
// A model of one layer's FFN half at the product's shapes and block structure, with the product's reader
// (qdot.cuh's warp_dot_q8t on tiled Q8_0 rows, activations from global memory):
//   gate_up: 704 blocks of the shared expert's gate-up (8 row pairs each, 5,632 rows), then 4 x 176 blocks of the
//            routed slots' (1,408 rows each), slot by slot; act = silu(g) * u. With counters, each block's thread 0
//            releases one count of its term (a fence, then an integer atomic) once the block's act values are
//            stored.
//   down:    512 blocks of 4 output rows: warps 0-3 a shared row each (5,632 values), warps 4-7 a row pair for two
//            of the four slots each (1,408 values), summed in the product's order (shared, then slots 0..3) by
//            lane 0 of warps 0-3 after a barrier.
// Variants, each a (gate_up, down) pair launched under programmatic dependent launch, timed over weight copies that
// rotate through more than the L2:
//   pdl     : the product's protocol (down waits for the gate-up grid in pdl_wait);
//   fence   : the gate-up releases its counters, the down still waits in pdl_wait (the counters' cost alone);
//   overlap : the down's warps wait for their term's counter (acquire loads) and call pdl_wait at their end only,
//             so that the down still completes after the gate-up.
// Every variant must give the pdl variant's bits; all are checked against a float64 model of the layer.
//
// Build and run on the GPU machine (from the repository root; device_run.sh's stage proto does it):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -DTM_WITH_CUDA=1 -I scripts/proto -I csrc/include
//        -I csrc/common -I csrc/cuda scripts/proto/down_overlap.cu -o /tmp/down_overlap && /tmp/down_overlap
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "proto.cuh"
#include "qdot.cuh"

namespace {

constexpr int kWarps = 8, kHidden = 2048, kShFfn = 5632, kFfn = 1408, kSlots = 4;
constexpr int kShTiles = kShFfn / kWarps, kSlotTiles = kFfn / kWarps;  // 704, 176 gate-up blocks
constexpr int kDownRows = 4, kDownBlocks = kHidden / kDownRows;         // 512 down blocks
enum Mode : int { kPdl, kFence, kOverlap };
const char* const kModeNames[] = {"pdl", "fence", "overlap"};

struct Weights {  // device pointers of one copy
  const uint8_t *sh_gate, *sh_up, *rt_gate, *rt_up, *sh_down, *rt_down;
};
__host__ __device__ constexpr int64_t rb(int cols) { return int64_t(cols) / 32 * 34; }  // Q8_0 row bytes

__device__ __forceinline__ float silu(float g) { return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g))); }

// counters[0]: shared tiles done, counters[1 + s]: slot s's tiles done (monotonic over launches).
template <int M>
__global__ void __launch_bounds__(kWarps * 32, 4)
    gate_up(Weights w, const float* __restrict__ x, float* act_sh, float* act_rt, unsigned* counters) {
  tm_cuda::pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.x;
  const bool shared = b < kShTiles;
  const int slot = shared ? -1 : (b - kShTiles) / kSlotTiles;
  const int row = (shared ? b : (b - kShTiles) % kSlotTiles) * kWarps + warp;
  const int64_t off = shared ? int64_t(row) * rb(kHidden) : (int64_t(slot) * kFfn + row) * rb(kHidden);
  const uint8_t* wr[2] = {(shared ? w.sh_gate : w.rt_gate) + off, (shared ? w.sh_up : w.rt_up) + off};
  const float* xs[1] = {x};
  float gu[2][1];
  tm_cuda::warp_dot_q8t<true, 2, 1, true, true>(wr, xs, kHidden / 32, gu);
  if (lane == 0) (shared ? act_sh + row : act_rt + slot * kFfn + row)[0] = __fmul_rn(silu(gu[0][0]), gu[1][0]);
  if constexpr (M != kPdl) {
    __syncthreads();  // the block's act stores, then thread 0's release of one count
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(counters + (shared ? 0 : 1 + slot), 1u);
    }
  }
}

__device__ __forceinline__ void wait_count(const unsigned* c, unsigned target) {
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(c) : "memory");
    if (static_cast<int>(v - target) >= 0) return;
    __nanosleep(64);
  }
}

template <int M>
__global__ void __launch_bounds__(kWarps * 32, 4)
    down(Weights w, const float* act_sh, const float* act_rt, float* y, const unsigned* counters, unsigned iter) {
  __shared__ float s_sh[kDownRows], s_rt[kDownRows][kSlots];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = blockIdx.x * kDownRows;
  if constexpr (M == kOverlap) {
    tm_cuda::pdl_trigger();  // the next launch may start; this one's pdl_wait comes at its end
  } else {
    tm_cuda::pdl_begin();
  }
  if (warp < kDownRows) {
    if constexpr (M == kOverlap) wait_count(counters, (iter + 1) * kShTiles);
    const uint8_t* wr[1] = {w.sh_down + int64_t(r0 + warp) * rb(kShFfn)};
    const float* xs[1] = {act_sh};
    float d[1][1];
    tm_cuda::warp_dot_q8t<true, 1, 1, true, true>(wr, xs, kShFfn / 32, d);
    if (lane == 0) s_sh[warp] = d[0][0];
  } else {
    const int j = warp - kDownRows, pair = 2 * (j >> 1);
    for (int s = j & 1; s < kSlots; s += 2) {
      if constexpr (M == kOverlap) wait_count(counters + 1 + s, (iter + 1) * kSlotTiles);
      const uint8_t* base = w.rt_down + int64_t(s) * kHidden * rb(kFfn);
      const uint8_t* wr[2] = {base + int64_t(r0 + pair) * rb(kFfn), base + int64_t(r0 + pair + 1) * rb(kFfn)};
      const float* xs[1] = {act_rt + s * kFfn};
      float d[2][1];
      tm_cuda::warp_dot_q8t<false, 2, 1, true, true>(wr, xs, kFfn / 32, d);
      if (lane == 0) {
        s_rt[pair][s] = d[0][0];
        s_rt[pair + 1][s] = d[1][0];
      }
    }
  }
  __syncthreads();
  if (warp < kDownRows && lane == 0) {
    float acc = s_sh[warp];
    for (int s = 0; s < kSlots; ++s) acc = __fadd_rn(acc, s_rt[warp][s]);
    y[r0 + warp] = acc;
  }
  if constexpr (M == kOverlap) tm_cuda::pdl_wait();  // complete only after the gate-up (common.cuh's protocol)
}

double dot64(const std::vector<uint8_t>& m, int64_t row, int cols, const std::vector<double>& x) {
  const uint8_t* r = m.data() + row * rb(cols);
  double s = 0;
  for (int c = 0; c < cols; ++c) s += tiled_value(r, cols, c) * x[c];
  return s;
}

}  // namespace

int main() {
  std::mt19937 rng(1);
  std::vector<uint8_t> h_sh_gate = random_tiled_rows(kShFfn, kHidden, rng);
  std::vector<uint8_t> h_sh_up = random_tiled_rows(kShFfn, kHidden, rng);
  std::vector<uint8_t> h_rt_gate = random_tiled_rows(kSlots * kFfn, kHidden, rng);
  std::vector<uint8_t> h_rt_up = random_tiled_rows(kSlots * kFfn, kHidden, rng);
  std::vector<uint8_t> h_sh_down = random_tiled_rows(kHidden, kShFfn, rng);
  std::vector<uint8_t> h_rt_down = random_tiled_rows(kSlots * kHidden, kFfn, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(kHidden);
  for (float& v : x) v = normal(rng);

  // float64 model of the layer's FFN half
  std::vector<double> x64(x.begin(), x.end()), a_sh(kShFfn), a_rt(kSlots * kFfn), ref(kHidden);
  auto silu64 = [](double g) { return g / (1.0 + std::exp(-g)); };
  for (int r = 0; r < kShFfn; ++r)
    a_sh[r] = silu64(dot64(h_sh_gate, r, kHidden, x64)) * dot64(h_sh_up, r, kHidden, x64);
  for (int r = 0; r < kSlots * kFfn; ++r)
    a_rt[r] = silu64(dot64(h_rt_gate, r, kHidden, x64)) * dot64(h_rt_up, r, kHidden, x64);
  for (int r = 0; r < kHidden; ++r) {
    double s = dot64(h_sh_down, r, kShFfn, a_sh);
    for (int k = 0; k < kSlots; ++k) {
      std::vector<double> a(a_rt.begin() + k * kFfn, a_rt.begin() + (k + 1) * kFfn);
      s += dot64(h_rt_down, int64_t(k) * kHidden + r, kFfn, a);
    }
    ref[r] = s;
  }

  // one allocation holding all six matrices, rotated as one set
  const std::vector<uint8_t>* parts[6] = {&h_sh_gate, &h_sh_up, &h_rt_gate, &h_rt_up, &h_sh_down, &h_rt_down};
  std::vector<uint8_t> all;
  size_t offs[6];
  for (int i = 0; i < 6; ++i) {
    offs[i] = all.size();
    all.insert(all.end(), parts[i]->begin(), parts[i]->end());
  }
  int copies = 0;
  uint8_t* dall = rotating_copies(all, &copies);
  auto weights = [&](int c) {
    const uint8_t* b = dall + all.size() * c;
    return Weights{b + offs[0], b + offs[1], b + offs[2], b + offs[3], b + offs[4], b + offs[5]};
  };
  float *dx, *dsh, *drt, *dy;
  unsigned* dcnt;
  CHECK(cudaMalloc(&dx, kHidden * 4));
  CHECK(cudaMalloc(&dsh, kShFfn * 4));
  CHECK(cudaMalloc(&drt, kSlots * kFfn * 4));
  CHECK(cudaMalloc(&dy, kHidden * 4));
  CHECK(cudaMalloc(&dcnt, 8 * 4));
  CHECK(cudaMemcpy(dx, x.data(), kHidden * 4, cudaMemcpyHostToDevice));
  std::printf("FFN half of a layer: %.1f MB of weights, %d copies; gate_up %d blocks, down %d blocks\n",
              all.size() / 1e6, copies, kShTiles + kSlots * kSlotTiles, kDownBlocks);

  std::vector<float> first;
  for (int mode = kPdl; mode <= kOverlap; ++mode) {
    void (*gu)(Weights, const float*, float*, float*, unsigned*) =
        mode == kPdl ? gate_up<kPdl> : mode == kFence ? gate_up<kFence> : gate_up<kOverlap>;
    void (*dn)(Weights, const float*, const float*, float*, const unsigned*, unsigned) =
        mode == kPdl ? down<kPdl> : mode == kFence ? down<kFence> : down<kOverlap>;
    CHECK(cudaMemset(dcnt, 0, 8 * 4));
    CHECK(cudaMemset(dy, 0xff, kHidden * 4));
    unsigned iter = 0;
    const double us = time_us(
        [&](int c) {
          const Weights wc = weights(c);
          launch_pdl(gu, kShTiles + kSlots * kSlotTiles, kWarps * 32, 0, nullptr, wc, dx, dsh, drt, dcnt);
          launch_pdl(dn, kDownBlocks, kWarps * 32, 0, nullptr, wc, dsh, drt, dy, dcnt, iter++);
        },
        copies, 200);
    std::vector<float> y(kHidden);
    CHECK(cudaMemcpy(y.data(), dy, kHidden * 4, cudaMemcpyDeviceToHost));
    const double err = rel_err(y, ref);
    if (mode == kPdl) first = y;
    const bool same = std::memcmp(y.data(), first.data(), kHidden * 4) == 0;
    std::printf("  %-8s %7.2f us a (gate_up, down) pair  err %.1e%s  %s\n", kModeNames[mode], us, err,
                err < 1e-4 ? "" : "  WRONG", same ? "bits = pdl" : "BITS DIFFER");
  }
  return 0;
}
