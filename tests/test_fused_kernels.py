"""The fused kernels are bitwise the unfused sequences they replace, and the dot product keeps its promises on
the shapes the small kernel tests do not reach.

- ``qkv_rope`` == rmsnorm_factors, three matmuls (scaled by inv, with bias) and rope_kv_append, bit for bit,
  on every device, with xw given or computed in the kernel, also when the kernel before it moves the position
  it reads;
- ``rmsnorm_router_topk`` == rmsnorm then router_topk, bit for bit (h, ids and weights);
- ``experts_gate_up`` == the shared expert's moe_gate_up then the routed one's, bit for bit (also tiled);
- a gate-up of several tokens (CUDA: grouped GEMMs, a block per expert) == the same tokens one at a time, bit
  for bit, in every format;
- ``router_experts_gate_up`` == rmsnorm_router_topk then experts_gate_up, bit for bit, and leaves its scratch
  zero; the shared-expert gate it writes is the float64 sigmoid's, and the down that reads it gives the bits
  of the down that computes it;
- ``experts_down_accumulate`` == the shared expert's moe_down_accumulate then the routed one's, bit for bit;
- ``router_experts_ffn`` == router_experts_gate_up then experts_down_accumulate, bit for bit (on an sm_90 GPU
  one persistent launch), and the two share a scratch;
- rows of thousands of values, odd block counts and rows that are only 2-byte aligned: against the float64
  reference, and the same bits whatever the alignment of the weights in memory.
"""

from __future__ import annotations

import kernel_reference as ref
import numpy as np
import pytest
import torch
from conftest import device_params, same_bits, write_late

from tornado_moe import kernels as K

DEVICES = device_params()
QTYPE_PARAMS = [pytest.param(q, id=name) for name, q in ref.QTYPES.items()]
TOL_LONG = 2e-5  # float32 dot products of ~4000 terms against float64
NAN = float("nan")


def randn(rng: np.random.Generator, shape: tuple[int, ...], device: str, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).to(device)


