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
    LIBGGUF_TYPES,
    QuantType,
    block_size,
    dequantize,
    quant_type_of,
    quantize,
    row_bytes,
    type_size,
)

BLOCK_TYPES = [QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1,
               QuantType.IQ4_NL, QuantType.Q2_K, QuantType.Q3_K, QuantType.Q4_K, QuantType.Q5_K,
               QuantType.Q6_K, QuantType.IQ4_XS]
# IQ4_NL's and IQ4_XS's levels, as llama.cpp's kvalues_iq4nl (written out here, not taken from the module)
KV = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
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
    assert [block_size(t) for t in ALL_TYPES] == [1, 1, 32, 32, 32, 32, 32, *[256] * 5, 32, 256, 1]
    assert [type_size(t) for t in ALL_TYPES] == [4, 2, 18, 20, 22, 24, 34, 84, 110, 144, 176, 210, 18, 136, 2]
    for t in ALL_TYPES:  # agrees with gguf's table
        assert (block_size(t), type_size(t)) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))]
    assert row_bytes(QuantType.Q8_0, 2048) == 64 * 34
    assert row_bytes(QuantType.F16, 7) == 14
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        row_bytes(QuantType.Q4_0, 48)
    # GGML type ids
    assert [int(t) for t in ALL_TYPES] == [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 30]
    for qt in (QuantType.Q2_K, QuantType.Q3_K, QuantType.Q4_K, QuantType.IQ4_XS):
        with pytest.raises(ValueError, match="multiple of the block size 256"):
            row_bytes(qt, 1408)  # Qwen1.5-MoE's expert rows: llama.cpp stores those in another type
    assert row_bytes(QuantType.IQ4_NL, 1408) == 44 * 18  # ... IQ4_NL for Q2_K, Q3_K and IQ4_XS files


def test_type_groups() -> None:
    """K_TYPES are llama.cpp's k-quants (IQ4_XS also has 256-value super-blocks but is an i-quant);
    LIBGGUF_TYPES are exactly the types gguf.quants cannot quantize (so quantize has an encoder for each)."""
    assert {t for t in QuantType if block_size(t) == 256} == K_TYPES | {QuantType.IQ4_XS}
    assert {t.name for t in K_TYPES} == {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    x = np.ones((1, 256), np.float32)
    for qt in QuantType:
        try:
            gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qt)))
        except NotImplementedError:
            assert qt in LIBGGUF_TYPES, qt
        else:
            assert qt not in LIBGGUF_TYPES, qt


def test_file_types_are_llama_cpps() -> None:
    expected = {QuantType.F32: "ALL_F32", QuantType.F16: "MOSTLY_F16", QuantType.BF16: "MOSTLY_BF16",
                QuantType.Q3_K: "MOSTLY_Q3_K_S", QuantType.Q4_K: "MOSTLY_Q4_K_S",
                QuantType.Q5_K: "MOSTLY_Q5_K_S"}
    for qt, ft in FILE_TYPE.items():
        assert ft == int(gguf.LlamaFileType[expected.get(qt, f"MOSTLY_{qt.name}")]), qt
    assert set(FILE_TYPE) == set(QuantType)


def test_quant_type_of() -> None:
    assert quant_type_of(8, where="x") is QuantType.Q8_0
    assert quant_type_of(11, where="x") is QuantType.Q3_K and quant_type_of(23, where="x") is QuantType.IQ4_XS
    with pytest.raises(UnsupportedModelError, match=r"m\.gguf: blk\.0\.attn_q\.weight.*IQ2_XXS"):
        quant_type_of(int(gguf.GGMLQuantizationType.IQ2_XXS), where="m.gguf: blk.0.attn_q.weight")
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
        if not finite:  # (Q2_K's, Q4_K's and Q5_K's infinite d and dmin give inf - inf: NaN only)
            assert np.isnan(mine).any() and np.isfinite(mine).any()
            assert np.isinf(mine).any() or qt in (QuantType.Q2_K, QuantType.Q4_K, QuantType.Q5_K)
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


