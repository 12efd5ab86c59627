/*
 * common.cuh - internal to csrc/cuda: error checks, launch limits, the one launch path (with programmatic
 * dependent launch) and its protocol, small device helpers (fp16/bf16 widening, warp reductions in a fixed
 * butterfly order). Every .cu of the CUDA backend includes it.
 *
 * Error handling: every CUDA runtime call goes through TM_CUDA_TRY (which names the kernel and the call), every
 * launch goes through launch(), which checks it (cudaGetLastError; with TM_DEBUG_SYNC also a stream synchronize,
 * skipped while the stream is being captured). No launcher calls anything illegal during stream capture: no
 * synchronisation, no allocation; device limits are cached on first use (tm_cuda::get_limits).
 */
#ifndef TORNADO_MOE_CUDA_COMMON_CUH
#define TORNADO_MOE_CUDA_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "backends.h"
#include "qtypes.h"

namespace tm_cuda {

// ---- error checks -----------------------------------------------------------------------------------------

#define TM_CUDA_TRY(expr, what)                                                                          \
  do {                                                                                                   \
    const cudaError_t tm_cuda_err_ = (expr);                                                             \
    if (tm_cuda_err_ != cudaSuccess)                                                                     \
      return tm_set_error(TM_ERR_CUDA, "%s: %s failed: %s", (what), #expr, cudaGetErrorString(tm_cuda_err_)); \
  } while (0)

// Checks the launch just made on `stream` (and, under TM_DEBUG_SYNC, its completion when not capturing).
int launch_check(cudaStream_t stream, const char* kernel);

// ---- launch limits ----------------------------------------------------------------------------------------

// The limits the launchers plan with: the current device's values (cached per device on first use), lowered by
// the test caps of tm_set_launch_limits_for_testing.
struct Limits {
  int device;
  int sm_count;
  int64_t max_grid_x;   // blocks in x per launch
  int64_t max_grid_yz;  // blocks in y (and z) per launch: min(65535, device y/z limits, test cap)
  int64_t smem_block;   // dynamic + static shared memory a block may use: min(opt-in limit, test cap)
  bool pdl;             // launch with programmatic dependent launch (TORNADO_MOE_PDL=0 turns it off)
  int cc_major;         // compute capability (the copy engine's bulk copies need 9)
  bool ffn_one_launch;  // tm_router_experts_ffn's persistent launch where it applies (tm_set_ffn_one_launch, or
                        // TORNADO_MOE_FFN_ONE_LAUNCH=1; off by default: slower on the H200)
};
int get_limits(Limits* out);

// Raises the dynamic shared-memory limit of `func` to `bytes` when that is above the 48 KB default (cached per
// device and kernel, so the attribute call happens once; it is legal during stream capture).
int ensure_dynamic_smem(const void* func, int64_t bytes, const char* kernel);

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// A kernel's launch configuration, with programmatic dependent launch when `pdl` (`attr`: the attribute's storage,
// which must outlive the launch). Also what scripts/proto's experiments launch with.
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                                        cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr->val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cfg;
}

// Every kernel is launched through launch(): with programmatic dependent launch (PDL) the next kernel of the
// stream may start while this one drains, and every kernel follows one protocol (see pdl_wait below), so the
// overlap never changes a result.
template <typename... KArgs, typename... Args>
int launch(const Limits& lim, const char* fn, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
           cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = launch_config(grid, block, smem, stream, lim.pdl, &attr);
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) return tm_set_error(TM_ERR_CUDA, "%s: kernel launch failed: %s", fn, cudaGetErrorString(err));
  return launch_check(stream, fn);
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 1 when `p` is a multiple of `align` bytes.
inline bool aligned(const void* p, uintptr_t align) { return (reinterpret_cast<uintptr_t>(p) % align) == 0; }

// Launchers require the natural alignment of the weight format (2 bytes for fp16/bf16 and the block formats,
// whose blocks are read as 16-bit words; 4 bytes for F32) and 4 bytes for float32 activations.
int check_weight_alignment(const char* kernel, const char* arg, int qtype, const void* p);
int check_f32_alignment(const char* kernel, const char* arg, const void* p);

// Blocks per SM the weight kernels (matmul, moe, qkv_rope) are compiled for: __launch_bounds__'s register cap.
#ifndef TM_WEIGHT_MIN_BLOCKS
#define TM_WEIGHT_MIN_BLOCKS 2
#endif

// ---- programmatic dependent launch -------------------------------------------------------------------------
// The protocol every kernel follows: before pdl_wait() it may only read immutable data (weights) and issue cache
// prefetches; pdl_wait() returns once the previous kernel of the stream has completed and its writes are visible;
// pdl_trigger() comes after pdl_wait() and lets the next kernel start. Hence when a kernel starts, every kernel
// before its predecessor has completed, and a kernel completes only after its predecessor did. Both are no-ops
// for a launch without the PDL attribute. A kernel that updates values in place that other blocks of it read
// around (a residual row, a rotated q) reads them with __ldcg, so no multiprocessor's L1 keeps a line that another
// one rewrites while the next kernel may already run.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_begin() {
  pdl_wait();
  pdl_trigger();
}

