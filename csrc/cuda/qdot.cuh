/*
 * qdot.cuh - internal to csrc/cuda: GGUF block decoders and THE warp dot product of a weight row with float32
 * activations. Every matrix-vector kernel (matmul, routed/shared expert gate-up and down, router logits, the
 * shared-expert gate) computes its dot products with warp_dot below, so one (row, activation) pair always gives
 * the same bits whichever kernel variant, tile shape or launch chunking asked for it.
 *
 * Lane layout and reduction order (fixed per weight format and row length, never by the launch):
 *   A row is a sequence of "blocks" (32 values for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL, 256 for the K types and
 *   IQ4_XS; 4 values for the F16x4/BF16x4/F32x4 layouts used when the row length is a multiple of 4; 1 value
 *   otherwise). kLanes lanes share a block (part = lane % kLanes), so one warp step covers 32 / kLanes consecutive
 *   blocks; step s, lane l handles block s * (32 / kLanes) + l / kLanes. Each lane keeps one float32 accumulator
 *   per (row, token) and adds its blocks in increasing step order (Q8_0: its 4 activations are one int8 group of
 *   act_quant.h, codes a and scale 2^e, and acc = fma(d * 2^e, dp4a(q, a), acc), both factors exact;
 *   Q4_0/Q5_0/IQ4_NL: acc = fma(d, sum_i q_i x_i, acc) with the in-block sum an fma chain, IQ4's q the level
 *   kv[code]; Q4_1/Q5_1: acc = fma(d, sum q x, acc) then fma(m, sum x, acc); Q2_K/Q4_K/Q5_K: per sub-block of
 *   the lane, in order, fma(d*sc, sum q x, acc) then fma(-(dmin*m), sum x, acc); Q3_K/Q6_K/IQ4_XS: per sub-block
 *   of the lane, in order, fma(d*scale, sum q x, acc); plain: an fma per value). The 32 lane accumulators are
 *   then summed by the xor butterfly of warp_sum.
 *   All arithmetic uses explicit _rn intrinsics, so the compiler cannot contract or reorder it differently in
 *   different instantiations: a row's result does not depend on how many rows or tokens the calling warp handles
 *   at once, nor on the load width.
 *
 * Loads: block formats are read as 16-bit words (blocks of 34/18/20 bytes are only 2-byte aligned); Q8_0 rows
 * re-laid out as TM_Q8_0_TILED with 16- and 8-byte loads (warp_dot_q8t); fp16/bf16/f32 rows in the x4 layouts as
 * 8/16-byte vectors when the pointers allow (template flag V; same arithmetic either way); activations as float4
 * when 16-byte aligned (V) else as four floats, with plain loads (they may come from the previous kernel of the
 * stream, or from shared memory). Weight loads of U steps are issued before any of them is used, to keep enough
 * bytes in flight for a memory-bound matrix-vector product.
 */
#ifndef TORNADO_MOE_CUDA_QDOT_CUH
#define TORNADO_MOE_CUDA_QDOT_CUH

#include <type_traits>

#include "act_quant.h"
#include "common.cuh"

namespace tm_cuda {

// The row layouts of the dot product (see above). X4 layouts are chosen by the row length alone.
// Q8_0T / Q8_0T16 are TM_Q8_0_TILED: Q8_0's blocks, lanes and arithmetic, read from the tiled row layout with
// 8-byte code loads, or 16-byte ones when every row is 16-byte aligned (rows of a multiple of 256 values).
enum class Fmt : int { Q8_0, Q8_0T, Q8_0T16, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, F16X4, BF16, BF16X4, F32,
                       F32X4, Q2_K, Q3_K, IQ4_NL, IQ4_XS };
constexpr bool fmt_tiled(Fmt f) { return f == Fmt::Q8_0T || f == Fmt::Q8_0T16; }

// Four floats of a weight row (read-only path) or of an activation (plain loads: it may be the previous kernel's
// output, or live in shared memory).
template <bool V>
__device__ __forceinline__ float4 ld_f4(const float* p) {
  if constexpr (V) {
    return __ldg(reinterpret_cast<const float4*>(p));
  } else {
    return make_float4(__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3));
  }
}
template <bool V>
__device__ __forceinline__ float4 ld_x4(const float* p) {
  if constexpr (V) {
    return *reinterpret_cast<const float4*>(p);
  } else {
    return make_float4(p[0], p[1], p[2], p[3]);
  }
}

// 2^23 + byte i of `word` as a float (exact): a byte-to-float conversion at full ALU rate (no I2F).
__device__ __forceinline__ float biased_byte(uint32_t word, int i) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7650u + static_cast<unsigned>(i)));
}

// The codes of a block's 4 bytes in w (code i = byte i - bias + 2^23, bias = 2^23 + the format's zero point)
// times 4 activations, as one fma chain; the second form continues the chain s (8 codes: lo's, then hi's).
__device__ __forceinline__ float dot4_codes(uint32_t w, float bias, const float4& x) {
  float s = __fmul_rn(__fsub_rn(biased_byte(w, 0), bias), x.x);
  s = __fmaf_rn(__fsub_rn(biased_byte(w, 1), bias), x.y, s);
  s = __fmaf_rn(__fsub_rn(biased_byte(w, 2), bias), x.z, s);
  return __fmaf_rn(__fsub_rn(biased_byte(w, 3), bias), x.w, s);
}
__device__ __forceinline__ float dot4_codes(uint32_t w, float bias, const float4& x, float s) {
  s = __fmaf_rn(__fsub_rn(biased_byte(w, 0), bias), x.x, s);
  s = __fmaf_rn(__fsub_rn(biased_byte(w, 1), bias), x.y, s);
  s = __fmaf_rn(__fsub_rn(biased_byte(w, 2), bias), x.z, s);
  return __fmaf_rn(__fsub_rn(biased_byte(w, 3), bias), x.w, s);
}
__device__ __forceinline__ float dot8_codes(uint32_t lo, uint32_t hi, float bias, const float4& xlo,
                                            const float4& xhi) {
  return dot4_codes(hi, bias, xhi, dot4_codes(lo, bias, xlo));
}

// 8 activations summed in order (lo's, then hi's): the minimum's factor of Q4_1 / Q5_1.
__device__ __forceinline__ float sum8(const float4& lo, const float4& hi) {
  float sx = __fadd_rn(lo.x, lo.y);
  sx = __fadd_rn(sx, lo.z);
  sx = __fadd_rn(sx, lo.w);
  sx = __fadd_rn(sx, hi.x);
  sx = __fadd_rn(sx, hi.y);
  sx = __fadd_rn(sx, hi.z);
  return __fadd_rn(sx, hi.w);
}
// 4 bits -> bit 4 of each of 4 bytes (a 5-bit format's fifth bits under its nibbles)
__device__ __forceinline__ uint32_t fifth_bits(uint32_t b) {
  return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

// Each layout: kVals values per block, kBytes bytes per block, kLanes lanes per block, kLoadRegs registers one
// lane's loads of one block occupy while in flight; Frag (one lane's raw weights of a block), XFrag (its
// activations), load/loadx, and dot (acc + the block's contribution, in a fixed order).
template <Fmt F>
struct FmtTraits;

// Q8_0: 34-byte blocks (fp16 d, 32 int8); 8 lanes per block, 4 values per lane.
template <>
struct FmtTraits<Fmt::Q8_0> {
  static constexpr int kVals = 32, kBytes = 34, kLanes = 8, kLoadRegs = 3;
  struct Frag {
    uint32_t q, d;
  };
  using XFrag = float4;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int part) {
    Frag f;
    f.d = ldg_u16(blk);
    f.q = ldg_u16(blk + 2 + 4 * part) | (ldg_u16(blk + 4 + 4 * part) << 16);
    return f;
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int part) {
    return ld_x4<V>(xb + 4 * part);
  }
  // The 4 activations are one group of act_quant.h (group = block * 8 + part): its codes meet the weight codes
  // in one DP4A (an exact integer sum), and the block adds d * 2^e (exact) times that sum with one rounding.
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    const tm_act::Q8Group a = tm_act::q8_group(x.x, x.y, x.z, x.w);
    return dot_codes(f, a.codes, a.scale, acc);
  }
  // the same with the activation group already quantized (codes, scale as act_quant.h makes them); the weight
  // codes are the int8 bytes as stored (the GGUF block's and TM_Q8_0_TILED's), the DP4A's signed operand as is
  __device__ __forceinline__ static float dot_codes(const Frag& f, uint32_t codes, float scale, float acc) {
    const int sum = __dp4a(static_cast<int>(f.q), static_cast<int>(codes), 0);
    return __fmaf_rn(__fmul_rn(fp16_bits_to_f32(f.d), scale), static_cast<float>(sum), acc);
  }
};