def poisoned(shape: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.full(shape, NAN, dtype=torch.float32, device=device)


def shifted(raw: torch.Tensor, offset: int, device: str) -> torch.Tensor:
    """The same bytes at `offset` bytes past a fresh allocation's (aligned) start."""
    buf = torch.zeros(raw.numel() + 64, dtype=torch.uint8, device=device)
    view = buf[offset : offset + raw.numel()]
    view.copy_(raw.reshape(-1).to(device))
    assert view.data_ptr() % 16 == offset % 16
    return view


# ---- fused attention input ------------------------------------------------------------------------

QKV_SHAPES = [  # n_tokens, hidden, n_heads, n_kv_heads, head_dim, pos0
    (1, 128, 4, 4, 32, 0),
    (3, 96, 4, 2, 16, 5),  # GQA, three blocks per row (a partial pair), prefill at an offset
    (1, 2112, 2, 1, 64, 9),  # two chunks per row
    (2, 2048, 4, 2, 64, 3),  # 512 partial sums: the 16-byte reads of the given sums (grouped_inv_vector_ok)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPE_PARAMS)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
@pytest.mark.parametrize("shape", QKV_SHAPES)
def test_qkv_rope_is_the_unfused_sequence_bitwise(device: str, qtype: int, neox: bool, shape: tuple) -> None:
    n_tokens, hidden, n_heads, n_kv, hd, pos0 = shape
    max_ctx, eps, base = pos0 + n_tokens + 2, 1e-6, 10000.0
    rng = np.random.default_rng(11)
    x, norm_w = randn(rng, (n_tokens, hidden), device, 2.0), randn(rng, (hidden,), device)
    wq, _ = ref.make_weights(rng, (n_heads * hd, hidden), qtype, 0.2)
    wk, _ = ref.make_weights(rng, (n_kv * hd, hidden), qtype, 0.2)
    wv, _ = ref.make_weights(rng, (n_kv * hd, hidden), qtype, 0.2)
    wq, wk, wv = wq.to(device), wk.to(device), wv.to(device)
    bq, bk, bv = (randn(rng, (n * hd,), device) for n in (n_heads, n_kv, n_kv))
    pos = torch.tensor([pos0], dtype=torch.int32, device=device)

    # unfused: (xw, xss, inv) = rmsnorm_factors(x); q, k, v = (W xw) * inv + b; rope + append
    xw, inv = poisoned((n_tokens, hidden), device), poisoned((n_tokens,), device)
    xss = poisoned((n_tokens, K.norm_groups(hidden)), device)
    K.rmsnorm_factors(x, norm_w, xw, xss, inv, n_tokens, hidden, eps)
    q_ref = poisoned((n_tokens, n_heads * hd), device)
    k, v = poisoned((n_tokens, n_kv * hd), device), poisoned((n_tokens, n_kv * hd), device)
    for w, b, out, rows in ((wq, bq, q_ref, n_heads * hd), (wk, bk, k, n_kv * hd), (wv, bv, v, n_kv * hd)):
        K.matmul(qtype, w, xw, b, out, n_tokens, rows, hidden, scale=inv)
    kc_ref, vc_ref = poisoned((max_ctx, n_kv * hd), device), poisoned((max_ctx, n_kv * hd), device)
    K.rope_kv_append(q_ref, k, v, kc_ref, vc_ref, pos, n_tokens, n_heads, n_kv, hd, max_ctx, base, neox)

    for given in ((None, None), (xw, xss)):  # computed in the kernel, or as the kernel before it wrote them
        q = poisoned((n_tokens, n_heads * hd), device)
        kc, vc = poisoned((max_ctx, n_kv * hd), device), poisoned((max_ctx, n_kv * hd), device)
        K.qkv_rope(qtype, x, *given, norm_w, eps, wq, wk, wv, bq, bk, bv, q, kc, vc, pos, n_tokens, hidden,
                   n_heads, n_kv, hd, max_ctx, base, neox)
        rows = slice(pos0, pos0 + n_tokens)
        assert not torch.isnan(q).any()
        assert not torch.isnan(kc[rows]).any() and not torch.isnan(vc[rows]).any()
        assert torch.equal(q, q_ref)
        assert torch.equal(kc[rows], kc_ref[rows]) and torch.equal(vc[rows], vc_ref[rows])
        # no other cache row is touched
        assert torch.isnan(kc[:pos0]).all() and torch.isnan(vc[pos0 + n_tokens :]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [37, 64, 2048, 2112, 4100])
def test_rmsnorm_factors_grouped_sum_bitwise(device: str, dim: int) -> None:
    """xw = x * w, the partial sums xss and inv are the grouped sum's (tornado_moe.h) bit for bit, on every
    device (37, 4100: a short last group; 4100: more groups than a lane's 32 strides), with and without xss;
    (x * inv) * w is rmsnorm's y within float32 rounding, and the deferred product (W xw) * inv the normalised
    product within float32 rounding of float64's."""
    rng = np.random.default_rng(21)
    n_tokens, eps = 3, 1e-6
    x, w = randn(rng, (n_tokens, dim), device, 3.0), randn(rng, (dim,), device)
    xss_ref, ss_ref = ref.grouped_sum_sq(x)
    inv_ref = ref.grouped_inv(ss_ref, dim, eps)
    xw, inv = poisoned((n_tokens, dim), device), poisoned((n_tokens,), device)
    xss = poisoned((n_tokens, K.norm_groups(dim)), device)
    K.rmsnorm_factors(x, w, xw, xss, inv, n_tokens, dim, eps)
    assert torch.equal(xw, x * w)
    assert torch.equal(xss.cpu(), xss_ref) and torch.equal(inv.cpu(), inv_ref)
    alone = poisoned((n_tokens,), device)
    K.rmsnorm_factors(x, w, poisoned((n_tokens, dim), device), None, alone, n_tokens, dim, eps)
    assert torch.equal(alone, inv)
    y = poisoned((n_tokens, dim), device)
    K.rmsnorm(x, w, y, n_tokens, dim, eps)
    assert ref.rel_err((x * inv[:, None]) * w, y) < 1e-6
    if dim % 32:
        return  # no Q8_0 rows of that length
    raw, w64 = ref.make_weights(rng, (40, dim), ref.QTYPES["Q8_0"])
    out = poisoned((n_tokens, 40), device)
    K.matmul(ref.QTYPES["Q8_0"], raw.to(device), xw, None, out, n_tokens, 40, dim, scale=inv)
    inv64 = 1.0 / torch.sqrt((x.double().cpu() ** 2).mean(dim=-1, keepdim=True) + eps)
    expected = (ref.dot_input(xw, ref.QTYPES["Q8_0"]) @ w64.T) * inv64  # Q8_0 takes xw's int8 groups
    assert ref.rel_err(out.cpu(), expected) < TOL_LONG


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["gguf", "tiled"])
# (rows, tokens, dim): 2176 has no whole 16-byte chunk of sums a lane (the scalar sum); 17,000 rows give a
# GPU's decode call two rows a warp, the output head's shape
@pytest.mark.parametrize("rows,n_tokens,dim", [(40, 3, 2176), (40, 3, 2048), (17_000, 1, 2048)])
def test_matmul_scale_from_sums_is_the_scale_of_the_factors(device: str, layout: str, rows: int,
                                                             n_tokens: int, dim: int) -> None:
    """The output head's deferred norm: matmul(xw, x_sums=xss, eps) gives the bits of matmul(xw, scale=inv),
    inv being rmsnorm_factors' from the same x, with xw's int8 groups or without; and scale with x_sums is
    refused."""
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    rng = np.random.default_rng(23)
    eps = 1e-6
    x, norm_w = randn(rng, (n_tokens, dim), device, 3.0), randn(rng, (dim,), device)
    xw, inv = poisoned((n_tokens, dim), device), poisoned((n_tokens,), device)
    xss = poisoned((n_tokens, K.norm_groups(dim)), device)
    K.rmsnorm_factors(x, norm_w, xw, xss, inv, n_tokens, dim, eps)
    w = ref.make_weights(rng, (rows, dim), ref.QTYPES["Q8_0"], 0.1)[0].to(device)
    qtype = ref.QTYPES["Q8_0"]
    groups = None
    if layout == "tiled":
        w, qtype = tile_q8_0(w, dim), Q8_0_TILED
        groups = ref.act_groups(xw).to(device)
    y_scale, y_sums = poisoned((n_tokens, rows), device), poisoned((n_tokens, rows), device)
    K.matmul(qtype, w, xw, None, y_scale, n_tokens, rows, dim, scale=inv, x_groups=groups)
    K.matmul(qtype, w, xw, None, y_sums, n_tokens, rows, dim, x_groups=groups, x_sums=xss, eps=eps)
    assert not torch.isnan(y_scale).any()
    assert torch.equal(y_sums, y_scale)
    with pytest.raises(RuntimeError, match="give 'scale' or 'x_sums', not both"):
        K.matmul(qtype, w, xw, None, y_sums, n_tokens, rows, dim, scale=inv, x_sums=xss, eps=eps)


@pytest.mark.parametrize("device", DEVICES)
def test_qkv_rope_reads_a_position_its_predecessor_writes(device: str) -> None:
    """qkv_rope computes its rotation factors before pdl_wait from the position it finds then (a guess) and
    must compute them again when the kernel before it moves the position. Here that kernel is an argmax over a
    long row that writes the position at its end and triggers its dependents at its start, so that on the GPU
    qkv_rope's blocks can start, and read the old position 0, while it runs; the result must still be the
    unfused sequence's at position 5."""
    n_tokens, hidden, n_heads, n_kv, hd, new_pos = 1, 256, 4, 2, 64, 5
    qtype, max_ctx, eps, base = ref.QTYPES["Q8_0"], 8, 1e-6, 10000.0
    rng = np.random.default_rng(12)
    x, norm_w = randn(rng, (n_tokens, hidden), device, 2.0), randn(rng, (hidden,), device)
    ws = [ref.make_weights(rng, (n * hd, hidden), qtype, 0.2)[0].to(device) for n in (n_heads, n_kv, n_kv)]
    bs = [randn(rng, (n * hd,), device) for n in (n_heads, n_kv, n_kv)]

    def run(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = poisoned((n_tokens, n_heads * hd), device)
        kc, vc = poisoned((max_ctx, n_kv * hd), device), poisoned((max_ctx, n_kv * hd), device)
        K.qkv_rope(qtype, x, None, None, norm_w, eps, *ws, *bs, q, kc, vc, pos, n_tokens, hidden, n_heads,
                   n_kv, hd, max_ctx, base, True)
        return q, kc, vc

    expected = run(torch.tensor([new_pos], dtype=torch.int32, device=device))
    pos = torch.zeros(1, dtype=torch.int32, device=device)
    write_late(pos, new_pos)
    got = run(pos)
    assert int(pos.item()) == new_pos
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g.nan_to_num(7.0), e.nan_to_num(7.0))
    assert not torch.isnan(got[0]).any() and not torch.isnan(got[1][new_pos]).any()


def test_qkv_rope_without_bias_matches_float64() -> None:
    """A guard that does not lean on the unfused kernels: q against rmsnorm, W h and RoPE in float64."""
    rng = np.random.default_rng(12)
    n_tokens, hidden, n_heads, hd, pos0, eps, base = 2, 64, 2, 16, 3, 1e-6, 100.0
    x, norm_w = randn(rng, (n_tokens, hidden), "cpu"), randn(rng, (hidden,), "cpu")
    raw, w64 = ref.make_weights(rng, (n_heads * hd, hidden), ref.QTYPES["Q8_0"])
    q = poisoned((n_tokens, n_heads * hd), "cpu")
    kc, vc = torch.zeros(pos0 + n_tokens, n_heads * hd), torch.zeros(pos0 + n_tokens, n_heads * hd)
    pos = torch.tensor([pos0], dtype=torch.int32)
    K.qkv_rope(8, x, None, None, norm_w, eps, raw, raw, raw, None, None, None, q, kc, vc, pos, n_tokens,
               hidden, n_heads, n_heads, hd, pos0 + n_tokens, base, True)
    # the deferred norm: W (x * norm_w), the product's activations as Q8_0 takes them, then / rms(x)
    inv = 1.0 / torch.sqrt((x.double() ** 2).mean(dim=-1, keepdim=True) + eps)
    wh = (ref.dot_input(x * norm_w, ref.QTYPES["Q8_0"]) @ w64.T) * inv
    positions = torch.arange(pos0, pos0 + n_tokens)
    expected = ref.rope(wh.view(n_tokens, n_heads, hd), positions, base, True)
    assert ref.rel_err(q.view(n_tokens, n_heads, hd), expected) < 1e-5
    assert torch.equal(kc[pos0:], q)  # same weights for k: the same rotated rows


# ---- fused router ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("n_tokens,n_experts,hidden,top_k", [(1, 60, 2048, 4), (4, 17, 33, 3)])
def test_rmsnorm_router_topk_is_rmsnorm_then_router_bitwise(
    device: str, normalize: bool, n_tokens: int, n_experts: int, hidden: int, top_k: int
) -> None:
    rng = np.random.default_rng(13)
    x, norm_w = randn(rng, (n_tokens, hidden), device, 3.0), randn(rng, (hidden,), device)
    w_router = randn(rng, (n_experts, hidden), device, 0.05)
    h_ref = poisoned((n_tokens, hidden), device)
    ids_ref = torch.full((n_tokens, top_k), -1, dtype=torch.int32, device=device)
    wt_ref = poisoned((n_tokens, top_k), device)
    K.rmsnorm(x, norm_w, h_ref, n_tokens, hidden, 1e-6)
    K.router_topk(w_router, h_ref, ids_ref, wt_ref, n_tokens, n_experts, hidden, top_k, normalize)

    h = poisoned((n_tokens, hidden), device)
    ids = torch.full((n_tokens, top_k), -1, dtype=torch.int32, device=device)
    wt = poisoned((n_tokens, top_k), device)
    K.rmsnorm_router_topk(x, norm_w, 1e-6, h, w_router, ids, wt, n_tokens, n_experts, hidden, top_k,
                          normalize)
    assert torch.equal(h, h_ref) and torch.equal(ids, ids_ref) and torch.equal(wt, wt_ref)
    assert (ids >= 0).all() and not torch.isnan(wt).any()


# ---- shared + routed gate-up in one launch -----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["gguf", "tiled"])
@pytest.mark.parametrize("n_tokens,n_experts,top_k,ffn_sh,ffn,hidden", [(1, 6, 4, 40, 24, 256),
                                                                         (3, 5, 2, 17, 9, 512)])
def test_experts_gate_up_is_shared_then_routed_bitwise(
    device: str, layout: str, n_tokens: int, n_experts: int, top_k: int, ffn_sh: int, ffn: int, hidden: int
) -> None:
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    rng = np.random.default_rng(17)
    qtype = Q8_0_TILED if layout == "tiled" else 8

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        raw = ref.make_weights(rng, shape, 8, 0.1)[0].to(device)
        return tile_q8_0(raw, hidden) if layout == "tiled" else raw

    gs, us = weights((ffn_sh, hidden)), weights((ffn_sh, hidden))
    g, u = weights((n_experts, ffn, hidden)), weights((n_experts, ffn, hidden))
    h = randn(rng, (n_tokens, hidden), device)
    ids = torch.from_numpy(np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tokens)])).to(
        device=device, dtype=torch.int32)
    sh_ref, act_ref = poisoned((n_tokens, ffn_sh), device), poisoned((n_tokens, top_k, ffn), device)
    K.moe_gate_up(qtype, gs, us, h, None, sh_ref, n_tokens, 1, 0, 1, 1, ffn_sh, hidden)
    K.moe_gate_up(qtype, g, u, h, ids, act_ref, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden)
    sh, act = poisoned((n_tokens, ffn_sh), device), poisoned((n_tokens, top_k, ffn), device)
    K.experts_gate_up(qtype, gs, us, sh, ffn_sh, g, u, h, ids, act, n_tokens, top_k, n_experts, ffn, hidden)
    assert not torch.isnan(sh_ref).any() and not torch.isnan(act_ref).any()
    assert torch.equal(sh, sh_ref) and torch.equal(act, act_ref)


