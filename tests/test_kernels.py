"""The kernels of csrc/include/tornado_moe.h through torch.ops.tornado_moe, against float64 references.

Every kernel runs on the CPU and, where a GPU is visible, on CUDA (gpu-marked params), for every weight
format. References (tests/kernel_reference.py) never touch the C code: weights are quantized with gguf's
quantizers and dequantized with ``gguf.quants.dequantize``; the math is torch float64. Outputs are
NaN-poisoned before each call and must come back fully written.

Error bounds (TOL_* below) are on ||out - ref|| / ||ref|| against the float64 reference on the same
dequantized weights: a few times what float32 accumulation over these lengths gives (~1e-7..1e-6), far below
what a wrong block layout, scale or index would give (~1e-2 and up).
"""

from __future__ import annotations

import ctypes
import struct

import kernel_reference as ref
import numpy as np
import pytest
import torch
from conftest import attention_scratch, device_params, write_late

from tornado_moe import kernels as K
from tornado_moe.native import NativeLibraryNotFoundError, library_path
from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

TOL_RMSNORM = 1e-6  # one float32 sum of squares, then three roundings per element
TOL_ROPE = 1e-5  # positions < 32: room for float32 angles (the CPU evaluates them in double)
TOL_MATMUL = 1e-5  # float32 dot products of <= 128 terms (matmul, gate-up, down, router logits)
TOL_ATTENTION = 1e-5  # float32 scores, exp and weighted sums over <= 20 positions
TOL_ROUTER = 1e-5  # softmax probabilities of float32 logits

NAN = float("nan")
QTYPE_PARAMS = [pytest.param(q, id=name) for name, q in ref.QTYPES.items()]
K_QTYPE_PARAMS = [pytest.param(q, id=name) for name, q in ref.K_QTYPES.items()]
DEVICES = device_params()


def poisoned(shape: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.full(shape, NAN, dtype=torch.float32, device=device)


def randn(rng: np.random.Generator, shape: tuple[int, ...], device: str, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).to(device)


def int32(values, device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def distinct_ids(
    rng: np.random.Generator, n_tokens: int, top_k: int, n_experts: int, device: str
) -> torch.Tensor:
    """Router-like ids: top_k distinct experts per token."""
    return int32(np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tokens)]), device)


def assert_written(out: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "some outputs were not written (still NaN-poisoned)"


# ---- embedding ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPE_PARAMS + K_QTYPE_PARAMS)
def test_embedding_is_gguf_dequantize_bitwise(device: str, qtype: int) -> None:
    rng = np.random.default_rng(1)
    vocab, dim = 37, (512 if qtype in ref.K_QTYPES.values() else 96)
    raw = ref.quantize(rng.standard_normal((vocab, dim)).astype(np.float32), qtype)
    ids = [0, 36, 5, 5, 17]
    out = poisoned((len(ids), dim), device)
    K.embedding(qtype, torch.from_numpy(raw).to(device), int32(ids, device), out, len(ids), vocab, dim)
    expected = ref.dequantize(raw, qtype)[ids]
    assert np.array_equal(out.cpu().numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [p for p in QTYPE_PARAMS + K_QTYPE_PARAMS if p.values[0] not in (0, 1, 30)])
def test_embedding_decodes_random_bytes_as_gguf(device: str, qtype: int) -> None:
    """Every bit of a block format, not only what a quantizer writes (scales, mins, sign bits, high bits):
    random bytes decode as gguf's dequantizer does, bit for bit (NaN where it gives NaN; CUDA may change a
    NaN's payload)."""
    rng = np.random.default_rng(7)
    vocab, dim = 64, (512 if qtype in ref.K_QTYPES.values() else 96)
    row_bytes = ref.quantize(np.zeros((1, dim), np.float32), qtype).shape[-1]
    raw = rng.integers(0, 256, (vocab, row_bytes), dtype=np.uint8)
    out = poisoned((vocab, dim), device)
    ids = int32(list(range(vocab)), device)
    K.embedding(qtype, torch.from_numpy(raw).to(device), ids, out, vocab, vocab, dim)
    with np.errstate(invalid="ignore"):  # random scales of inf and NaN: the NaNs the test expects
        expected = ref.dequantize(raw, qtype)
    got = out.cpu().numpy()
    nan = np.isnan(expected)
    assert nan.mean() < 0.25 and np.array_equal(np.isnan(got), nan)  # most values are numbers
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [pytest.param(1, id="F16"), pytest.param(30, id="BF16")])
def test_half_formats_widen_exactly_for_all_65536_values(device: str, qtype: int) -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if qtype == 1:
        expected = bits.view(np.float16).astype(np.float32)
    else:
        expected = (bits.astype(np.uint32) << 16).view(np.float32)
    table = torch.from_numpy(bits.view(np.uint8).reshape(2048, 64).copy()).to(device)
    out = torch.zeros(2048, 32, device=device)
    K.embedding(qtype, table, int32(list(range(2048)), device), out, 2048, 2048, 32)
    got = out.cpu().numpy().reshape(-1)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    if device == "cpu":  # NaN payloads are kept bit for bit on the CPU; CUDA may canonicalise them
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    else:
        assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


# ---- rmsnorm -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_tokens,dim", [(1, 64), (5, 100), (3, 2048)])
def test_rmsnorm(device: str, n_tokens: int, dim: int) -> None:
    rng = np.random.default_rng(2)
    x, w = randn(rng, (n_tokens, dim), device, 3.0), randn(rng, (dim,), device)
    y = poisoned((n_tokens, dim), device)
    K.rmsnorm(x, w, y, n_tokens, dim, 1e-6)
    assert_written(y)
    expected = ref.rmsnorm(x.cpu().double(), w.cpu().double(), 1e-6)
    assert ref.rel_err(y, expected) < TOL_RMSNORM
    # in place (x and y alias) gives the same bits
    x_inplace = x.clone()
    K.rmsnorm(x_inplace, w, x_inplace, n_tokens, dim, 1e-6)
    assert torch.equal(x_inplace, y)


