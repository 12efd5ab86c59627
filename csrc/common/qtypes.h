/*
 * qtypes.h - internal: block geometry and names of GGML weight formats, shared by the dispatcher (argument
 * checks), the CPU and CUDA kernels and the torch shell (tensor byte-size checks). C-compatible, header-only.
 */
#ifndef TORNADO_MOE_QTYPES_H
#define TORNADO_MOE_QTYPES_H

#include <stdint.h>

#include "host_device.h"
#include "tornado_moe.h"

/* 1 when the kernels support weight format `qtype` (a tm_qtype value). */
static inline TM_HOST_DEVICE int tm_qtype_supported(int qtype) {
  switch (qtype) {
    case TM_F32: case TM_F16: case TM_Q4_0: case TM_Q4_1: case TM_Q5_0: case TM_Q5_1: case TM_Q8_0: case TM_Q2_K:
    case TM_Q3_K: case TM_Q4_K: case TM_Q5_K: case TM_Q6_K: case TM_IQ4_NL: case TM_IQ4_XS: case TM_BF16:
    case TM_Q8_0_TILED: return 1;
    default: return 0;
  }
}

/* Values per block (a row length must be a multiple of it); 0 for an unsupported format. */
static inline TM_HOST_DEVICE int64_t tm_qtype_block_size(int qtype) {
  switch (qtype) {
    case TM_F32: case TM_F16: case TM_BF16: return 1;
    case TM_Q4_0: case TM_Q4_1: case TM_Q5_0: case TM_Q5_1: case TM_Q8_0: case TM_IQ4_NL: return 32;
    case TM_Q2_K: case TM_Q3_K: case TM_Q4_K: case TM_Q5_K: case TM_Q6_K: case TM_IQ4_XS: return 256;
    case TM_Q8_0_TILED: return 128;  /* a row is whole steps of 4 Q8_0 blocks */
    default: return 0;
  }
}

/* Bytes per block as stored in a GGUF file; 0 for an unsupported format. */
static inline TM_HOST_DEVICE int64_t tm_qtype_block_bytes(int qtype) {
  switch (qtype) {
    case TM_F32: return 4;
    case TM_F16: case TM_BF16: return 2;
    case TM_Q4_0: return 2 + 16;
    case TM_Q4_1: return 2 + 2 + 16;
    case TM_Q5_0: return 2 + 4 + 16;
    case TM_Q5_1: return 2 + 2 + 4 + 16;
    case TM_Q8_0: return 2 + 32;
    case TM_Q2_K: return 16 + 64 + 2 + 2;
    case TM_Q3_K: return 32 + 64 + 12 + 2;
    case TM_Q4_K: return 2 + 2 + 12 + 128;
    case TM_Q5_K: return 2 + 2 + 12 + 32 + 128;
    case TM_Q6_K: return 128 + 64 + 16 + 2;
    case TM_IQ4_NL: return 2 + 16;
    case TM_IQ4_XS: return 2 + 2 + 4 + 128;
    case TM_Q8_0_TILED: return 4 * (2 + 32);
    default: return 0;
  }
}

/* Bytes of one row of `cols` values (cols a multiple of the block size). */
static inline TM_HOST_DEVICE int64_t tm_qtype_row_bytes(int qtype, int64_t cols) {
  int64_t bs = tm_qtype_block_size(qtype);
  return bs > 0 ? cols / bs * tm_qtype_block_bytes(qtype) : 0;
}

/* Codes of the formats whose bits are not a byte or a nibble at a fixed place (layouts in tornado_moe.h), value by
 * value: the CUDA embedding's decoder. The CPU decoders (quant_blocks.h) and the CUDA dot products unroll the same
 * layouts; the tests hold all of them to gguf's dequantizer, bit for bit. */
/* Q5_0 / Q5_1: the 5-bit code q (0..31) of value c (0..31), from the fifth bits' uint32 at qh and the nibbles
 * after it (Q5_0's value is (q - 16) * d). */
