/*
 * rgu_timeline.cuh - the timeline stamps of router_experts_gate_up and experts_down (a measurement build only,
 * -DTM_RGU_TIMELINE=1), included by their two sources before router.cuh. Each source holds its own copy of the rows
 * (no relocatable device code: the product's kernels stay whole-program compiled); take_timeline_rows copies one
 * source's rows out and clears them, and tm_cuda_rgu_timeline joins the two copies (their rows do not overlap in a
 * decode step).
 */
#ifndef TM_CUDA_RGU_TIMELINE_CUH
#define TM_CUDA_RGU_TIMELINE_CUH

#include <cuda_runtime.h>

#include <cstdint>

namespace tm_cuda {
namespace {
// ---- a measurement build only (-DTM_RGU_TIMELINE=1; results/NOTES.md lesson 46 a) ----
// Per block of the latest router_experts_gate_up launch: the global timer (ns) at its start, after pdl_wait,
// when its role is known, when its inputs are ready (shared: h normalised; router: its logits stored; routed:
// the flag acquired) and the latest end of its warps; its role (0 router, 1 shared, 2 routed) and SM. The blocks
// of the experts_down launch after it follow from row kDownTimelineRow0 (role 3; its third and fourth stamps are
// when the block's last routed warp and its last shared warp finished their dot products), on the same clock, and
// the last row (no decode block reaches it) holds router_topk_warp's steps (role 4, through router.cuh's
// TM_TOPK_STAMP hook: poll start, logits in, softmax, picks, ids stored).
// tm_cuda_rgu_timeline copies the rows out and clears them (scripts/rgu_timeline.py). Without the flag the stamps
// are empty and the kernels are the product's, bit for bit.
#ifndef TM_RGU_TIMELINE
#define TM_RGU_TIMELINE 0
#endif
#if TM_RGU_TIMELINE
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
}  // namespace
struct TimelineRow {
  unsigned long long t[5];
  uint32_t role, sm;
};
static_assert(sizeof(TimelineRow) == 48, "scripts/rgu_timeline.py's ROW");
// moe_experts_down.cu's rows (its take_timeline_rows), for tm_cuda_rgu_timeline in moe_router_gate_up.cu
bool take_down_timeline_rows(TimelineRow* host, int64_t n);
namespace {
constexpr int kTimelineRows = 8192;
constexpr uint32_t kDownTimelineRow0 = 4096;
__device__ TimelineRow rgu_timeline[kTimelineRows];
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(v));
  return v;
}
// row0: kDownTimelineRow0 for the down's blocks (its first token's only)
__device__ __forceinline__ void stamp(int k, uint32_t row0 = 0) {
  const uint32_t r = row0 + blockIdx.x;
  if (threadIdx.x == 0 && blockIdx.y == 0 && r < kTimelineRows) rgu_timeline[r].t[k] = global_ns();
}
__device__ __forceinline__ void stamp_role(uint32_t role, uint32_t row0 = 0) {
  const uint32_t r = row0 + blockIdx.x;
  if (threadIdx.x == 0 && blockIdx.y == 0 && r < kTimelineRows) {
    rgu_timeline[r].role = role;
    rgu_timeline[r].sm = sm_id();
  }
}
// Stamp k at the latest of the calling warps (the rows start cleared: tm_cuda_rgu_timeline zeroes them).
__device__ __forceinline__ void stamp_latest(int k, uint32_t row0 = 0) {
  const uint32_t r = row0 + blockIdx.x;
  if ((threadIdx.x & 31) == 0 && blockIdx.y == 0 && r < kTimelineRows) atomicMax(&rgu_timeline[r].t[k], global_ns());
}
// The end of the block's last warp.
__device__ __forceinline__ void stamp_end(uint32_t row0 = 0) { stamp_latest(4, row0); }
// One step of the publishing router block's top-k, by lane 0 of its warp.
__device__ __forceinline__ void stamp_topk(int k) {
  if ((threadIdx.x & 31) == 0) {
    rgu_timeline[kTimelineRows - 1].t[k] = global_ns();
    rgu_timeline[kTimelineRows - 1].role = 4;
  }
}
#define TM_TOPK_STAMP(k) stamp_topk(k)
// This source's first n rows into host memory, then all of them zeroed (rows no later launch stamps, e.g. a
// prefill's larger grid, would otherwise look like the next launch's).
inline bool take_timeline_rows(TimelineRow* host, int64_t n) {
  void* dev = nullptr;
  return cudaDeviceSynchronize() == cudaSuccess &&
         cudaMemcpyFromSymbol(host, rgu_timeline, static_cast<size_t>(n) * sizeof(TimelineRow)) == cudaSuccess &&
         cudaGetSymbolAddress(&dev, rgu_timeline) == cudaSuccess &&
         cudaMemset(dev, 0, sizeof(rgu_timeline)) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
}
#else
__device__ __forceinline__ void stamp(int, uint32_t = 0) {}
__device__ __forceinline__ void stamp_role(uint32_t, uint32_t = 0) {}
__device__ __forceinline__ void stamp_latest(int, uint32_t = 0) {}
__device__ __forceinline__ void stamp_end(uint32_t = 0) {}
constexpr uint32_t kDownTimelineRow0 = 0;
#endif

}  // namespace
}  // namespace tm_cuda

#endif