def test_hand_built_q2_k_q3_k_blocks() -> None:
    """Q2_K's and Q3_K's 2-bit code order, Q2_K's nibble scale and min, Q3_K's hmask and signed scales."""
    v = np.arange(256)
    h, k, lane, j = v // 128, v % 128 // 32, v % 32, v // 16
    q2 = (v * 7 + v // 5) % 4  # value v's 2-bit code
    qs = np.zeros(64, dtype=np.uint8)
    for i in range(256):
        qs[32 * h[i] + lane[i]] |= q2[i] << (2 * k[i])
    sc = np.arange(16) * 5 % 16
    mins = (15 - np.arange(16) * 3) % 16
    d, dmin = np.array([0.25, -1.5], dtype="<f2")
    fp16 = np.array([d, dmin], dtype="<f2").view(np.uint8)
    blk2 = np.concatenate([(sc | (mins << 4)).astype(np.uint8), qs, fp16])
    expected2 = (np.float32(d) * sc[j]) * q2 - np.float32(dmin) * mins[j]
    np.testing.assert_array_equal(dequantize(blk2, QuantType.Q2_K, (256,)), expected2)

    high = (v * 13 // 7) % 2  # the hmask bit: 0 subtracts 4 from the low 2 bits
    hmask = np.zeros(32, dtype=np.uint8)
    for i in range(256):
        hmask[lane[i]] |= high[i] << (4 * h[i] + k[i])
    q3 = q2 - 4 * (1 - high)
    assert set(q3) == set(range(-4, 4))
    scale6 = np.array([0, 63, 32, 31, 1, 17, 48, 5, 40, 33, 2, 62, 16, 47, 9, 30])  # scale = this - 32
    scales = np.zeros(12, dtype=np.uint8)
    for jj in range(16):
        scales[jj % 8] |= (scale6[jj] & 15) << (4 * (jj // 8))
        scales[8 + jj % 4] |= (scale6[jj] >> 4) << (2 * (jj // 4))
    blk3 = np.concatenate([hmask, qs, scales, np.array([0.125], dtype="<f2").view(np.uint8)])
    expected3 = (np.float32(0.125) * (scale6[j] - 32).astype(np.float32)) * q3
    np.testing.assert_array_equal(dequantize(blk3, QuantType.Q3_K, (256,)), expected3)


def test_hand_built_iq4_blocks() -> None:
    """IQ4_NL's nibble order and levels; IQ4_XS's packed signed scales and its sub-blocks' nibbles."""
    codes = (np.arange(32) * 5 + 3) % 16
    packed = (codes[:16] | (codes[16:] << 4)).astype(np.uint8)  # low nibble = value i, high = value i + 16
    nl = np.concatenate([np.array([-0.5], dtype="<f2").view(np.uint8), packed])
    np.testing.assert_array_equal(dequantize(nl, QuantType.IQ4_NL, (32,)), np.float32(-0.5) * KV[codes])

    v = np.arange(256)
    q = (v * 11 + v // 3) % 16  # value v's code
    qs = np.zeros(128, dtype=np.uint8)
    for i in range(256):  # sub-block i // 32 at bytes 16 (i // 32)..: IQ4_NL's layout
        qs[16 * (i // 32) + i % 16] |= q[i] << (4 * (i % 32 // 16))
    ls = np.array([0, 63, 32, 31, 1, 45, 18, 50])  # 6 bits; the scale is ls - 32
    scales_l = np.zeros(4, dtype=np.uint8)
    scales_h = 0
    for j in range(8):
        scales_l[j // 2] |= (ls[j] & 15) << (4 * (j % 2))
        scales_h |= int(ls[j] >> 4) << (2 * j)
    d = np.float16(0.375)
    blk = np.concatenate([np.array([d], dtype="<f2").view(np.uint8),
                          np.array([scales_h], dtype="<u2").view(np.uint8), scales_l, qs])
    expected = (np.float32(d) * (ls[v // 32] - 32).astype(np.float32)) * KV[q]
    np.testing.assert_array_equal(dequantize(blk, QuantType.IQ4_XS, (256,)), expected)


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
    if qt in LIBGGUF_TYPES:
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
        QuantType.IQ4_NL: 0.12,  # half the widest gap of the levels (24 / 127 of the largest) and rounding
        QuantType.Q2_K: 0.4,  # half a 2-bit step over a sub-block's range (<= 2 amax / 3), plus 4-bit scales
        QuantType.Q3_K: 0.2,  # half a step of 8 levels over [-amax, amax], plus 6-bit scales
        QuantType.Q4_K: 0.1,  # 4-bit codes, a 6-bit scale and min per 32 values
        QuantType.Q5_K: 0.05,
        QuantType.Q6_K: 1 / 32,
        QuantType.IQ4_XS: 0.12,  # IQ4_NL's levels with a 6-bit scale per 32 values
    }[qt]
    assert (err <= bound * amax + 1e-30).all()


def test_quantize_rejects_ragged_rows() -> None:
    with pytest.raises(ValueError, match="block size"):
        quantize(np.zeros((2, 40), np.float32), QuantType.Q8_0)
