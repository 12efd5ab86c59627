"""tornado_moe.quant.formats against gguf.quants (bit for bit) and against hand-built blocks.

What "bit for bit" compares: the float32 results viewed as uint32, i.e. every bit including the sign of zero
and NaN payloads. Block types are checked on random code bytes with fp16 scales drawn from every finite
fp16 bit pattern (negative, zero, subnormal, max) and separately with inf/NaN scales; F16 and BF16 over all
65,536 bit patterns (NaNs included); F32 over random bit patterns.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tornado_moe.errors import UnsupportedModelError
from tornado_moe.quant.formats import (
    FILE_TYPE,
    FP16_FIELDS,
    K_TYPES,
    QuantType,
    block_size,
    dequantize,
    quant_type_of,
    quantize,
    row_bytes,
    type_size,
)

BLOCK_TYPES = [QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q4_K,
               QuantType.Q5_K, QuantType.Q6_K]
ALL_TYPES = list(QuantType)


def _gguf_deq(raw: np.ndarray, qt: QuantType) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qt))), dtype=np.float32)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.dtype == b.dtype == np.float32
        and a.shape == b.shape
        and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


_SPECIAL_F16 = np.array(
    [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00], dtype=np.uint16
)


def _random_blocks(qt: QuantType, n_blocks: int, rng: np.random.Generator, finite: bool) -> np.ndarray:
    """Random blocks whose fp16 fields are random bit patterns: all finite, or half of them inf/NaN.

    The first blocks get special finite scales (+-0, smallest subnormals, largest subnormal, +-max, +-1).
    """
    blocks = rng.integers(0, 256, size=(n_blocks, type_size(qt)), dtype=np.uint8)
    for off in FP16_FIELDS[qt]:
        bits = rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint32).astype(np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & ~np.uint16(0x4000), bits)  # clear one exponent bit
        bits[: len(_SPECIAL_F16)] = _SPECIAL_F16
        if not finite:  # exponent all ones in every other block: +-inf or NaN with a random payload
            bits[1::2] |= np.uint16(0x7C00)
            bits[1:8:2] &= np.uint16(0xFC00)  # a few exact infinities
        blocks[:, off : off + 2] = bits.astype("<u2").view(np.uint8).reshape(n_blocks, 2)
    return blocks


def test_sizes() -> None:
    assert [block_size(t) for t in ALL_TYPES] == [1, 1, 32, 32, 32, 32, 32, 256, 256, 256, 1]
    assert [type_size(t) for t in ALL_TYPES] == [4, 2, 18, 20, 22, 24, 34, 144, 176, 210, 2]
    for t in ALL_TYPES:  # agrees with gguf's table
        assert (block_size(t), type_size(t)) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))]
    assert row_bytes(QuantType.Q8_0, 2048) == 64 * 34
    assert row_bytes(QuantType.F16, 7) == 14
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        row_bytes(QuantType.Q4_0, 48)
    assert [int(t) for t in ALL_TYPES] == [0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30]  # GGML type ids
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        row_bytes(QuantType.Q4_K, 1408)  # Qwen1.5-MoE's expert rows: llama.cpp stores those in another type


def test_file_types_are_llama_cpps() -> None:
    expected = {QuantType.F32: "ALL_F32", QuantType.F16: "MOSTLY_F16", QuantType.BF16: "MOSTLY_BF16",
                QuantType.Q4_K: "MOSTLY_Q4_K_S", QuantType.Q5_K: "MOSTLY_Q5_K_S"}
    for qt, ft in FILE_TYPE.items():
        assert ft == int(gguf.LlamaFileType[expected.get(qt, f"MOSTLY_{qt.name}")]), qt
    assert set(FILE_TYPE) == set(QuantType)


def test_quant_type_of() -> None:
    assert quant_type_of(8, where="x") is QuantType.Q8_0
    with pytest.raises(UnsupportedModelError, match=r"m\.gguf: blk\.0\.attn_q\.weight.*Q3_K"):
        quant_type_of(int(gguf.GGMLQuantizationType.Q3_K), where="m.gguf: blk.0.attn_q.weight")
    with pytest.raises(UnsupportedModelError, match="unknown"):
        quant_type_of(250, where="t")


@pytest.mark.parametrize("qt", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_dequantize_bitwise_equals_gguf(qt: QuantType) -> None:
    rng = np.random.default_rng(int(qt))
    rows, blocks_per_row = 64, 8
    for finite in (False, True):
        blocks = _random_blocks(qt, rows * blocks_per_row, rng, finite)
        raw = blocks.reshape(rows, blocks_per_row * type_size(qt))
        with np.errstate(invalid="ignore"):  # inf * 0 -> NaN is part of what is compared
            mine = dequantize(raw, qt, (rows, blocks_per_row * block_size(qt)))
            ref = _gguf_deq(raw, qt)
        assert _same_bits(mine, ref)
        if not finite:  # (Q4_K's and Q5_K's infinite d and dmin give inf - inf: NaN only)
            assert np.isnan(mine).any() and np.isfinite(mine).any()
            assert np.isinf(mine).any() or qt in (QuantType.Q4_K, QuantType.Q5_K)
    # The scale values we drew do cover negative, zero and subnormal fp16 numbers.
    off = FP16_FIELDS[qt][0]
    d = np.ascontiguousarray(blocks[:, off : off + 2]).view("<f2").ravel()
    assert (d < 0).any() and (d == 0).any() and ((np.abs(d) < 6.1e-5) & (d != 0)).any()


@pytest.mark.parametrize("qt", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_accepts_flat_and_3d(qt: QuantType) -> None:
    rng = np.random.default_rng(5)
    cols = 2 * block_size(qt)
    shape = (3, 4, cols)  # e.g. [E, I, H]
    raw = _random_blocks(qt, 3 * 4 * 2, rng, True).reshape(12, row_bytes(qt, cols))
    a = dequantize(raw, qt, shape)
    b = dequantize(raw.reshape(-1), qt, shape)
    assert a.shape == shape and _same_bits(a, b)
    assert _same_bits(a.reshape(12, cols), _gguf_deq(raw, qt))
    with pytest.raises(ValueError, match="needs"):
        dequantize(raw[:-1], qt, shape)


def test_hand_built_blocks() -> None:
    """The layouts as documented, independently of gguf: nibble order, offsets, scale and minimum."""
    codes = np.arange(32, dtype=np.uint8) % 16  # value j has code j % 16
    packed = codes[:16] | (codes[16:] << 4)  # byte j: low nibble = value j, high nibble = value j + 16
    d = np.array([0.5], dtype="<f2").view(np.uint8)
    m = np.array([-3.0], dtype="<f2").view(np.uint8)

    q40 = np.concatenate([d, packed])
    np.testing.assert_array_equal(
        dequantize(q40, QuantType.Q4_0, (32,)), (codes.astype(np.float32) - 8) * 0.5
    )
    q41 = np.concatenate([d, m, packed])
    np.testing.assert_array_equal(dequantize(q41, QuantType.Q4_1, (32,)), codes * 0.5 - 3.0)
    q8 = np.concatenate([d, (np.arange(32) - 16).astype(np.int8).view(np.uint8)])
    np.testing.assert_array_equal(dequantize(q8, QuantType.Q8_0, (32,)), (np.arange(32) - 16) * 0.5)
    # Q5_0: the fifth bit of value j is bit j of the uint32 after d
    fifth = np.uint32(0xA5A5F00F)
    q50 = np.concatenate([d, np.array([fifth], dtype="<u4").view(np.uint8), packed])
    q5 = codes + 16 * ((fifth >> np.arange(32, dtype=np.uint32)) & 1)
    np.testing.assert_array_equal(dequantize(q50, QuantType.Q5_0, (32,)), (q5.astype(np.float32) - 16) * 0.5)
    q51 = np.concatenate([d, m, np.array([fifth], dtype="<u4").view(np.uint8), packed])
    np.testing.assert_array_equal(dequantize(q51, QuantType.Q5_1, (32,)), q5 * 0.5 - 3.0)


def test_hand_built_k_blocks() -> None:
    """Q4_K's packed 6-bit scales and mins and its nibble order; Q6_K's value layout."""
    sc = np.array([1, 2, 3, 63, 5, 40, 7, 33])  # 6 bits each; sub-blocks 4..7 split as low 4 + top 2 bits
    mins = np.array([0, 9, 17, 62, 4, 21, 60, 1])
    s = np.zeros(12, dtype=np.uint8)
    s[0:4] = sc[0:4] | ((sc[4:8] >> 4) << 6)
    s[4:8] = mins[0:4] | ((mins[4:8] >> 4) << 6)
    s[8:12] = (sc[4:8] & 0xF) | ((mins[4:8] & 0xF) << 4)
    q = np.arange(256) * 7 % 16  # value v's code
    qs = np.zeros(128, dtype=np.uint8)
    for v in range(256):
        qs[32 * (v // 64) + v % 32] |= q[v] << (4 * ((v // 32) % 2))
    d, dmin = np.array([0.25, 0.5], dtype="<f2")
    blk = np.concatenate([np.array([d, dmin], dtype="<f2").view(np.uint8), s, qs])
    j = np.arange(256) // 32
    expected = np.float32(d) * sc[j].astype(np.float32) * q - np.float32(dmin) * mins[j].astype(np.float32)
    np.testing.assert_array_equal(dequantize(blk, QuantType.Q4_K, (256,)), expected)
    # Q5_K: the same, with value v's fifth bit at bit v // 32 of qh[v % 32]
    high = (np.arange(256) * 11 // 3) % 2
    qh = np.zeros(32, dtype=np.uint8)
    for v in range(256):
        qh[v % 32] |= high[v] << (v // 32)
    blk5 = np.concatenate([blk[:16], qh, qs])
    expected5 = (np.float32(d) * sc[j].astype(np.float32) * (q + 16 * high)
                 - np.float32(dmin) * mins[j].astype(np.float32))
    np.testing.assert_array_equal(dequantize(blk5, QuantType.Q5_K, (256,)), expected5)

    q6 = np.arange(256) * 5 % 64  # value v's code q (stored), value (q - 32) * d * scale
    ql, qh = np.zeros(128, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    for v in range(256):
        h, k, lane = v // 128, v % 128 // 32, v % 32
        ql[64 * h + 32 * (k % 2) + lane] |= (q6[v] & 0xF) << (4 * (k // 2))
        qh[32 * h + lane] |= (q6[v] >> 4) << (2 * k)
    scales = (np.arange(16) * 9 - 70).astype(np.int8)
    blk6 = np.concatenate([ql, qh, scales.view(np.uint8), np.array([0.125], dtype="<f2").view(np.uint8)])
    expected6 = np.float32(0.125) * scales[np.arange(256) // 16].astype(np.float32) * (q6 - 32)
    np.testing.assert_array_equal(dequantize(blk6, QuantType.Q6_K, (256,)), expected6)


def test_f16_bf16_all_bit_patterns() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype("<u2")
    raw = bits.view(np.uint8)
    for qt in (QuantType.F16, QuantType.BF16):
        mine = dequantize(raw, qt, (1 << 16,))
        assert _same_bits(mine, _gguf_deq(raw.reshape(1, -1), qt).reshape(-1))
    # BF16 is exactly the top half of float32: every pattern, NaN payloads included.
    bf = dequantize(raw, QuantType.BF16, (1 << 16,))
    np.testing.assert_array_equal(bf.view(np.uint32), bits.astype(np.uint32) << 16)


def test_f32_bit_patterns() -> None:
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 1 << 32, size=(16, 64), dtype=np.uint64).astype("<u4")
    mine = dequantize(bits.view(np.uint8), QuantType.F32, (16, 64))
    np.testing.assert_array_equal(mine.view(np.uint32), bits)


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
def test_quantize_matches_gguf_and_round_trips(qt: QuantType) -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((8, 512)) * rng.uniform(0.01, 3, size=(8, 1))).astype(np.float32)
    raw = quantize(x, qt)
    assert raw.dtype == np.uint8 and raw.shape == (8, row_bytes(qt, 512)) and raw.flags.c_contiguous
    if qt in K_TYPES:
        import libgguf

        np.testing.assert_array_equal(raw, libgguf.quantize_rows(x, int(qt)))
    elif qt in BLOCK_TYPES or qt == QuantType.BF16:
        ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qt)))
        np.testing.assert_array_equal(raw, ref)
    elif qt == QuantType.F16:
        np.testing.assert_array_equal(raw.view("<f2"), x.astype(np.float16))
    else:
        np.testing.assert_array_equal(raw.view("<f4"), x)
    back = dequantize(raw, qt, x.shape)
    # error bounds per format (relative to the block's largest magnitude)
    amax = np.abs(x.reshape(8, -1, block_size(qt) if qt in BLOCK_TYPES else 1)).max(axis=-1, keepdims=True)
    err = np.abs(back - x).reshape(amax.shape[:-1] + (-1,))
    bound = {
        QuantType.F32: 0.0,
        QuantType.F16: 2**-11,
        QuantType.BF16: 2**-8,
        QuantType.Q8_0: 0.5 / 127 + 1e-3,
        QuantType.Q4_0: 1 / 8 + 1e-3,
        QuantType.Q4_1: 2 / 15 + 1e-3,
        QuantType.Q5_0: 1 / 16 + 1e-3,
        QuantType.Q5_1: 1 / 31 + 1e-3,
        QuantType.Q4_K: 0.1,  # 4-bit codes, a 6-bit scale and min per 32 values
        QuantType.Q5_K: 0.05,
        QuantType.Q6_K: 1 / 32,
    }[qt]
    assert (err <= bound * amax + 1e-30).all()


def test_quantize_rejects_ragged_rows() -> None:
    with pytest.raises(ValueError, match="block size"):
        quantize(np.zeros((2, 40), np.float32), QuantType.Q8_0)
