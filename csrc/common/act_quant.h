/*
 * act_quant.h - internal: the int8 activation groups that every dot product with Q8_0 weights takes, on the CPU
 * and on CUDA (one definition, so both backends and every kernel round the same activations the same way).
 *
 * Why: a Q8_0 weight times a float32 activation costs the GPU reader a byte-to-float conversion, a subtraction
 * and an FMA per weight; with int8 activations four weights take one DP4A (results/NOTES.md, lessons 134-137).
 *
 * A row's activations are cut into groups of 4 consecutive values (group j = values 4j .. 4j+3; the GPU reader's
 * lane step, so its lane layout and reduction order are unchanged). Per group, with amax = max |x_i|:
 *   - a scale 2^e, the smallest power of two with amax * 2^-e < 127.5 (7 bits for the largest value; a multiply
 *     by 2^-e is exact, so no division and no rounding but the codes'),
 *   - codes q_i = rint(x_i * 2^-e) in [-127, 127] (round to nearest, ties to even),
 * so the group stands for the values q_i * 2^e. Special groups: amax < 2^-100 (zero included): codes 0, scale 0;
 * any NaN or infinite value: codes 0, scale NaN (a NaN input still gives a NaN dot product, as the out-of-range
 * expert rows rely on).
 */
#ifndef TORNADO_MOE_ACT_QUANT_H
#define TORNADO_MOE_ACT_QUANT_H

#include <cstdint>

#include "host_device.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#include <cstring>
#endif

namespace tm_act {

struct Q8Group {
  uint32_t codes;  // q_0 .. q_3 as the bytes 0 .. 3 (two's complement)
  float scale;     // 2^e, 0 or NaN
};

TM_HOST_DEVICE inline uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
#endif
}
TM_HOST_DEVICE inline float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
#endif
}
// The low byte of rint(x * inv) (|x * inv| <= 127.5, inv a power of two, so the product is exact): on the GPU
// one FFMA with 2^23 + 2^22, whose rounding to an integer is rint's (ties to even) and whose low mantissa byte is
// that integer's two's complement byte; on the host nearbyint in the default rounding mode (to nearest, even).
TM_HOST_DEVICE inline uint32_t code_byte(float x, float inv) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(__fmaf_rn(x, inv, 12582912.0f)) & 0xFFu;
#else
  return static_cast<uint32_t>(static_cast<int>(std::nearbyint(x * inv))) & 0xFFu;
#endif
}

TM_HOST_DEVICE inline Q8Group q8_group(float x0, float x1, float x2, float x3) {
  // |x| as bits (sign cleared): ordered like the magnitudes, NaN and infinity above every finite value
  const uint32_t a0 = float_bits(x0) & 0x7FFFFFFFu, a1 = float_bits(x1) & 0x7FFFFFFFu;
  const uint32_t a2 = float_bits(x2) & 0x7FFFFFFFu, a3 = float_bits(x3) & 0x7FFFFFFFu;
  const uint32_t m01 = a0 > a1 ? a0 : a1, m23 = a2 > a3 ? a2 : a3;
  const uint32_t amax = m01 > m23 ? m01 : m23;
  if (amax >= 0x7F800000u) return Q8Group{0u, bits_float(0x7FC00000u)};  // NaN or infinity
  if (amax < 0x0D800000u) return Q8Group{0u, 0.0f};                      // below 2^-100
  // amax in [2^(k-1), 2^k) with k = biased exponent - 126; 2^(k-7) puts it in [64, 128)
  int e = static_cast<int>(amax >> 23) - 133;
  float inv = bits_float(static_cast<uint32_t>(127 - e) << 23);
  if (bits_float(amax) * inv >= 127.5f) {
    ++e;
    inv = bits_float(static_cast<uint32_t>(127 - e) << 23);
  }
  const uint32_t q0 = code_byte(x0, inv), q1 = code_byte(x1, inv), q2 = code_byte(x2, inv), q3 = code_byte(x3, inv);
  return Q8Group{q0 | (q1 << 8) | (q2 << 16) | (q3 << 24), bits_float(static_cast<uint32_t>(127 + e) << 23)};
}

// Code i of a group as an integer.
TM_HOST_DEVICE inline int group_code(uint32_t codes, int i) {
  return static_cast<int>(static_cast<int8_t>(static_cast<uint8_t>(codes >> (8 * i))));
}

// The groups' layout in memory, the one the GPU's tiled Q8_0 reader loads (two 16-byte words a lane a reader
// group): per 512 values (4 steps of 32 lanes of 4 values) 1024 bytes, lane l's codes of steps u = 0..3 at
// 16 l + 4 u, then their float scales at 512 + 16 l + 4 u. Group j (values 4j .. 4j+3) belongs to step s = j / 32,
// lane j % 32. A short last block of 512 values takes its whole 1024 bytes. (tm_act_groups_bytes in tornado_moe.h.)
constexpr int kGroupBlockBytes = 1024;
TM_HOST_DEVICE constexpr int64_t groups_bytes(int64_t n) { return (n + 511) / 512 * kGroupBlockBytes; }
// Byte offset of group j's codes (its scale at + 512).
TM_HOST_DEVICE constexpr int64_t group_offset(int64_t j) {
  return (j >> 7) * kGroupBlockBytes + 16 * (j & 31) + 4 * ((j >> 5) & 3);
}

#if !defined(__CUDA_ARCH__)
// Group j in the layout above at buf: its codes at group_offset(j), its scale 512 bytes further.
inline void store_group(uint8_t* buf, int64_t j, const Q8Group& g) {
  std::memcpy(buf + group_offset(j), &g.codes, 4);
  std::memcpy(buf + group_offset(j) + 512, &g.scale, 4);
}
inline Q8Group load_group(const uint8_t* buf, int64_t j) {
  Q8Group g;
  std::memcpy(&g.codes, buf + group_offset(j), 4);
  std::memcpy(&g.scale, buf + group_offset(j) + 512, 4);
  return g;
}
// Value i of the 4 a group stands for.
inline float group_value(const Q8Group& g, int i) { return static_cast<float>(group_code(g.codes, i)) * g.scale; }

// The groups of x[0 .. n) (n a multiple of 4) in the layout above at buf.
inline void store_groups(const float* x, uint8_t* buf, int64_t n) {
  for (int64_t j = 0; j < n / 4; ++j)
    store_group(buf, j, q8_group(x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]));
}

// The groups of rows x[rows, n] into q, groups_bytes(n) bytes a row: what the GPU's producers store.
inline void store_row_groups(const float* x, uint8_t* q, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) store_groups(x + r * n, q + r * groups_bytes(n), n);
}

// The values the groups of rows [rows, n] at q (groups_bytes(n) bytes a row) stand for, into x: q8_round's values
// of the floats they were made from.
inline void load_row_groups(const uint8_t* q, float* x, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n / 4; ++j) {
      const Q8Group g = load_group(q + r * groups_bytes(n), j);
      for (int i = 0; i < 4; ++i) x[r * n + 4 * j + i] = group_value(g, i);
    }
}

// The values the groups of x[0 .. n) stand for (n a multiple of 4), into out (may be x): what a Q8_0 dot product
// multiplies (the CPU kernels round their activations with this, then take their float dot products).
inline void q8_round(const float* x, float* out, int64_t n) {
  for (int64_t j = 0; j < n; j += 4) {
    const Q8Group g = q8_group(x[j], x[j + 1], x[j + 2], x[j + 3]);
    for (int i = 0; i < 4; ++i) out[j + i] = group_value(g, i);
  }
}
#endif

}  // namespace tm_act

#endif
