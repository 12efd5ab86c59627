/*
 * quant_blocks.h - internal: decode GGUF weight rows (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) into float32 for the CPU kernels (and TM_Q8_0_TILED, the same values re-laid
 * out). Every value is produced exactly as gguf's reference dequantizer does (fp16/bf16 widening is exact; Q8_0
 * q*d, Q4_0 (q-8)*d, Q5_0 (q-16)*d, Q4_1 and Q5_1 q*d + m, Q2_K, Q4_K and Q5_K (d*sc)*q - dmin*m, Q3_K
 * (d*sc)*(q-4), Q6_K (d*scale)*(q-32), IQ4_NL d*kv[q], IQ4_XS (d*scale)*kv[q], each operation a rounded float32
 * one), so a decoded row is bitwise equal to gguf.quants.dequantize of the same bytes.
 */
#ifndef TORNADO_MOE_CPU_QUANT_BLOCKS_H
#define TORNADO_MOE_CPU_QUANT_BLOCKS_H

#include <array>
#include <cstdint>
#include <cstring>

#include "qtypes.h"

namespace tm_cpu {

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));  // rows need not be 2-byte aligned
  return v;
}

// IEEE half -> float, exact for every input (subnormals, infinities, NaN payloads). Written with bit masks
// instead of branches so that row decoding vectorizes.
inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;  // exponent and mantissa
  const uint32_t exp = em >> 10;
  const uint32_t normal = (em << 13) + (112u << 23);  // rebias the exponent 15 -> 127
  const uint32_t special = (em << 13) | 0x7f800000u;  // infinities and NaN (payload kept)
  // zero or subnormal: mant * 2^-24 is exact in float32
  const float sub_f = static_cast<float>(em) * 5.9604644775390625e-08f;
  uint32_t sub;
  std::memcpy(&sub, &sub_f, sizeof(sub));
  const uint32_t is_sub = 0u - static_cast<uint32_t>(exp == 0);  // all ones or zero: a branch-free select
  const uint32_t is_special = 0u - static_cast<uint32_t>(exp == 31);
  const uint32_t bits = sign | (sub & is_sub) | (special & is_special) | (normal & ~(is_sub | is_special));
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// bfloat16 -> float: the upper half of the float32 bits.
inline float bf16_to_f32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void decode_q8_0_block(const uint8_t* blk, float* out) {
  const float d = fp16_to_f32(load_u16(blk));
  const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(qs[i]) * d;
}

inline void decode_q4_0_block(const uint8_t* blk, float* out) {
  const float d = fp16_to_f32(load_u16(blk));
  const uint8_t* qs = blk + 2;
  // two separate loops (low nibbles, then high) so that each vectorizes
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(static_cast<int>(qs[i] & 0x0f) - 8) * d;
  for (int i = 0; i < 16; ++i) out[i + 16] = static_cast<float>(static_cast<int>(qs[i] >> 4) - 8) * d;
}

inline void decode_q4_1_block(const uint8_t* blk, float* out) {
  const float d = fp16_to_f32(load_u16(blk));
  const float m = fp16_to_f32(load_u16(blk + 2));
  const uint8_t* qs = blk + 4;
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(qs[i] & 0x0f) * d + m;
  for (int i = 0; i < 16; ++i) out[i + 16] = static_cast<float>(qs[i] >> 4) * d + m;
}

// The 5-, K- and 6-bit formats below unroll qtypes.h's code layouts (tm_q5_code, tm_q4_k_code, tm_q5_k_code,
// tm_q6_k_code) into loops of one shift per value, which vectorize: the per-value helpers ran 4-8x slower.

// Byte i of kFifthBits[b] is 0x10 when bit i of b is set: 8 fifth bits spread over the bytes of their values.
inline constexpr std::array<uint64_t, 256> kFifthBits = [] {
  std::array<uint64_t, 256> t{};
  for (int b = 0; b < 256; ++b)
    for (int i = 0; i < 8; ++i) t[b] |= static_cast<uint64_t>((b >> i) & 1) << (8 * i + 4);
  return t;
}();