# every format at 13 tokens (grouped on CUDA); the pair-list limit, which no format changes, at 1,100 tokens
SEVERAL_TOKEN_GATE_UPS = [
    *(pytest.param(q, 13, id=f"{name}-grouped")
      for name, q in {**ref.QTYPES, **ref.K_QTYPES, "Q8_0_tiled": "tiled"}.items()),
    pytest.param(8, 1100, id="Q8_0-beyond_the_pair_list"),
    pytest.param("tiled", 1100, id="Q8_0_tiled-beyond_the_pair_list"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype,n_tokens", SEVERAL_TOKEN_GATE_UPS)
def test_gate_up_of_several_tokens_is_token_by_token_bitwise(device: str, qtype: int | str,
                                                            n_tokens: int) -> None:
    """A step of several tokens gives every (t, s) the bits of that token alone, for tm_moe_gate_up fused and
    per-slot and for tm_experts_gate_up. On CUDA 13 tokens take the grouped GEMMs (6 experts: groups of 4
    tokens, the remainder one by one; ids out of range give NaN rows from the extra column) and 1,100 tokens
    (4,400 pairs) the block per pair that one token takes."""
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    top_k, n_experts, ffn_sh, ffn, hidden = 4, 6, 20, 12, 256
    rng = np.random.default_rng(29)

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        raw = ref.make_weights(rng, shape, 8 if qtype == "tiled" else qtype, 0.1)[0].to(device)
        return tile_q8_0(raw, hidden) if qtype == "tiled" else raw

    q = Q8_0_TILED if qtype == "tiled" else qtype
    gs, us = weights((ffn_sh, hidden)), weights((ffn_sh, hidden))
    g, u = weights((n_experts, ffn, hidden)), weights((n_experts, ffn, hidden))
    h = randn(rng, (n_tokens, hidden), device)
    ids = torch.from_numpy(np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tokens)])).to(
        device=device, dtype=torch.int32)
    if device == "cuda":  # the CPU refuses such ids; CUDA writes NaN rows
        ids[2, 1], ids[5, 3] = -1, n_experts

    def one_token_at_a_time() -> tuple[torch.Tensor, torch.Tensor]:
        sh, act = poisoned((n_tokens, ffn_sh), device), poisoned((n_tokens, top_k, ffn), device)
        for t in range(n_tokens):
            K.moe_gate_up(q, gs, us, h[t:t + 1], None, sh[t:t + 1], 1, 1, 0, 1, 1, ffn_sh, hidden)
            K.moe_gate_up(q, g, u, h[t:t + 1], ids[t:t + 1], act[t:t + 1], 1, top_k, 0, top_k, n_experts, ffn,
                          hidden)
        return sh, act

    sh_want, act_want = one_token_at_a_time()
    assert not torch.isnan(sh_want).any() and bool(torch.isnan(act_want).any()) == (device == "cuda")
    act = poisoned((n_tokens, top_k, ffn), device)
    K.moe_gate_up(q, g, u, h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden)
    assert same_bits(act, act_want)
    per_slot = poisoned((n_tokens, top_k, ffn), device)
    for s in range(top_k):
        K.moe_gate_up(q, g, u, h, ids, per_slot, n_tokens, top_k, s, 1, n_experts, ffn, hidden)
    assert same_bits(per_slot, act_want)
    sh, act = poisoned((n_tokens, ffn_sh), device), poisoned((n_tokens, top_k, ffn), device)
    K.experts_gate_up(q, gs, us, sh, ffn_sh, g, u, h, ids, act, n_tokens, top_k, n_experts, ffn, hidden)
    assert same_bits(sh, sh_want) and same_bits(act, act_want)


# ---- router + shared + routed gate-up in one launch ----------------------------------------------------

ROUTER_GATE_UP_SHAPES = [  # n_tokens, n_experts, top_k, ffn_sh, ffn, hidden
    (1, 60, 4, 40, 24, 256),  # qwen2moe's 60 experts: 8 router blocks, the last half idle
    (3, 5, 2, 17, 9, 512),  # one router block per token; several tokens wait on their own flags
    (2, 64, 8, 16, 8, 384),  # 64 experts (both logits of every lane); tiled: the 8-byte code reader
    (1, 70, 4, 16, 8, 256),  # more experts than one warp ranks: the two-launch path
    (1025, 5, 4, 17, 9, 256),  # more pairs than the grouped gate-up lists: several tokens in the fused launch
    # 704 shared blocks: more than a 132-SM GPU holds at once (4 an SM), so that blocks start as others
    # retire, after the router's release
    (1, 8, 4, 5632, 64, 256),
]
GROUPED_MAX_PAIRS = 4096  # tornado_moe.h: a CUDA gate-up of more (token, slot) pairs takes a block per pair