static inline TM_HOST_DEVICE int tm_q5_code(const uint8_t* qh, int c) {
  const uint32_t h = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
  const int lo = (qh[4 + (c & 15)] >> (4 * (c >> 4))) & 0xF;
  return lo | (int)(((h >> c) & 1u) << 4);
}
/* Q4_K: the 6-bit scale and min of sub-block j (0..7) from the block's 12 packed bytes s. */
static inline TM_HOST_DEVICE void tm_q4_k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
/* Q4_K: the code (0..15) of value c (0..255) of a block whose nibbles start at qs. */
static inline TM_HOST_DEVICE int tm_q4_k_code(const uint8_t* qs, int c) {
  return (qs[32 * (c / 64) + c % 32] >> (4 * ((c / 32) & 1))) & 0xF;
}
/* Q5_K: the code (0..31) of value c (0..255) of the block at blk (qh at byte 16, nibbles at 48). */
static inline TM_HOST_DEVICE int tm_q5_k_code(const uint8_t* blk, int c) {
  return tm_q4_k_code(blk + 48, c) | (((blk[16 + c % 32] >> (c / 32)) & 1) << 4);
}
/* Q6_K: q - 32 of value c (0..255) of the block at blk (ql at byte 0, qh at 128; ggml's dequantize_row_q6_K):
 * value 128h + 32k + l takes nibble k / 2 of ql[64h + 32(k % 2) + l] and bits 2k, 2k+1 of qh[32h + l]. */