// Q5_0 (M false: (q - 16) * d) and Q5_1 (M true: q * d + m); the fifth bits' uint32 follows the fp16 fields.
template <bool M>
inline void decode_q5_block(const uint8_t* blk, float* out) {
  const float d = fp16_to_f32(load_u16(blk));
  const float m = M ? fp16_to_f32(load_u16(blk + 2)) : 0.0f;
  const uint8_t* at = blk + (M ? 4 : 2);
  uint8_t fifth[32];  // 0x10 or 0 for value i
  for (int k = 0; k < 4; ++k) std::memcpy(fifth + 8 * k, &kFifthBits[at[k]], 8);
  const uint8_t* qs = at + 4;
  for (int half = 0; half < 2; ++half) {  // low nibbles: values 0..15; high nibbles: 16..31
    for (int i = 0; i < 16; ++i) {
      const int q = ((qs[i] >> (4 * half)) & 0x0f) | fifth[16 * half + i];
      out[16 * half + i] = M ? static_cast<float>(q) * d + m : static_cast<float>(q - 16) * d;
    }
  }
}

// Q4_K (K5 false) and Q5_K (K5 true): sub-block j's values (d*sc)*q - dmin*m.
template <bool K5>
inline void decode_q45_k_block(const uint8_t* blk, float* out) {
  const float d = fp16_to_f32(load_u16(blk));
  const float dmin = fp16_to_f32(load_u16(blk + 2));
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + (K5 ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    tm_q4_k_scale_min(blk + 4, j, &sc, &m);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    for (int i = 0; i < 32; ++i) {
      const int v = ((q[i] >> shift) & 0x0f) | (K5 ? ((qh[i] >> j) & 1) << 4 : 0);
      out[32 * j + i] = dl * static_cast<float>(v) - ml;
    }
  }
}

inline void decode_q6_k_block(const uint8_t* blk, float* out) {
  const float d = fp16_to_f32(load_u16(blk + 208));
  const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int k = 0; k < 4; ++k) {  // values 128h + 32k + l: nibble k / 2 of ql[64h + 32(k % 2) + l]
      const uint8_t* ql = blk + 64 * h + 32 * (k & 1);
      const int shift = 4 * (k >> 1);
      for (int half = 0; half < 2; ++half) {  // 16 values a scale
        const float ds = d * static_cast<float>(scales[8 * h + 2 * k + half]);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q = ((ql[l] >> shift) & 0x0f) | (((qh[l] >> (2 * k)) & 3) << 4);
          out[128 * h + 32 * k + l] = ds * static_cast<float>(q - 32);
        }
      }
    }
  }
}

// Q2_K: value 128h + 32k + l is bits 2k, 2k+1 of code byte 32h + l (tm_q2_k_code); sub-block j of 16 values
// has scale blk[j] & 15 and min blk[j] >> 4.
inline void decode_q2_k_block(const uint8_t* blk, float* out) {
  const float d = fp16_to_f32(load_u16(blk + 80));
  const float dmin = fp16_to_f32(load_u16(blk + 82));
  for (int h = 0; h < 2; ++h) {
    const uint8_t* qs = blk + 16 + 32 * h;
    for (int k = 0; k < 4; ++k) {
      for (int half = 0; half < 2; ++half) {
        const int j = 8 * h + 2 * k + half;
        const float dl = d * static_cast<float>(blk[j] & 15), ml = dmin * static_cast<float>(blk[j] >> 4);
        for (int l = 16 * half; l < 16 * half + 16; ++l)
          out[128 * h + 32 * k + l] = dl * static_cast<float>((qs[l] >> (2 * k)) & 3) - ml;
      }
    }
  }
}

// Q3_K: Q2_K's code placement, the third bit from hmask (tm_q3_k_code), the signed scales of tm_q3_k_scale.
inline void decode_q3_k_block(const uint8_t* blk, float* out) {
  const float d = fp16_to_f32(load_u16(blk + 108));
  for (int h = 0; h < 2; ++h) {
    const uint8_t* qs = blk + 32 + 32 * h;
    for (int k = 0; k < 4; ++k) {
      const int hbit = 4 * h + k;
      for (int half = 0; half < 2; ++half) {
        const float dl = d * static_cast<float>(tm_q3_k_scale(blk + 96, 8 * h + 2 * k + half));
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q = (((qs[l] >> (2 * k)) & 3) | (((blk[l] >> hbit) & 1) << 2)) - 4;
          out[128 * h + 32 * k + l] = dl * static_cast<float>(q);
        }
      }
    }
  }
}