def takes_fused_router_launch(device: str, n_tokens: int, n_experts: int, top_k: int) -> bool:
    """Whether router_experts_gate_up runs as one launch (and moves its scratch's epoch): CUDA, at most 64
    experts, and one token or more pairs than the grouped gate-up of a several-token step takes."""
    return device == "cuda" and n_experts <= 64 and (n_tokens == 1 or n_tokens * top_k > GROUPED_MAX_PAIRS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["gguf", "tiled", "f16"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("shape", ROUTER_GATE_UP_SHAPES)
def test_router_experts_gate_up_is_router_then_gate_up_bitwise(device: str, layout: str, normalize: bool,
                                                               shape: tuple) -> None:
    """h, ids, weights and both activations equal rmsnorm_router_topk's then experts_gate_up's; calls back to
    back on one scratch, with the token count changing between them (each continues from the sync words the
    last one left: an epoch and a ticket count back at 0; flags and logits tagged with the epoch). f16 rows of
    an odd length: the router's one-value-per-lane dot. The normalized runs also give the shared-expert gate
    row (one router row more: with 64 experts a ninth router block), whose outputs must match the float64
    sigmoid and be the same bits in every call."""
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    n_tokens, n_experts, top_k, ffn_sh, ffn, hidden = shape
    if layout == "f16":
        hidden += 1
    rng = np.random.default_rng(23)
    qtype = {"gguf": 8, "tiled": Q8_0_TILED, "f16": 1}[layout]

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        raw = ref.make_weights(rng, shape, 1 if layout == "f16" else 8, 0.1)[0].to(device)
        return tile_q8_0(raw, hidden) if layout == "tiled" else raw

    gs, us = weights((ffn_sh, hidden)), weights((ffn_sh, hidden))
    g, u = weights((n_experts, ffn, hidden)), weights((n_experts, ffn, hidden))
    x, norm_w = randn(rng, (n_tokens, hidden), device, 3.0), randn(rng, (hidden,), device)
    # router rows 4-byte but not 16-byte aligned in the normalized runs: the F32X4 dot without vector loads
    buf = torch.zeros(n_experts * hidden + 4, dtype=torch.float32, device=device)
    w_router = buf[int(normalize):int(normalize) + n_experts * hidden].view(n_experts, hidden)
    w_router.copy_(randn(rng, (n_experts, hidden), device, 0.05))

    gate_inp = randn(rng, (hidden,), device, 0.05) if normalize else None

    def outputs() -> list[torch.Tensor]:  # h, ids, weights, act_sh, act, poisoned
        ids = torch.full((n_tokens, top_k), -1, dtype=torch.int32, device=device)
        return [poisoned((n_tokens, hidden), device), ids, poisoned((n_tokens, top_k), device),
                poisoned((n_tokens, ffn_sh), device), poisoned((n_tokens, top_k, ffn), device)]

    h, ids, wt, sh, act = want = outputs()
    K.rmsnorm_router_topk(x, norm_w, 1e-6, h, w_router, ids, wt, n_tokens, n_experts, hidden, top_k,
                          normalize)
    K.experts_gate_up(qtype, gs, us, sh, ffn_sh, g, u, h, ids, act, n_tokens, top_k, n_experts, ffn, hidden)
    assert not any(torch.isnan(t).any() for t in (h, wt, sh, act)) and (ids >= 0).all()

    words = K.router_gate_up_scratch_words(n_tokens, n_experts, hidden)
    scratch = torch.zeros(words, dtype=torch.int32, device=device)
    calls = [n_tokens, 1, n_tokens] if n_tokens > 1 else [1, 1, 1]
    gates = []
    epoch = 0  # the fused launches so far (the two calls leave the scratch alone)
    for call, n in enumerate(calls):
        fused = takes_fused_router_launch(device, n, n_experts, top_k)
        epoch += fused
        h, ids, wt, sh, act = got = outputs()
        gate = poisoned((n_tokens,), device) if gate_inp is not None else None
        K.router_experts_gate_up(x, norm_w, 1e-6, h, w_router, ids, wt, qtype, gs, us, sh, ffn_sh, gate_inp,
                                 gate, g, u, act, n, n_experts, hidden, top_k, normalize, ffn, scratch)
        assert all(torch.equal(a[:n], b[:n]) for a, b in zip(got, want, strict=True)), call
        if gate is not None:
            z = want[0][:n].double().cpu() @ gate_inp.double().cpu()
            torch.testing.assert_close(gate[:n].double().cpu(), torch.sigmoid(z), rtol=0, atol=1e-6)
            gates.append(gate[:n])
            assert torch.equal(gate[:n], gates[0][:n]), call
        assert scratch[:2].tolist() == [0, epoch], call  # (ticket count, epoch)
        if fused:  # each token's h_ready flag (64 bits after the ids_ready group) carries this call's tag
            group = -(-n // 32) * 32
            assert (scratch[64 + 2 * group + 1:64 + 2 * group + 2 * n:2] == epoch).all(), call


@pytest.mark.parametrize("device", DEVICES)
def test_router_experts_gate_up_checks_its_scratch(device: str) -> None:
    n_tokens, n_experts, hidden = 1, 4, 32
    w = torch.zeros(n_experts * 4, 34, dtype=torch.uint8, device=device)
    x, h = torch.zeros(n_tokens, hidden, device=device), torch.zeros(n_tokens, hidden, device=device)
    ids, wt = torch.zeros(1, 2, dtype=torch.int32, device=device), torch.zeros(1, 2, device=device)
    act = torch.zeros(1, 2, 4, device=device)
    short = torch.zeros(K.router_gate_up_scratch_words(n_tokens, n_experts, hidden) - 1, dtype=torch.int32,
                        device=device)
    router = torch.zeros(n_experts, hidden, device=device)
    with pytest.raises(RuntimeError, match="scratch"):
        K.router_experts_gate_up(x, x[0], 1e-6, h, router, ids, wt, 8, w, w, act, 4, None, None, w, w, act,
                                 n_tokens, n_experts, hidden, 2, False, 4, short)
    # 2 flag groups and the tagged logits, past router_experts_ffn's words (2 * (128 + 4 * 1024)) and on a
    # 16-byte boundary, then each token's int8 groups of h (256 words per 512 values), then a float a token
    # (the deferred shared gate-up's inv)
    assert K.router_gate_up_scratch_words(33, 60, 2048) == 8448 + 33 * 4 * 256 + 33
    assert (K.router_gate_up_scratch_words(1000, 10, 600)
            == 64 + 4 * 1024 + 2 * 1000 * 10 + 1000 * 2 * 256 + 1000)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["gguf", "tiled"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("n_tokens,n_experts,top_k,ffn_sh,ffn,hidden", [(1, 6, 4, 512, 384, 36),
                                                                         (3, 9, 7, 256, 128, 17)])
def test_experts_down_is_shared_then_routed_bitwise(
    device: str, layout: str, gated: bool, n_tokens: int, n_experts: int, top_k: int, ffn_sh: int, ffn: int,
    hidden: int
) -> None:
    """Shared then routed slots into one x (7 slots: groups of 4, 2 and 1; an odd hidden size: a partial
    block of rows); on CUDA an expert id out of range gives NaN in both, tiled shared rows of a multiple of
    256 values are read from copies in shared memory, a cap too small for those copies takes the one-launch
    kernel's reader from global memory, and a smaller one the two-launch path. Each also writes the next
    norm's factors from the x it stores, xw and the partial sums xss, bit for bit rmsnorm_factors'."""
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    rng = np.random.default_rng(19)
    qtype = Q8_0_TILED if layout == "tiled" else 8

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        raw = ref.make_weights(rng, shape, 8, 0.1)[0].to(device)
        return tile_q8_0(raw, shape[-1]) if layout == "tiled" else raw

    wd_sh, wd = weights((hidden, ffn_sh)), weights((n_experts, hidden, ffn))
    act_sh, act = randn(rng, (n_tokens, ffn_sh), device), randn(rng, (n_tokens, top_k, ffn), device)
    gate = randn(rng, (hidden,), device, 0.1) if gated else None
    h = randn(rng, (n_tokens, hidden), device)
    ids = torch.from_numpy(np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tokens)])).to(
        device=device, dtype=torch.int32)
    bad = device == "cuda" and n_tokens > 1  # the CPU reports a bad id; the GPU cannot, it writes NaN
    if bad:
        ids[1, 2] = n_experts
    wts = torch.from_numpy(rng.random((n_tokens, top_k), dtype=np.float32)).to(device)
    x0, next_w = randn(rng, (n_tokens, hidden), device), randn(rng, (hidden,), device)
    want = x0.clone()
    K.moe_down_accumulate(qtype, wd_sh, act_sh, None, None, gate, h, want, n_tokens, 1, 0, 1, 1, hidden,
                          ffn_sh)
    K.moe_down_accumulate(qtype, wd, act, ids, wts, None, None, want, n_tokens, top_k, 0, top_k, n_experts,
                          hidden, ffn)
    for smem_cap in (0, 1024, 64):  # 1024 bytes: no room for 4 row copies; 64: nor for the slot terms
        if smem_cap and device != "cuda":
            continue
        K.set_launch_limits_for_testing(smem_cap, 0)
        try:
            got, xw = x0.clone(), poisoned((n_tokens, hidden), device)
            xss = poisoned((n_tokens, K.norm_groups(hidden)), device)
            K.experts_down_accumulate(qtype, wd_sh, act_sh, gate, None, ffn_sh, wd, act, ids, wts, h, got,
                                      next_w, xw, xss, n_tokens, top_k, n_experts, hidden, ffn)
        finally:
            K.set_launch_limits_for_testing(0, 0)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        xw_f = poisoned((n_tokens, hidden), device)
        xss_f = poisoned((n_tokens, K.norm_groups(hidden)), device)
        K.rmsnorm_factors(got, next_w, xw_f, xss_f, poisoned((n_tokens,), device), n_tokens, hidden, 1e-6)
        assert torch.equal(xw.nan_to_num(), xw_f.nan_to_num()) and torch.equal(xw_f.nan_to_num(),
                                                                               (got * next_w).nan_to_num())
        assert torch.equal(xss.isnan(), xss_f.isnan()) and torch.equal(xss.nan_to_num(), xss_f.nan_to_num())
        assert not torch.isnan(xss[0]).any()
    assert bool(torch.isnan(want).any()) == bad and not torch.isnan(want[0]).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_tokens,n_experts", [(1, 60), (3, 8), (1, 70)])  # 70: the router's own launches
def test_experts_down_with_the_routers_gate_is_the_gated_down_bitwise(device: str, n_tokens: int,
                                                                      n_experts: int) -> None:
    """The decode chain: router_experts_gate_up writes the shared-expert gate factors and
    experts_down_accumulate reads them (gate_sh) instead of computing sigmoid(gate_inp . h) in each block; x
    must be the bits of the down given gate_inp and h, on the one-launch and the separate-launch (router,
    gate, gate-up) paths. Tiled rows of a multiple of 256 values: the shared down's rows from shared memory,
    as in the model."""
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    top_k, ffn_sh, ffn, hidden = 4, 512, 128, 256
    rng = np.random.default_rng(31)

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        return tile_q8_0(ref.make_weights(rng, shape, 8, 0.1)[0].to(device), shape[-1])

    gs, us = weights((ffn_sh, hidden)), weights((ffn_sh, hidden))
    g, u = weights((n_experts, ffn, hidden)), weights((n_experts, ffn, hidden))
    wd_sh, wd = weights((hidden, ffn_sh)), weights((n_experts, hidden, ffn))
    x, norm_w = randn(rng, (n_tokens, hidden), device, 3.0), randn(rng, (hidden,), device)
    w_router, gate_inp = randn(rng, (n_experts, hidden), device, 0.05), randn(rng, (hidden,), device, 0.05)
    h, act_sh = poisoned((n_tokens, hidden), device), poisoned((n_tokens, ffn_sh), device)
    act, gate_sh = poisoned((n_tokens, top_k, ffn), device), poisoned((n_tokens,), device)
    ids = torch.zeros(n_tokens, top_k, dtype=torch.int32, device=device)
    wts = torch.zeros(n_tokens, top_k, device=device)
    words = K.router_gate_up_scratch_words(n_tokens, n_experts, hidden)
    scratch = torch.zeros(words, dtype=torch.int32, device=device)
    K.router_experts_gate_up(x, norm_w, 1e-6, h, w_router, ids, wts, Q8_0_TILED, gs, us, act_sh, ffn_sh,
                             gate_inp, gate_sh, g, u, act, n_tokens, n_experts, hidden, top_k, True, ffn,
                             scratch)
    assert not torch.isnan(gate_sh).any() and not torch.isnan(act).any()
    x0 = randn(rng, (n_tokens, hidden), device)
    computed, read = x0.clone(), x0.clone()
    K.experts_down_accumulate(Q8_0_TILED, wd_sh, act_sh, gate_inp, None, ffn_sh, wd, act, ids, wts, h,
                              computed, None, None, None, n_tokens, top_k, n_experts, hidden, ffn)
    K.experts_down_accumulate(Q8_0_TILED, wd_sh, act_sh, None, gate_sh, ffn_sh, wd, act, ids, wts, None,
                              read, None, None, None, n_tokens, top_k, n_experts, hidden, ffn)
    assert not torch.isnan(computed).any() and not torch.equal(computed, x0)
    assert torch.equal(read, computed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_tokens,n_experts", [(1, 60), (3, 8), (1, 70)])  # 70: the router's own launches
def test_int8_groups_pass_from_gate_up_to_down_to_qkv_as_the_rounded_floats(device: str, n_tokens: int,
                                                                            n_experts: int) -> None:
    """The decode chain's int8 activation groups: router_experts_gate_up writes act_sh's and act's groups
    instead of the floats, experts_down_accumulate reads only those (the floats' buffers poisoned) and writes
    xw's groups, qkv_rope reads those. Every group buffer must hold the bytes of kernel_reference.act_groups
    (model64's groups, laid out as tornado_moe.h says) of the floats the same call writes without groups, and
    every result must be the bits of the chain without groups (one launch, the grouped prefill path, the
    router's own launches; on CUDA also the down's two launches under a shared-memory cap). ffn = 1408 and
    ffn_sh = 640: short last blocks of the layout."""
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    top_k, ffn_sh, ffn, hidden, n_heads, hd = 4, 640, 1408, 256, 4, 32
    rng = np.random.default_rng(37)

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        return tile_q8_0(ref.make_weights(rng, shape, 8, 0.1)[0].to(device), shape[-1])

    def groups(*shape: int) -> torch.Tensor:  # zeroed, as the engine allocates them
        return torch.zeros(*shape[:-1], K.act_groups_bytes(shape[-1]), dtype=torch.uint8, device=device)

    gs, us = weights((ffn_sh, hidden)), weights((ffn_sh, hidden))
    g, u = weights((n_experts, ffn, hidden)), weights((n_experts, ffn, hidden))
    wd_sh, wd = weights((hidden, ffn_sh)), weights((n_experts, hidden, ffn))
    x, norm_w = randn(rng, (n_tokens, hidden), device, 3.0), randn(rng, (hidden,), device)
    next_w = randn(rng, (hidden,), device)
    w_router, gate_inp = randn(rng, (n_experts, hidden), device, 0.05), randn(rng, (hidden,), device, 0.05)
    scratch = torch.zeros(K.router_gate_up_scratch_words(n_tokens, n_experts, hidden), dtype=torch.int32,
                          device=device)

    def gate_up(*given: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        h, act_sh = poisoned((n_tokens, hidden), device), poisoned((n_tokens, ffn_sh), device)
        act, gate_sh = poisoned((n_tokens, top_k, ffn), device), poisoned((n_tokens,), device)
        ids = torch.zeros(n_tokens, top_k, dtype=torch.int32, device=device)
        wts = torch.zeros(n_tokens, top_k, device=device)
        K.router_experts_gate_up(x, norm_w, 1e-6, h, w_router, ids, wts, Q8_0_TILED, gs, us, act_sh, ffn_sh,
                                 gate_inp, gate_sh, g, u, act, n_tokens, n_experts, hidden, top_k, True, ffn,
                                 scratch, *given)
        return act_sh, act, h, gate_sh, ids, wts

    act_sh_q, act_q = groups(n_tokens, ffn_sh), groups(n_tokens, top_k, ffn)
    act_sh, act, *routed = gate_up(None, None)
    _, _, *routed_q = gate_up(act_sh_q, act_q)
    assert not torch.isnan(act_sh).any() and not torch.isnan(act).any()
    assert all(torch.equal(a, b) for a, b in zip(routed, routed_q, strict=True))
    assert torch.equal(act_sh_q.cpu(), ref.act_groups(act_sh))
    assert torch.equal(act_q.cpu(), ref.act_groups(act))
    gate_sh, ids, wts = routed[1:]

    x0 = randn(rng, (n_tokens, hidden), device)

    def down(floats: tuple[torch.Tensor, torch.Tensor], given: tuple[torch.Tensor | None, ...],
             smem_cap: int = 0) -> tuple[torch.Tensor, ...]:
        xo, xw = x0.clone(), poisoned((n_tokens, hidden), device)
        xss = poisoned((n_tokens, K.norm_groups(hidden)), device)
        K.set_launch_limits_for_testing(smem_cap, 0)
        try:
            K.experts_down_accumulate(Q8_0_TILED, wd_sh, floats[0], None, gate_sh, ffn_sh, wd, floats[1], ids,
                                      wts, None, xo, next_w, xw, xss, n_tokens, top_k, n_experts, hidden, ffn,
                                      *given)
        finally:
            K.set_launch_limits_for_testing(0, 0)
        return xo, xw, xss

    xo, xw, xss = down((act_sh, act), (None, None, None))
    assert not torch.isnan(xo).any() and not torch.equal(xo, x0)
    unread = (torch.full_like(act_sh, float("nan")), torch.full_like(act, float("nan")))
    xw_groups = groups(n_tokens, hidden)
    for smem_cap in (0, 64) if device == "cuda" else (0,):  # 64 bytes: the two launches
        xw_groups.zero_()
        got = down(unread, (act_sh_q, act_q, xw_groups), smem_cap)
        assert all(torch.equal(a, b) for a, b in zip(got, (xo, xw, xss), strict=True)), smem_cap
        assert torch.equal(xw_groups.cpu(), ref.act_groups(xw)), smem_cap

    wq, wk, wv = (weights((n * hd, hidden)) for n in (n_heads, n_heads, n_heads))
    pos, max_ctx = torch.tensor([2], dtype=torch.int32, device=device), 2 + n_tokens
    qkv = []
    for xw_given in (None, xw_groups):
        q = poisoned((n_tokens, n_heads * hd), device)
        kc, vc = poisoned((max_ctx, n_heads * hd), device), poisoned((max_ctx, n_heads * hd), device)
        K.qkv_rope(Q8_0_TILED, xo, xw, xss, next_w, 1e-6, wq, wk, wv, None, None, None, q, kc, vc, pos,
                   n_tokens, hidden, n_heads, n_heads, hd, max_ctx, 1e6, True, xw_given)
        qkv.append((q, kc[2:], vc[2:]))
    assert not torch.isnan(qkv[0][0]).any()
    assert all(torch.equal(a, b) for a, b in zip(*qkv, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_tokens,pos0", [(1, 5), (1, 300), (2, 140)])  # 300, 140: the merged partials
def test_attention_groups_feed_the_output_projection_bitwise(device: str, n_tokens: int, pos0: int) -> None:
    """attention's out_groups are kernel_reference.act_groups of the out it writes (whichever block writes
    it), and the output projection that reads them gives the bits of the one that rounds out itself."""
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    n_heads, n_kv, hd, hidden = 4, 2, 64, 256
    max_ctx = pos0 + n_tokens
    rng = np.random.default_rng(41)
    q = randn(rng, (n_tokens, n_heads * hd), device)
    kc, vc = randn(rng, (max_ctx, n_kv * hd), device), randn(rng, (max_ctx, n_kv * hd), device)
    pos = torch.tensor([pos0], dtype=torch.int32, device=device)
    scratch = torch.zeros(K.attention_scratch_words(n_tokens, n_heads, hd), dtype=torch.int32, device=device)
    out = poisoned((n_tokens, n_heads * hd), device)
    out_q = torch.zeros(n_tokens, K.act_groups_bytes(n_heads * hd), dtype=torch.uint8, device=device)
    K.attention(q, kc, vc, out, pos, n_tokens, n_heads, n_kv, hd, max_ctx, scratch, out_q)
    assert not torch.isnan(out).any()
    assert torch.equal(out_q.cpu(), ref.act_groups(out))
    wo = tile_q8_0(ref.make_weights(rng, (hidden, n_heads * hd), 8, 0.1)[0].to(device), n_heads * hd)
    x0 = randn(rng, (n_tokens, hidden), device)
    ys = [x0.clone(), x0.clone()]
    for y, groups in zip(ys, (None, out_q), strict=True):
        K.matmul(Q8_0_TILED, wo, out, None, y, n_tokens, hidden, n_heads * hd, True, None, groups)
    assert not torch.equal(ys[0], x0) and torch.equal(ys[1], ys[0])


@pytest.mark.parametrize("device", DEVICES)
def test_int8_groups_go_with_their_floats(device: str) -> None:
    """Group buffers are checked: given with the floats they belong to, both halves' or neither, 16-byte
    aligned, and to the down only with the tiled Q8_0 rows that multiply them."""
    n_tokens, n_experts, hidden, ffn = 1, 4, 32, 32
    w = torch.zeros(n_experts * ffn, 34, dtype=torch.uint8, device=device)
    x = torch.ones(n_tokens, hidden, device=device)
    act_sh, act = torch.zeros(n_tokens, ffn, device=device), torch.zeros(n_tokens, 2, ffn, device=device)
    ids = torch.zeros(n_tokens, 2, dtype=torch.int32, device=device)
    wt = torch.ones(n_tokens, 2, device=device)
    q = torch.zeros(n_tokens, 2, K.act_groups_bytes(ffn) + 16, dtype=torch.uint8, device=device)
    q_sh = torch.zeros(n_tokens, K.act_groups_bytes(ffn) + 16, dtype=torch.uint8, device=device)
    down = (8, w, act_sh, None, None, ffn, w, act, ids, wt, None, x, None, None, None, n_tokens, 2, n_experts,
            hidden, ffn)
    with pytest.raises(RuntimeError, match="together or neither"):
        K.experts_down_accumulate(*down, q_sh, None, None)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        K.experts_down_accumulate(*down, q_sh.view(-1)[8:], q, None)
    with pytest.raises(RuntimeError, match="'xw_groups' goes with 'xw'"):
        K.experts_down_accumulate(*down, None, None, q_sh)
    with pytest.raises(RuntimeError, match="need TM_Q8_0_TILED rows"):
        K.experts_down_accumulate(*down, q_sh, q, None)


@pytest.mark.parametrize("device", DEVICES)
def test_the_shared_gate_comes_from_one_place(device: str) -> None:
    """The router's gate row and its output go together; the down takes its gate from gate_inp_sh or from
    gate_sh, not both."""
    n_tokens, n_experts, hidden = 1, 4, 32
    w = torch.zeros(n_experts * 4, 34, dtype=torch.uint8, device=device)
    x, h = torch.zeros(n_tokens, hidden, device=device), torch.zeros(n_tokens, hidden, device=device)
    ids, wt = torch.zeros(1, 2, dtype=torch.int32, device=device), torch.zeros(1, 2, device=device)
    act, gate = torch.zeros(1, 2, 4, device=device), torch.zeros(1, device=device)
    words = K.router_gate_up_scratch_words(n_tokens, n_experts, hidden)
    scratch = torch.zeros(words, dtype=torch.int32, device=device)
    router, gate_inp = torch.zeros(n_experts, hidden, device=device), torch.zeros(hidden, device=device)
    with pytest.raises(RuntimeError, match="go together"):
        K.router_experts_gate_up(x, x[0], 1e-6, h, router, ids, wt, 8, w, w, act, 4, gate_inp, None, w, w,
                                 act, n_tokens, n_experts, hidden, 2, False, 4, scratch)
    with pytest.raises(RuntimeError, match="not both"):
        K.experts_down_accumulate(8, w, act, gate_inp, gate, 4, w, act, ids, wt, h, x, None, None, None,
                                  n_tokens, 2, n_experts, hidden, 4)


# ---- the whole FFN half in one launch ------------------------------------------------------------------

# n_tokens, n_experts, top_k, ffn_sh, ffn, hidden: one launch on an sm_90 GPU (tiled rows), but the last
FFN_SHAPES = [
    (1, 60, 4, 512, 128, 256),  # qwen2moe's router; more blocks than row pairs or shared tiles: idle blocks
    (1, 8, 4, 5632, 1408, 2048),  # Qwen1.5-MoE-A2.7B's expert shapes: several chunks of every kind a block
    (1, 8, 2, 768, 384, 512),  # routed down rows of an odd multiple of 128 values (8-byte code words)
    (1, 64, 1, 256, 256, 256),  # one slot, 64 experts
    (2, 8, 2, 256, 128, 256),  # two tokens: the two launches
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("shape", FFN_SHAPES)
def test_router_experts_ffn_is_gate_up_then_down_bitwise(device: str, gated: bool, shape: tuple) -> None:
    """Every output (x, h, ids, weights, act_sh, act and the shared gate) equals router_experts_gate_up's then
    experts_down_accumulate's, bit for bit, in three calls back to back on one scratch with a
    router_experts_gate_up call between them on the same scratch (they share its epoch word), in the default
    form (two launches) and with the persistent launch chosen (set_ffn_one_launch)."""
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    n_tokens, n_experts, top_k, ffn_sh, ffn, hidden = shape
    if device == "cpu" and hidden > 1024:
        pytest.skip("the CPU runs the two calls themselves; the large shape is for the GPU's schedule")
    rng = np.random.default_rng(41)

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        return tile_q8_0(ref.make_weights(rng, shape, 8, 0.1)[0].to(device), shape[-1])

    gs, us, wd_sh = weights((ffn_sh, hidden)), weights((ffn_sh, hidden)), weights((hidden, ffn_sh))
    g, u = weights((n_experts, ffn, hidden)), weights((n_experts, ffn, hidden))
    wd = weights((n_experts, hidden, ffn))
    x0, norm_w = randn(rng, (n_tokens, hidden), device, 3.0), randn(rng, (hidden,), device)
    w_router = randn(rng, (n_experts, hidden), device, 0.05)
    gate_inp = randn(rng, (hidden,), device, 0.05) if gated else None
    normalize = not gated

    def outputs() -> list[torch.Tensor | None]:  # x, h, ids, weights, act_sh, act, gate
        return [x0.clone(), poisoned((n_tokens, hidden), device),
                torch.full((n_tokens, top_k), -1, dtype=torch.int32, device=device),
                poisoned((n_tokens, top_k), device), poisoned((n_tokens, ffn_sh), device),
                poisoned((n_tokens, top_k, ffn), device), poisoned((n_tokens,), device) if gated else None]

    words = K.router_experts_ffn_scratch_words(n_tokens, n_experts, hidden)
    assert words >= K.router_gate_up_scratch_words(n_tokens, n_experts, hidden)

    def two_launches(scratch: torch.Tensor) -> list:
        x, h, ids, wt, sh, act, gate = out = outputs()
        K.router_experts_gate_up(x, norm_w, 1e-6, h, w_router, ids, wt, Q8_0_TILED, gs, us, sh, ffn_sh,
                                 gate_inp, gate, g, u, act, n_tokens, n_experts, hidden, top_k, normalize,
                                 ffn, scratch)
        K.experts_down_accumulate(Q8_0_TILED, wd_sh, sh, None, gate, ffn_sh, wd, act, ids, wt, h, x, None,
                                  None, None, n_tokens, top_k, n_experts, hidden, ffn)
        return out

    want = two_launches(torch.zeros(words, dtype=torch.int32, device=device))
    assert not any(torch.isnan(t).any() for t in want if t is not None and t.is_floating_point())
    assert not torch.equal(want[0], x0) and (want[2] >= 0).all()
    scratch = torch.zeros(words, dtype=torch.int32, device=device)
    def ffn_calls(one_launch: bool) -> None:
        for call in range(3):
            got = outputs()
            x, h, ids, wt, sh, act, gate = got
            K.router_experts_ffn(x, norm_w, 1e-6, h, w_router, ids, wt, Q8_0_TILED, gs, us, wd_sh, sh, ffn_sh,
                                 gate_inp, gate, g, u, wd, act, n_tokens, n_experts, hidden, top_k, normalize,
                                 ffn, scratch)
            names = ("x", "h", "ids", "weights", "act_sh", "act", "gate")
            for name, a, b in zip(names, got, want, strict=True):
                assert a is None or torch.equal(a, b), (one_launch, call, name)
            if call == 1:  # the other kernel on the same scratch in between
                shared = two_launches(scratch)
                assert all(a is None or torch.equal(a, b) for a, b in zip(shared, want, strict=True))
        one = (one_launch and n_tokens == 1 and device == "cuda"
               and torch.cuda.get_device_capability()[0] >= 9)
        assert K.router_experts_ffn_launches(device, Q8_0_TILED, n_tokens, n_experts, top_k, hidden, ffn_sh,
                                             ffn) == (1 if device == "cpu" or one else 2)

    try:  # chosen explicitly: TORNADO_MOE_FFN_ONE_LAUNCH=1 in the environment changes the default
        K.set_ffn_one_launch(False)
        ffn_calls(False)  # the two launches
        K.set_ffn_one_launch(True)
        ffn_calls(True)  # the persistent launch where it applies
    finally:
        K.set_ffn_one_launch(None)


@pytest.mark.parametrize("device", DEVICES)
def test_router_experts_ffn_checks_its_arguments(device: str) -> None:
    """A scratch one word short and a gate row without its output are errors; GGUF-layout rows are run as the
    two launches on a GPU."""
    n_tokens, n_experts, hidden, ffn = 1, 4, 256, 128
    w = torch.zeros(n_experts * hidden * 4, 34, dtype=torch.uint8, device=device)
    x, h = torch.zeros(n_tokens, hidden, device=device), torch.zeros(n_tokens, hidden, device=device)
    ids, wt = torch.zeros(1, 2, dtype=torch.int32, device=device), torch.zeros(1, 2, device=device)
    act = torch.zeros(1, 2, ffn, device=device)
    router, gate_inp = torch.zeros(n_experts, hidden, device=device), torch.zeros(hidden, device=device)
    words = K.router_experts_ffn_scratch_words(n_tokens, n_experts, hidden)
    short = torch.zeros(words - 1, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="scratch"):
        K.router_experts_ffn(x, x[0], 1e-6, h, router, ids, wt, 8, w, w, w, act, ffn, None, None, w, w, w,
                             act, n_tokens, n_experts, hidden, 2, False, ffn, short)
    scratch = torch.zeros(words, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="go together"):
        K.router_experts_ffn(x, x[0], 1e-6, h, router, ids, wt, 8, w, w, w, act, ffn, gate_inp, None, w, w, w,
                             act, n_tokens, n_experts, hidden, 2, False, ffn, scratch)
    assert K.router_experts_ffn_launches(device, 8, 1, n_experts, 2, hidden, ffn, ffn) == (
        1 if device == "cpu" else 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slot", [0, 3])
def test_experts_down_reads_expert_ids_its_predecessor_writes(device: str, slot: int) -> None:
    """experts_down_accumulate's blocks start under PDL while the kernel before it runs; whatever they do
    before pdl_wait (the shared rows' copies), the expert ids they use must be the ones that kernel writes.
    Here it is an argmax over a long row that writes one slot's id at its end and triggers its dependents at
    its start (see test_qkv_rope_reads_a_position_its_predecessor_writes). A guess of the ids taken before the
    wait (measured on the H200, results/NOTES.md v4p) fails this test unless it is checked after it."""
    from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

    n_experts, top_k, ffn_sh, ffn, hidden, new_id = 6, 4, 512, 384, 36, 5
    rng = np.random.default_rng(23)

    def weights(shape: tuple[int, ...]) -> torch.Tensor:
        return tile_q8_0(ref.make_weights(rng, shape, 8, 0.1)[0].to(device), shape[-1])

    wd_sh, wd = weights((hidden, ffn_sh)), weights((n_experts, hidden, ffn))
    act_sh, act = randn(rng, (1, ffn_sh), device), randn(rng, (1, top_k, ffn), device)
    gate, h = randn(rng, (hidden,), device, 0.1), randn(rng, (1, hidden), device)
    wts = torch.from_numpy(rng.random((1, top_k), dtype=np.float32)).to(device)
    x0 = randn(rng, (1, hidden), device)
    old_ids = torch.arange(top_k, dtype=torch.int32, device=device).reshape(1, top_k)
    new_ids = old_ids.clone()
    new_ids[0, slot] = new_id

    def down(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        K.experts_down_accumulate(Q8_0_TILED, wd_sh, act_sh, gate, None, ffn_sh, wd, act, ids, wts, h, x,
                                  None, None, None, 1, top_k, n_experts, hidden, ffn)
        return x

    expected, stale = down(new_ids, x0.clone()), down(old_ids, x0.clone())
    assert not torch.equal(expected, stale)  # the moved id changes the result
    ids, x = old_ids.clone(), x0.clone()  # nothing launched between the argmax and the down
    write_late(ids.view(-1)[slot : slot + 1], new_id)
    got = down(ids, x)
    assert torch.equal(ids, new_ids)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_experts_gate_up_needs_expert_ids(device: str) -> None:
    w = torch.zeros(4, 34, dtype=torch.uint8, device=device)
    h, act = torch.zeros(1, 32, device=device), torch.zeros(1, 4, device=device)
    with pytest.raises(RuntimeError, match="ids"):
        K.experts_gate_up(8, w, w, act, 4, w, w, h, None, act, 1, 1, 1, 4, 32)


# ---- long, odd and misaligned rows ------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPE_PARAMS)
@pytest.mark.parametrize("cols", [4160, 96], ids=["three-chunks", "odd-blocks"])
def test_matmul_long_rows_and_any_alignment(device: str, qtype: int, cols: int) -> None:
    rng = np.random.default_rng(14)
    rows, n_tokens = 37, 2
    raw, w64 = ref.make_weights(rng, (rows, cols), qtype)
    x = randn(rng, (n_tokens, cols), device)
    y = poisoned((n_tokens, rows), device)
    K.matmul(qtype, raw.to(device), x, None, y, n_tokens, rows, cols)
    assert not torch.isnan(y).any()
    assert ref.rel_err(y, ref.dot_input(x, qtype) @ w64.T) < TOL_LONG
    # the same bytes 2 (4 for F32) and 6 bytes off a 16-byte boundary: the same bits
    for offset in ((4, 12) if qtype == ref.QTYPES["F32"] else (2, 6)):
        y_off = poisoned((n_tokens, rows), device)
        K.matmul(qtype, shifted(raw, offset, device), x, None, y_off, n_tokens, rows, cols)
        assert torch.equal(y_off, y), f"offset {offset}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [pytest.param(8, id="Q8_0"), pytest.param(3, id="Q4_1")])
def test_moe_with_multi_chunk_rows(device: str, qtype: int) -> None:
    """Rows of 2 chunks (expert FFN for down, hidden for gate-up): fused == per slot, and vs float64."""
    rng = np.random.default_rng(15)
    n_tokens, top_k, n_experts, ffn, hidden = 2, 2, 3, 2112, 2080
    wg_raw, wg = ref.make_weights(rng, (n_experts, 8, hidden), qtype, 0.1)
    wu_raw, wu = ref.make_weights(rng, (n_experts, 8, hidden), qtype, 0.1)
    wd_raw, wd = ref.make_weights(rng, (n_experts, 24, ffn), qtype, 0.1)
    h = randn(rng, (n_tokens, hidden), device)
    ids = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32, device=device)
    weights = torch.rand(n_tokens, top_k, generator=torch.Generator().manual_seed(1)).to(device)
    act = poisoned((n_tokens, top_k, 8), device)
    K.moe_gate_up(qtype, wg_raw.to(device), wu_raw.to(device), h, ids, act, n_tokens, top_k, 0, top_k,
                  n_experts, 8, hidden)
    assert ref.rel_err(act, ref.moe_gate_up(wg, wu, h, ids, top_k, qtype)) < TOL_LONG
    # down over rows of 2112 values (the activations are made up: only the down product is under test here)
    act_d = randn(rng, (n_tokens, top_k, ffn), device)
    x0 = randn(rng, (n_tokens, 24), device)
    fused = x0.clone()
    K.moe_down_accumulate(qtype, wd_raw.to(device), act_d, ids, weights, None, None, fused, n_tokens, top_k,
                          0, top_k, n_experts, 24, ffn)
    expected = ref.moe_down_accumulate(wd, act_d, ids, weights, None, None, x0, range(top_k), qtype)
    assert ref.rel_err(fused, expected) < TOL_LONG
    per_slot = x0.clone()
    for s in range(top_k):
        K.moe_down_accumulate(qtype, wd_raw.to(device), act_d, ids, weights, None, None, per_slot, n_tokens,
                              top_k, s, 1, n_experts, 24, ffn)
    assert torch.equal(per_slot, fused)