# ---- matmul ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPE_PARAMS)
@pytest.mark.parametrize("n_tokens", [1, 3, 7])
def test_matmul(device: str, qtype: int, n_tokens: int) -> None:
    rng = np.random.default_rng(3 + n_tokens)
    rows, cols = 40, 128
    raw, w64 = ref.make_weights(rng, (rows, cols), qtype)
    w = raw.to(device)
    x, bias = randn(rng, (n_tokens, cols), device), randn(rng, (rows,), device)
    expected = ref.dot_input(x, qtype) @ w64.T

    y = poisoned((n_tokens, rows), device)
    K.matmul(qtype, w, x, None, y, n_tokens, rows, cols)
    assert_written(y)
    assert ref.rel_err(y, expected) < TOL_MATMUL

    y_bias = poisoned((n_tokens, rows), device)
    K.matmul(qtype, w, x, bias, y_bias, n_tokens, rows, cols)
    assert ref.rel_err(y_bias, expected + bias.cpu().double()) < TOL_MATMUL

    residual = randn(rng, (n_tokens, rows), device)
    y_acc = residual.clone()
    K.matmul(qtype, w, x, bias, y_acc, n_tokens, rows, cols, accumulate=True)
    assert ref.rel_err(y_acc, residual.cpu().double() + expected + bias.cpu().double()) < TOL_MATMUL
    # the fused residual add is exactly "y + (dot + bias)" in float32
    assert torch.equal(y_acc, residual + y_bias)

    # the per-token scale (the deferred norm's inv) is exactly "dot * scale + bias", each rounded
    scale = randn(rng, (n_tokens,), device)
    y_scaled = poisoned((n_tokens, rows), device)
    K.matmul(qtype, w, x, bias, y_scaled, n_tokens, rows, cols, scale=scale)
    assert torch.equal(y_scaled, y * scale[:, None] + bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "qtype,dtype", [(0, torch.float32), (1, torch.float16), (30, torch.bfloat16)], ids=["F32", "F16", "BF16"]
)
def test_matmul_takes_float_weight_tensors(device: str, qtype: int, dtype: torch.dtype) -> None:
    """F32/F16/BF16 weights may be passed in their own dtype instead of raw bytes: same bits."""
    rng = np.random.default_rng(4)
    rows, cols = 16, 40
    raw, _ = ref.make_weights(rng, (rows, cols), qtype)
    x = randn(rng, (2, cols), device)
    y_raw, y_typed = poisoned((2, rows), device), poisoned((2, rows), device)
    K.matmul(qtype, raw.to(device), x, None, y_raw, 2, rows, cols)
    K.matmul(qtype, raw.view(dtype).to(device), x, None, y_typed, 2, rows, cols)
    assert torch.equal(y_raw, y_typed)


# ---- rope + KV append, attention ---------------------------------------------------------------------------

ATTN_SHAPES = [  # n_tokens, n_heads, n_kv_heads, head_dim, pos0
    (1, 4, 4, 16, 0),
    (5, 8, 2, 32, 3),  # GQA, prefill at an offset
    (3, 6, 3, 64, 11),
    (1, 16, 4, 128, 17),  # decode at pos > 0
    (2, 4, 2, 256, 130),  # the vector layout at 8 dims a lane, past one block's 128 positions
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_rope_kv_append(device: str, neox: bool, shape: tuple[int, ...]) -> None:
    n_tokens, n_heads, n_kv, head_dim, pos0 = shape
    max_ctx, base = pos0 + n_tokens + 2, 10000.0
    rng = np.random.default_rng(5)
    q = randn(rng, (n_tokens, n_heads, head_dim), device)
    k, v = randn(rng, (n_tokens, n_kv, head_dim), device), randn(rng, (n_tokens, n_kv, head_dim), device)
    k_cache, v_cache = (
        poisoned((max_ctx, n_kv, head_dim), device),
        poisoned((max_ctx, n_kv, head_dim), device),
    )
    q_in = q.clone()
    K.rope_kv_append(
        q,
        k,
        v,
        k_cache,
        v_cache,
        int32([pos0], device),
        n_tokens,
        n_heads,
        n_kv,
        head_dim,
        max_ctx,
        base,
        neox,
    )
    positions = torch.arange(pos0, pos0 + n_tokens)
    assert ref.rel_err(q, ref.rope(q_in.cpu().double(), positions, base, neox)) < TOL_ROPE
    rows = slice(pos0, pos0 + n_tokens)
    assert ref.rel_err(k_cache[rows], ref.rope(k.cpu().double(), positions, base, neox)) < TOL_ROPE
    assert torch.equal(v_cache[rows], v)
    # nothing outside the appended rows is touched
    assert torch.isnan(k_cache[:pos0]).all() and torch.isnan(k_cache[pos0 + n_tokens :]).all()
    assert torch.isnan(v_cache[:pos0]).all() and torch.isnan(v_cache[pos0 + n_tokens :]).all()


def test_rope_styles_differ() -> None:
    """NEOX and interleaved pairs are different rotations (guards against a flag that is ignored)."""
    rng = np.random.default_rng(6)
    outs = []
    for neox in (True, False):
        q = randn(rng, (1, 1, 8), "cpu")
        q.copy_(torch.arange(8, dtype=torch.float32).view(1, 1, 8))
        kc, vc = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
        K.rope_kv_append(q, q.clone(), q.clone(), kc, vc, int32([2], "cpu"), 1, 1, 1, 8, 4, 100.0, neox)
        outs.append(q)
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_attention(device: str, shape: tuple[int, ...]) -> None:
    n_tokens, n_heads, n_kv, head_dim, pos0 = shape
    max_ctx = pos0 + n_tokens + 3
    rng = np.random.default_rng(7)
    q = randn(rng, (n_tokens, n_heads, head_dim), device)
    # rows past the last position stay NaN: reading them would poison the output
    k_cache, v_cache = (
        poisoned((max_ctx, n_kv, head_dim), device),
        poisoned((max_ctx, n_kv, head_dim), device),
    )
    k_cache[: pos0 + n_tokens] = randn(rng, (pos0 + n_tokens, n_kv, head_dim), device)
    v_cache[: pos0 + n_tokens] = randn(rng, (pos0 + n_tokens, n_kv, head_dim), device)
    out = poisoned((n_tokens, n_heads, head_dim), device)
    K.attention(q, k_cache, v_cache, out, int32([pos0], device), n_tokens, n_heads, n_kv, head_dim, max_ctx,
                attention_scratch(n_tokens, n_heads, head_dim, device))
    assert_written(out)
    assert ref.rel_err(out, ref.attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), pos0)) < TOL_ATTENTION


@pytest.mark.parametrize("device", DEVICES)
def test_attention_of_one_block_is_the_merge_bitwise(device: str) -> None:
    """On CUDA a context of at most 128 positions (4 tiles: one block's warps) is written by that block, a
    longer one by the last of its busy blocks to arrive, which merges their partials from the scratch. Keys at
    positions 128-159 that score about -1e28 against a positive q weigh exp(-1e28 - m) = 0 exactly, so
    attending to 160 positions must give the bits of attending to the first 128: the one-block path is the
    merge's arithmetic. Three calls share one scratch, so its arrival counters must be back at zero after
    each."""
    n_heads, n_kv, head_dim, short, long = 2, 2, 128, 128, 160
    rng = np.random.default_rng(12)
    q = randn(rng, (1, n_heads, head_dim), device).abs() * 0.1 + 0.01
    k_cache, v_cache = (randn(rng, (long, n_kv, head_dim), device) for _ in range(2))
    k_cache[short:] = -1e28
    scratch = attention_scratch(1, n_heads, head_dim, device)

    def run(context: int) -> torch.Tensor:
        out = poisoned((1, n_heads, head_dim), device)
        K.attention(q, k_cache, v_cache, out, int32([context - 1], device), 1, n_heads, n_kv, head_dim, long,
                    scratch)
        assert_written(out)
        return out

    got_short, got_long, again = run(short), run(long), run(long)
    want = ref.attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), short - 1)
    assert ref.rel_err(got_short, want) < TOL_ATTENTION
    assert torch.equal(got_long, got_short)
    assert torch.equal(again, got_long)
    assert not arrival_counters(scratch, n_heads).any(), "arrival counters left non-zero"