// Q4_0: 18-byte blocks (fp16 d, 16 bytes: low nibbles values 0..15, high nibbles 16..31); 4 lanes per block,
// lane part p takes bytes 4p..4p+3, i.e. values 4p..4p+3 and 16+4p..16+4p+3.
template <>
struct FmtTraits<Fmt::Q4_0> {
  static constexpr int kVals = 32, kBytes = 18, kLanes = 4, kLoadRegs = 3;
  struct Frag {
    uint32_t q, d;
  };
  struct XFrag {
    float4 lo, hi;
  };
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int part) {
    Frag f;
    f.d = ldg_u16(blk);
    f.q = ldg_u16(blk + 2 + 4 * part) | (ldg_u16(blk + 4 + 4 * part) << 16);
    return f;
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int part) {
    return XFrag{ld_x4<V>(xb + 4 * part), ld_x4<V>(xb + 16 + 4 * part)};
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    constexpr float kBias = 8388616.0f;  // 2^23 + 8: q - 8
    const float s = dot8_codes(f.q & 0x0F0F0F0Fu, (f.q >> 4) & 0x0F0F0F0Fu, kBias, x.lo, x.hi);
    return __fmaf_rn(fp16_bits_to_f32(f.d), s, acc);
  }
};

// Q4_1: 20-byte blocks (fp16 d, fp16 m, 16 bytes of nibbles as Q4_0); v = q*d + m, so a block contributes
// d * sum(q x) + m * sum(x).
template <>
struct FmtTraits<Fmt::Q4_1> {
  static constexpr int kVals = 32, kBytes = 20, kLanes = 4, kLoadRegs = 4;
  struct Frag {
    uint32_t q, dm;
  };
  using XFrag = FmtTraits<Fmt::Q4_0>::XFrag;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int part) {
    Frag f;
    f.dm = ldg_u16(blk) | (ldg_u16(blk + 2) << 16);
    f.q = ldg_u16(blk + 4 + 4 * part) | (ldg_u16(blk + 6 + 4 * part) << 16);
    return f;
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int part) {
    return XFrag{ld_x4<V>(xb + 4 * part), ld_x4<V>(xb + 16 + 4 * part)};
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    constexpr float kBias = 8388608.0f;  // 2^23: q
    const float s = dot8_codes(f.q & 0x0F0F0F0Fu, (f.q >> 4) & 0x0F0F0F0Fu, kBias, x.lo, x.hi);
    const float sx = sum8(x.lo, x.hi);
    acc = __fmaf_rn(fp16_bits_to_f32(f.dm & 0xFFFFu), s, acc);
    return __fmaf_rn(fp16_bits_to_f32(f.dm >> 16), sx, acc);
  }
};

// Q5_0 (22 bytes: fp16 d, then the uint32 of fifth bits, 16 bytes of nibbles as Q4_0; v = (q - 16) * d) and
// Q5_1 (24 bytes: fp16 d, fp16 m, then as Q5_0; v = q*d + m, a block contributing d * sum(q x) + m * sum(x)).
// Lanes as Q4_0's; a lane's 8 fifth bits (values 4p..4p+3, then 16+4p..16+4p+3) are taken at load.
template <bool M>
struct Q5Traits {
  static constexpr int kHead = M ? 4 : 2;  // bytes before the fifth bits
  static constexpr int kVals = 32, kBytes = kHead + 4 + 16, kLanes = 4, kLoadRegs = 4;
  struct Frag {
    uint32_t q, dm, bits;
  };
  using XFrag = FmtTraits<Fmt::Q4_0>::XFrag;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int part) {
    const uint32_t qh = ldg_u16(blk + kHead) | (ldg_u16(blk + kHead + 2) << 16);
    const uint32_t bits = ((qh >> (4 * part)) & 0xFu) | (((qh >> (16 + 4 * part)) & 0xFu) << 4);
    const uint8_t* q = blk + kHead + 4 + 4 * part;
    const uint32_t dm = M ? ldg_u16(blk) | (ldg_u16(blk + 2) << 16) : ldg_u16(blk);
    return Frag{ldg_u16(q) | (ldg_u16(q + 2) << 16), dm, bits};
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int part) {
    return FmtTraits<Fmt::Q4_0>::loadx<V>(xb, part);
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    const uint32_t lo = (f.q & 0x0F0F0F0Fu) | fifth_bits(f.bits & 0xFu);
    const uint32_t hi = ((f.q >> 4) & 0x0F0F0F0Fu) | fifth_bits(f.bits >> 4);
    constexpr float kBias = M ? 8388608.0f : 8388624.0f;  // 2^23 (q) or 2^23 + 16 (q - 16)
    const float s = dot8_codes(lo, hi, kBias, x.lo, x.hi);
    acc = __fmaf_rn(fp16_bits_to_f32(f.dm & 0xFFFFu), s, acc);
    if constexpr (M) acc = __fmaf_rn(fp16_bits_to_f32(f.dm >> 16), sum8(x.lo, x.hi), acc);
    return acc;
  }
};
template <>
struct FmtTraits<Fmt::Q5_0> : Q5Traits<false> {};
template <>
struct FmtTraits<Fmt::Q5_1> : Q5Traits<true> {};

// Two sub-blocks of a lane in the K formats with scales and mins (Q2_K, Q4_K, Q5_K): their 4 codes each (lo, hi:
// one per byte, 0..31) times x.lo and x.hi; dm = d | dmin << 16 (fp16 bits), scm = the sub-blocks' scales sc0, sc1
// and mins m0, m1 as bytes 0..3. v = (d*sc)*q - dmin*m, so each sub-block adds (d*sc) * sum(q x), then
// -(dmin*m) * sum(x).
__device__ __forceinline__ float scale_min_dot(uint32_t lo, uint32_t hi, uint32_t dm, uint32_t scm, const float4& xlo,
                                               const float4& xhi, float acc) {
  constexpr float kBias = 8388608.0f;  // 2^23: q
  const float s0 = dot4_codes(lo, kBias, xlo);
  const float s1 = dot4_codes(hi, kBias, xhi);
  const float x0 = __fadd_rn(__fadd_rn(__fadd_rn(xlo.x, xlo.y), xlo.z), xlo.w);
  const float x1 = __fadd_rn(__fadd_rn(__fadd_rn(xhi.x, xhi.y), xhi.z), xhi.w);
  const float d = fp16_bits_to_f32(dm & 0xFFFFu), dmin = fp16_bits_to_f32(dm >> 16);
  acc = __fmaf_rn(__fmul_rn(d, static_cast<float>(scm & 0xFFu)), s0, acc);
  acc = __fmaf_rn(-__fmul_rn(dmin, static_cast<float>((scm >> 16) & 0xFFu)), x0, acc);
  acc = __fmaf_rn(__fmul_rn(d, static_cast<float>((scm >> 8) & 0xFFu)), s1, acc);
  return __fmaf_rn(-__fmul_rn(dmin, static_cast<float>(scm >> 24)), x1, acc);
}