static inline TM_HOST_DEVICE int tm_q6_k_code(const uint8_t* blk, int c) {
  const int h = c / 128, k = (c % 128) / 32, l = c % 32;
  const int lo = (blk[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 0xF;
  const int hi = (blk[128 + 32 * h + l] >> (2 * k)) & 3;
  return (lo | (hi << 4)) - 32;
}

/* Q2_K: the 2-bit code (0..3) of value c (0..255) of the block at blk (codes at byte 16): value 128h + 32k + l
 * is bits 2k, 2k+1 of byte 32h + l; sub-block c / 16's scale is blk[c / 16] & 15, its min blk[c / 16] >> 4. */
static inline TM_HOST_DEVICE int tm_q2_k_code(const uint8_t* blk, int c) {
  return (blk[16 + 32 * (c / 128) + c % 32] >> (2 * ((c % 128) / 32))) & 3;
}
/* Q3_K: q - 4 (-4..3) of value c of the block at blk (hmask at byte 0, codes at 32): Q2_K's code placement plus
 * bit 4h + k of hmask[l] as the third bit. */
static inline TM_HOST_DEVICE int tm_q3_k_code(const uint8_t* blk, int c) {
  const int h = c / 128, k = (c % 128) / 32, l = c % 32;
  const int lo = (blk[32 + 32 * h + l] >> (2 * k)) & 3;
  return (lo | (((blk[l] >> (4 * h + k)) & 1) << 2)) - 4;
}
/* Q3_K: the signed scale (sc - 32, -32..31) of sub-block j (0..15) from the block's 12 scale bytes s: the low 4 bits
 * are nibble j / 8 of s[j % 8], the high 2 bits are bits 2(j / 4), +1 of s[8 + j % 4]. */
static inline TM_HOST_DEVICE int tm_q3_k_scale(const uint8_t* s, int j) {
  return (((s[j % 8] >> (4 * (j / 8))) & 15) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}
/* IQ4_NL / IQ4_XS: the level kv[q] of a 4-bit code (llama.cpp's kvalues_iq4nl: -127, -104, -83, -65, -49, -35,
 * -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), packed as bytes kv + 128 of two words so that host and device share
 * it without a table in memory; tm_iq4_levels_biased gives the words to the CUDA byte-permute lookup. */
#define TM_IQ4_LEVELS_LO 0x766A5D4F3F2D1801ull /* kv[0..7] + 128, kv[0] in the low byte */
#define TM_IQ4_LEVELS_HI 0xF1D9C5B5A6998D81ull /* kv[8..15] + 128 */
static inline TM_HOST_DEVICE int tm_iq4_level(int q) {
  const unsigned long long w = q < 8 ? TM_IQ4_LEVELS_LO : TM_IQ4_LEVELS_HI;
  return (int)((w >> (8 * (q & 7))) & 0xFFu) - 128;
}
/* IQ4_NL: the code (0..15) of value c (0..31) of a block whose 16 nibble bytes start at qs (as Q4_0's). IQ4_XS's
 * sub-block j holds the same layout at byte 8 + 16j of its block. */
static inline TM_HOST_DEVICE int tm_iq4_code(const uint8_t* qs, int c) { return (qs[c & 15] >> (4 * (c >> 4))) & 15; }
/* IQ4_XS: the signed scale (ls - 32) of sub-block j (0..7) of the block at blk: the low 4 bits are nibble j % 2
 * of byte 4 + j / 2, the high 2 bits are bits 2j, 2j+1 of the uint16 at byte 2. */
static inline TM_HOST_DEVICE int tm_iq4_xs_scale(const uint8_t* blk, int j) {
  const unsigned high = (unsigned)blk[2] | ((unsigned)blk[3] << 8);
  return (((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | (int)(((high >> (2 * j)) & 3u) << 4)) - 32;
}

/* TM_Q8_0_TILED (layout in tornado_moe.h): byte offsets, inside a row of `cols` values, of the code of value c
 * and of the fp16 scale of block b; a stored code byte is the int8 q (two's complement), tm_q8t_code gives q. */
static inline TM_HOST_DEVICE int tm_q8t_code(uint8_t stored) { return static_cast<int>(static_cast<int8_t>(stored)); }
static inline TM_HOST_DEVICE int64_t tm_q8t_group_width(int64_t cols, int64_t group) {
  const int64_t steps = cols / 128;
  return group < steps / 4 ? 4 : steps % 4;
}
static inline TM_HOST_DEVICE int64_t tm_q8t_code_offset(int64_t cols, int64_t c) {
  const int64_t b = c / 32, i = c % 32, s = b / 4, g = s / 4, u = s % 4;
  const int64_t lane = 8 * (b % 4) + i / 4;
  return 512 * g + 4 * (tm_q8t_group_width(cols, g) * lane + u) + i % 4;
}
static inline TM_HOST_DEVICE int64_t tm_q8t_scale_offset(int64_t cols, int64_t b) {
  const int64_t s = b / 4, g = s / 4, u = s % 4;
  return cols + 32 * g + 2 * (tm_q8t_group_width(cols, g) * (b % 4) + u);
}

/* GGML name of any type id (for error messages), "unknown" outside the GGML enum. */
static inline const char* tm_ggml_type_name(int qtype) {
  switch (qtype) {
    case 0: return "F32";      case 1: return "F16";      case 2: return "Q4_0";     case 3: return "Q4_1";
    case 6: return "Q5_0";     case 7: return "Q5_1";     case 8: return "Q8_0";     case 9: return "Q8_1";
    case 10: return "Q2_K";    case 11: return "Q3_K";    case 12: return "Q4_K";    case 13: return "Q5_K";
    case 14: return "Q6_K";    case 15: return "Q8_K";    case 16: return "IQ2_XXS"; case 17: return "IQ2_XS";
    case 18: return "IQ3_XXS"; case 19: return "IQ1_S";   case 20: return "IQ4_NL";  case 21: return "IQ3_S";
    case 22: return "IQ2_S";   case 23: return "IQ4_XS";  case 24: return "I8";      case 25: return "I16";
    case 26: return "I32";     case 27: return "I64";     case 28: return "F64";     case 29: return "IQ1_M";
    case 30: return "BF16";    case 34: return "TQ1_0";   case 35: return "TQ2_0";   case 39: return "MXFP4";
    case TM_Q8_0_TILED: return "Q8_0_TILED";
    default: return "unknown";
  }
}

#define TM_SUPPORTED_QTYPES_TEXT \
  "F32 (0), F16 (1), Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), " \
  "Q6_K (14), IQ4_NL (20), IQ4_XS (23), BF16 (30), Q8_0_TILED (264)"

#endif
