/*
 * device.cu - the CUDA backend's device plumbing: compiled/device-count/properties queries, the launch limits
 * every launcher plans with (device values cached per device on first use, lowered by the test hook), shared-
 * memory opt-in, whole-stream CUDA graphs (capture, instantiate, launch, destroy), stream synchronisation, and
 * tm_advance_position (one thread of one block: pos[0] += delta, two's-complement wrap like the CPU kernel).
 */
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "common.cuh"

namespace tm_cuda {
namespace {

struct DeviceInfo {
  bool valid = false;
  int sm_count = 0;
  int max_grid_x = 0, max_grid_y = 0, max_grid_z = 0;
  int64_t smem_optin = 0;
  int64_t l2_bytes = 0;
  int cc_major = 0;
  char name[256] = {0};
};

constexpr int kMaxDevices = 64;
std::mutex g_info_mutex;
DeviceInfo g_info[kMaxDevices];

// Test caps (0 = the device's own value).
std::atomic<int64_t> g_cap_smem{0};
std::atomic<int> g_cap_grid_yz{0};
// tm_set_ffn_one_launch's choice (-1: the environment's).
std::atomic<int> g_ffn_one_launch{-1};

int device_info(int device, DeviceInfo* out) {
  if (device < 0 || device >= kMaxDevices)
    return tm_set_error(TM_ERR_CUDA, "tm_cuda: device ordinal %d outside the supported range [0, %d)", device,
                        kMaxDevices);
  std::lock_guard<std::mutex> lock(g_info_mutex);
  DeviceInfo& info = g_info[device];
  if (!info.valid) {
    const char* what = "tm_cuda device query";
    int v = 0;
    TM_CUDA_TRY(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device), what);
    info.sm_count = v;
    TM_CUDA_TRY(cudaDeviceGetAttribute(&v, cudaDevAttrMaxGridDimX, device), what);
    info.max_grid_x = v;
    TM_CUDA_TRY(cudaDeviceGetAttribute(&v, cudaDevAttrMaxGridDimY, device), what);
    info.max_grid_y = v;
    TM_CUDA_TRY(cudaDeviceGetAttribute(&v, cudaDevAttrMaxGridDimZ, device), what);
    info.max_grid_z = v;
    TM_CUDA_TRY(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), what);
    info.smem_optin = v;
    TM_CUDA_TRY(cudaDeviceGetAttribute(&v, cudaDevAttrL2CacheSize, device), what);
    info.l2_bytes = v;
    TM_CUDA_TRY(cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, device), what);
    info.cc_major = v;
    cudaDeviceProp prop;
    TM_CUDA_TRY(cudaGetDeviceProperties(&prop, device), what);
    std::snprintf(info.name, sizeof(info.name), "%s", prop.name);
    info.valid = true;
  }
  *out = info;
  return TM_OK;
}

struct SmemOptIn {
  const void* func;
  int device;
  int64_t bytes;
};
std::mutex g_smem_mutex;
std::vector<SmemOptIn> g_smem_optins;

}  // namespace

int get_limits(Limits* out) {
  int device = 0;
  TM_CUDA_TRY(cudaGetDevice(&device), "tm_cuda launch limits");
  DeviceInfo info;
  TM_TRY(device_info(device, &info));
  out->device = device;
  out->sm_count = info.sm_count;
  out->max_grid_x = info.max_grid_x;
  int64_t yz = 65535;
  if (info.max_grid_y < yz) yz = info.max_grid_y;
  if (info.max_grid_z < yz) yz = info.max_grid_z;
  const int cap_grid = g_cap_grid_yz.load(std::memory_order_relaxed);
  if (cap_grid > 0 && cap_grid < yz) yz = cap_grid;
  out->max_grid_yz = yz;
  int64_t smem = info.smem_optin;
  const int64_t cap_smem = g_cap_smem.load(std::memory_order_relaxed);
  if (cap_smem > 0 && cap_smem < smem) smem = cap_smem;
  out->smem_block = smem;
  // Read once per process: TORNADO_MOE_PDL=0 launches every kernel without programmatic dependent launch;
  // TORNADO_MOE_FFN_ONE_LAUNCH=1 lets tm_router_experts_ffn run as one persistent launch (else its two).
  static const bool pdl = [] {
    const char* v = std::getenv("TORNADO_MOE_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  static const bool ffn_env = [] {
    const char* v = std::getenv("TORNADO_MOE_FFN_ONE_LAUNCH");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  const int ffn_set = g_ffn_one_launch.load(std::memory_order_relaxed);
  out->pdl = pdl;
  out->cc_major = info.cc_major;
  out->ffn_one_launch = ffn_set >= 0 ? ffn_set == 1 : ffn_env;
  return TM_OK;
}

int ensure_dynamic_smem(const void* func, int64_t bytes, const char* kernel) {
  if (bytes <= 48 * 1024) return TM_OK;  // the default limit needs no opt-in
  int device = 0;
  TM_CUDA_TRY(cudaGetDevice(&device), kernel);
  std::lock_guard<std::mutex> lock(g_smem_mutex);
  for (SmemOptIn& o : g_smem_optins) {
    if (o.func == func && o.device == device) {
      if (o.bytes >= bytes) return TM_OK;
      TM_CUDA_TRY(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
                  kernel);
      o.bytes = bytes;
      return TM_OK;
    }
  }
  TM_CUDA_TRY(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
              kernel);
  g_smem_optins.push_back(SmemOptIn{func, device, bytes});
  return TM_OK;
}

int launch_check(cudaStream_t stream, const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return tm_set_error(TM_ERR_CUDA, "%s: kernel launch failed: %s", kernel, cudaGetErrorString(err));
#ifdef TM_DEBUG_SYNC
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return TM_OK;  // cannot tell: do not synchronise a stream that may be capturing
  }
  if (status == cudaStreamCaptureStatusNone) {
    const cudaError_t done = cudaStreamSynchronize(stream);
    if (done != cudaSuccess)
      return tm_set_error(TM_ERR_CUDA, "%s: kernel failed (TM_DEBUG_SYNC): %s", kernel, cudaGetErrorString(done));
  }
#else
  (void)stream;
#endif
  return TM_OK;
}

int check_weight_alignment(const char* kernel, const char* arg, int qtype, const void* p) {
  const uintptr_t need = qtype == TM_F32 ? 4 : qtype == TM_Q8_0_TILED ? 16 : 2;  // Q8_0_TILED: up to 16-byte loads
  if (aligned(p, need)) return TM_OK;
  return tm_set_error(TM_ERR_INVALID_ARGUMENT,
                      "%s: argument '%s' (%s weights) must be %d-byte aligned on CUDA (address %p)", kernel, arg,
                      tm_ggml_type_name(qtype), static_cast<int>(need), p);
}

int check_f32_alignment(const char* kernel, const char* arg, const void* p) {
  if (p == nullptr || aligned(p, 4)) return TM_OK;
  return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: float32 argument '%s' must be 4-byte aligned (address %p)",
                      kernel, arg, p);
}