// Q4_K (144-byte blocks of 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
// nibbles) and Q5_K (176 bytes: the same with 32 bytes of fifth bits before the nibbles); 32 lanes per block.
// Lane p takes chunk c = p / 8 (nibble bytes 32c..32c+31) at bytes 4(p % 8)..+3: their low nibbles are values
// 4(p % 8).. of sub-block 2c, their high nibbles the same of sub-block 2c + 1 (Q5_K: the fifth bits are bits 2c,
// 2c + 1 of qh bytes 4(p % 8)..+3). v = (d*sc)*q - dmin*m, so a sub-block contributes (d*sc) * sum(q x) -
// (dmin*m) * sum(x). The scales and mins of the lane's two sub-blocks are unpacked at load (tm_q4_k_scale_min's
// bits) into one word: sc0, sc1, m0, m1.
template <bool K5>
struct Q45KTraits {
  static constexpr int kQs = K5 ? 48 : 16;  // the nibbles' offset
  static constexpr int kVals = 256, kBytes = kQs + 128, kLanes = 32, kLoadRegs = K5 ? 8 : 6;
  struct Frag {
    uint32_t q, dm, scm, h;  // h (Q5_K): the lane's fifth bits, bit 0 (sub-block 2c) and 1 (2c + 1) of each byte
  };
  using XFrag = FmtTraits<Fmt::Q4_0>::XFrag;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int part) {
    const int c = part >> 3;
    const uint8_t* s = blk + 4;
    // bytes 2c, 2c+1 (j < 4: the scales; j >= 4: their top bits are the mins' top bits), 2c+4, 2c+5, and for
    // c >= 2 bytes 2c-4, 2c-3 (their top bits are the scales' top bits)
    const uint32_t b = ldg_u16(s + 2 * c), e = ldg_u16(s + 2 * c + 4);
    uint32_t scm;
    if (c < 2) {
      scm = (b & 0x3F3Fu) | ((e & 0x3F3Fu) << 16);
    } else {
      const uint32_t a = ldg_u16(s + 2 * c - 4);
      const uint32_t sc = (e & 0x0F0Fu) | ((a >> 2) & 0x3030u);
      const uint32_t m = ((e >> 4) & 0x0F0Fu) | ((b >> 2) & 0x3030u);
      scm = sc | (m << 16);
    }
    uint32_t h = 0;
    if constexpr (K5) {
      const uint8_t* qh = blk + 16 + 4 * (part & 7);
      h = ((ldg_u16(qh) | (ldg_u16(qh + 2) << 16)) >> (2 * c)) & 0x03030303u;
    }
    const uint8_t* q = blk + kQs + 32 * c + 4 * (part & 7);
    return Frag{ldg_u16(q) | (ldg_u16(q + 2) << 16), ldg_u16(blk) | (ldg_u16(blk + 2) << 16), scm, h};
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int part) {
    const float* p = xb + 64 * (part >> 3) + 4 * (part & 7);
    return XFrag{ld_x4<V>(p), ld_x4<V>(p + 32)};
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    const uint32_t lo = (f.q & 0x0F0F0F0Fu) | ((f.h & 0x01010101u) << 4);
    const uint32_t hi = ((f.q >> 4) & 0x0F0F0F0Fu) | ((f.h & 0x02020202u) << 3);
    return scale_min_dot(lo, hi, f.dm, f.scm, x.lo, x.hi, acc);
  }
};
template <>
struct FmtTraits<Fmt::Q4_K> : Q45KTraits<false> {};
template <>
struct FmtTraits<Fmt::Q5_K> : Q45KTraits<true> {};

// Q6_K: 210-byte blocks of 256 values (128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d; tm_q6_k_code's value
// layout); 32 lanes per block. Lane p takes half h = p / 16 and l = 2(p % 16), 2(p % 16) + 1: the values
// 128h + 32k + l for k = 0..3 (ql words at 64h + l and 64h + 32 + l, the qh word at 128 + 32h + l), whose
// sub-blocks 8h + 2k + (p % 16 >= 8) have one scale each; a sub-block contributes (d*scale) * sum((q-32) x).
template <>
struct FmtTraits<Fmt::Q6_K> {
  static constexpr int kVals = 256, kBytes = 210, kLanes = 32, kLoadRegs = 8;
  struct Frag {
    uint32_t q, hd, sc;  // ql (k = 0, 1 low bytes; nibbles), qh word | d << 16, the four int8 scales
  };
  struct XFrag {
    float4 a, b;  // x at values (k = 0: l, l+1; k = 1: l, l+1) and (k = 2, 3)
  };
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int part) {
    const int h = part >> 4, l = 2 * (part & 15);
    const uint8_t* s = blk + 192 + 8 * h;
    const int hi_byte = (part & 15) >= 8 ? 8 : 0;
    uint32_t sc = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) sc |= ((ldg_u16(s + 2 * k) >> hi_byte) & 0xFFu) << (8 * k);
    return Frag{ldg_u16(blk + 64 * h + l) | (ldg_u16(blk + 64 * h + 32 + l) << 16),
                ldg_u16(blk + 128 + 32 * h + l) | (ldg_u16(blk + 208) << 16), sc};
  }
  template <bool V>
  __device__ __forceinline__ static float2 ld_x2(const float* p) {
    if constexpr (V) {
      return *reinterpret_cast<const float2*>(p);
    } else {
      return make_float2(p[0], p[1]);
    }
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int part) {
    const float* p = xb + 128 * (part >> 4) + 2 * (part & 15);
    const float2 x0 = ld_x2<V>(p), x1 = ld_x2<V>(p + 32), x2 = ld_x2<V>(p + 64), x3 = ld_x2<V>(p + 96);
    return XFrag{make_float4(x0.x, x0.y, x1.x, x1.y), make_float4(x2.x, x2.y, x3.x, x3.y)};
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    const uint32_t qh = f.hd & 0xFFFFu;
    // bytes (k, l), (k, l+1), (k+1, l), (k+1, l+1): low 4 bits from ql, bits 4-5 from qh
    const uint32_t w01 = (f.q & 0x0F0F0F0Fu) | (((qh & 0x0303u) | (((qh >> 2) & 0x0303u) << 16)) << 4);
    const uint32_t w23 = ((f.q >> 4) & 0x0F0F0F0Fu) | ((((qh >> 4) & 0x0303u) | (((qh >> 6) & 0x0303u) << 16)) << 4);
    constexpr float kBias = 8388640.0f;  // 2^23 + 32: q - 32
    const float d = fp16_bits_to_f32(f.hd >> 16);
    const float s0 = __fmaf_rn(__fsub_rn(biased_byte(w01, 1), kBias), x.a.y,
                               __fmul_rn(__fsub_rn(biased_byte(w01, 0), kBias), x.a.x));
    const float s1 = __fmaf_rn(__fsub_rn(biased_byte(w01, 3), kBias), x.a.w,
                               __fmul_rn(__fsub_rn(biased_byte(w01, 2), kBias), x.a.z));
    const float s2 = __fmaf_rn(__fsub_rn(biased_byte(w23, 1), kBias), x.b.y,
                               __fmul_rn(__fsub_rn(biased_byte(w23, 0), kBias), x.b.x));
    const float s3 = __fmaf_rn(__fsub_rn(biased_byte(w23, 3), kBias), x.b.w,
                               __fmul_rn(__fsub_rn(biased_byte(w23, 2), kBias), x.b.z));
    const uint32_t sc = f.sc;
    acc = __fmaf_rn(__fmul_rn(d, static_cast<float>(static_cast<int8_t>(sc & 0xFFu))), s0, acc);
    acc = __fmaf_rn(__fmul_rn(d, static_cast<float>(static_cast<int8_t>((sc >> 8) & 0xFFu))), s1, acc);
    acc = __fmaf_rn(__fmul_rn(d, static_cast<float>(static_cast<int8_t>((sc >> 16) & 0xFFu))), s2, acc);
    return __fmaf_rn(__fmul_rn(d, static_cast<float>(static_cast<int8_t>(sc >> 24))), s3, acc);
  }
};

