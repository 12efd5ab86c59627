// kernel_table.cpp - every kernel by index for tm_invoke (the Java route): one row per kernel with its name, its
// signature (one letter per argument between `device` and `stream`, see tornado_moe.h) and an unpacker that turns
// the 64-bit argument words back into the C types and calls the public tm_* function (which validates).
#include <cinttypes>
#include <cstring>

#include "backends.h"

namespace {

// Argument words, as documented in tornado_moe.h.
template <typename T>
T* ptr(uint64_t w) { return reinterpret_cast<T*>(static_cast<uintptr_t>(w)); }
int64_t i64(uint64_t w) { return static_cast<int64_t>(w); }
int i32(uint64_t w) { return static_cast<int>(static_cast<int64_t>(w)); }
float f32(uint64_t w) {
  uint32_t bits = static_cast<uint32_t>(w & 0xffffffffu);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

using Invoker = int (*)(tm_device device, const uint64_t* a, void* stream);

struct KernelRow {
  const char* name;
  const char* signature;
  Invoker invoke;
  uint32_t int32_words;  // bit k: word k is an 'i' passed to an int32_t parameter (must fit)
};

bool fits_int(uint64_t w) {
  int64_t v = static_cast<int64_t>(w);
  return v >= INT32_MIN && v <= INT32_MAX;
}

const KernelRow kKernels[] = {
    {"embedding", "qpppiii",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_embedding(d, i32(a[0]), ptr<const void>(a[1]), ptr<const int32_t>(a[2]), ptr<float>(a[3]),
                           i64(a[4]), i64(a[5]), i64(a[6]), s);
     },
     0},
    {"rmsnorm", "pppiif",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_rmsnorm(d, ptr<const float>(a[0]), ptr<const float>(a[1]), ptr<float>(a[2]), i64(a[3]), i64(a[4]),
                         f32(a[5]), s);
     },
     0},
    {"rmsnorm_factors", "pppnpiif",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_rmsnorm_factors(d, ptr<const float>(a[0]), ptr<const float>(a[1]), ptr<float>(a[2]),
                                 ptr<float>(a[3]), ptr<float>(a[4]), i64(a[5]), i64(a[6]), f32(a[7]), s);
     },
     0},
    {"matmul", "qppnpiiibnnnfnnnn",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_matmul(d, i32(a[0]), ptr<const void>(a[1]), ptr<const float>(a[2]), ptr<const float>(a[3]),
                        ptr<float>(a[4]), i64(a[5]), i64(a[6]), i64(a[7]), i32(a[8]), ptr<const float>(a[9]),
                        ptr<const uint8_t>(a[10]), ptr<const float>(a[11]), f32(a[12]), ptr<const float>(a[13]),
                        ptr<float>(a[14]), ptr<float>(a[15]), ptr<uint8_t>(a[16]), s);
     },
     0},
    {"rope_kv_append", "ppppppiiiiifb",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_rope_kv_append(d, ptr<float>(a[0]), ptr<const float>(a[1]), ptr<const float>(a[2]),
                                ptr<float>(a[3]), ptr<float>(a[4]), ptr<const int32_t>(a[5]), i64(a[6]), i64(a[7]),
                                i64(a[8]), i64(a[9]), i64(a[10]), f32(a[11]), i32(a[12]), s);
     },
     0},
    {"qkv_rope", "qpnnpfpppnnnppppiiiiiifbn",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_qkv_rope(d, i32(a[0]), ptr<const float>(a[1]), ptr<const float>(a[2]), ptr<const float>(a[3]),
                          ptr<const float>(a[4]), f32(a[5]), ptr<const void>(a[6]), ptr<const void>(a[7]),
                          ptr<const void>(a[8]), ptr<const float>(a[9]), ptr<const float>(a[10]),
                          ptr<const float>(a[11]), ptr<float>(a[12]), ptr<float>(a[13]), ptr<float>(a[14]),
                          ptr<const int32_t>(a[15]), i64(a[16]), i64(a[17]), i64(a[18]), i64(a[19]), i64(a[20]),
                          i64(a[21]), f32(a[22]), i32(a[23]), ptr<const uint8_t>(a[24]), s);
     },
     0},
    {"attention", "pppppiiiiipn",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_attention(d, ptr<const float>(a[0]), ptr<const float>(a[1]), ptr<const float>(a[2]),
                           ptr<float>(a[3]), ptr<const int32_t>(a[4]), i64(a[5]), i64(a[6]), i64(a[7]), i64(a[8]),
                           i64(a[9]), ptr<int32_t>(a[10]), ptr<uint8_t>(a[11]), s);
     },
     0},
    {"router_topk", "ppppiiiib",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_router_topk(d, ptr<const float>(a[0]), ptr<const float>(a[1]), ptr<int32_t>(a[2]),
                             ptr<float>(a[3]), i64(a[4]), i64(a[5]), i64(a[6]), i64(a[7]), i32(a[8]), s);
     },
     0},
    {"rmsnorm_router_topk", "ppfppppiiiib",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_rmsnorm_router_topk(d, ptr<const float>(a[0]), ptr<const float>(a[1]), f32(a[2]), ptr<float>(a[3]),
                                     ptr<const float>(a[4]), ptr<int32_t>(a[5]), ptr<float>(a[6]), i64(a[7]),
                                     i64(a[8]), i64(a[9]), i64(a[10]), i32(a[11]), s);
     },
     0},
    {"moe_gate_up", "qpppnpiiiiiiin",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_moe_gate_up(d, i32(a[0]), ptr<const void>(a[1]), ptr<const void>(a[2]), ptr<const float>(a[3]),
                             ptr<const int32_t>(a[4]), ptr<float>(a[5]), i64(a[6]), i64(a[7]), i64(a[8]), i64(a[9]),
                             i64(a[10]), i64(a[11]), i64(a[12]), ptr<const float>(a[13]), s);
     },
     0},
    {"experts_gate_up", "qpppipppppiiiii",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_experts_gate_up(d, i32(a[0]), ptr<const void>(a[1]), ptr<const void>(a[2]), ptr<float>(a[3]),
                                 i64(a[4]), ptr<const void>(a[5]), ptr<const void>(a[6]), ptr<const float>(a[7]),
                                 ptr<const int32_t>(a[8]), ptr<float>(a[9]), i64(a[10]), i64(a[11]), i64(a[12]),
                                 i64(a[13]), i64(a[14]), s);
     },
     0},
    {"router_experts_gate_up", "ppfppppqpppinnpppiiiibipnnnnn",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_router_experts_gate_up(d, ptr<const float>(a[0]), ptr<const float>(a[1]), f32(a[2]),
                                        ptr<float>(a[3]), ptr<const float>(a[4]), ptr<int32_t>(a[5]),
                                        ptr<float>(a[6]), i32(a[7]), ptr<const void>(a[8]), ptr<const void>(a[9]),
                                        ptr<float>(a[10]), i64(a[11]), ptr<const float>(a[12]), ptr<float>(a[13]),
                                        ptr<const void>(a[14]), ptr<const void>(a[15]), ptr<float>(a[16]),
                                        i64(a[17]), i64(a[18]), i64(a[19]), i64(a[20]), i32(a[21]), i64(a[22]),
                                        ptr<int32_t>(a[23]), ptr<uint8_t>(a[24]), ptr<uint8_t>(a[25]),
                                        ptr<const float>(a[26]), ptr<const float>(a[27]),
                                        ptr<const uint8_t>(a[28]), s);
     },
     0},
    {"router_experts_ffn", "ppfppppqppppinnppppiiiibipnnn",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_router_experts_ffn(d, ptr<float>(a[0]), ptr<const float>(a[1]), f32(a[2]), ptr<float>(a[3]),
                                    ptr<const float>(a[4]), ptr<int32_t>(a[5]), ptr<float>(a[6]), i32(a[7]),
                                    ptr<const void>(a[8]), ptr<const void>(a[9]), ptr<const void>(a[10]),
                                    ptr<float>(a[11]), i64(a[12]), ptr<const float>(a[13]), ptr<float>(a[14]),
                                    ptr<const void>(a[15]), ptr<const void>(a[16]), ptr<const void>(a[17]),
                                    ptr<float>(a[18]), i64(a[19]), i64(a[20]), i64(a[21]), i64(a[22]), i32(a[23]),
                                    i64(a[24]), ptr<int32_t>(a[25]), ptr<const float>(a[26]), ptr<const float>(a[27]),
                                    ptr<const uint8_t>(a[28]), s);
     },
     0},
    {"moe_down_accumulate", "qppnnnnpiiiiiii",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_moe_down_accumulate(d, i32(a[0]), ptr<const void>(a[1]), ptr<const float>(a[2]),
                                     ptr<const int32_t>(a[3]), ptr<const float>(a[4]), ptr<const float>(a[5]),
                                     ptr<const float>(a[6]), ptr<float>(a[7]), i64(a[8]), i64(a[9]), i64(a[10]),
                                     i64(a[11]), i64(a[12]), i64(a[13]), i64(a[14]), s);
     },
     0},
    {"experts_down_accumulate", "qppnnipppnnpnnniiiiinnn",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_experts_down_accumulate(d, i32(a[0]), ptr<const void>(a[1]), ptr<const float>(a[2]),
                                         ptr<const float>(a[3]), ptr<const float>(a[4]), i64(a[5]),
                                         ptr<const void>(a[6]), ptr<const float>(a[7]), ptr<const int32_t>(a[8]),
                                         ptr<const float>(a[9]), ptr<const float>(a[10]), ptr<float>(a[11]),
                                         ptr<const float>(a[12]), ptr<float>(a[13]), ptr<float>(a[14]),
                                         i64(a[15]), i64(a[16]), i64(a[17]), i64(a[18]), i64(a[19]),
                                         ptr<const uint8_t>(a[20]), ptr<const uint8_t>(a[21]), ptr<uint8_t>(a[22]),
                                         s);
     },
     0},
    {"argmax", "ppii",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_argmax(d, ptr<const float>(a[0]), ptr<int32_t>(a[1]), i64(a[2]), i64(a[3]), s);
     },
     0},
    {"sample", "ppiffiup",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_sample(d, ptr<const float>(a[0]), ptr<int32_t>(a[1]), i64(a[2]), f32(a[3]), f32(a[4]), i64(a[5]),
                        a[6], ptr<const int32_t>(a[7]), s);
     },
     0},
    {"advance_position", "pinni",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_advance_position(d, ptr<int32_t>(a[0]), i32(a[1]), ptr<const int32_t>(a[2]), ptr<int32_t>(a[3]),
                                  i64(a[4]), s);
     },
     1u << 1},
    {"argmax_advance", "ppipini",
     [](tm_device d, const uint64_t* a, void* s) {
       return tm_argmax_advance(d, ptr<const float>(a[0]), ptr<int32_t>(a[1]), i64(a[2]), ptr<int32_t>(a[3]),
                                i32(a[4]), ptr<int32_t>(a[5]), i64(a[6]), s);
     },
     1u << 4},
};

