"""GGML block formats that tornado-moe reads: sizes, dequantization (own numpy code) and quantization.

Layouts (little endian, one block covers ``block_size`` consecutive values of a row):

- F32 / F16 / BF16: one value per "block" (4 / 2 / 2 bytes). BF16 is the top half of an IEEE float32.
- Q8_0 (34 bytes): fp16 scale ``d``, then 32 int8 codes ``q``; value = q * d.
- Q4_0 (18 bytes): fp16 scale ``d``, then 16 bytes of nibbles; the LOW nibble of byte j is value j, the
  HIGH nibble of byte j is value j + 16; value = (q - 8) * d.
- Q4_1 (20 bytes): fp16 scale ``d``, fp16 minimum ``m``, then 16 bytes of nibbles as in Q4_0;
  value = q * d + m (two float32 roundings: product first, then the sum).
- Q5_0 (22 bytes): fp16 scale ``d``, a little-endian uint32 whose bit j is the fifth bit of value j, then 16
  bytes of nibbles as in Q4_0; value = (q - 16) * d.
- Q5_1 (24 bytes): fp16 ``d``, fp16 ``m``, then as Q5_0; value = q * d + m.
- IQ4_NL (18 bytes): fp16 scale ``d``, then 16 bytes of nibbles as in Q4_0; value = d * KV[q], KV being
  llama.cpp's non-linear levels (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113).
- Q2_K (84 bytes, 256 values in 16 sub-blocks of 16): 16 scale bytes (low nibble: scale ``sc[j]``, high
  nibble: minimum ``m[j]`` of sub-block j), 64 bytes of 2-bit codes, fp16 ``d``, fp16 ``dmin``. Value
  128h + 32k + l (h < 2, k < 4, l < 32) is bits 2k, 2k + 1 of code byte 32h + l;
  value = (d * sc[j]) * q - dmin * m[j], each operation rounded.
- Q3_K (110 bytes, 256 values in 16 sub-blocks of 16): 32 bytes ``hmask``, 64 bytes of 2-bit codes placed as
  Q2_K's, 12 bytes of 6-bit scales, fp16 ``d``. Value 128h + 32k + l has q = low - 4 (high bit 0) or low (high
  bit 1), the high bit being bit 4h + k of hmask[l]: q in -4..3. Sub-block j's scale: low 4 bits nibble j // 8
  of scale byte j % 8, high 2 bits bits 2(j // 4), +1 of byte 8 + j % 4, minus 32 (-32..31);
  value = (d * scale[j]) * q.
- Q4_K (144 bytes, 256 values in 8 sub-blocks of 32): fp16 ``d``, fp16 ``dmin``, 12 bytes packing a 6-bit
  scale ``sc[j]`` and minimum ``m[j]`` per sub-block, then 128 bytes of nibbles (bytes 32c..32c+31: low
  nibbles are sub-block 2c, high nibbles 2c + 1); value = (d * sc[j]) * q - dmin * m[j], each operation
  rounded.
- Q5_K (176 bytes): Q4_K with 32 bytes of fifth bits between the scales and the nibbles: bit j of byte l is
  the fifth bit of value l of sub-block j.
- Q6_K (210 bytes, 256 values in 16 sub-blocks of 16): 128 bytes of low nibbles, 64 bytes of 2-bit high parts,
  16 int8 scales, fp16 ``d``; value = (d * scale[s]) * (q - 32). Value 128h + 32k + l (h < 2, k < 4, l < 32)
  takes nibble k // 2 of low byte 64h + 32(k % 2) + l and bits 2k, 2k + 1 of high byte 32h + l.
- IQ4_XS (136 bytes, 256 values in 8 sub-blocks of 32): fp16 ``d``, a little-endian uint16 ``scales_h``,
  4 bytes ``scales_l``, then 8 x 16 bytes of nibbles, sub-block j's at 8 + 16j laid out as IQ4_NL's. Sub-block
  j's scale: low 4 bits nibble j % 2 of scales_l[j // 2], high 2 bits bits 2j, 2j + 1 of scales_h, minus 32
  (-32..31); value = (d * scale[j]) * KV[q].

``dequantize`` is written here, independently of ``gguf.quants``, because it is the oracle the kernels
are checked against; the tests prove it is bit-identical to ``gguf.quants.dequantize``. ``quantize`` uses
``gguf.quants.quantize`` for the 32-value Q4_0 ... Q8_0 (and BF16), and ``libgguf`` (llama.cpp's reference
quantizers, no importance matrix) for the K types and IQ4_NL / IQ4_XS (:data:`LIBGGUF_TYPES`), so files we
write quantize exactly as llama.cpp's tools.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from tornado_moe.errors import UnsupportedModelError

__all__ = [
    "QuantType",
    "block_size",
    "type_size",
    "row_bytes",
    "quant_type_of",
    "dequantize",
    "quantize",
    "FLOAT_TYPES",
    "FP16_FIELDS",
    "CODES_OFFSET",
    "K_TYPES",
    "LIBGGUF_TYPES",
    "IQ4_LEVELS",
    "FILE_TYPE",
]


class QuantType(enum.IntEnum):
    """The GGML tensor types tornado-moe supports; values are the GGML type ids stored in GGUF files."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23
    BF16 = 30