// Q2_K (84-byte blocks of 256 values: 16 bytes of scales and mins, 64 bytes of 2-bit codes, fp16 d, fp16 dmin) and
// Q3_K (110 bytes: 32 bytes hmask, 64 bytes of codes, 12 bytes of 6-bit scales, fp16 d); 32 lanes per block, both
// in tm_q2_k_code's value layout. Lane p takes h = p / 16, the code pair kk = (p / 8) % 2 and l = 4(p % 8)..+3:
// the values 128h + 32k + l for k = 2kk (lo) and 2kk + 1 (hi), bits 2k, 2k+1 of code bytes 32h + l (Q3_K: bit
// 4h + k of hmask[l] above them). Those are sub-blocks j0 = 8h + 4kk + (p % 8 >= 4) and j0 + 2: Q2_K adds them
// as Q4_K's (scale_min_dot); Q3_K as (d*sc) * sum((q-4) x) each, its scales signed (tm_q3_k_scale's bits).
template <bool K3>
struct Q23KTraits {
  static constexpr int kQs = K3 ? 32 : 16;  // the 2-bit codes' offset
  static constexpr int kVals = 256, kBytes = K3 ? 110 : 84, kLanes = 32, kLoadRegs = K3 ? 9 : 6;
  struct Frag {
    uint32_t q, dm, scm;  // q: the lane's codes per byte, Q2_K lo's in bits 0-1 and hi's in 2-3, Q3_K's 3-bit
                          // lo's in 0-2 and hi's in 4-6; dm: d (| dmin << 16); scm: sc0, sc1 (Q3_K: + 32), m0, m1
  };
  using XFrag = FmtTraits<Fmt::Q4_0>::XFrag;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int part) {
    const int h = part >> 4, kk = (part >> 3) & 1, hb = (part & 7) >= 4 ? 8 : 0;
    const uint8_t* qs = blk + kQs + 32 * h + 4 * (part & 7);
    const uint32_t q = ((ldg_u16(qs) | (ldg_u16(qs + 2) << 16)) >> (4 * kk)) & 0x0F0F0F0Fu;
    const uint8_t* s = blk + (K3 ? 96 : 0) + 8 * (K3 ? 0 : h) + 4 * kk;  // the bytes of j0 % 8 - hb, then j0 + 2's
    const uint32_t b0 = (ldg_u16(s) >> hb) & 0xFFu, b1 = (ldg_u16(s + 2) >> hb) & 0xFFu;
    if constexpr (K3) {
      const uint8_t* hm = blk + 4 * (part & 7);
      const uint32_t hbits = ((ldg_u16(hm) | (ldg_u16(hm + 2) << 16)) >> (4 * h + 2 * kk)) & 0x03030303u;
      // low 4 bits: nibble h of bytes j0 % 8 and (j0 + 2) % 8; high 2 bits: bits 2(2h + kk) of bytes 8 + j0 % 4
      // and 8 + (j0 + 2) % 4
      const uint32_t top0 = (ldg_u16(blk + 104) >> hb) & 0xFFu, top1 = (ldg_u16(blk + 106) >> hb) & 0xFFu;
      const int up = 2 * (2 * h + kk);
      const uint32_t sc0 = ((b0 >> (4 * h)) & 15u) | (((top0 >> up) & 3u) << 4);
      const uint32_t sc1 = ((b1 >> (4 * h)) & 15u) | (((top1 >> up) & 3u) << 4);
      const uint32_t codes = (q & 0x03030303u) | ((hbits & 0x01010101u) << 2) |          // lo: bits 0-2
                             (((q >> 2) & 0x03030303u) | ((hbits & 0x02020202u) << 1)) << 4;  // hi: bits 4-6
      return Frag{codes, ldg_u16(blk + 108), sc0 | (sc1 << 8)};
    } else {
      return Frag{q, ldg_u16(blk + 80) | (ldg_u16(blk + 82) << 16),
                  (b0 & 15u) | ((b1 & 15u) << 8) | ((b0 >> 4) << 16) | ((b1 >> 4) << 24)};
    }
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int part) {
    const float* p = xb + 128 * (part >> 4) + 64 * ((part >> 3) & 1) + 4 * (part & 7);
    return XFrag{ld_x4<V>(p), ld_x4<V>(p + 32)};
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    if constexpr (K3) {
      constexpr float kBias = 8388612.0f;  // 2^23 + 4: q - 4
      const float s0 = dot4_codes(f.q & 0x0F0F0F0Fu, kBias, x.lo);
      const float s1 = dot4_codes((f.q >> 4) & 0x0F0F0F0Fu, kBias, x.hi);
      const float d = fp16_bits_to_f32(f.dm);
      acc = __fmaf_rn(__fmul_rn(d, static_cast<float>(static_cast<int>(f.scm & 0xFFu) - 32)), s0, acc);
      return __fmaf_rn(__fmul_rn(d, static_cast<float>(static_cast<int>(f.scm >> 8) - 32)), s1, acc);
    } else {
      return scale_min_dot(f.q & 0x03030303u, (f.q >> 2) & 0x03030303u, f.dm, f.scm, x.lo, x.hi, acc);
    }
  }
};
template <>
struct FmtTraits<Fmt::Q2_K> : Q23KTraits<false> {};
template <>
struct FmtTraits<Fmt::Q3_K> : Q23KTraits<true> {};

// 4 codes (one per byte, 0..15) -> their IQ4 levels kv + 128 (tm_iq4_level's packed bytes), one per byte: two
// byte-permute lookups in the halves of the table (codes & 7), a third picking the half by bit 3 of each code.
__device__ __forceinline__ uint32_t iq4_levels_biased(uint32_t codes) {
  const uint32_t pack = codes | (codes >> 4);
  const uint32_t sel = (pack & 0xFFu) | ((pack >> 8) & 0xFF00u);  // nibble i = code i
  constexpr uint64_t kLo = TM_IQ4_LEVELS_LO, kHi = TM_IQ4_LEVELS_HI;
  const uint32_t lo = __byte_perm(static_cast<uint32_t>(kLo), static_cast<uint32_t>(kLo >> 32), sel & 0x7777u);
  const uint32_t hi = __byte_perm(static_cast<uint32_t>(kHi), static_cast<uint32_t>(kHi >> 32), sel & 0x7777u);
  return __byte_perm(lo, hi, 0x3210u | ((sel & 0x8888u) >> 1));
}
// An IQ4 lane's 8 nibble codes (q: low nibbles values 4p..4p+3, high 16+4p..) times x, as Q4_0's fma chain of
// the levels kv[q].
__device__ __forceinline__ float iq4_dot8(uint32_t q, const float4& xlo, const float4& xhi) {
  constexpr float kBias = 8388736.0f;  // 2^23 + 128: the stored kv + 128
  return dot8_codes(iq4_levels_biased(q & 0x0F0F0F0Fu), iq4_levels_biased((q >> 4) & 0x0F0F0F0Fu), kBias, xlo, xhi);
}

// IQ4_NL: 18-byte blocks (fp16 d, 16 bytes of nibbles as Q4_0's; v = d * kv[q]); Q4_0's lanes and arithmetic with
// the levels in place of q - 8.
template <>
struct FmtTraits<Fmt::IQ4_NL> : FmtTraits<Fmt::Q4_0> {
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    return __fmaf_rn(fp16_bits_to_f32(f.d), iq4_dot8(f.q, x.lo, x.hi), acc);
  }
};