constexpr int kKernelCount = static_cast<int>(sizeof(kKernels) / sizeof(kKernels[0]));

// 'q' and 'b' words, and the 'i' words marked in int32_words, must fit an int.
bool narrow_int_ok(const KernelRow& row, const uint64_t* args, int* bad_arg) {
  for (int k = 0; row.signature[k] != '\0'; ++k) {
    bool narrow = row.signature[k] == 'q' || row.signature[k] == 'b' || ((row.int32_words >> k) & 1u);
    if (narrow && !fits_int(args[k])) {
      *bad_arg = k;
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" {

TM_API int tm_kernel_count(void) { return kKernelCount; }

TM_API const char* tm_kernel_name(int index) {
  return (index >= 0 && index < kKernelCount) ? kKernels[index].name : nullptr;
}

TM_API const char* tm_kernel_signature(int index) {
  return (index >= 0 && index < kKernelCount) ? kKernels[index].signature : nullptr;
}

TM_API int tm_kernel_index(const char* name) {
  if (name == nullptr) return -1;
  for (int i = 0; i < kKernelCount; ++i)
    if (std::strcmp(kKernels[i].name, name) == 0) return i;
  return -1;
}

TM_API int tm_invoke(int index, tm_device device, const uint64_t* args, int n_args, void* stream) {
  if (index < 0 || index >= kKernelCount)
    return tm_set_error(TM_ERR_UNKNOWN_KERNEL, "tm_invoke: unknown kernel index %d (the table has %d kernels)", index,
                        kKernelCount);
  const KernelRow& row = kKernels[index];
  int expected = static_cast<int>(std::strlen(row.signature));
  if (n_args != expected)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "tm_invoke(%s): got %d argument words, the signature '%s' needs %d",
                        row.name, n_args, row.signature, expected);
  if (args == nullptr)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "tm_invoke(%s): argument array is a null pointer", row.name);
  int bad = -1;
  if (!narrow_int_ok(row, args, &bad))
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "tm_invoke(%s): argument word %d (%" PRId64 ") does not fit an int",
                        row.name, bad, static_cast<int64_t>(args[bad]));
  return row.invoke(device, args, stream);
}

}  // extern "C"