// The IQ4 levels (tm_iq4_level) as floats, for a table lookup per value.
inline const std::array<float, 16> kIq4Levels = [] {
  std::array<float, 16> t{};
  for (int q = 0; q < 16; ++q) t[q] = static_cast<float>(tm_iq4_level(q));
  return t;
}();

// 32 values from IQ4 nibbles qs (low nibbles values 0..15, high 16..31), times the scale.
inline void decode_iq4_values(const uint8_t* qs, float scale, float* out) {
  for (int i = 0; i < 16; ++i) out[i] = scale * kIq4Levels[qs[i] & 15];
  for (int i = 0; i < 16; ++i) out[i + 16] = scale * kIq4Levels[qs[i] >> 4];
}

inline void decode_iq4_nl_block(const uint8_t* blk, float* out) {
  decode_iq4_values(blk + 2, fp16_to_f32(load_u16(blk)), out);
}

inline void decode_iq4_xs_block(const uint8_t* blk, float* out) {
  const float d = fp16_to_f32(load_u16(blk));
  for (int j = 0; j < 8; ++j)
    decode_iq4_values(blk + 8 + 16 * j, d * static_cast<float>(tm_iq4_xs_scale(blk, j)), out + 32 * j);
}

// The first n values of a row of `qtype` blocks (qtypes.h's geometry), each decoded by decode(block, out).
template <class Decode>
inline void decode_blocks(int qtype, const uint8_t* row, int64_t n, float* out, Decode decode) {
  const int64_t vals = tm_qtype_block_size(qtype), bytes = tm_qtype_block_bytes(qtype);
  for (int64_t b = 0; b < n / vals; ++b) decode(row + bytes * b, out + vals * b);
}

// Decodes the first `n` values of a row (n a multiple of the block size; qtype supported) into out[0, n); for
// TM_Q8_0_TILED, whose layout depends on the row length, n must be the whole row.
inline void decode_row(int qtype, const uint8_t* row, int64_t n, float* out) {
  switch (qtype) {
    case TM_F32:
      std::memcpy(out, row, static_cast<size_t>(n) * sizeof(float));
      break;
    case TM_F16:
      for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_f32(load_u16(row + 2 * i));
      break;
    case TM_BF16:
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(load_u16(row + 2 * i));
      break;
    case TM_Q8_0:
      decode_blocks(qtype, row, n, out, decode_q8_0_block);
      break;
    case TM_Q4_0:
      decode_blocks(qtype, row, n, out, decode_q4_0_block);
      break;
    case TM_Q4_1:
      decode_blocks(qtype, row, n, out, decode_q4_1_block);
      break;
    case TM_Q5_0:
      decode_blocks(qtype, row, n, out, decode_q5_block<false>);
      break;
    case TM_Q5_1:
      decode_blocks(qtype, row, n, out, decode_q5_block<true>);
      break;
    case TM_Q2_K:
      decode_blocks(qtype, row, n, out, decode_q2_k_block);
      break;
    case TM_Q3_K:
      decode_blocks(qtype, row, n, out, decode_q3_k_block);
      break;
    case TM_Q4_K:
      decode_blocks(qtype, row, n, out, decode_q45_k_block<false>);
      break;
    case TM_Q5_K:
      decode_blocks(qtype, row, n, out, decode_q45_k_block<true>);
      break;
    case TM_Q6_K:
      decode_blocks(qtype, row, n, out, decode_q6_k_block);
      break;
    case TM_IQ4_NL:
      decode_blocks(qtype, row, n, out, decode_iq4_nl_block);
      break;
    case TM_IQ4_XS:
      decode_blocks(qtype, row, n, out, decode_iq4_xs_block);
      break;
    case TM_Q8_0_TILED:  // the Q8_0 values at their tiled places (qtypes.h); n is the whole row
      for (int64_t b = 0; b < n / 32; ++b) {
        const float d = fp16_to_f32(load_u16(row + tm_q8t_scale_offset(n, b)));
        for (int64_t i = 0; i < 32; ++i) {
          const int q = tm_q8t_code(row[tm_q8t_code_offset(n, 32 * b + i)]);
          out[32 * b + i] = static_cast<float>(q) * d;
        }
      }
      break;
    default:
      break;  // unreachable: the dispatcher rejects unsupported formats
  }
}

}  // namespace tm_cpu

#endif