FLOAT_TYPES: frozenset[QuantType] = frozenset({QuantType.F32, QuantType.F16, QuantType.BF16})

# (values per block, bytes per block)
_SIZES: dict[QuantType, tuple[int, int]] = {
    QuantType.F32: (1, 4),
    QuantType.F16: (1, 2),
    QuantType.BF16: (1, 2),
    QuantType.Q8_0: (32, 34),
    QuantType.Q4_0: (32, 18),
    QuantType.Q4_1: (32, 20),
    QuantType.Q5_0: (32, 22),
    QuantType.Q5_1: (32, 24),
    QuantType.IQ4_NL: (32, 18),
    QuantType.Q2_K: (256, 84),
    QuantType.Q3_K: (256, 110),
    QuantType.Q4_K: (256, 144),
    QuantType.Q5_K: (256, 176),
    QuantType.Q6_K: (256, 210),
    QuantType.IQ4_XS: (256, 136),
}
#: llama.cpp's k-quants: 256-value super-blocks of 16- or 32-value sub-blocks (IQ4_XS has super-blocks too but
#: is not one of them)
K_TYPES: frozenset[QuantType] = frozenset(
    {QuantType.Q2_K, QuantType.Q3_K, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K}
)
#: the types :func:`quantize` encodes with libgguf (llama.cpp's own quantizers): gguf.quants cannot
LIBGGUF_TYPES: frozenset[QuantType] = K_TYPES | {QuantType.IQ4_NL, QuantType.IQ4_XS}

#: ``general.file_type`` (llama.cpp's LlamaFileType) of a file whose weight matrices are in the type (a K type
#: with its fallbacks for rows that are not whole super-blocks: llama.cpp's "_S" mixes where there is one;
#: Q2_K's is MOSTLY_Q2_K, the mix llama.cpp names after the type)
FILE_TYPE: dict[QuantType, int] = {
    QuantType.F32: 0,
    QuantType.F16: 1,
    QuantType.Q4_0: 2,
    QuantType.Q4_1: 3,
    QuantType.Q8_0: 7,
    QuantType.Q5_0: 8,
    QuantType.Q5_1: 9,
    QuantType.Q2_K: 10,
    QuantType.Q3_K: 11,
    QuantType.Q4_K: 14,
    QuantType.Q5_K: 16,
    QuantType.Q6_K: 18,
    QuantType.IQ4_NL: 25,
    QuantType.IQ4_XS: 30,
    QuantType.BF16: 32,
}


