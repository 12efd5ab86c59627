/*
 * norm_embed.cu - tm_embedding and tm_rmsnorm on CUDA.
 *
 * embedding: a grid-stride loop over the n_tokens * dim output values (256 threads a block, at most 16 blocks per
 *   SM); each value is decoded exactly as gguf's dequantizer does (quant_blocks.h's operations: Q8_0 q*d, Q4_0
 *   (q-8)*d, Q4_1 q*d + m, Q4_K (d*sc)*q - dmin*m, IQ4_NL d*kv[q], ..., each a rounded float32 operation), so
 *   rows are bitwise equal to gguf.quants.dequantize and to the CPU kernel. A token id outside [0, vocab) cannot
 *   be reported from the device: its row is filled with NaN.
 * rmsnorm: one block of 256 threads per token (grid-stride over tokens) computing norm.cuh's tree (the one the
 *   fused kernels share); every x value is read before the barrier that precedes the writes, so x and y may alias
 *   (x is therefore read with plain loads). rmsnorm_factors: the same blocks; warp 0 evaluates the deferred form's
 *   grouped sum (norm.cuh), writing inv and the partial sums xss, then every thread writes xw = x * w.
 */
#include <cmath>

#include "norm.cuh"

namespace tm_cuda {
namespace {

__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_kernel(const float* x, const float* __restrict__ w, float* y, int64_t n_tokens, int64_t dim, float eps) {
  __shared__ float scratch[kNormWarps + 1];
  pdl_begin();
  for (int64_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    const float* xt = x + t * dim;
    float* yt = y + t * dim;
    // y may alias x: each thread writes only what it read, after block_rms_inv's barriers, and the closing
    // barrier puts the next token's reads after these writes
    block_rmsnorm(xt, w, dim, eps, yt, nullptr, scratch);
  }
}

__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_factors_kernel(const float* x, const float* __restrict__ w, float* xw, float* xss, float* inv,
                           int64_t n_tokens, int64_t dim, float eps) {
  pdl_begin();
  for (int64_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    const float* xt = x + t * dim;
    if (threadIdx.x < 32) {  // warp 0: the grouped sums (norm.cuh) and inv
      float* st = xss != nullptr ? xss + t * norm_groups(dim) : nullptr;
      const float r = warp_grouped_inv(
          [&](int64_t g) {
            const float ss = group_sum_sq([&](int64_t i) { return xt[i]; }, g, dim);
            if (st != nullptr) st[g] = ss;
            return ss;
          },
          dim, eps);
      if (threadIdx.x == 0) inv[t] = r;
    }
    __syncthreads();  // xw may alias x: every read of x for the sums before the first write of xw
    float* ot = xw + t * dim;
    for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) ot[i] = norm_factor_xw(xt[i], __ldg(w + i));
  }
}

// Value c of a row of `cols` values.
__device__ __forceinline__ float decode_value(int qtype, const uint8_t* row, int64_t cols, int64_t c) {
  switch (qtype) {
    case TM_F32:
      return __ldg(reinterpret_cast<const float*>(row) + c);
    case TM_F16:
      return fp16_bits_to_f32(ldg_u16(row + 2 * c));
    case TM_BF16:
      return bf16_bits_to_f32(ldg_u16(row + 2 * c));
    case TM_Q8_0: {
      const uint8_t* blk = row + (c / 32) * 34;
      const float d = fp16_bits_to_f32(ldg_u16(blk));
      const int q = static_cast<int8_t>(__ldg(blk + 2 + c % 32));
      return __fmul_rn(static_cast<float>(q), d);
    }
    case TM_Q8_0_TILED: {
      const float d = fp16_bits_to_f32(ldg_u16(row + tm_q8t_scale_offset(cols, c / 32)));
      const int q = tm_q8t_code(__ldg(row + tm_q8t_code_offset(cols, c)));
      return __fmul_rn(static_cast<float>(q), d);
    }
    case TM_Q4_0: {
      const uint8_t* blk = row + (c / 32) * 18;
      const int j = static_cast<int>(c % 32);
      const uint32_t byte = __ldg(blk + 2 + (j & 15));
      const int q = static_cast<int>(j < 16 ? (byte & 15u) : (byte >> 4)) - 8;
      return __fmul_rn(static_cast<float>(q), fp16_bits_to_f32(ldg_u16(blk)));
    }
    case TM_Q4_1: {
      const uint8_t* blk = row + (c / 32) * 20;
      const int j = static_cast<int>(c % 32);
      const uint32_t byte = __ldg(blk + 4 + (j & 15));
      const int q = static_cast<int>(j < 16 ? (byte & 15u) : (byte >> 4));
      return __fadd_rn(__fmul_rn(static_cast<float>(q), fp16_bits_to_f32(ldg_u16(blk))),
                       fp16_bits_to_f32(ldg_u16(blk + 2)));
    }
    case TM_Q5_0: {
      const uint8_t* blk = row + (c / 32) * 22;
      const int q = tm_q5_code(blk + 2, static_cast<int>(c % 32)) - 16;
      return __fmul_rn(static_cast<float>(q), fp16_bits_to_f32(ldg_u16(blk)));
    }
    case TM_Q5_1: {
      const uint8_t* blk = row + (c / 32) * 24;
      const int q = tm_q5_code(blk + 4, static_cast<int>(c % 32));
      return __fadd_rn(__fmul_rn(static_cast<float>(q), fp16_bits_to_f32(ldg_u16(blk))),
                       fp16_bits_to_f32(ldg_u16(blk + 2)));
    }
    case TM_Q4_K:
    case TM_Q5_K: {
      const bool k5 = qtype == TM_Q5_K;
      const uint8_t* blk = row + (c / 256) * (k5 ? 176 : 144);
      const int v = static_cast<int>(c % 256);
      int sc, m;
      tm_q4_k_scale_min(blk + 4, v / 32, &sc, &m);
      const float dl = __fmul_rn(fp16_bits_to_f32(ldg_u16(blk)), static_cast<float>(sc));
      const float ml = __fmul_rn(fp16_bits_to_f32(ldg_u16(blk + 2)), static_cast<float>(m));
      const int q = k5 ? tm_q5_k_code(blk, v) : tm_q4_k_code(blk + 16, v);
      return __fsub_rn(__fmul_rn(dl, static_cast<float>(q)), ml);
    }
    case TM_Q2_K: {
      const uint8_t* blk = row + (c / 256) * 84;
      const int v = static_cast<int>(c % 256);
      const uint32_t sm = __ldg(blk + v / 16);
      const float dl = __fmul_rn(fp16_bits_to_f32(ldg_u16(blk + 80)), static_cast<float>(sm & 15u));
      const float ml = __fmul_rn(fp16_bits_to_f32(ldg_u16(blk + 82)), static_cast<float>(sm >> 4));
      return __fsub_rn(__fmul_rn(dl, static_cast<float>(tm_q2_k_code(blk, v))), ml);
    }
    case TM_Q3_K: {
      const uint8_t* blk = row + (c / 256) * 110;
      const int v = static_cast<int>(c % 256);
      const float sc = static_cast<float>(tm_q3_k_scale(blk + 96, v / 16));
      const float dl = __fmul_rn(fp16_bits_to_f32(ldg_u16(blk + 108)), sc);
      return __fmul_rn(dl, static_cast<float>(tm_q3_k_code(blk, v)));
    }
    case TM_IQ4_NL: {
      const uint8_t* blk = row + (c / 32) * 18;
      const float kv = static_cast<float>(tm_iq4_level(tm_iq4_code(blk + 2, static_cast<int>(c % 32))));
      return __fmul_rn(fp16_bits_to_f32(ldg_u16(blk)), kv);
    }
    case TM_IQ4_XS: {
      const uint8_t* blk = row + (c / 256) * 136;
      const int v = static_cast<int>(c % 256);
      const float dl = __fmul_rn(fp16_bits_to_f32(ldg_u16(blk)), static_cast<float>(tm_iq4_xs_scale(blk, v / 32)));
      const float kv = static_cast<float>(tm_iq4_level(tm_iq4_code(blk + 8 + 16 * (v / 32), v % 32)));
      return __fmul_rn(dl, kv);
    }
    default: {  // TM_Q6_K
      const uint8_t* blk = row + (c / 256) * 210;
      const int v = static_cast<int>(c % 256);
      const float ds = __fmul_rn(fp16_bits_to_f32(ldg_u16(blk + 208)),
                                 static_cast<float>(static_cast<int8_t>(blk[192 + v / 16])));
      return __fmul_rn(ds, static_cast<float>(tm_q6_k_code(blk, v)));
    }
  }
}

__global__ void __launch_bounds__(256)
    embedding_kernel(int qtype, const uint8_t* __restrict__ table, const int32_t* __restrict__ ids,
                     float* __restrict__ out, int64_t n_tokens, int64_t vocab, int64_t dim, int64_t row_bytes) {
  const int64_t total = n_tokens * dim;
  pdl_begin();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / dim, c = i % dim;
    const int64_t id = ids[t];
    out[i] = (id < 0 || id >= vocab) ? __int_as_float(0x7fc00000) : decode_value(qtype, table + id * row_bytes, dim, c);
  }
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_embedding(int qtype, const void* table, const int32_t* ids, float* out, int64_t n_tokens,
                                 int64_t vocab, int64_t dim, void* stream) {
  const char* fn = "tm_embedding";
  TM_TRY(check_weight_alignment(fn, "table", qtype, table));
  TM_TRY(check_f32_alignment(fn, "out", out));
  Limits lim;
  TM_TRY(get_limits(&lim));
  int64_t blocks = ceil_div(n_tokens * dim, 256);
  const int64_t max_blocks = static_cast<int64_t>(lim.sm_count) * 16;
  if (blocks > max_blocks) blocks = max_blocks;
  return launch(lim, fn, embedding_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, as_stream(stream), qtype,
                static_cast<const uint8_t*>(table), ids, out, n_tokens, vocab, dim, tm_qtype_row_bytes(qtype, dim));
}

extern "C" int tm_cuda_rmsnorm_factors(const float* x, const float* w, float* xw, float* xss, float* inv,
                                       int64_t n_tokens, int64_t dim, float eps, void* stream) {
  const char* fn = "tm_rmsnorm_factors";
  TM_TRY(check_f32_alignment(fn, "x", x));
  TM_TRY(check_f32_alignment(fn, "w", w));
  TM_TRY(check_f32_alignment(fn, "xw", xw));
  TM_TRY(check_f32_alignment(fn, "xss", xss));
  TM_TRY(check_f32_alignment(fn, "inv", inv));
  Limits lim;
  TM_TRY(get_limits(&lim));
  int64_t blocks = n_tokens;
  const int64_t max_blocks = static_cast<int64_t>(lim.sm_count) * 32;
  if (blocks > max_blocks) blocks = max_blocks;
  return launch(lim, fn, rmsnorm_factors_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kNormThreads), 0,
                as_stream(stream), x, w, xw, xss, inv, n_tokens, dim, eps);
}

extern "C" int tm_cuda_rmsnorm(const float* x, const float* w, float* y, int64_t n_tokens, int64_t dim, float eps,
                               void* stream) {
  const char* fn = "tm_rmsnorm";
  TM_TRY(check_f32_alignment(fn, "x", x));
  TM_TRY(check_f32_alignment(fn, "w", w));
  TM_TRY(check_f32_alignment(fn, "y", y));
  Limits lim;
  TM_TRY(get_limits(&lim));
  int64_t blocks = n_tokens;
  const int64_t max_blocks = static_cast<int64_t>(lim.sm_count) * 32;
  if (blocks > max_blocks) blocks = max_blocks;
  return launch(lim, fn, rmsnorm_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kNormThreads), 0,
                as_stream(stream), x, w, y, n_tokens, dim, eps);
}
