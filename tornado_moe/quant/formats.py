"""GGML block formats that tornado-moe reads: sizes, dequantization (own numpy code) and quantization.

Layouts (little endian, one block covers ``block_size`` consecutive values of a row):

- F32 / F16 / BF16: one value per "block" (4 / 2 / 2 bytes). BF16 is the top half of an IEEE float32.
- Q8_0 (34 bytes): fp16 scale ``d``, then 32 int8 codes ``q``; value = q * d.
- Q4_0 (18 bytes): fp16 scale ``d``, then 16 bytes of nibbles; the LOW nibble of byte j is value j, the
  HIGH nibble of byte j is value j + 16; value = (q - 8) * d.
- Q4_1 (20 bytes): fp16 scale ``d``, fp16 minimum ``m``, then 16 bytes of nibbles as in Q4_0;
  value = q * d + m (two float32 roundings: product first, then the sum).

``dequantize`` is written here, independently of ``gguf.quants``, because it is the oracle the kernels
are checked against; the tests prove it is bit-identical to ``gguf.quants.dequantize``. ``quantize`` uses
``gguf.quants.quantize`` for the block types, so files we write quantize exactly as llama.cpp's converter.
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
]


class QuantType(enum.IntEnum):
    """The GGML tensor types tornado-moe supports; values are the GGML type ids stored in GGUF files."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
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
}


# Byte offsets, inside one block, of its fp16 fields (scale d, then Q4_1's minimum m) and of its codes:
# the one description of the block layouts that the decoder and the model writers share.
FP16_FIELDS: dict[QuantType, tuple[int, ...]] = {
    QuantType.Q8_0: (0,),
    QuantType.Q4_0: (0,),
    QuantType.Q4_1: (0, 2),
}
CODES_OFFSET: dict[QuantType, int] = {QuantType.Q8_0: 2, QuantType.Q4_0: 2, QuantType.Q4_1: 4}


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
        if qtype == QuantType.Q8_0:
            q = codes.view(np.int8).astype(np.float32)
            out = q * d
        elif qtype == QuantType.Q4_0:
            q = (_nibbles(codes).astype(np.int8) - np.int8(8)).astype(np.float32)
            out = q * d
        elif qtype == QuantType.Q4_1:
            m = _fp16_column(blocks, FP16_FIELDS[qtype][1])
            q = _nibbles(codes).astype(np.float32)
            out = q * d + m
        else:  # pragma: no cover - every QuantType is handled above
            raise AssertionError(qtype)
    return out.reshape(shape)


def quantize(values: np.ndarray, qtype: QuantType) -> np.ndarray:
    """Encode float values [..., cols] as GGML ``qtype`` bytes [..., row_bytes] (uint8, C-contiguous).

    Block types go through ``gguf.quants.quantize`` (llama.cpp's reference rounding); float types are
    converted directly (F16 and BF16 round to nearest even).
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
    else:
        out = np.asarray(gguf.quants.quantize(values, gguf.GGMLQuantizationType(int(qtype))), dtype=np.uint8)
    return np.ascontiguousarray(out).reshape(*values.shape[:-1], rb)