# Byte offsets, inside one block, of its fp16 fields (scale d, then Q4_1's minimum m, Q2_K's / Q4_K's dmin)
# and of its nibbles, int8 or 2-bit codes (the low bits, where high bits are stored apart): the one
# description of the block layouts that the decoder and the model writers share. Every fp16 field scales a
# block's values linearly.
FP16_FIELDS: dict[QuantType, tuple[int, ...]] = {
    QuantType.Q8_0: (0,),
    QuantType.Q4_0: (0,),
    QuantType.Q4_1: (0, 2),
    QuantType.Q5_0: (0,),
    QuantType.Q5_1: (0, 2),
    QuantType.IQ4_NL: (0,),
    QuantType.Q2_K: (80, 82),
    QuantType.Q3_K: (108,),
    QuantType.Q4_K: (0, 2),
    QuantType.Q5_K: (0, 2),
    QuantType.Q6_K: (208,),
    QuantType.IQ4_XS: (0,),
}
CODES_OFFSET: dict[QuantType, int] = {QuantType.Q8_0: 2, QuantType.Q4_0: 2, QuantType.Q4_1: 4,
                                      QuantType.Q5_0: 6, QuantType.Q5_1: 8, QuantType.IQ4_NL: 2,
                                      QuantType.Q2_K: 16, QuantType.Q3_K: 32, QuantType.Q4_K: 16,
                                      QuantType.Q5_K: 48, QuantType.Q6_K: 0, QuantType.IQ4_XS: 8}

#: IQ4_NL's and IQ4_XS's 16 levels (llama.cpp's kvalues_iq4nl), indexed by the 4-bit code
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.float32)


def block_size(qt: QuantType) -> int:
    """Number of values one block of ``qt`` encodes (1 for the float types, 32 for the block types)."""
    return _SIZES[QuantType(qt)][0]


def type_size(qt: QuantType) -> int:
    """Number of bytes one block of ``qt`` occupies."""
    return _SIZES[QuantType(qt)][1]


def row_bytes(qt: QuantType, cols: int) -> int:
    """Bytes of one row of ``cols`` values; raises ValueError if ``cols`` is not a whole number of blocks."""
    bs, ts = _SIZES[QuantType(qt)]
    if cols <= 0 or cols % bs != 0:
        raise ValueError(
            f"{QuantType(qt).name}: a row of {cols} values is not a multiple of the block size {bs}"
        )
    return cols // bs * ts


def quant_type_of(ggml_type: int, *, where: str) -> QuantType:
    """Map a GGML type id to :class:`QuantType`; raise UnsupportedModelError naming ``where`` otherwise.

    ``where`` should say which file and tensor the type came from, e.g. ``"model.gguf: blk.0.attn_q.weight"``.
    """
    try:
        return QuantType(int(ggml_type))
    except ValueError:
        pass
    try:
        import gguf

        name = gguf.GGMLQuantizationType(int(ggml_type)).name
    except (ImportError, ValueError):
        name = "unknown"
    supported = ", ".join(t.name for t in QuantType)
    raise UnsupportedModelError(
        f"{where}: tensor type {name} (ggml type id {int(ggml_type)}) is not supported; "
        f"supported: {supported}"
    )