@pytest.mark.parametrize("device", DEVICES)
def test_attention_long_context_repeats_bitwise(device: str) -> None:
    """1,100 positions: 35 tiles, so all 8 blocks are busy and three workers take two tiles each, merged by
    whichever block arrives last. The result must not depend on that order: repeated calls on one scratch give
    the same bits (and are close to the float64 reference)."""
    n_tokens, n_heads, n_kv, head_dim, pos0 = 2, 8, 2, 128, 1098
    max_ctx = pos0 + n_tokens
    rng = np.random.default_rng(23)
    q = randn(rng, (n_tokens, n_heads, head_dim), device)
    k_cache, v_cache = (randn(rng, (max_ctx, n_kv, head_dim), device) for _ in range(2))
    scratch = attention_scratch(n_tokens, n_heads, head_dim, device)
    outs = []
    for _ in range(4):
        out = poisoned((n_tokens, n_heads, head_dim), device)
        K.attention(q, k_cache, v_cache, out, int32([pos0], device), n_tokens, n_heads, n_kv, head_dim,
                    max_ctx, scratch)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert ref.rel_err(outs[0], ref.attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), pos0)) < 1e-4
    assert not arrival_counters(scratch, n_tokens * n_heads).any(), "arrival counters left non-zero"


def arrival_counters(scratch: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """The attention scratch's per-pair arrival counters (the first word of each pair's record)."""
    return scratch.view(n_pairs, -1)[:, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_attention_calls_of_any_token_count_share_one_scratch(device: str) -> None:
    """A decode step's call (one token) and a prefill step's (several) share the engine's scratch: after
    calls of one token at 300+ positions (merged through the scratch), a call of 9 tokens gives the bits of
    the 9 one-token calls, and so on in turn; the counters are back at zero after each."""
    n_tokens, n_heads, n_kv, head_dim, pos0 = 9, 4, 2, 64, 300
    max_ctx = pos0 + n_tokens
    rng = np.random.default_rng(31)
    q = randn(rng, (n_tokens, n_heads, head_dim), device)
    k_cache, v_cache = (randn(rng, (max_ctx, n_kv, head_dim), device) for _ in range(2))
    scratch = attention_scratch(n_tokens, n_heads, head_dim, device)

    def run(t0: int, count: int) -> torch.Tensor:
        out = poisoned((count, n_heads, head_dim), device)
        K.attention(q[t0:t0 + count].contiguous(), k_cache, v_cache, out, int32([pos0 + t0], device), count,
                    n_heads, n_kv, head_dim, max_ctx, scratch)
        assert not arrival_counters(scratch, n_tokens * n_heads).any(), "arrival counters left non-zero"
        return out

    for _ in range(2):
        singles = torch.cat([run(t, 1) for t in range(n_tokens)])
        batched = run(0, n_tokens)
        assert torch.equal(batched, singles)
    assert ref.rel_err(batched, ref.attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), pos0)) < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_attention_reads_a_position_its_predecessor_writes(device: str) -> None:
    """attention's blocks start under PDL while the kernel before it runs, and before pdl_wait they prefetch
    the cache rows of the context they find then; the context they attend to must be the position that kernel
    writes: here an argmax over a long row that writes the position at its end and triggers its dependents at
    its start, so that on the GPU the attention's blocks can start, and read the old position 0, while it
    runs. 40 positions: a whole tile and a partial one."""
    n_heads, n_kv, head_dim, new_pos, max_ctx = 4, 2, 128, 39, 48
    rng = np.random.default_rng(17)
    q = randn(rng, (1, n_heads, head_dim), device)
    k_cache, v_cache = (randn(rng, (max_ctx, n_kv, head_dim), device) for _ in range(2))

    scratch = attention_scratch(1, n_heads, head_dim, device)

    def run(pos: torch.Tensor) -> torch.Tensor:
        out = poisoned((1, n_heads, head_dim), device)
        K.attention(q, k_cache, v_cache, out, pos, 1, n_heads, n_kv, head_dim, max_ctx, scratch)
        return out

    expected, stale = run(int32([new_pos], device)), run(int32([0], device))
    assert not torch.equal(expected, stale)
    pos, out = int32([0], device), poisoned((1, n_heads, head_dim), device)  # nothing launched in between
    write_late(pos, new_pos)
    K.attention(q, k_cache, v_cache, out, pos, 1, n_heads, n_kv, head_dim, max_ctx, scratch)
    assert int(pos.item()) == new_pos
    assert torch.equal(out, expected)


# ---- router ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("n_tokens,n_experts,hidden,top_k", [(1, 8, 64, 2), (5, 60, 96, 4), (3, 17, 33, 3)])
def test_router_topk(
    device: str, normalize: bool, n_tokens: int, n_experts: int, hidden: int, top_k: int
) -> None:
    rng = np.random.default_rng(8)
    w, h = randn(rng, (n_experts, hidden), device, 0.3), randn(rng, (n_tokens, hidden), device)
    ids = torch.full((n_tokens, top_k), -1, dtype=torch.int32, device=device)
    weights = poisoned((n_tokens, top_k), device)
    K.router_topk(w, h, ids, weights, n_tokens, n_experts, hidden, top_k, normalize)
    assert_written(weights)
    p_ref, ids_ref, w_ref = ref.router_topk(w.cpu(), h.cpu(), top_k, normalize)
    got = ids.cpu().long()
    # the chosen experts carry the reference's top-k probabilities, in descending order...
    assert torch.allclose(p_ref.gather(1, got), p_ref.gather(1, ids_ref), rtol=TOL_ROUTER, atol=0)
    # ...and with these well-separated random logits they are exactly the reference's ids
    assert torch.equal(got, ids_ref)
    assert ref.rel_err(weights, w_ref) < TOL_ROUTER


@pytest.mark.parametrize("device", DEVICES)
def test_router_ties_go_to_the_lowest_expert_id(device: str) -> None:
    n_experts, hidden, top_k = 8, 32, 4
    # integer weights against h = e_0: the logits are exact and tie exactly
    logits = [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, -1.0]
    w = torch.zeros(n_experts, hidden)
    w[:, 0] = torch.tensor(logits)
    w[:, 1:] = torch.randn(n_experts, hidden - 1)
    h = torch.zeros(3, hidden)
    h[0, 0] = 1.0  # ties at the top (1, 2, 4) and across the k boundary (5, 6)
    h[2, 0] = -1.0  # negated logits: 7, then 3, then 0, then the tie 5/6
    ids = torch.full((3, top_k), -1, dtype=torch.int32, device=device)
    weights = poisoned((3, top_k), device)
    K.router_topk(w.to(device), h.to(device), ids, weights, 3, n_experts, hidden, top_k, False)
    ids, weights = ids.cpu(), weights.cpu()
    assert ids[0].tolist() == [1, 2, 4, 5]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] and weights[0, 2] > weights[0, 3]
    assert ids[1].tolist() == [0, 1, 2, 3]  # all logits equal
    assert torch.equal(weights[1], torch.full((top_k,), 1.0 / n_experts))
    assert ids[2].tolist() == [7, 3, 0, 5]


