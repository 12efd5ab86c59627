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
- Q4_K (144 bytes, 256 values in 8 sub-blocks of 32): fp16 ``d``, fp16 ``dmin``, 12 bytes packing a 6-bit
  scale ``sc[j]`` and minimum ``m[j]`` per sub-block, then 128 bytes of nibbles (bytes 32c..32c+31: low
  nibbles are sub-block 2c, high nibbles 2c + 1); value = (d * sc[j]) * q - dmin * m[j], each operation
  rounded.
- Q5_K (176 bytes): Q4_K with 32 bytes of fifth bits between the scales and the nibbles: bit j of byte l is
  the fifth bit of value l of sub-block j.
- Q6_K (210 bytes, 256 values in 16 sub-blocks of 16): 128 bytes of low nibbles, 64 bytes of 2-bit high parts,
  16 int8 scales, fp16 ``d``; value = (d * scale[s]) * (q - 32). Value 128h + 32k + l (h < 2, k < 4, l < 32)
  takes nibble k // 2 of low byte 64h + 32(k % 2) + l and bits 2k, 2k + 1 of high byte 32h + l.

``dequantize`` is written here, independently of ``gguf.quants``, because it is the oracle the kernels
are checked against; the tests prove it is bit-identical to ``gguf.quants.dequantize``. ``quantize`` uses
``gguf.quants.quantize`` for the 32-value block types and ``libgguf`` (llama.cpp's reference quantizers) for
the K types, so files we write quantize exactly as llama.cpp's tools.
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
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
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
    QuantType.Q4_K: (256, 144),
    QuantType.Q5_K: (256, 176),
    QuantType.Q6_K: (256, 210),
}
#: the K types: 256-value super-blocks, quantized by libgguf
K_TYPES: frozenset[QuantType] = frozenset({QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K})

#: ``general.file_type`` (llama.cpp's LlamaFileType) of a file whose weight matrices are in the type (a K type
#: with its fallbacks for rows that are not whole super-blocks: llama.cpp's "_S" mixes)
FILE_TYPE: dict[QuantType, int] = {
    QuantType.F32: 0,
    QuantType.F16: 1,
    QuantType.Q4_0: 2,
    QuantType.Q4_1: 3,
    QuantType.Q8_0: 7,
    QuantType.Q5_0: 8,
    QuantType.Q5_1: 9,
    QuantType.Q4_K: 14,
    QuantType.Q5_K: 16,
    QuantType.Q6_K: 18,
    QuantType.BF16: 32,
}


# Byte offsets, inside one block, of its fp16 fields (scale d, then Q4_1's minimum m, Q4_K's dmin) and of
# its nibbles or int8 codes: the one description of the block layouts that the decoder and the model writers
# share.
FP16_FIELDS: dict[QuantType, tuple[int, ...]] = {
    QuantType.Q8_0: (0,),
    QuantType.Q4_0: (0,),
    QuantType.Q4_1: (0, 2),
    QuantType.Q5_0: (0,),
    QuantType.Q5_1: (0, 2),
    QuantType.Q4_K: (0, 2),
    QuantType.Q5_K: (0, 2),
    QuantType.Q6_K: (208,),
}
CODES_OFFSET: dict[QuantType, int] = {QuantType.Q8_0: 2, QuantType.Q4_0: 2, QuantType.Q4_1: 4,
                                      QuantType.Q5_0: 6, QuantType.Q5_1: 8, QuantType.Q4_K: 16,
                                      QuantType.Q5_K: 48, QuantType.Q6_K: 0}


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


def _dequantize_k(blocks: np.ndarray, qtype: QuantType, d: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K / Q6_K blocks [n, bytes] to values [n, 256] (layouts in the module docstring)."""
    n = blocks.shape[0]
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


def quantize(values: np.ndarray, qtype: QuantType) -> np.ndarray:
    """Encode float values [..., cols] as GGML ``qtype`` bytes [..., row_bytes] (uint8, C-contiguous).

    32-value block types go through ``gguf.quants.quantize`` and the K types through ``libgguf`` (llama.cpp's
    reference rounding); float types are converted directly (F16 and BF16 round to nearest even).
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
    elif qtype in K_TYPES:
        import libgguf

        out = libgguf.quantize_rows(values.reshape(-1, values.shape[-1]), int(qtype))
    else:
        out = np.asarray(gguf.quants.quantize(values, gguf.GGMLQuantizationType(int(qtype))), dtype=np.uint8)
    return np.ascontiguousarray(out).reshape(*values.shape[:-1], rb)