// tm_advance_position's update, from pos[0] as read before (p_old): pos[0] = p_old + delta (two's-complement wrap,
// as the CPU kernel), and log[p] = token for the new position p inside [0, log_len) when log is given. One thread.
__device__ __forceinline__ void advance_position_from(int32_t* pos, int32_t p_old, int32_t delta, int32_t token,
                                                      int32_t* log, int64_t log_len) {
  const int32_t p = static_cast<int32_t>(static_cast<uint32_t>(p_old) + static_cast<uint32_t>(delta));
  pos[0] = p;
  if (log != nullptr && p >= 0 && p < log_len) log[p] = token;
}

// Barrier `id` (1-15; 0 is __syncthreads) of the kThreads threads (whole warps) that reach it: a block whose warps
// have different roles synchronises each role's warps alone.
template <int kThreads>
__device__ __forceinline__ void named_barrier(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// Before pdl_wait, the value a small device word (the decode position) holds now: a guess only, since the previous
// kernel may still rewrite it. A kernel uses it for work it checks after pdl_wait (hints, or results it recomputes
// when the word moved), never for a result as it stands. Volatile: the load is issued where it is written.
__device__ __forceinline__ int32_t peek_before_wait(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// A float a kernel needs only after its dot products (a bias, the residual it adds to), loaded before them so
// that its round trip overlaps theirs instead of following them. A strong load at gpu scope: it reads around L1
// as __ldcg does (common for values rewritten in place), and ptxas keeps it where it is written, where it sinks
// __ldg / __ldcg loads down to their first use (results/NOTES.md, lesson 21).
__device__ __forceinline__ float ld_ahead(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];\n" : "=f"(v) : "l"(p) : "memory");
  return v;
}

// A hint that the 128-byte line holding p will be read soon (no fault, no effect on results).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// The same hint into this multiprocessor's L1: for data the block reads once more soon (an attention tile's values).
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
}

// The first `lines` 128-byte lines of a row (at most `bytes`) into this multiprocessor's L1, one prefetch per lane
// and line: fire-and-forget requests that hold no register, for a row the warp reads after a step of its own
// (a norm) that does not depend on it.
__device__ __forceinline__ void prefetch_row_l1(const void* row, int64_t bytes, int64_t lines, int lane) {
  const char* p = static_cast<const char*>(row);
  const int64_t end = bytes < 128 * lines ? bytes : 128 * lines;
  for (int64_t off = 128 * lane; off < end; off += 32 * 128) prefetch_l1(p + off);
}

// The lines of a weight row into L2: what a kernel may do before pdl_wait (weights never change), so its first
// loads hit L2 while the previous kernel still runs. On sm_90 lane 0 hands the whole row to the copy engine (TMA)
// in one instruction, whose requests do not queue in the multiprocessor's load path (H200, results/NOTES.md v4h:
// the output head 94.8 -> 92.2 us); the range is narrowed to 16-byte boundaries, as the instruction requires
// (the bytes cut off share a sector with the rest or are not prefetched: a hint either way).
__device__ __forceinline__ void prefetch_row_l2(const void* row, int64_t bytes, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uintptr_t a = (reinterpret_cast<uintptr_t>(row) + 15) & ~uintptr_t{15};
  const uintptr_t e = (reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(bytes)) & ~uintptr_t{15};
  if (lane == 0 && e > a)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(a), "r"(static_cast<uint32_t>(e - a)));
#else
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 128 * lane; off < bytes; off += 32 * 128) prefetch_l2(p + off);
#endif
}