def _fp16_column(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte ``offset`` of every block, widened exactly to float32, shape [n_blocks, 1]."""
    raw = np.ascontiguousarray(blocks[:, offset : offset + 2])
    return raw.view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Unpack [n, 16] bytes of Q4 codes into [n, 32] uint8 values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def dequantize(raw: np.ndarray, qtype: QuantType, shape: Sequence[int]) -> np.ndarray:
    """Decode GGML-encoded bytes into a float32 array of ``shape``.

    ``raw`` is uint8 (any shape: its bytes are taken in C order, e.g. [rows, row_bytes] or flat) holding
    exactly ``prod(shape[:-1]) * row_bytes(qtype, shape[-1])`` bytes. The result is a new array.
    """
    qtype = QuantType(qtype)
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise ValueError("dequantize: shape must have at least one dimension")
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    need = n_rows * row_bytes(qtype, shape[-1])
    data = np.ascontiguousarray(raw).reshape(-1)
    if data.dtype != np.uint8:
        data = data.view(np.uint8)
    if data.size != need:
        raise ValueError(
            f"dequantize: {qtype.name} tensor of shape {shape} needs {need} bytes, got {data.size}"
        )

    if qtype == QuantType.F32:
        out = data.view("<f4").astype(np.float32)
    elif qtype == QuantType.F16:
        out = data.view("<f2").astype(np.float32)
    elif qtype == QuantType.BF16:
        # bf16 is the upper 16 bits of a float32: widening is a pure bit shift, exact for every pattern.
        out = (data.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        bs, ts = _SIZES[qtype]
        blocks = data.reshape(-1, ts)
        d = _fp16_column(blocks, FP16_FIELDS[qtype][0])
        codes = blocks[:, CODES_OFFSET[qtype]:]
        if qtype in K_TYPES:
            out = _dequantize_k(blocks, qtype, d)
        elif qtype == QuantType.IQ4_XS:
            out = _dequantize_iq4_xs(blocks, d)
        elif qtype == QuantType.IQ4_NL:
            out = d * IQ4_LEVELS[_nibbles(codes)]
        elif qtype == QuantType.Q8_0:
            q = codes.view(np.int8).astype(np.float32)
            out = q * d
        elif qtype == QuantType.Q4_0:
            q = (_nibbles(codes).astype(np.int8) - np.int8(8)).astype(np.float32)
            out = q * d
        elif qtype == QuantType.Q4_1:
            m = _fp16_column(blocks, FP16_FIELDS[qtype][1])
            q = _nibbles(codes).astype(np.float32)
            out = q * d + m
        elif qtype == QuantType.Q5_0:
            q = (_five_bit_codes(blocks, qtype).astype(np.int8) - np.int8(16)).astype(np.float32)
            out = q * d
        elif qtype == QuantType.Q5_1:
            m = _fp16_column(blocks, FP16_FIELDS[qtype][1])
            out = _five_bit_codes(blocks, qtype).astype(np.float32) * d + m
        else:  # pragma: no cover - every QuantType is handled above
            raise AssertionError(qtype)
    return out.reshape(shape)


def _five_bit_codes(blocks: np.ndarray, qtype: QuantType) -> np.ndarray:
    """Q5_0 / Q5_1: [n, 32] uint8 codes, the nibbles plus the fifth bits of the uint32 just before them."""
    at = CODES_OFFSET[qtype]
    high = np.ascontiguousarray(blocks[:, at - 4:at]).view("<u4")  # [n, 1]: bit j = value j's fifth bit
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    return _nibbles(blocks[:, at:]) | (fifth << np.uint8(4))


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K: [n, 64] code bytes to [n, 16, 16] uint8 2-bit codes by sub-block (value 128h + 32k + l is
    bits 2k, 2k + 1 of byte 32h + l)."""
    shifted = qs.reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    return (shifted & np.uint8(3)).reshape(-1, 16, 16)


def _dequantize_k(blocks: np.ndarray, qtype: QuantType, d: np.ndarray) -> np.ndarray:
    """K-type blocks [n, bytes] to values [n, 256] (layouts in the module docstring)."""
    n = blocks.shape[0]
    if qtype == QuantType.Q2_K:
        at = CODES_OFFSET[qtype]
        dmin = _fp16_column(blocks, FP16_FIELDS[qtype][1])
        s = blocks[:, :at]
        dl = (d * (s & np.uint8(0x0F)).astype(np.float32))[:, :, None]
        ml = (dmin * (s >> np.uint8(4)).astype(np.float32))[:, :, None]
        return (dl * _two_bit_codes(blocks[:, at:at + 64]).astype(np.float32) - ml).reshape(n, 256)
    if qtype == QuantType.Q3_K:
        at = CODES_OFFSET[qtype]
        low = _two_bit_codes(blocks[:, at:at + 64]).reshape(n, 8, 32)  # [block, 4h + k, l]
        high = (blocks[:, None, :at] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)
        q = low.astype(np.int8) - ((high ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)  # -4..3
        s = blocks[:, 96:108]
        lo = np.concatenate([s[:, :8] & np.uint8(0x0F), s[:, :8] >> np.uint8(4)], axis=1)  # j = 0-7, 8-15
        hi = (s[:, None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & np.uint8(3)
        scale = (lo | (hi.reshape(n, 16) << np.uint8(4))).astype(np.int8) - np.int8(32)
        dl = (d * scale.astype(np.float32))[:, :, None]
        return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)
    if qtype in (QuantType.Q4_K, QuantType.Q5_K):
        dmin = _fp16_column(blocks, FP16_FIELDS[qtype][1])
        s = blocks[:, 4:16].astype(np.int32)
        lo, hi = s[:, 0:4], s[:, 8:12]  # scales' and mins' low bits of sub-blocks 4..7 live in bytes 8..11
        sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=1)
        m = np.concatenate([s[:, 4:8] & 63, (hi >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
        qs = blocks[:, CODES_OFFSET[qtype]:].reshape(n, 4, 1, 32)
        q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2).reshape(n, 8, 32)
        if qtype == QuantType.Q5_K:  # bit j of qh[l]: value l of sub-block j
            qh = blocks[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]
            q = q | ((qh & np.uint8(1)) << np.uint8(4))
        dl = (d * sc.astype(np.float32))[:, :, None]
        ml = (dmin * m.astype(np.float32))[:, :, None]
        return (dl * q.astype(np.float32) - ml).reshape(n, 256)
    ql = blocks[:, :128].reshape(n, 2, 1, 2, 32)  # [block, h, nibble, k % 2, l]
    low = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=2).reshape(n, 2, 4, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    q = ((low | ((qh & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16)
    ds = d * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return (ds[:, :, None] * q.astype(np.float32)).reshape(n, 256)


def _dequantize_iq4_xs(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks [n, 136] to values [n, 256] (layout in the module docstring)."""
    n = blocks.shape[0]
    sl = blocks[:, 4:8]
    low = np.stack([sl & np.uint8(0x0F), sl >> np.uint8(4)], axis=2).reshape(n, 8)  # j: nibble j % 2
    sh = np.ascontiguousarray(blocks[:, 2:4]).view("<u2")  # [n, 1]
    high = ((sh >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)).astype(np.uint8)
    scale = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (d * scale.astype(np.float32))[:, :, None]
    q = _nibbles(blocks[:, CODES_OFFSET[QuantType.IQ4_XS]:].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl * IQ4_LEVELS[q]).reshape(n, 256)


def quantize(values: np.ndarray, qtype: QuantType) -> np.ndarray:
    """Encode float values [..., cols] as GGML ``qtype`` bytes [..., row_bytes] (uint8, C-contiguous).

    Q4_0 ... Q8_0 go through ``gguf.quants.quantize``, :data:`LIBGGUF_TYPES` (the K types, IQ4_NL, IQ4_XS)
    through ``libgguf`` (llama.cpp's reference rounding, no importance matrix); float types are converted
    directly (F16 and BF16 round to nearest even).
    """
    import gguf

    qtype = QuantType(qtype)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.ndim == 0:
        raise ValueError("quantize: values must have at least one dimension")
    rb = row_bytes(qtype, values.shape[-1])
    if qtype == QuantType.F32:
        out = values.view(np.uint8)
    elif qtype == QuantType.F16:
        out = values.astype("<f2").view(np.uint8)
    elif qtype in LIBGGUF_TYPES:
        import libgguf

        out = libgguf.quantize_rows(values.reshape(-1, values.shape[-1]), int(qtype))
    else:
        out = np.asarray(gguf.quants.quantize(values, gguf.GGMLQuantizationType(int(qtype))), dtype=np.uint8)
    return np.ascontiguousarray(out).reshape(*values.shape[:-1], rb)
