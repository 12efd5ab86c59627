"""TM_Q8_0_TILED (Q8_0 rows re-laid out for the GPU's loads) gives bitwise the results of the GGUF layout.

- the layout: tile/untile are inverse permutations of a row's bytes, and the kernels' own decoder (embedding,
  through qtypes.h's offsets) reads tiled rows as exactly gguf's dequantization of the original bytes;
- every weight kernel (matmul in all its tilings, qkv_rope, moe gate-up and down) on tiled rows == on the
  GGUF rows, bit for bit, on every device, for rows of whole groups of 4 steps, of a group plus a tail, and of
  a tail only (the shapes that exercise each branch of the CUDA reader);
- bad input: rows that are not a multiple of 128 values, and weights that are not 16-byte aligned on CUDA.
"""

from __future__ import annotations

import gguf
import kernel_reference as ref
import numpy as np
import pytest
import torch
from conftest import GPU, device_params

from tornado_moe import kernels as K
from tornado_moe.quant.tiled import Q8_0_TILED, can_tile, tile_q8_0, untile_q8_0

Q8_0 = 8
DEVICES = device_params()
# 128: one step (tail only), 384: 3 steps (tail only), 512: 1 group, 640: 1 group + 1, 1408: 2 groups + 3
# (the Qwen expert FFN), 2048: 4 groups (the Qwen hidden size)
COLS = [128, 384, 512, 640, 1408, 2048]


def q8_rows(rng: np.random.Generator, shape: tuple[int, ...], device: str) -> tuple[torch.Tensor, ...]:
    """(GGUF Q8_0 bytes, the same rows tiled) on ``device``."""
    raw, _ = ref.make_weights(rng, shape, Q8_0, 0.1)
    raw = raw.to(device)
    return raw, tile_q8_0(raw, shape[-1])


def randn(rng: np.random.Generator, shape: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device)