// IQ4_XS: 136-byte blocks of 256 values in 8 sub-blocks of 32 (fp16 d, the uint16 of scale highs, 4 bytes of scale
// lows, then per sub-block 16 bytes laid out as an IQ4_NL block's nibbles); 32 lanes per block. Lane p takes
// sub-block j = p / 4 as IQ4_NL's lane p % 4; a sub-block adds (d*(ls-32)) * sum(kv[q] x).
template <>
struct FmtTraits<Fmt::IQ4_XS> {
  static constexpr int kVals = 256, kBytes = 136, kLanes = 32, kLoadRegs = 5;
  struct Frag {
    uint32_t q, d, ls;  // ls: the sub-block's 6-bit scale (+ 32)
  };
  using XFrag = FmtTraits<Fmt::Q4_0>::XFrag;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int part) {
    const int j = part >> 2;
    const uint8_t* q = blk + 8 + 16 * j + 4 * (part & 3);
    const uint32_t low = (ldg_u16(blk + 4 + 2 * (j >> 2)) >> (4 * (j & 3))) & 15u;  // nibble j % 2 of byte j / 2
    const uint32_t high = (ldg_u16(blk + 2) >> (2 * j)) & 3u;
    return Frag{ldg_u16(q) | (ldg_u16(q + 2) << 16), ldg_u16(blk), low | (high << 4)};
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int part) {
    return FmtTraits<Fmt::Q4_0>::loadx<V>(xb + 32 * (part >> 2), part & 3);
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    const float dl = __fmul_rn(fp16_bits_to_f32(f.d), static_cast<float>(static_cast<int>(f.ls) - 32));
    return __fmaf_rn(dl, iq4_dot8(f.q, x.lo, x.hi), acc);
  }
};

// Plain 16-bit formats, one value per lane per step (row lengths that are not a multiple of 4).
template <bool BF>
struct Plain16Traits {
  static constexpr int kVals = 1, kBytes = 2, kLanes = 1, kLoadRegs = 1;
  struct Frag {
    uint32_t h;
  };
  using XFrag = float;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int) {
    return Frag{ldg_u16(blk)};
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int) {
    return *xb;
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    return __fmaf_rn(BF ? bf16_bits_to_f32(f.h) : fp16_bits_to_f32(f.h), x, acc);
  }
};
template <>
struct FmtTraits<Fmt::F16> : Plain16Traits<false> {};
template <>
struct FmtTraits<Fmt::BF16> : Plain16Traits<true> {};

// 16-bit formats, four consecutive values per lane per step (8 bytes).
template <bool BF>
struct Quad16Traits {
  static constexpr int kVals = 4, kBytes = 8, kLanes = 1, kLoadRegs = 4;
  struct Frag {
    uint32_t a, b;
  };
  using XFrag = float4;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int) {
    if constexpr (V) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(blk));
      return Frag{u.x, u.y};
    } else {
      return Frag{ldg_u16(blk) | (ldg_u16(blk + 2) << 16), ldg_u16(blk + 4) | (ldg_u16(blk + 6) << 16)};
    }
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int) {
    return ld_x4<V>(xb);
  }
  __device__ __forceinline__ static float cvt(uint32_t bits) {
    return BF ? bf16_bits_to_f32(bits) : fp16_bits_to_f32(bits);
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    acc = __fmaf_rn(cvt(f.a & 0xFFFFu), x.x, acc);
    acc = __fmaf_rn(cvt(f.a >> 16), x.y, acc);
    acc = __fmaf_rn(cvt(f.b & 0xFFFFu), x.z, acc);
    return __fmaf_rn(cvt(f.b >> 16), x.w, acc);
  }
};
template <>
struct FmtTraits<Fmt::F16X4> : Quad16Traits<false> {};
template <>
struct FmtTraits<Fmt::BF16X4> : Quad16Traits<true> {};

template <>
struct FmtTraits<Fmt::F32> {
  static constexpr int kVals = 1, kBytes = 4, kLanes = 1, kLoadRegs = 1;
  struct Frag {
    float w;
  };
  using XFrag = float;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int) {
    return Frag{__ldg(reinterpret_cast<const float*>(blk))};
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int) {
    return *xb;
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    return __fmaf_rn(f.w, x, acc);
  }
};

template <>
struct FmtTraits<Fmt::F32X4> {
  static constexpr int kVals = 4, kBytes = 16, kLanes = 1, kLoadRegs = 6;
  struct Frag {
    float4 w;
  };
  using XFrag = float4;
  template <bool V>
  __device__ __forceinline__ static Frag load(const uint8_t* blk, int) {
    return Frag{ld_f4<V>(reinterpret_cast<const float*>(blk))};
  }
  template <bool V>
  __device__ __forceinline__ static XFrag loadx(const float* xb, int) {
    return ld_x4<V>(xb);
  }
  __device__ __forceinline__ static float dot(const Frag& f, const XFrag& x, float acc) {
    acc = __fmaf_rn(f.w.x, x.x, acc);
    acc = __fmaf_rn(f.w.y, x.y, acc);
    acc = __fmaf_rn(f.w.z, x.z, acc);
    return __fmaf_rn(f.w.w, x.w, acc);
  }
};

// One dot-product step: lane fragments f[r] of block `blk` of each row, multiplied with the activations of that
// block (shared x[t], or x[r] per row) into acc. Every reader below goes through this, so all of them add the
// same operands in the same order.
template <class T, int NR, int NT, bool SX, bool V>
__device__ __forceinline__ void dot_step(float (&acc)[NR][NT], const typename T::Frag (&f)[NR],
                                         const float* const (&x)[SX ? NT : NR], int64_t blk, int part) {
  if constexpr (SX) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const typename T::XFrag xf = T::template loadx<V>(x[t] + blk * T::kVals, part);
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[r][t] = T::dot(f[r], xf, acc[r][t]);
    }
  } else {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const typename T::XFrag xf = T::template loadx<V>(x[r] + blk * T::kVals, part);
      acc[r][0] = T::dot(f[r], xf, acc[r][0]);
    }
  }
}

// warp_dot's hook when there is none.
struct NoHook {
  __device__ __forceinline__ void operator()() const {}
};

// Registers per lane that warp_dot_q8t fills with one batch of loads (a tuning knob, see results/NOTES.md).
#ifndef TM_Q8T_LOAD_REGS
#define TM_Q8T_LOAD_REGS 12
#endif
// Timing-only bounds (wrong results; results/NOTES.md lesson 129): 1 keeps the reader's weight words
// (TM_PROBE_W_FIXED) or activations (TM_PROBE_ACT_FIXED) at the first batch of the row, so every later batch
// re-reads those bytes from L1 instead of streaming new ones: what the kernels would gain if those loads were free.
#ifndef TM_PROBE_W_FIXED
#define TM_PROBE_W_FIXED 0
#endif
#ifndef TM_PROBE_ACT_FIXED
#define TM_PROBE_ACT_FIXED 0
#endif
// Pre-quantized activations (the tiled reader's XT = uint8_t): a vector's act_quant.h groups in act_quant.h's
// layout (per 512 values, a reader group, 512 code bytes then 128 float scales).
constexpr int kQ8ActGroupBytes = tm_act::kGroupBlockBytes;
__host__ __device__ constexpr int64_t q8act_bytes(int64_t n) { return tm_act::groups_bytes(n); }
// Group j's (codes, scale) into the layout at buf.
__device__ __forceinline__ void store_q8act(uint8_t* buf, int64_t j, const tm_act::Q8Group& g) {
  uint8_t* p = buf + tm_act::group_offset(j);
  *reinterpret_cast<uint32_t*>(p) = g.codes;
  *reinterpret_cast<float*>(p + 512) = g.scale;
}
// The groups of x[0 .. n) (n a multiple of 4) into buf by the threads of a block (or of its first nthreads), thread
// i taking groups i, i + nthreads, ...; the caller synchronises before buf is read.
__device__ __forceinline__ void store_q8act_vector(const float* x, uint8_t* buf, int64_t n, int nthreads) {
  for (int64_t j = threadIdx.x; j < n / 4; j += nthreads)
    store_q8act(buf, j, tm_act::q8_group(x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]));
}