# ---- routed experts ----------------------------------------------------------------------------------------

MOE_SHAPES = [  # n_tokens, top_k, n_experts, ffn, hidden
    (1, 2, 4, 32, 64),
    (7, 4, 8, 64, 96),
]


def moe_weights(rng: np.random.Generator, qtype: int, n_experts: int, ffn: int, hidden: int, device: str):
    wg_raw, wg = ref.make_weights(rng, (n_experts, ffn, hidden), qtype, 0.2)
    wu_raw, wu = ref.make_weights(rng, (n_experts, ffn, hidden), qtype, 0.2)
    wd_raw, wd = ref.make_weights(rng, (n_experts, hidden, ffn), qtype, 0.2)
    return (wg_raw.to(device), wu_raw.to(device), wd_raw.to(device)), (wg, wu, wd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPE_PARAMS)
@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_moe_gate_up(device: str, qtype: int, shape: tuple[int, ...]) -> None:
    n_tokens, top_k, n_experts, ffn, hidden = shape
    rng = np.random.default_rng(9)
    (wg, wu, _), (wg64, wu64, _) = moe_weights(rng, qtype, n_experts, ffn, hidden, device)
    h = randn(rng, (n_tokens, hidden), device)
    ids = distinct_ids(rng, n_tokens, top_k, n_experts, device)
    act = poisoned((n_tokens, top_k, ffn), device)
    K.moe_gate_up(qtype, wg, wu, h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden)
    assert_written(act)
    assert ref.rel_err(act, ref.moe_gate_up(wg64, wu64, h, ids, top_k, qtype)) < TOL_MATMUL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPE_PARAMS)
def test_dense_ffn_is_one_expert_without_ids(device: str, qtype: int) -> None:
    """ids = None: expert 0 for every slot (a dense FFN / the shared expert), then a gated down-accumulate."""
    rng = np.random.default_rng(10)
    n_tokens, ffn, hidden = 3, 64, 96
    (wg, wu, wd), (wg64, wu64, wd64) = moe_weights(rng, qtype, 1, ffn, hidden, device)
    h = randn(rng, (n_tokens, hidden), device)
    act = poisoned((n_tokens, 1, ffn), device)
    K.moe_gate_up(qtype, wg, wu, h, None, act, n_tokens, 1, 0, 1, 1, ffn, hidden)
    assert ref.rel_err(act, ref.moe_gate_up(wg64, wu64, h, None, 1, qtype)) < TOL_MATMUL
    gate_inp, x = randn(rng, (hidden,), device, 0.1), randn(rng, (n_tokens, hidden), device)
    x_ref = ref.moe_down_accumulate(wd64, act, None, None, gate_inp, h, x, range(1), qtype)
    K.moe_down_accumulate(qtype, wd, act, None, None, gate_inp, h, x, n_tokens, 1, 0, 1, 1, hidden, ffn)
    assert ref.rel_err(x, x_ref) < TOL_MATMUL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPE_PARAMS)
@pytest.mark.parametrize("shape", MOE_SHAPES)
@pytest.mark.parametrize(
    "with_weights,with_gate",
    [(True, False), (False, False), (True, True)],
    ids=["weights", "unweighted", "weights+gate"],
)
def test_moe_down_accumulate(
    device: str, qtype: int, shape: tuple[int, ...], with_weights: bool, with_gate: bool
) -> None:
    n_tokens, top_k, n_experts, ffn, hidden = shape
    rng = np.random.default_rng(11)
    (_, _, wd), (_, _, wd64) = moe_weights(rng, qtype, n_experts, ffn, hidden, device)
    act = randn(rng, (n_tokens, top_k, ffn), device)
    ids = distinct_ids(rng, n_tokens, top_k, n_experts, device)
    weights = torch.rand(n_tokens, top_k).to(device) if with_weights else None
    gate_inp = randn(rng, (hidden,), device, 0.2) if with_gate else None
    h = randn(rng, (n_tokens, hidden), device) if with_gate else None
    x = randn(rng, (n_tokens, hidden), device)
    x_ref = ref.moe_down_accumulate(wd64, act, ids, weights, gate_inp, h, x, range(top_k), qtype)
    K.moe_down_accumulate(
        qtype, wd, act, ids, weights, gate_inp, h, x, n_tokens, top_k, 0, top_k, n_experts, hidden, ffn
    )
    assert_written(x)
    assert ref.rel_err(x, x_ref) < TOL_MATMUL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPE_PARAMS)