@pytest.mark.parametrize("cols", COLS)
def test_tile_is_a_row_permutation_and_untile_inverts_it(cols: int) -> None:
    rng = np.random.default_rng(cols)
    raw, tiled = q8_rows(rng, (3, cols), "cpu")
    assert tiled.shape == raw.shape and not torch.equal(tiled, raw)
    assert torch.equal(untile_q8_0(tiled, cols), raw)
    for r in range(3):  # each row keeps its own bytes, only moved
        assert torch.equal(torch.sort(tiled[r]).values, torch.sort(raw[r]).values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", COLS)
def test_kernel_decoder_reads_tiled_rows_as_gguf_dequantizes(device: str, cols: int) -> None:
    rng = np.random.default_rng(1 + cols)
    vocab = 5
    raw, tiled = q8_rows(rng, (vocab, cols), device)
    ids = torch.tensor([4, 0, 2, 2], dtype=torch.int32, device=device)
    out = torch.full((4, cols), float("nan"), device=device)
    K.embedding(Q8_0_TILED, tiled, ids, out, 4, vocab, cols)
    want = gguf.quants.dequantize(raw.cpu().numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert out.cpu().numpy().tobytes() == want[ids.cpu().numpy()].astype(np.float32).tobytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("n_tokens", [1, 5])
@pytest.mark.parametrize("x_offset", [0, 1], ids=["x-aligned", "x-misaligned"])
def test_matmul_tiled_is_gguf_layout_bitwise(device: str, cols: int, n_tokens: int, x_offset: int) -> None:
    rng = np.random.default_rng(2 + cols + n_tokens)
    rows = 40
    raw, tiled = q8_rows(rng, (rows, cols), device)
    # x_offset 1: activations 4 bytes past 16-byte alignment (the kernels' scalar-load path)
    x = randn(rng, (n_tokens * cols + 1,), device)[x_offset : x_offset + n_tokens * cols]
    bias = randn(rng, (rows,), device)
    for accumulate in (False, True):
        y0 = randn(rng, (n_tokens, rows), device)
        a, b = y0.clone(), y0.clone()
        K.matmul(Q8_0, raw, x, bias, a, n_tokens, rows, cols, accumulate)
        K.matmul(Q8_0_TILED, tiled, x, bias, b, n_tokens, rows, cols, accumulate)
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_tiled_with_two_rows_per_warp_is_gguf_layout_bitwise(device: str) -> None:
    """Decode calls with many rows give each CUDA warp two rows (the output head's tiling)."""
    rng = np.random.default_rng(3)
    rows, cols = 64 * 132 + 37, 256  # past the two-rows threshold on an H200 (and any smaller GPU)
    raw, tiled = q8_rows(rng, (rows, cols), device)
    x = randn(rng, (1, cols), device)
    a, b = torch.empty(1, rows, device=device), torch.empty(1, rows, device=device)
    K.matmul(Q8_0, raw, x, None, a, 1, rows, cols)
    K.matmul(Q8_0_TILED, tiled, x, None, b, 1, rows, cols)
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
# 1024 and 2048: 256 and 512 sums, which CUDA loads ahead of the dot products when a kernel before it wrote
# them (two and four 16-byte quads a lane); 4096: more than it holds ahead
@pytest.mark.parametrize("hidden,n_heads,head_dim",
                         [(512, 4, 128), (384, 6, 64), (1024, 2, 64), (2048, 2, 64), (4096, 2, 64)])
def test_qkv_rope_tiled_is_gguf_layout_bitwise(device: str, hidden: int, n_heads: int, head_dim: int) -> None:
    """Tiled rows give the GGUF layout's bits; so do xw, its sums and its int8 groups given by the kernel
    before (the decode chain's form) instead of computed in qkv_rope."""
    rng = np.random.default_rng(4 + hidden)
    n_tokens, n_kv, max_ctx, pos0 = 2, n_heads // 2, 8, 3
    x, norm_w = randn(rng, (n_tokens, hidden), device), randn(rng, (hidden,), device)
    ws = [q8_rows(rng, (n * head_dim, hidden), device) for n in (n_heads, n_kv, n_kv)]
    bq, bk, bv = (randn(rng, (n * head_dim,), device) for n in (n_heads, n_kv, n_kv))
    pos = torch.tensor([pos0], dtype=torch.int32, device=device)
    results = []
    for qtype, which in ((Q8_0, 0), (Q8_0_TILED, 1)):
        q = torch.full((n_tokens, n_heads * head_dim), float("nan"), device=device)
        kc = torch.zeros(max_ctx, n_kv * head_dim, device=device)
        vc = torch.zeros(max_ctx, n_kv * head_dim, device=device)
        wq, wk, wv = (w[which] for w in ws)
        K.qkv_rope(qtype, x, None, None, norm_w, 1e-6, wq, wk, wv, bq, bk, bv, q, kc, vc, pos, n_tokens,
                   hidden, n_heads, n_kv, head_dim, max_ctx, 10000.0, True)
        results.append((q, kc, vc))
    xw, inv = torch.empty_like(x), torch.empty(n_tokens, device=device)
    xss = torch.empty(n_tokens, K.norm_groups(hidden), device=device)
    K.rmsnorm_factors(x, norm_w, xw, xss, inv, n_tokens, hidden, 1e-6)
    for xw_groups in (None, ref.act_groups(xw).to(device)):
        q = torch.full((n_tokens, n_heads * head_dim), float("nan"), device=device)
        kc = torch.zeros(max_ctx, n_kv * head_dim, device=device)
        vc = torch.zeros(max_ctx, n_kv * head_dim, device=device)
        K.qkv_rope(Q8_0_TILED, x, xw, xss, norm_w, 1e-6, *(w[1] for w in ws), bq, bk, bv, q, kc, vc, pos,
                   n_tokens, hidden, n_heads, n_kv, head_dim, max_ctx, 10000.0, True, xw_groups)
        results.append((q, kc, vc))
    assert not torch.isnan(results[0][0]).any()
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_k", [4, 3], ids=["4-slots", "3-slots"])  # down groups of 4, and of 2 + 1
@pytest.mark.parametrize("hidden,ffn", [(512, 1408), (640, 384)])
def test_moe_tiled_is_gguf_layout_bitwise(device: str, top_k: int, hidden: int, ffn: int) -> None:
    rng = np.random.default_rng(5 + top_k + hidden)
    n_tokens, n_experts = 2, 6
    wg, wg_t = q8_rows(rng, (n_experts, ffn, hidden), device)
    wu, wu_t = q8_rows(rng, (n_experts, ffn, hidden), device)
    wd, wd_t = q8_rows(rng, (n_experts, hidden, ffn), device)
    h = randn(rng, (n_tokens, hidden), device)
    ids = torch.from_numpy(np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tokens)])).to(
        device=device, dtype=torch.int32)
    weights = torch.from_numpy(rng.random((n_tokens, top_k), dtype=np.float32)).to(device)
    gate_inp = randn(rng, (hidden,), device)
    x0 = randn(rng, (n_tokens, hidden), device)
    acts, xs = [], []
    for qtype, g, u, d in ((Q8_0, wg, wu, wd), (Q8_0_TILED, wg_t, wu_t, wd_t)):
        act = torch.full((n_tokens, top_k, ffn), float("nan"), device=device)
        K.moe_gate_up(qtype, g, u, h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden)
        x = x0.clone()
        K.moe_down_accumulate(qtype, d, act, ids, weights, None, None, x, n_tokens, top_k, 0, top_k,
                              n_experts, hidden, ffn)
        # a shared expert (no ids) with its sigmoid gate, as the layer graph runs it
        K.moe_down_accumulate(qtype, d[0], act[:, 0].contiguous(), None, None, gate_inp, h, x, n_tokens, 1,
                              0, 1, 1, hidden, ffn)
        acts.append(act)
        xs.append(x)
    assert not torch.isnan(acts[0]).any()
    assert torch.equal(acts[0], acts[1])
    assert torch.equal(xs[0], xs[1])


def test_can_tile_only_q8_0_rows_of_whole_steps() -> None:
    assert can_tile(Q8_0, 2048) and can_tile(Q8_0, 1408)
    assert not can_tile(Q8_0, 96) and not can_tile(Q8_0, 2112)  # 2112 = 16.5 steps
    assert not can_tile(2, 2048)  # Q4_0


@pytest.mark.parametrize("device", DEVICES)
def test_tiled_rows_of_partial_steps_are_rejected(device: str) -> None:
    w = torch.zeros(2, 96 // 32 * 34, dtype=torch.uint8, device=device)
    x, y = torch.zeros(1, 96, device=device), torch.zeros(1, 2, device=device)
    with pytest.raises(RuntimeError, match="Q8_0_TILED block size 128"):
        K.matmul(Q8_0_TILED, w, x, None, y, 1, 2, 96)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_tiled_weights_must_be_16_byte_aligned_on_cuda() -> None:
    buf = torch.zeros(2 * 136 + 16, dtype=torch.uint8, device="cuda")
    x, y = torch.zeros(1, 128, device="cuda"), torch.zeros(1, 2, device="cuda")
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        K.matmul(Q8_0_TILED, buf[8 : 8 + 2 * 136], x, None, y, 1, 2, 128)