template <class T>
__device__ __forceinline__ T ldg_vec(const uint8_t* p) {
  return __ldg(reinterpret_cast<const T*>(p));
}
// A word of a tiled row: from global memory (read-only path), or with SM from the copy of the row the kernel put
// in its shared memory (a plain load: the compiler sees the shared address space through the inlined pointer).
template <class T, bool SM>
__device__ __forceinline__ T ld_row(const uint8_t* p) {
  if constexpr (SM) {
    return *reinterpret_cast<const T*>(p);
  } else {
    return ldg_vec<T>(p);
  }
}

// One batch of warp_dot_q8t: groups g0 .. g0 + kGroups - 1 of a tiled row. Full: every one of them is a whole
// group (no bounds logic, so the compiler issues all loads, activations included, before the first use); else the
// last batch, whose groups may be short (the tail, tail < 4 steps) or past the row end (skipped). code[r] and
// scale[r] point at this lane's code and scale words of group g0 in row r, xg[.] at group g0's activations (the
// caller advances them: no per-batch address arithmetic).
template <int kGroups, bool Full, bool W16, int NR, int NT, bool SX, bool V, bool SM, class Hook, class XT, int PF>
__device__ __forceinline__ void q8t_batch(const uint8_t* const (&w)[NR], const uint8_t* const (&code)[NR],
                                          const uint8_t* const (&scale)[NR], const XT* const (&xg)[SX ? NT : NR],
                                          int g0, int ngroups, int tail, int scales, int lane,
                                          float (&acc)[NR][NT], const Hook& hook, bool first) {
  using T = FmtTraits<Fmt::Q8_0>;  // a tiled row's step: Q8_0's fragments and arithmetic
  const int sub = lane >> 3, part = lane & 7;
  uint2 c[kGroups][NR][2], sc[kGroups][NR];
#pragma unroll
  for (int v = 0; v < kGroups; ++v) {
    const int g = g0 + v;
    if (Full || g < ngroups) {
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if constexpr (W16) {
          const uint4 q = ld_row<uint4, SM>(code[r] + v * 512);
          c[v][r][0] = make_uint2(q.x, q.y);
          c[v][r][1] = make_uint2(q.z, q.w);
        } else {
          c[v][r][0] = ld_row<uint2, SM>(code[r] + v * 512);
          c[v][r][1] = ld_row<uint2, SM>(code[r] + v * 512 + 8);
        }
        sc[v][r] = ld_row<uint2, SM>(scale[r] + v * 32);
      }
    } else if (g == ngroups && tail > 0) {
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        // Two pointers per row, formed here: the compiler would otherwise keep one per word and row live
        // through the whole row (loop-invariant), registers that rows without a tail never use.
        const uint8_t* tcode = w[r] + g * 512 + 4 * tail * lane;
        const uint8_t* tscale = w[r] + scales + g * 32 + 2 * tail * sub;
        uint32_t q[3] = {0, 0, 0}, d[3] = {0, 0, 0};
#pragma unroll
        for (int u = 0; u < 3; ++u) {
          if (u < tail) {
            q[u] = ld_row<uint32_t, SM>(tcode + 4 * u);
            d[u] = ld_row<unsigned short, SM>(tscale + 2 * u);
          }
        }
        c[v][r][0] = make_uint2(q[0], q[1]);
        c[v][r][1] = make_uint2(q[2], 0u);
        sc[v][r] = make_uint2(d[0] | (d[1] << 16), d[2]);
      }
    }
  }
  // PF > 0: the whole batch PF batches ahead asked for in L2, one prefetch per 128-byte line (the same bits). With
  // int8 activations PF = 2 sped the down (a three-wave grid that leaves DRAM idle) and slowed the gate-up (whose
  // 1,408 blocks keep it busy) on the H200 (results/NOTES.md lesson 136), so the down asks for it alone. The scales'
  // sector from lane 0 alone: asked by the four code-line lanes too, the down ran 8% slower (lesson 149).
  if constexpr (Full && !SM && PF > 0) {
    if (g0 + (PF + 1) * kGroups <= ngroups) {
#pragma unroll
      for (int v = 0; v < kGroups; ++v)
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          if ((lane & 7) == 0) prefetch_l2(code[r] + (PF * kGroups + v) * 512);
          if (lane == 0) prefetch_l2(scale[r] + (PF * kGroups + v) * 32);
        }
    }
  }
  if (first) hook();  // while this batch's loads are in flight (warp_dot's hook)
  // row r's fragment of step (g0 + v) * 4 + u: Q8_0's step, operand for operand
  const auto frag = [&](int v, int r, int u) {
    const uint2 cw = c[v][r][u >> 1];
    const uint32_t sw = (u >> 1) ? sc[v][r].y : sc[v][r].x;
    return typename T::Frag{(u & 1) ? cw.y : cw.x, (u & 1) ? sw >> 16 : sw & 0xFFFFu};
  };
  if constexpr (std::is_same_v<XT, uint8_t>) {  // pre-quantized activation groups (q8act layout)
    constexpr int NX = SX ? NT : NR;
#pragma unroll
    for (int v = 0; v < kGroups; ++v) {
      const int g = g0 + v;
      const int width = Full || g < ngroups ? 4 : (g == ngroups ? tail : 0);
      if (width == 0) continue;
      uint4 aq[NX];
      float4 as[NX];
#pragma unroll
      for (int i = 0; i < NX; ++i) {  // a short group is stored whole: both loads stay in bounds
        const uint8_t* xb = xg[i] + v * kQ8ActGroupBytes + 16 * lane;
        aq[i] = *reinterpret_cast<const uint4*>(xb);
        as[i] = *reinterpret_cast<const float4*>(xb + 512);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (u < width) {
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            const typename T::Frag f = frag(v, r, u);
#pragma unroll
            for (int t = 0; t < (SX ? NT : 1); ++t) {
              const int i = SX ? t : r;
              const uint32_t a = u == 0 ? aq[i].x : u == 1 ? aq[i].y : u == 2 ? aq[i].z : aq[i].w;
              const float d = u == 0 ? as[i].x : u == 1 ? as[i].y : u == 2 ? as[i].z : as[i].w;
              acc[r][t] = T::dot_codes(f, a, d, acc[r][t]);
            }
          }
        }
      }
    }
  } else {  // float activations, quantized step by step
#pragma unroll
    for (int v = 0; v < kGroups; ++v) {
      const int g = g0 + v;
      const int width = Full || g < ngroups ? 4 : (g == ngroups ? tail : 0);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (u < width) {
          typename T::Frag f[NR];
#pragma unroll
          for (int r = 0; r < NR; ++r) f[r] = frag(v, r, u);
          dot_step<T, NR, NT, SX, V>(acc, f, xg, (v * 4 + u) * 4 + sub, part);
        }
      }
    }
  }
}

// warp_dot for TM_Q8_0_TILED rows (layout in tornado_moe.h): every lane gets the same code words and scales, in the
// same step order, as from the Q8_0 bytes of the same row, and feeds them to the same arithmetic
// (FmtTraits<Q8_0>::dot), so the result is bitwise warp_dot<Q8_0>'s. What changes is the loads: per group of 4 steps
// a lane reads its 16 code bytes as one 16-byte word (W16) or two 8-byte ones, and its lane group's 4 scales as one
// 8-byte word (2 or 3 loads instead of 12 16-bit ones); all loads of a batch of kGroups groups are in flight before
// the first use. Whole batches run without bounds logic; the one batch that may hold short groups comes last, as its
// groups do in the row (the order of the steps is unchanged). Indices are 32-bit (a row has far fewer than 2^31
// bytes): the reader's instructions per byte are what bounds the expert kernels (results/NOTES.md).
// The batches are not software-pipelined on purpose: a second batch in flight costs the registers that decide
// the blocks per SM, and on the H200 every pipelined variant (activations from L1 or from shared memory) was
// slower than more warps per SM (results/NOTES.md, v4f), so the reader keeps few registers live.
// XT: float activations (quantized step by step, act_quant.h), or uint8_t: the q8act layout's groups of the same
// values, made once by the kernel that wrote them (the same operands, so the same bits, without the rounding work).
template <bool W16, int NR, int NT, bool SX, bool V, bool SM = false, class Hook = NoHook, class XT = float,
          int PF = 0>