// ---- weight rows copied into shared memory by the copy engine (sm_90) ---------------------------------------
// A warp hands a whole row to the TMA unit in one instruction (lane 0), with a transaction barrier in shared memory
// that completes when the bytes have landed: the bytes in flight then cost no registers, and the dot product reads
// them at shared-memory latency. Copies need 16-byte aligned addresses and sizes. A barrier is used for one phase
// per kernel (wait parity 0), which is all the kernels need. sm_90 instructions, as pdl_wait's.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The transaction barrier's operations (one thread each, but mbar_wait: every thread that waits).
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// Makes barrier initialisations visible to the copy engine (after mbar_init, before the copies that use them).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` of copies to land before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Waits until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t b = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(b), "r"(parity)
        : "memory");
  } while (!done);
}
// The copy engine moves `bytes` (a multiple of 16, both addresses 16-byte aligned) from src to dst and completes
// them on `bar` (armed for them with mbar_arrive_expect_tx).
__device__ __forceinline__ void bulk_copy_to_smem(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Lane 0: arm `bar` for `bytes` and start the copy of the row at src to dst.
__device__ __forceinline__ void bulk_row_to_smem(uint8_t* dst, const uint8_t* src, uint32_t bytes, uint64_t* bar) {
  mbar_init(bar, 1);
  mbar_init_fence();
  mbar_arrive_expect_tx(bar, bytes);
  bulk_copy_to_smem(dst, src, bytes, bar);
}
// Every lane: wait until the copy armed on `bar` has landed (after a __syncwarp that orders lane 0's init).
__device__ __forceinline__ void bulk_wait(uint64_t* bar) { mbar_wait(bar, 0); }

// ---- flags between the blocks of one grid ------------------------------------------------------------------
// Integer words only (never a floating-point atomic). A block may only wait for blocks that are already running
// (kernels hand out roles by an atomic ticket for that), so a wait always ends.
// A flag is one 64-bit word, (tag << 32) | payload, written with one store: kernels tag with the call's epoch, so
// that a flag never needs clearing, and a reader that sees the tag has the payload from the same load.
// - flag_release publishes what a block stored before it: the block's threads store, __syncthreads(), then one
//   thread calls it (the barrier makes their stores the releasing thread's predecessors); a consumer acquires with
//   ld_acquire_u64, after which all its threads (past a barrier) see those stores.
// - tagged_store publishes the payload alone (a relaxed store, no fence: a MEMBAR under a saturated memory system
//   took microseconds, results/NOTES.md lesson 47); readers poll with ld_relaxed_u64 and trust only the payload.
// Polling a released flag with relaxed loads and one fence.acq_rel after was slower on the H200 than polling it
// with acquire loads (the MEMBAR lies on every waiting block's path: results/NOTES.md v4i).
#ifndef TM_FLAG_SPIN_NS
#define TM_FLAG_SPIN_NS 32
#endif
__device__ __forceinline__ unsigned long long tagged(uint32_t tag, uint32_t payload) {
  return (static_cast<unsigned long long>(tag) << 32) | payload;
}
__device__ __forceinline__ uint32_t tag_of(unsigned long long w) { return static_cast<uint32_t>(w >> 32); }
__device__ __forceinline__ void flag_release(unsigned long long* flag, uint32_t tag, uint32_t payload) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;\n" ::"l"(flag), "l"(tagged(tag, payload)) : "memory");
}
__device__ __forceinline__ void tagged_store(unsigned long long* p, uint32_t tag, uint32_t payload) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;\n" ::"l"(p), "l"(tagged(tag, payload)) : "memory");
}
__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long* p) {
  unsigned long long w;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];\n" : "=l"(w) : "l"(p) : "memory");
  return w;
}
__device__ __forceinline__ unsigned long long ld_acquire_u64(const unsigned long long* p) {
  unsigned long long w;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(w) : "l"(p) : "memory");
  return w;
}

// ---- device helpers ---------------------------------------------------------------------------------------

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float fp16_bits_to_f32(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ uint32_t ldg_u16(const uint8_t* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}

// Butterfly sum over the 32 lanes: every lane ends with the same value, and the order of the additions depends
// only on the lane layout (never on scheduling).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}

// Stable sigmoid / silu with the header's formulas (IEEE division, accurate expf).
__device__ __forceinline__ float sigmoid_f32(float z) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-z))); }
__device__ __forceinline__ float silu_f32(float g) { return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g))); }

}  // namespace tm_cuda

#endif