namespace {
__global__ void advance_position_kernel(int32_t* pos, int32_t delta, const int32_t* token, int32_t* log,
                                        int64_t log_len) {
  pdl_begin();
  advance_position_from(pos, pos[0], delta, log != nullptr ? token[0] : 0, log, log_len);
}
}  // namespace

}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" {

int tm_cuda_compiled_impl(void) { return 1; }

int tm_cuda_device_count_impl(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: report 0 and leave no sticky error behind
    return 0;
  }
  return n;
}

int tm_cuda_device_props_impl(tm_device_props* out) {
  int device = 0;
  TM_CUDA_TRY(cudaGetDevice(&device), "tm_cuda_device_props");
  DeviceInfo info;
  TM_TRY(device_info(device, &info));
  std::memset(out, 0, sizeof(*out));
  out->sm_count = info.sm_count;
  out->max_grid_y = info.max_grid_y;
  out->max_grid_z = info.max_grid_z;
  out->smem_per_block_optin = info.smem_optin;
  out->l2_bytes = info.l2_bytes;
  std::snprintf(out->name, sizeof(out->name), "%s", info.name);
  return TM_OK;
}

int tm_cuda_set_launch_limits_impl(int64_t smem_per_block, int max_grid_yz) {
  g_cap_smem.store(smem_per_block, std::memory_order_relaxed);
  g_cap_grid_yz.store(max_grid_yz, std::memory_order_relaxed);
  return TM_OK;
}

int tm_cuda_set_ffn_one_launch_impl(int on) {
  g_ffn_one_launch.store(on, std::memory_order_relaxed);
  return TM_OK;
}

int tm_cuda_graph_begin_capture_impl(void* stream) {
  // Thread-local mode: launches from any thread are captured; only this thread is barred from unsafe calls.
  TM_CUDA_TRY(cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeThreadLocal),
              "tm_cuda_graph_begin_capture");
  return TM_OK;
}

int tm_cuda_graph_end_capture_impl(void* stream, void** graph_exec_out) {
  *graph_exec_out = nullptr;
  cudaGraph_t graph = nullptr;
  TM_CUDA_TRY(cudaStreamEndCapture(as_stream(stream), &graph), "tm_cuda_graph_end_capture");
  if (graph == nullptr)
    return tm_set_error(TM_ERR_CUDA, "tm_cuda_graph_end_capture: the capture produced no graph");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  const cudaError_t destroyed = cudaGraphDestroy(graph);  // the executable graph keeps what it needs
  if (err != cudaSuccess)
    return tm_set_error(TM_ERR_CUDA, "tm_cuda_graph_end_capture: cudaGraphInstantiate failed: %s",
                        cudaGetErrorString(err));
  if (destroyed != cudaSuccess) {
    (void)cudaGraphExecDestroy(exec);
    return tm_set_error(TM_ERR_CUDA, "tm_cuda_graph_end_capture: cudaGraphDestroy failed: %s",
                        cudaGetErrorString(destroyed));
  }
  *graph_exec_out = static_cast<void*>(exec);
  return TM_OK;
}

int tm_cuda_graph_launch_impl(void* graph_exec, void* stream) {
  TM_CUDA_TRY(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph_exec), as_stream(stream)), "tm_cuda_graph_launch");
  return TM_OK;
}

int tm_cuda_graph_destroy_impl(void* graph_exec) {
  TM_CUDA_TRY(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_exec)), "tm_cuda_graph_destroy");
  return TM_OK;
}

int tm_cuda_stream_synchronize_impl(void* stream) {
  TM_CUDA_TRY(cudaStreamSynchronize(as_stream(stream)), "tm_stream_synchronize");
  return TM_OK;
}

int tm_cuda_advance_position(int32_t* pos, int32_t delta, const int32_t* token, int32_t* log, int64_t log_len,
                             void* stream) {
  Limits lim;
  TM_TRY(get_limits(&lim));
  return launch(lim, "tm_advance_position", advance_position_kernel, dim3(1), dim3(1), 0, as_stream(stream), pos,
                delta, token, log, log_len);
}

}  // extern "C"