__device__ __forceinline__ void warp_dot_q8t(const uint8_t* const (&w)[NR], const XT* const (&x)[SX ? NT : NR],
                                             int64_t nblocks, float (&out)[NR][NT], const Hook& hook = Hook{}) {
  constexpr int kFit = TM_Q8T_LOAD_REGS / (6 * NR);  // 6 registers per group and row in flight
  constexpr int kGroups = kFit < 1 ? 1 : (kFit > 4 ? 4 : kFit);
  const int lane = threadIdx.x & 31;
  const int nb = static_cast<int>(nblocks), nsteps = nb / 4, ngroups = nsteps / 4, tail = nsteps % 4;
  const int scales = nb * 32;  // byte offset of the scale area in a row

  float acc[NR][NT];
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
  constexpr int NX = SX ? NT : NR;
  const uint8_t* code[NR];
  const uint8_t* scale[NR];
  const XT* xg[NX];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    code[r] = w[r] + 16 * lane;
    scale[r] = w[r] + scales + 8 * (lane >> 3);
  }
#pragma unroll
  for (int i = 0; i < NX; ++i) xg[i] = x[i];
  constexpr int kWStep = TM_PROBE_W_FIXED ? 0 : kGroups * 512, kSStep = TM_PROBE_W_FIXED ? 0 : kGroups * 32;
  // 4 steps x 4 blocks x 32 values per group: 512 floats, or kQ8ActGroupBytes
  constexpr int kXStep = TM_PROBE_ACT_FIXED ? 0 : kGroups * (std::is_same_v<XT, uint8_t> ? kQ8ActGroupBytes : 512);
  int g0 = 0;
  for (; g0 + kGroups <= ngroups; g0 += kGroups) {
    q8t_batch<kGroups, true, W16, NR, NT, SX, V, SM, Hook, XT, PF>(w, code, scale, xg, g0, ngroups, tail, scales,
                                                               lane, acc, hook, g0 == 0);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      code[r] += kWStep;
      scale[r] += kSStep;
    }
#pragma unroll
    for (int i = 0; i < NX; ++i) xg[i] += kXStep;
  }
  // What is left: fewer than kGroups whole groups, then the tail group (if any), as one batch.
  if (g0 < ngroups + (tail > 0 ? 1 : 0))
    q8t_batch<kGroups, false, W16, NR, NT, SX, V, SM, Hook, XT, PF>(w, code, scale, xg, g0, ngroups, tail, scales,
                                                                lane, acc, hook, g0 == 0);
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) out[r][t] = warp_sum(acc[r][t]);
}

// warp_dot (below) for every layout but the tiled ones: rows read block by block.
template <Fmt F, int NR, int NT, bool SX, bool V>
__device__ __forceinline__ void warp_dot_blocks(const uint8_t* const (&w)[NR], const float* const (&x)[SX ? NT : NR],
                                                int64_t nblocks, float (&out)[NR][NT]) {
  using T = FmtTraits<F>;
  constexpr int kBlocksPerStep = 32 / T::kLanes;
  // Steps whose weight loads are issued together: a budget of about 48 loaded registers per lane for shared
  // activations, 24 for per-row activations (the down projection keeps NR experts' rows and activations live),
  // so that two blocks of 8 warps fit an SM without spilling.
  constexpr int kBudget = SX ? (NR * NT > 1 ? 40 : 48) : 24;
  constexpr int kFit = kBudget / (T::kLoadRegs * NR * NT);
  constexpr int kUnroll = kFit < 1 ? 1 : (kFit > 16 ? 16 : kFit);
  const int lane = threadIdx.x & 31;
  const int sub = lane / T::kLanes;
  const int part = lane % T::kLanes;

  float acc[NR][NT];
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

  // Batches of kUnroll steps in which every lane has a block run without bounds checks (affine addresses); the
  // rest (at most kUnroll steps plus a partial step) clamps and predicates. The accumulation order is the same.
  const int64_t nsteps = (nblocks + kBlocksPerStep - 1) / kBlocksPerStep;
  const int64_t nfull = nblocks / kBlocksPerStep;  // steps in which all 32 lanes have a block
  int64_t s0 = 0;
  for (; s0 + kUnroll <= nfull; s0 += kUnroll) {
    typename T::Frag f[kUnroll][NR];
    const int64_t blk0 = s0 * kBlocksPerStep + sub;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < NR; ++r)
        f[u][r] = T::template load<V>(w[r] + (blk0 + u * kBlocksPerStep) * T::kBytes, part);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dot_step<T, NR, NT, SX, V>(acc, f[u], x, blk0 + u * kBlocksPerStep, part);
  }
  for (; s0 < nsteps; s0 += kUnroll) {
    typename T::Frag f[kUnroll][NR];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // Past the row end a lane re-reads the last block (always valid, never used): unpredicated loads let the
      // compiler issue all of them before the first use.
      int64_t blk = (s0 + u) * kBlocksPerStep + sub;
      blk = blk < nblocks ? blk : nblocks - 1;
#pragma unroll
      for (int r = 0; r < NR; ++r) f[u][r] = T::template load<V>(w[r] + blk * T::kBytes, part);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t blk = (s0 + u) * kBlocksPerStep + sub;
      if (blk < nblocks) dot_step<T, NR, NT, SX, V>(acc, f[u], x, blk, part);
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) out[r][t] = warp_sum(acc[r][t]);
}

// Warp dot products of NR weight rows with activations, NT tokens at once.
//   SX (shared x): every row is multiplied with the same NT activation vectors x[0..NT) (matmul token tiles,
//                  gate+up pairs); otherwise NT must be 1 and row r is multiplied with its own x[r] (the slots of
//                  a down projection).
//   w[r]     : start of row r (kBytes-sized blocks, or a tiled row); x[.]: start of the activation row (float32,
//              row length nblocks * kVals); every lane must call this (full-warp shuffles), out[r][t] is the same
//              on all lanes.
//   SM       : the rows w[r] are copies in shared memory (tiled layouts only; bulk_row_to_smem in common.cuh).
//   hook     : (tiled layouts) called once, by every lane, while the first batch's weight loads are in flight
//              (work that would otherwise wait for the dot product: the deferred norm's inv, norm.cuh); it must
//              not touch the dot's registers. Not called for the other layouts, nor for rows without a batch:
//              the caller then runs it after the dot product (warp_dot returns whether it ran).
template <Fmt F, int NR, int NT, bool SX, bool V, bool SM = false, class Hook = NoHook>
__device__ __forceinline__ bool warp_dot(const uint8_t* const (&w)[NR], const float* const (&x)[SX ? NT : NR],
                                         int64_t nblocks, float (&out)[NR][NT], const Hook& hook = Hook{}) {
  static_assert(SX || NT == 1, "per-row activations take one token");
  static_assert(!SM || fmt_tiled(F), "only the tiled reader reads rows from shared memory");
  if constexpr (fmt_tiled(F)) {
    warp_dot_q8t<F == Fmt::Q8_0T16, NR, NT, SX, V, SM>(w, x, nblocks, out, hook);
    return nblocks >= 4;  // at least one step, so one batch, ran: the hook with it
  } else {
    warp_dot_blocks<F, NR, NT, SX, V>(w, x, nblocks, out);
    return false;
  }
}

// warp_dot of tiled rows with pre-quantized activations (xq[.]: the q8act layout of the activation rows, as
// store_q8act_vector writes it): the bits of warp_dot on the float activations they were made from. PF: the
// reader's L2 prefetch distance in batches (0: none).
template <Fmt F, int NR, int NT, bool SX, bool SM = false, int PF = 0, class Hook = NoHook>
__device__ __forceinline__ bool warp_dot_q8act(const uint8_t* const (&w)[NR],
                                               const uint8_t* const (&xq)[SX ? NT : NR], int64_t nblocks,
                                               float (&out)[NR][NT], const Hook& hook = Hook{}) {
  static_assert(fmt_tiled(F), "pre-quantized activations are read by the tiled reader");
  static_assert(SX || NT == 1, "per-row activations take one token");
  warp_dot_q8t<F == Fmt::Q8_0T16, NR, NT, SX, true, SM, Hook, uint8_t, PF>(w, xq, nblocks, out, hook);
  return nblocks >= 4;
}