@pytest.mark.parametrize("with_gate", [False, True], ids=["routed", "gated"])
def test_moe_fused_equals_per_slot_bitwise(device: str, qtype: int, with_gate: bool) -> None:
    """One launch over all slots == top_k launches of one slot == two launches of two slots, bit for bit."""
    n_tokens, top_k, n_experts, ffn, hidden = 7, 4, 8, 64, 96
    rng = np.random.default_rng(12)
    (wg, wu, wd), _ = moe_weights(rng, qtype, n_experts, ffn, hidden, device)
    h = randn(rng, (n_tokens, hidden), device)
    ids = distinct_ids(rng, n_tokens, top_k, n_experts, device)
    weights = torch.rand(n_tokens, top_k).to(device)
    gate_inp = randn(rng, (hidden,), device, 0.2) if with_gate else None
    x0 = randn(rng, (n_tokens, hidden), device)

    def gate_up(ranges: list[tuple[int, int]]) -> torch.Tensor:
        act = poisoned((n_tokens, top_k, ffn), device)
        for begin, count in ranges:
            K.moe_gate_up(qtype, wg, wu, h, ids, act, n_tokens, top_k, begin, count, n_experts, ffn, hidden)
        return act

    def down(act: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        x = x0.clone()
        for begin, count in ranges:
            K.moe_down_accumulate(
                qtype,
                wd,
                act,
                ids,
                weights,
                gate_inp,
                h if with_gate else None,
                x,
                n_tokens,
                top_k,
                begin,
                count,
                n_experts,
                hidden,
                ffn,
            )
        return x

    fused, per_slot, halves = [(0, top_k)], [(s, 1) for s in range(top_k)], [(0, 2), (2, 2)]
    act = gate_up(fused)
    assert_written(act)
    assert torch.equal(act, gate_up(per_slot)) and torch.equal(act, gate_up(halves))
    assert torch.equal(act, gate_up(fused))  # run == run
    x = down(act, fused)
    assert torch.equal(x, down(act, per_slot)) and torch.equal(x, down(act, halves))
    assert torch.equal(x, down(act, fused))


# ---- K types (256-value super-blocks) ----------------------------------------------------------------------


def _q8_0_identity(n: int) -> torch.Tensor:
    """Raw Q8_0 rows of the n x n identity: d = 1 (fp16) and code 1 at the diagonal, so W x is exactly the
    values the kernel multiplies x's activations as."""
    block = np.zeros((n, n // 32, 34), dtype=np.uint8)
    block[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    for r in range(n):
        block[r, r // 32, 2 + r % 32] = 1
    return torch.from_numpy(block.reshape(n, -1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiled", [False, True], ids=["gguf", "tiled"])
def test_q8_0_products_take_int8_activation_groups(device: str, tiled: bool) -> None:
    """A Q8_0 dot product multiplies each group of 4 activations as int8 codes times a power of two
    (csrc/common/act_quant.h): through the identity, the kernel returns those values, bitwise the
    reference's q8_round, on ties (to even), the 127.5 boundary, tiny groups (to 0), huge and subnormal
    values; a NaN or an infinity makes the token's every product NaN."""
    n = 128
    edge = [1.0, 0.5, -0.25, 0.0,  # exact codes 64, 32, -16, 0
            100.0, 2.5, -3.5, 0.5,  # scale 1: ties 2.5 -> 2, -3.5 -> -4, 0.5 -> 0
            127.5, 1.0, 3.0, -1.0,  # 127.5 does not fit 7 bits: scale 2
            127.49998, 1.5, -0.5, 2.0,  # just below: scale 1
            1e-31, -2e-31, 0.0, 5e-32,  # below 2^-100: zeros
            2.0**-100, -(2.0**-101), 2.0**-120, 0.0,  # at the limit: kept
            3e38, -1e38, 1.0, 0.0,  # huge (scale 2^121)
            1e-3, 1e-40, -1e-44, 3e-39]  # subnormals beside a normal value
    rng = np.random.default_rng(7)
    rest = rng.standard_normal(n - len(edge)).astype(np.float32)
    x = np.concatenate([np.array(edge, dtype=np.float32), rest])
    rows = np.stack([x, x * np.float32(1e-3), x[::-1].copy(), x, x])
    rows[3, 9] = np.nan
    rows[4, 70] = np.inf
    xs = torch.from_numpy(rows).to(device)
    raw = _q8_0_identity(n)
    qtype = Q8_0_TILED if tiled else ref.QTYPES["Q8_0"]
    w = (tile_q8_0(raw, n) if tiled else raw).to(device)
    y = poisoned((5, n), device)
    K.matmul(qtype, w, xs, None, y, 5, n, n)
    expected = ref.q8_round(xs[:3].cpu())  # model64.q8_round
    hand = [1.0, 0.5, -0.25, 0.0, 100.0, 2.0, -4.0, 0.0, 128.0, 0.0, 4.0, 0.0, 127.0, 2.0, 0.0, 2.0,
            0.0, 0.0, 0.0, 0.0]
    assert expected[0, :20].tolist() == hand  # the definition, worked by hand for the first groups
    assert torch.equal(y[:3].cpu(), expected)
    assert torch.isnan(y[3:]).all()
    assert not torch.equal(expected, xs[:3].cpu())  # the rounding is real: this test can fail


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", K_QTYPE_PARAMS)
@pytest.mark.parametrize("n_tokens", [1, 3])
def test_k_types_matmul(device: str, qtype: int, n_tokens: int) -> None:
    """Rows of 2 and 9 super-blocks (the CUDA dot takes a whole warp per super-block), two activation
    alignments (vector loads or not): within float32 rounding of float64, the same bits either way."""
    rng = np.random.default_rng(32 + n_tokens)
    for rows, cols in ((40, 512), (9, 2304)):
        raw, w64 = ref.make_weights(rng, (rows, cols), qtype)
        w = raw.to(device)
        x = randn(rng, (n_tokens, cols), device)
        y = poisoned((n_tokens, rows), device)
        K.matmul(qtype, w, x, None, y, n_tokens, rows, cols)
        assert_written(y)
        assert ref.rel_err(y, x.cpu().double() @ w64.T) < TOL_MATMUL
        x_odd = torch.empty(n_tokens * cols + 1, device=device)[1:]  # 4 bytes off: scalar activation loads
        x_odd.copy_(x.reshape(-1))
        y_odd = poisoned((n_tokens, rows), device)
        K.matmul(qtype, w, x_odd, None, y_odd, n_tokens, rows, cols)
        assert torch.equal(y_odd, y), (rows, cols)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", K_QTYPE_PARAMS)
def test_k_types_experts(device: str, qtype: int) -> None:
    """Gate-up and down over K-type experts (hidden and FFN multiples of 256) against float64, and one launch
    over all slots bitwise the per-slot launches."""
    n_tokens, top_k, n_experts, ffn, hidden = 3, 2, 4, 256, 512
    rng = np.random.default_rng(33)
    (wg, wu, wd), (wg64, wu64, wd64) = moe_weights(rng, qtype, n_experts, ffn, hidden, device)
    h = randn(rng, (n_tokens, hidden), device)
    ids = distinct_ids(rng, n_tokens, top_k, n_experts, device)
    weights = torch.rand(n_tokens, top_k).to(device)
    act = poisoned((n_tokens, top_k, ffn), device)
    K.moe_gate_up(qtype, wg, wu, h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden)
    assert ref.rel_err(act, ref.moe_gate_up(wg64, wu64, h, ids, top_k, qtype)) < TOL_MATMUL
    per_slot = poisoned((n_tokens, top_k, ffn), device)
    for s in range(top_k):
        K.moe_gate_up(qtype, wg, wu, h, ids, per_slot, n_tokens, top_k, s, 1, n_experts, ffn, hidden)
    assert torch.equal(per_slot, act)
    x0 = randn(rng, (n_tokens, hidden), device)
    x = x0.clone()
    K.moe_down_accumulate(qtype, wd, act, ids, weights, None, None, x, n_tokens, top_k, 0, top_k, n_experts,
                          hidden, ffn)
    x_ref = ref.moe_down_accumulate(wd64, act, ids, weights, None, None, x0, range(top_k), qtype)
    assert ref.rel_err(x, x_ref) < TOL_MATMUL
    x_slots = x0.clone()
    for s in range(top_k):
        K.moe_down_accumulate(qtype, wd, act, ids, weights, None, None, x_slots, n_tokens, top_k, s, 1,
                              n_experts, hidden, ffn)
    assert torch.equal(x_slots, x)


@pytest.mark.parametrize("device", DEVICES)
def test_k_types_reject_rows_that_are_not_whole_super_blocks(device: str) -> None:
    w = torch.zeros(9 * 144, dtype=torch.uint8, device=device)
    x, y = torch.zeros(1, 1408, device=device), torch.zeros(1, 1, device=device)
    with pytest.raises(RuntimeError, match=r"'cols' = 1408 is not a multiple of the Q4_K block"):
        K.matmul(ref.K_QTYPES["Q4_K"], w, x, None, y, 1, 1, 1408)


# ---- argmax and sampling -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_ties_and_nan(device: str) -> None:
    vocab = 50
    logits = torch.randn(4, vocab)
    logits[1] = 0.0
    logits[1, 7] = logits[1, 3] = 5.0  # tie: the lower id wins
    logits[2, 20] = 9.0
    logits[2, 0] = logits[2, 10] = NAN  # NaN never wins
    logits[3] = -float("inf")
    logits[3, 30] = NAN  # all -inf: ties to id 0, the NaN still loses
    out = torch.full((4,), -1, dtype=torch.int32, device=device)
    K.argmax(logits.to(device), out, 4, vocab)
    assert out.cpu().tolist() == [int(torch.argmax(logits[0])), 3, 20, 0]


@pytest.mark.parametrize("device", DEVICES)
# a multiple of 4 ids: CUDA's 16-byte loads; not one: its scalar loop
@pytest.mark.parametrize("vocab", [151_936, 151_937])
def test_argmax_long_rows_ties_across_the_scan(device: str, vocab: int) -> None:
    """Vocabulary-sized rows, long enough for a kernel to split them over several blocks: a tie between ids
    far apart (scanned by different blocks when split by 1024-id stretches) still goes to the lower id, as
    does one inside a 4-id load, a maximum at the last id is found, and an all-NaN row gives 0."""
    logits = torch.randn(4, vocab)
    logits[0, 9000] = logits[0, 1500] = 7.0  # 1024-id stretches 8 and 1: the lower id, 1500, wins
    logits[1, vocab - 1] = 8.0
    logits[2] = NAN
    logits[3, 4003] = logits[3, 4001] = 6.0  # one 16-byte load: the lower id, 4001, wins
    out = torch.full((4,), -1, dtype=torch.int32, device=device)
    K.argmax(logits.to(device), out, 4, vocab)
    assert out.cpu().tolist() == [1500, vocab - 1, 0, 4001]


def run_sample(
    logits: torch.Tensor,
    device: str,
    steps: range,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 1234,
) -> list[int]:
    """One tm_sample call per step (the step read from a device tensor, as in a replayed graph)."""
    vocab = logits.shape[-1]
    logits = logits.to(device)
    out = torch.full((len(steps),), -1, dtype=torch.int32, device=device)
    step = torch.zeros(1, dtype=torch.int32, device=device)
    for i, s in enumerate(steps):
        step.fill_(s)
        K.sample(logits, out[i : i + 1], vocab, temperature, top_p, top_k, seed, step)
    return out.cpu().tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_sample_is_deterministic_per_seed_and_step(device: str) -> None:
    logits = torch.randn(1000) * 0.5
    a = run_sample(logits, device, range(40))
    assert a == run_sample(logits, device, range(40))
    assert len(set(a)) > 20  # different steps draw anew
    assert a != run_sample(logits, device, range(40), seed=99)  # and so do different seeds


@pytest.mark.parametrize("device", DEVICES)
def test_sample_draws_the_documented_generator(device: str) -> None:
    """token = first id, in descending p, whose cumulative p exceeds u = SplitMix64(seed, step).

    The generator is the one documented in csrc/common/sampling_rng.h, recomputed here in Python.
    """
    logits = torch.tensor([0.3, -1.0, 2.0, 0.5, 1.1, -0.2])
    seed = 0xDEADBEEFCAFEBABE  # >= 2**63: travels through torch's int64 as the same bits
    p = torch.softmax(logits.double(), dim=-1)
    order = torch.sort(p, descending=True, stable=True).indices
    cum = torch.cumsum(p[order], dim=0)
    steps = range(300)
    got = run_sample(logits, device, steps, seed=seed)
    checked = 0
    for s, token in zip(steps, got, strict=True):
        u = ref.sample_uniform(seed, s)
        if (cum - u).abs().min() < 1e-5:
            continue  # too close to a boundary for float32 vs float64
        assert token == int(order[int(torch.searchsorted(cum, u, right=True))]), f"step {s}"
        checked += 1
    assert checked > 290


# 99.9% quantiles of chi-square with df degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (5, 0.8)])
def test_sample_distribution_matches_softmax(device: str, top_k: int, top_p: float) -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 1.6, 0.9, -1.2, 0.4, 0.0])
    temperature, n = 0.8, 3000
    q = ref.sample_distribution(logits, temperature, top_p, top_k)
    got = run_sample(logits, device, range(n), temperature, top_p, top_k, seed=7)
    counts = np.bincount(got, minlength=8)
    kept = q.numpy() > 0
    assert counts[~kept].sum() == 0, "a token outside top-k / top-p was drawn"
    expected = n * q.numpy()[kept]
    chi2 = float((((counts[kept] - expected) ** 2) / expected).sum())
    df = int(kept.sum()) - 1
    assert chi2 < CHI2_999[df], f"chi2 {chi2:.1f} with {df} degrees of freedom"


@pytest.mark.parametrize("device", DEVICES)
def test_sample_top_k1_and_tiny_top_p_are_argmax(device: str) -> None:
    for seed in range(5):
        logits = torch.randn(5000, generator=torch.Generator().manual_seed(seed))
        best = int(torch.argmax(logits))
        assert run_sample(logits, device, range(8), top_k=1, seed=seed) == [best] * 8
        assert run_sample(logits, device, range(8), top_p=1e-6, seed=seed) == [best] * 8


@pytest.mark.parametrize("device", DEVICES)
def test_advance_position(device: str) -> None:
    pos = int32([5], device)
    K.advance_position(pos, 3)
    K.advance_position(pos, -2)
    assert pos.item() == 6


@pytest.mark.parametrize("device", DEVICES)
def test_advance_position_logs_the_token_at_the_new_position(device: str) -> None:
    pos, log = int32([5], device), int32([-1] * 9, device)
    # positions 6, 8, then 9 and 10, which are at or past log_len = 9 and so are not logged
    for token, delta in ((11, 1), (12, 2), (13, 1), (14, 1)):
        K.advance_position(pos, delta, int32([token], device), log, 9)
    assert pos.item() == 10
    assert log.tolist() == [-1] * 6 + [11, -1, 12]


@pytest.mark.parametrize("device", DEVICES)
# a multiple of 4 ids (CUDA's 16-byte loads) and not; a small one, read by few of the kernel's threads
@pytest.mark.parametrize("vocab", [151_936, 151_937, 50])
def test_argmax_advance_is_argmax_then_advance_position(device: str, vocab: int) -> None:
    """One launch of argmax_advance leaves the token, the position and the log as argmax then advance_position
    do, step after step: positions logged, one past the log's end not logged, a negative delta, a tie, NaN."""
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randn(6, vocab, generator=gen)
    rows[1, vocab // 3] = rows[1, vocab // 2] = 9.0  # a tie: the lower id
    rows[2] = NAN  # all NaN: id 0
    rows[3, vocab - 1] = 9.0
    deltas = [1, 3, 2, -4, 5, 1]  # positions 6, 9, 11 (past log_len = 10), 7, 12, 13
    state = {}
    for fused in (False, True):
        pos, log, out = int32([5], device), int32([-1] * 10, device), int32([-1], device)
        tokens = []
        for row, delta in zip(rows, deltas, strict=True):
            logits = row.to(device)
            if fused:
                K.argmax_advance(logits, out, vocab, pos, delta, log, 10)
            else:
                K.argmax(logits, out, 1, vocab)
                K.advance_position(pos, delta, out, log, 10)
            tokens.append(out.item())
        state[fused] = (tokens, pos.item(), log.tolist())
    assert state[True] == state[False]
    tokens, position, logged = state[True]
    assert tokens[1:4] == [vocab // 3, 0, vocab - 1] and position == 13
    assert logged[6] == tokens[0] and logged[9] == tokens[1] and logged[7] == tokens[3]
    # without a log only the position moves
    pos = int32([-2], device)
    K.argmax_advance(rows[0].to(device), out, vocab, pos, 2)
    assert pos.item() == 0 and out.item() == int(torch.argmax(rows[0]))


# ---- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_unsupported_qtype_is_named(device: str) -> None:
    w, x, y = (
        torch.zeros(4 * 144, dtype=torch.uint8, device=device),
        torch.zeros(1, 256, device=device),
        torch.zeros(1, 4, device=device),
    )
    with pytest.raises(RuntimeError, match=r"qtype 16 \(GGML IQ2_XXS\)"):
        K.matmul(16, w, x, None, y, 1, 4, 256)
    act = torch.zeros(1, 1, 4, device=device)
    with pytest.raises(
        RuntimeError, match=r"tm_moe_gate_up: unsupported weight format qtype 21 \(GGML IQ3_S\)"
    ):
        K.moe_gate_up(21, w, w, x, None, act, 1, 1, 0, 1, 1, 4, 256)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_are_named(device: str) -> None:
    z = torch.zeros(4096, device=device)
    zi = torch.zeros(64, dtype=torch.int32, device=device)
    w8 = torch.zeros(4096, dtype=torch.uint8, device=device)
    with pytest.raises(
        RuntimeError, match=r"tm_matmul: argument 'cols' = 48 is not a multiple of the Q8_0 block"
    ):
        K.matmul(8, w8, z, None, z, 1, 2, 48)
    with pytest.raises(RuntimeError, match=r"tm_router_topk: top_k = 9 exceeds n_experts = 8"):
        K.router_topk(z, z, zi, z, 1, 8, 16, 9, False)
    with pytest.raises(RuntimeError, match=r"tm_moe_gate_up: slot range"):
        K.moe_gate_up(0, z, z, z, zi, z, 1, 2, 1, 2, 2, 4, 8)
    with pytest.raises(RuntimeError, match=r"tm_moe_down_accumulate: slot range"):
        K.moe_down_accumulate(0, z, z, zi, None, None, None, z, 1, 2, -1, 1, 2, 8, 4)
    with pytest.raises(RuntimeError, match=r"n_heads = 6 is not a multiple of n_kv_heads = 4"):
        K.attention(z, z, z, z, zi, 1, 6, 4, 8, 4, attention_scratch(1, 6, 8, device))
    with pytest.raises(RuntimeError, match=r"'head_dim' = 7 must be even"):
        K.rope_kv_append(z, z, z, z, z, zi, 1, 2, 2, 7, 4, 1e4, True)
    with pytest.raises(RuntimeError, match=r"tm_rmsnorm: argument 'dim' must be > 0, got 0"):
        K.rmsnorm(z, z, z, 1, 0, 1e-6)
    with pytest.raises(RuntimeError, match=r"'temperature' must be finite and > 0"):
        K.sample(z, zi, 16, 0.0, 1.0, 0, 1, zi)
    with pytest.raises(RuntimeError, match=r"'gate_inp' is given"):
        K.moe_down_accumulate(0, z, z, zi, None, z, None, z, 1, 1, 0, 1, 1, 8, 4)
    # the torch shell checks dtypes and sizes before any pointer reaches the kernels
    with pytest.raises(
        RuntimeError, match=r"tornado_moe.rmsnorm: argument 'x' must be a float32 tensor, got float64"
    ):
        K.rmsnorm(z.double(), z, z, 1, 8, 1e-6)
    with pytest.raises(RuntimeError, match=r"argument 'y' has 4096 elements, the sizes given need 8192"):
        K.rmsnorm(torch.zeros(8192, device=device), torch.zeros(8192, device=device), z, 1, 8192, 1e-6)
    with pytest.raises(RuntimeError, match=r"argument 'w' has 4096 bytes, the sizes given need 5440"):
        K.matmul(8, w8, z, None, z, 1, 10, 512)
    with pytest.raises(RuntimeError, match=r"argument 'x' must be contiguous"):
        K.rmsnorm(z.view(64, 64).t(), z, z, 64, 64, 1e-6)


def test_tensors_on_two_devices_are_refused() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU to put tensors on two devices")
    with pytest.raises(RuntimeError, match=r"all tensors must be on one device"):
        K.rmsnorm(torch.zeros(8), torch.zeros(8, device="cuda"), torch.zeros(8), 1, 8, 1e-6)


def test_cpu_checks_positions_and_ids() -> None:
    """The CPU kernels check what only memory contents reveal: positions past the cache, ids out of range."""
    max_ctx, n_kv, hd = 4, 1, 8
    q, kv = torch.zeros(2, 1, hd), torch.zeros(2, n_kv, hd)
    cache = torch.zeros(max_ctx, n_kv, hd)
    with pytest.raises(
        RuntimeError, match=r"positions \[pos\[0\]=3, 5\) do not fit the KV cache of max_ctx=4"
    ):
        K.rope_kv_append(q, kv, kv, cache, cache.clone(), int32([3], "cpu"), 2, 1, 1, hd, max_ctx, 1e4, True)
    with pytest.raises(RuntimeError, match=r"tm_attention: positions"):
        K.attention(q, cache, cache, q.clone(), int32([-1], "cpu"), 2, 1, 1, hd, max_ctx,
                    attention_scratch(2, 1, hd, "cpu"))
    with pytest.raises(RuntimeError, match=r"tm_embedding: ids\[1\] = 10 is out of range \[0, vocab=10\)"):
        K.embedding(0, torch.zeros(10, 8), int32([0, 10], "cpu"), torch.zeros(2, 8), 2, 10, 8)
    ids = int32([[0, 3]], "cpu")
    with pytest.raises(RuntimeError, match=r"ids\[token 0, slot 1\] = 3 is out of range \[0, n_experts=3\)"):
        K.moe_gate_up(
            0,
            torch.zeros(3, 4, 8),
            torch.zeros(3, 4, 8),
            torch.zeros(1, 8),
            ids,
            torch.zeros(1, 2, 4),
            1,
            2,
            0,
            2,
            3,
            4,
            8,
        )


def test_missing_native_library_says_how_to_build(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORNADO_MOE_NATIVE_DIR", str(tmp_path))
    with pytest.raises(NativeLibraryNotFoundError, match=r"pip install -e \."):
        library_path("tornado_moe")


# ---- the C kernel table (tm_invoke, the Java route's entry) ------------------------------------------------


def c_library() -> ctypes.CDLL:
    K.cuda_compiled()  # loads the torch ops first: the same libtornado_moe.so is then shared
    lib = ctypes.CDLL(str(library_path("tornado_moe")))
    lib.tm_kernel_name.restype = ctypes.c_char_p
    lib.tm_kernel_signature.restype = ctypes.c_char_p
    lib.tm_last_error.restype = ctypes.c_char_p
    lib.tm_invoke.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.tm_kernel_index.argtypes = [ctypes.c_char_p]
    return lib


def f32_word(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def invoke(lib: ctypes.CDLL, name: str, device: str, words: list[int], stream: int = 0) -> int:
    index = lib.tm_kernel_index(name.encode())
    arr = (ctypes.c_uint64 * len(words))(*[w & (2**64 - 1) for w in words])
    return lib.tm_invoke(index, 1 if device == "cuda" else 0, arr, len(words), stream)


def test_kernel_table() -> None:
    lib = c_library()
    assert lib.tm_kernel_count() == len(K.KERNEL_NAMES)
    for i, name in enumerate(K.KERNEL_NAMES):
        assert lib.tm_kernel_name(i).decode() == name
        assert lib.tm_kernel_index(name.encode()) == i
        assert set(lib.tm_kernel_signature(i).decode()) <= set("qpnibfu")
    assert lib.tm_kernel_index(b"nope") == -1
    assert lib.tm_kernel_name(len(K.KERNEL_NAMES)) is None
    arr = (ctypes.c_uint64 * 1)(0)
    assert lib.tm_invoke(99, 0, arr, 1, None) == -5  # TM_ERR_UNKNOWN_KERNEL
    assert b"unknown kernel index 99" in lib.tm_last_error()
    assert invoke(lib, "argmax", "cpu", [0, 0, 1]) == -1
    assert b"tm_invoke(argmax): got 3 argument words, the signature 'ppii' needs 4" in lib.tm_last_error()
    assert invoke(lib, "matmul", "cpu", [1 << 40] + [0] * 16) == -1  # a qtype word that does not fit an int
    assert lib.tm_cuda_compiled() == int(K.cuda_compiled())


def test_c_abi_device_errors() -> None:
    lib = c_library()
    x = torch.zeros(32)
    words = [0, x.data_ptr(), x.data_ptr(), 0, x.data_ptr(), 1, 1, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    arr = (ctypes.c_uint64 * len(words))(*words)
    assert lib.tm_invoke(lib.tm_kernel_index(b"matmul"), 7, arr, len(words), None) == -1
    assert b"tm_matmul: unknown device 7" in lib.tm_last_error()
    if not lib.tm_cuda_compiled():
        assert lib.tm_cuda_device_count() == 0
        assert lib.tm_invoke(lib.tm_kernel_index(b"matmul"), 1, arr, len(words), None) == -3  # TM_ERR_NO_CUDA
        assert b"built without CUDA" in lib.tm_last_error()


@pytest.mark.parametrize("device", DEVICES)
def test_invoke_marshals_like_the_torch_ops(device: str) -> None:
    """tm_invoke with packed words (pointers, int64, float32 bits, uint64) == the torch op, bit for bit."""
    lib = c_library()
    rng = np.random.default_rng(13)
    stream = K.stream_of(torch.zeros(1, device=device))
    qtype, n_tokens, rows, cols = 8, 3, 24, 64
    w = ref.make_weights(rng, (rows, cols), qtype)[0].to(device)
    x, bias = randn(rng, (n_tokens, cols), device), randn(rng, (rows,), device)
    y_op = randn(rng, (n_tokens, rows), device)
    y_c, scale = y_op.clone(), randn(rng, (n_tokens,), device)
    K.matmul(qtype, w, x, bias, y_op, n_tokens, rows, cols, accumulate=True, scale=scale)
    assert (
        invoke(
            lib,
            "matmul",
            device,
            [qtype, w.data_ptr(), x.data_ptr(), bias.data_ptr(), y_c.data_ptr(), n_tokens, rows, cols, 1,
             scale.data_ptr(), 0, 0, 0, 0, 0, 0, 0],
            stream,
        )
        == 0
    )
    assert lib.tm_stream_synchronize(1 if device == "cuda" else 0, ctypes.c_void_p(stream)) == 0
    assert torch.equal(y_op, y_c)

    eps = 0.37  # large enough to change the result: proves the float word is read
    y_op, y_c = poisoned((n_tokens, cols), device), poisoned((n_tokens, cols), device)
    K.rmsnorm(x, x[0], y_op, n_tokens, cols, eps)
    assert (
        invoke(
            lib,
            "rmsnorm",
            device,
            [x.data_ptr(), x[0].data_ptr(), y_c.data_ptr(), n_tokens, cols, f32_word(eps)],
            stream,
        )
        == 0
    )
    lib.tm_stream_synchronize(1 if device == "cuda" else 0, ctypes.c_void_p(stream))
    assert torch.equal(y_op, y_c)

    logits = randn(rng, (500,), device)
    step = int32([17], device)
    seed = 0xFEEDFACE12345678
    out_op, out_c = int32([-1], device), int32([-1], device)
    K.sample(logits, out_op, 500, 0.7, 0.9, 40, seed, step)
    assert (
        invoke(
            lib,
            "sample",
            device,
            [
                logits.data_ptr(),
                out_c.data_ptr(),
                500,
                f32_word(0.7),
                f32_word(0.9),
                40,
                seed,
                step.data_ptr(),
            ],
            stream,
        )
        == 0
    )
    lib.tm_stream_synchronize(1 if device == "cuda" else 0, ctypes.c_void_p(stream))
    assert out_op.item() == out_c.item()
    pos = int32([5], device)
    token, log = int32([7], device), int32([0] * 4, device)
    assert invoke(lib, "advance_position", device, [pos.data_ptr(), -2, token.data_ptr(), log.data_ptr(), 4],
                  stream) == 0
    lib.tm_stream_synchronize(1 if device == "cuda" else 0, ctypes.c_void_p(stream))
    assert pos.item() == 3
    assert log.tolist() == [0, 0, 0, 7]
    logits = torch.zeros(6, device=device)
    logits[4] = 1.0
    assert invoke(lib, "argmax_advance", device, [logits.data_ptr(), token.data_ptr(), 6, pos.data_ptr(), -1,
                                                  log.data_ptr(), 4], stream) == 0
    lib.tm_stream_synchronize(1 if device == "cuda" else 0, ctypes.c_void_p(stream))
    assert (token.item(), pos.item(), log.tolist()) == (4, 2, [0, 0, 4, 7])
    head = [logits.data_ptr(), token.data_ptr(), 6, pos.data_ptr()]
    assert invoke(lib, "argmax_advance", device, [*head, 1 << 31, 0, 0], stream) == -1  # delta past int32
    assert invoke(lib, "argmax_advance", device, [*head, 1, log.data_ptr(), -1], stream) == -1
    assert b"'log_len' must be >= 0" in lib.tm_last_error()
