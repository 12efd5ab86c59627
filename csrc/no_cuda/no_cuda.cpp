// no_cuda.cpp - the CUDA backend of a library built without nvcc: every tm_cuda_* entry fails with TM_ERR_NO_CUDA
// and a message saying so, the library reports itself as CPU-only and sees no CUDA device.
#include "backends.h"

namespace {
int no_cuda(const char* what) {
  return tm_set_error(TM_ERR_NO_CUDA,
                      "%s: tornado-moe was built without CUDA (no nvcc at build time, or TORNADO_MOE_CUDA=OFF); use "
                      "TM_DEVICE_CPU or rebuild with the CUDA toolkit installed",
                      what);
}
}  // namespace

extern "C" {

int tm_cuda_embedding(int, const void*, const int32_t*, float*, int64_t, int64_t, int64_t, void*) {
  return no_cuda("tm_embedding");
}
int tm_cuda_rmsnorm(const float*, const float*, float*, int64_t, int64_t, float, void*) {
  return no_cuda("tm_rmsnorm");
}
int tm_cuda_rmsnorm_factors(const float*, const float*, float*, float*, float*, int64_t, int64_t, float, void*) {
  return no_cuda("tm_rmsnorm_factors");
}
int tm_cuda_matmul(int, const void*, const float*, const float*, float*, int64_t, int64_t, int64_t, int, const float*,
                   const uint8_t*, const float*, float, const float*, float*, float*, uint8_t*, void*) {
  return no_cuda("tm_matmul");
}
int tm_cuda_rope_kv_append(float*, const float*, const float*, float*, float*, const int32_t*, int64_t, int64_t,
                           int64_t, int64_t, int64_t, float, int, void*) {
  return no_cuda("tm_rope_kv_append");
}
int tm_cuda_qkv_rope(int, const float*, const float*, const float*, const float*, float, const void*, const void*,
                     const void*,
                     const float*, const float*, const float*, float*, float*, float*, const int32_t*, int64_t, int64_t, int64_t,
                     int64_t, int64_t, int64_t, float, int, const uint8_t*, void*) {
  return no_cuda("tm_qkv_rope");
}
int tm_cuda_attention(const float*, const float*, const float*, float*, const int32_t*, int64_t, int64_t, int64_t,
                      int64_t, int64_t, int32_t*, uint8_t*, void*) {
  return no_cuda("tm_attention");
}
int tm_cuda_router_topk(const float*, const float*, int32_t*, float*, int64_t, int64_t, int64_t, int64_t, int,
                        void*) {
  return no_cuda("tm_router_topk");
}
int tm_cuda_rmsnorm_router_topk(const float*, const float*, float, float*, const float*, int32_t*, float*, int64_t,
                                int64_t, int64_t, int64_t, int, void*) {
  return no_cuda("tm_rmsnorm_router_topk");
}
int tm_cuda_moe_gate_up(int, const void*, const void*, const float*, const int32_t*, float*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, const float*, void*) {
  return no_cuda("tm_moe_gate_up");
}
int tm_cuda_experts_gate_up(int, const void*, const void*, float*, int64_t, const void*, const void*, const float*,
                            const int32_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, void*) {
  return no_cuda("tm_experts_gate_up");
}
int tm_cuda_router_experts_gate_up(const float*, const float*, float, float*, const float*, int32_t*, float*, int,
                                   const void*, const void*, float*, int64_t, const float*, float*, const void*,
                                   const void*, float*, int64_t, int64_t, int64_t, int64_t, int, int64_t, int32_t*,
                                   uint8_t*, uint8_t*, const float*, const float*, const uint8_t*, void*) {
  return no_cuda("tm_router_experts_gate_up");
}
int tm_cuda_router_experts_ffn(float*, const float*, float, float*, const float*, int32_t*, float*, int,
                               const void*, const void*, const void*, float*, int64_t, const float*, float*,
                               const void*, const void*, const void*, float*, int64_t, int64_t, int64_t, int64_t, int,
                               int64_t, int32_t*, void*) {
  return TM_NOT_APPLICABLE;  // the two calls, which report the missing CUDA
}
int tm_cuda_router_experts_ffn_launches(int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {
  return no_cuda("tm_router_experts_ffn_launches");
}
int tm_cuda_experts_down_accumulate(int, const void*, const float*, const float*, const float*, int64_t, const void*,
                                    const float*, const int32_t*, const float*, const float*, float*, const float*,
                                    float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, const uint8_t*,
                                    const uint8_t*, uint8_t*, void*) {
  return no_cuda("tm_experts_down_accumulate");
}
int tm_cuda_moe_down_accumulate(int, const void*, const float*, const int32_t*, const float*, const float*,
                                const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                void*) {
  return no_cuda("tm_moe_down_accumulate");
}
int tm_cuda_argmax(const float*, int32_t*, int64_t, int64_t, void*) { return no_cuda("tm_argmax"); }
int tm_cuda_sample(const float*, int32_t*, int64_t, float, float, int64_t, uint64_t, const int32_t*, void*) {
  return no_cuda("tm_sample");
}
int tm_cuda_advance_position(int32_t*, int32_t, const int32_t*, int32_t*, int64_t, void*) {
  return no_cuda("tm_advance_position");
}
int tm_cuda_argmax_advance(const float*, int32_t*, int64_t, int32_t*, int32_t, int32_t*, int64_t, void*) {
  return no_cuda("tm_argmax_advance");
}

int tm_cuda_compiled_impl(void) { return 0; }
int tm_cuda_device_count_impl(void) { return 0; }
int tm_cuda_device_props_impl(tm_device_props*) { return no_cuda("tm_cuda_device_props"); }
int tm_cuda_set_launch_limits_impl(int64_t, int) { return no_cuda("tm_set_launch_limits_for_testing"); }
int tm_cuda_set_ffn_one_launch_impl(int) { return TM_OK; }  // nothing to choose without CUDA
int tm_cuda_graph_begin_capture_impl(void*) { return no_cuda("tm_cuda_graph_begin_capture"); }
int tm_cuda_graph_end_capture_impl(void*, void**) { return no_cuda("tm_cuda_graph_end_capture"); }
int tm_cuda_graph_launch_impl(void*, void*) { return no_cuda("tm_cuda_graph_launch"); }
int tm_cuda_graph_destroy_impl(void*) { return no_cuda("tm_cuda_graph_destroy"); }
int tm_cuda_stream_synchronize_impl(void*) { return no_cuda("tm_stream_synchronize"); }

}  // extern "C"