// A float32 row (a router row, the shared-expert gate) with x: F32X4 when the length n is a multiple of 4 (with
// vector loads when both pointers are 16-byte aligned), else F32. f32_row_mode (host) makes that choice for every
// caller, so a row gives the same bits in every kernel that reads it.
enum F32RowMode : int { kF32Row = 0, kF32RowX4 = 1, kF32RowX4Vec = 2 };
template <bool X4, bool V>
__device__ __forceinline__ float warp_dot_f32_row(const float* w, const float* x, int64_t n) {
  const uint8_t* wr[1] = {reinterpret_cast<const uint8_t*>(w)};
  const float* xs[1] = {x};
  float out[1][1];
  warp_dot<X4 ? Fmt::F32X4 : Fmt::F32, 1, 1, true, V>(wr, xs, X4 ? n / 4 : n, out);
  return out[0][0];
}
__device__ __forceinline__ float warp_dot_f32_row(int mode, const float* w, const float* x, int64_t n) {
  if (mode == kF32Row) return warp_dot_f32_row<false, false>(w, x, n);
  if (mode == kF32RowX4) return warp_dot_f32_row<true, false>(w, x, n);
  return warp_dot_f32_row<true, true>(w, x, n);
}

// warp_dot_f32_row's X4 layout (n a multiple of 4) with both the row and x in shared memory (plain loads): lane l
// adds the blocks l, l + 32, ... in increasing order with F32X4's arithmetic, then warp_sum, which is what
// warp_dot_blocks<F32X4> does whatever its batching, so the bits are warp_dot_f32_row's.
__device__ __forceinline__ float warp_dot_f32x4_row_smem(const float* w, const float* x, int64_t n) {
  using T = FmtTraits<Fmt::F32X4>;
  float acc = 0.0f;
  for (int64_t blk = threadIdx.x & 31; blk < n / 4; blk += 32)
    acc = T::dot(T::Frag{ld_x4<true>(w + 4 * blk)}, ld_x4<true>(x + 4 * blk), acc);
  return warp_sum(acc);
}

// ---- host side: choosing the layout -------------------------------------------------------------------------

inline int f32_row_mode(int64_t n, bool aligned16) {
  return n % 4 != 0 ? kF32Row : aligned16 ? kF32RowX4Vec : kF32RowX4;
}

// The row layout of `qtype` for rows of `cols` values (depends on the shape only, so results never depend on
// where the buffers happen to be allocated).
inline Fmt fmt_for(int qtype, int64_t cols) {
  const bool quad = cols % 4 == 0;
  switch (qtype) {
    case TM_Q8_0: return Fmt::Q8_0;
    case TM_Q8_0_TILED: return cols % 256 == 0 ? Fmt::Q8_0T16 : Fmt::Q8_0T;
    case TM_Q4_0: return Fmt::Q4_0;
    case TM_Q4_1: return Fmt::Q4_1;
    case TM_Q5_0: return Fmt::Q5_0;
    case TM_Q5_1: return Fmt::Q5_1;
    case TM_Q4_K: return Fmt::Q4_K;
    case TM_Q5_K: return Fmt::Q5_K;
    case TM_Q6_K: return Fmt::Q6_K;
    case TM_Q2_K: return Fmt::Q2_K;
    case TM_Q3_K: return Fmt::Q3_K;
    case TM_IQ4_NL: return Fmt::IQ4_NL;
    case TM_IQ4_XS: return Fmt::IQ4_XS;
    case TM_F16: return quad ? Fmt::F16X4 : Fmt::F16;
    case TM_BF16: return quad ? Fmt::BF16X4 : Fmt::BF16;
    default: return quad ? Fmt::F32X4 : Fmt::F32;
  }
}

// Values per block of a layout (the row length in blocks is cols / fmt_vals).
inline int64_t fmt_vals(Fmt f) {
  switch (f) {
    case Fmt::Q8_0: case Fmt::Q8_0T: case Fmt::Q8_0T16: case Fmt::Q4_0: case Fmt::Q4_1: case Fmt::Q5_0:
    case Fmt::Q5_1: case Fmt::IQ4_NL: return 32;
    case Fmt::Q2_K: case Fmt::Q3_K: case Fmt::Q4_K: case Fmt::Q5_K: case Fmt::Q6_K: case Fmt::IQ4_XS: return 256;
    case Fmt::F16X4: case Fmt::BF16X4: case Fmt::F32X4: return 4;
    default: return 1;
  }
}

// Whether the vector-load variant may be used: activations 16-byte aligned and, for the x4 plain layouts, the
// weight base aligned to its vector width (row strides are then multiples of it). Row layouts of one value per
// lane never use vectors.
inline bool fmt_vector_ok(Fmt f, const void* w, bool x_aligned16) {
  switch (f) {
    case Fmt::F16: case Fmt::BF16: case Fmt::F32: return false;
    case Fmt::F16X4: case Fmt::BF16X4: return x_aligned16 && aligned(w, 8);
    case Fmt::F32X4: return x_aligned16 && aligned(w, 16);
    default: return x_aligned16;
  }
}

template <Fmt F>
using FmtTag = std::integral_constant<Fmt, F>;

// Calls fn(FmtTag<F>{}, std::bool_constant<V>{}) for the runtime layout f and vector flag v; the one-value layouts
// are only instantiated with V = false.
template <class Fn>
inline int dispatch_fmt(Fmt f, bool v, Fn&& fn) {
  // a layout with vector loads or without them, as v says
  auto either = [&](auto tag) { return v ? fn(tag, std::true_type{}) : fn(tag, std::false_type{}); };
  switch (f) {
    case Fmt::Q8_0: return either(FmtTag<Fmt::Q8_0>{});
    case Fmt::Q8_0T: return either(FmtTag<Fmt::Q8_0T>{});
    case Fmt::Q8_0T16: return either(FmtTag<Fmt::Q8_0T16>{});
    case Fmt::Q4_0: return either(FmtTag<Fmt::Q4_0>{});
    case Fmt::Q4_1: return either(FmtTag<Fmt::Q4_1>{});
    case Fmt::Q5_0: return either(FmtTag<Fmt::Q5_0>{});
    case Fmt::Q5_1: return either(FmtTag<Fmt::Q5_1>{});
    case Fmt::Q4_K: return either(FmtTag<Fmt::Q4_K>{});
    case Fmt::Q5_K: return either(FmtTag<Fmt::Q5_K>{});
    case Fmt::Q6_K: return either(FmtTag<Fmt::Q6_K>{});
    case Fmt::Q2_K: return either(FmtTag<Fmt::Q2_K>{});
    case Fmt::Q3_K: return either(FmtTag<Fmt::Q3_K>{});
    case Fmt::IQ4_NL: return either(FmtTag<Fmt::IQ4_NL>{});
    case Fmt::IQ4_XS: return either(FmtTag<Fmt::IQ4_XS>{});
    case Fmt::F16X4: return either(FmtTag<Fmt::F16X4>{});
    case Fmt::BF16X4: return either(FmtTag<Fmt::BF16X4>{});
    case Fmt::F32X4: return either(FmtTag<Fmt::F32X4>{});
    case Fmt::F16: return fn(FmtTag<Fmt::F16>{}, std::false_type{});
    case Fmt::BF16: return fn(FmtTag<Fmt::BF16>{}, std::false_type{});
    default: return fn(FmtTag<Fmt::F32>{}, std::false_type{});
  }
}

}  // namespace tm_cuda

#endif
