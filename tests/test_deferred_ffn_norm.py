"""The shared expert's FFN norm deferred (results/NOTES.md lesson 186), kernel by kernel.

- ``matmul`` with ``next_norm_w`` (attn_output) writes y and the next norm's factors of that y: y_w, y_ss and
  y_w's int8 groups are rmsnorm_factors' (and the groups' layout) bit for bit, in its own launch (one token,
  rows a multiple of 8) and after it (other shapes), with y itself the plain product's bits;
- ``moe_gate_up`` with ``scale`` = rmsnorm_factors' inv multiplies xw and scales g and u by it: against
  float64, and a step of several tokens (CUDA: grouped GEMMs) gives the bits of the same tokens one at a time;
- ``router_experts_gate_up`` and ``router_experts_ffn`` with xw and xss are bitwise rmsnorm_router_topk, the
  shared moe_gate_up on xw scaled by inv and the routed moe_gate_up on h (then the down), in the one launch
  and in its fallbacks, with and without xw's groups;
- the arguments go together or are refused.
"""

from __future__ import annotations

import kernel_reference as ref
import numpy as np
import pytest
import torch
from conftest import device_params
from test_fused_kernels import ROUTER_GATE_UP_SHAPES, poisoned, randn, takes_fused_router_launch

from tornado_moe import kernels as K
from tornado_moe.quant.tiled import Q8_0_TILED, tile_q8_0

DEVICES = device_params()
EPS = 1e-6


def factors(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rmsnorm_factors' xw, xss and inv of the rows of x."""
    n, dim = x.shape
    xw, xss, inv = poisoned((n, dim), x.device.type), poisoned((n, K.norm_groups(dim)), x.device.type), \
        poisoned((n,), x.device.type)
    K.rmsnorm_factors(x, w, xw, xss, inv, n, dim, EPS)
    return xw, xss, inv


def weights(rng: np.random.Generator, shape: tuple[int, ...], layout: str, device: str) -> torch.Tensor:
    raw = ref.make_weights(rng, shape, 1 if layout == "f16" else 8, 0.1)[0].to(device)
    return tile_q8_0(raw, shape[-1]) if layout == "tiled" else raw


QTYPE = {"gguf": 8, "tiled": Q8_0_TILED, "f16": 1}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["gguf", "tiled"])
@pytest.mark.parametrize("with_groups", [True, False], ids=["x-groups", "x-floats"])
# (rows, tokens): 2048 and 40 rows of one token take the product's own launch on a GPU, 36 (not a multiple of
# 8) and three tokens the second launch
@pytest.mark.parametrize("rows,n_tokens", [(2048, 1), (40, 1), (36, 1), (40, 3)])
def test_matmul_writes_the_next_norms_factors(device: str, layout: str, with_groups: bool, rows: int,
                                              n_tokens: int) -> None:
    rng = np.random.default_rng(7)
    cols = 256
    w = weights(rng, (rows, cols), layout, device)
    x, y0 = randn(rng, (n_tokens, cols), device), randn(rng, (n_tokens, rows), device, 2.0)
    x_groups = ref.act_groups(x).to(device) if with_groups and layout == "tiled" else None
    next_w = randn(rng, (rows,), device)
    want_y = y0.clone()
    K.matmul(QTYPE[layout], w, x, None, want_y, n_tokens, rows, cols, True, x_groups=x_groups)
    want_xw, want_xss, _ = factors(want_y, next_w)
    y = y0.clone()
    y_w, y_ss = poisoned((n_tokens, rows), device), poisoned((n_tokens, K.norm_groups(rows)), device)
    y_w_groups = torch.zeros(n_tokens, K.act_groups_bytes(rows), dtype=torch.uint8, device=device)
    K.matmul(QTYPE[layout], w, x, None, y, n_tokens, rows, cols, True, x_groups=x_groups, next_norm_w=next_w,
             y_w=y_w, y_ss=y_ss, y_w_groups=y_w_groups)
    assert not torch.isnan(want_y).any() and not torch.equal(want_y, y0)
    assert torch.equal(y, want_y)
    assert torch.equal(y_w, want_xw) and torch.equal(y_ss, want_xss)
    assert torch.equal(y_w_groups.cpu(), ref.act_groups(want_xw))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["gguf", "tiled", "f16"])
@pytest.mark.parametrize("n_tokens,hidden", [(1, 2048), (5, 256), (3, 288)])  # 288: the sums' scalar reader
def test_moe_gate_up_with_scale_is_the_deferred_norm(device: str, layout: str, n_tokens: int,
                                                    hidden: int) -> None:
    """act = silu(W_g xw * inv) * (W_u xw * inv) against float64 (xw as the weights' format rounds it); the
    step of several tokens gives the bits of its tokens one at a time, on the floats or on xw's groups."""
    if layout == "tiled" and hidden % 128:
        pytest.skip("tiled rows are whole 128-value steps")
    rng = np.random.default_rng(11)
    ffn = 24
    qt = 1 if layout == "f16" else 8  # the rows' GGUF type (tiled rows are Q8_0's, re-laid out)
    (graw, g64), (uraw, u64) = (ref.make_weights(rng, (ffn, hidden), qt, 0.1) for _ in range(2))
    gw, uw = (tile_q8_0(r.to(device), hidden) if layout == "tiled" else r.to(device) for r in (graw, uraw))
    x, norm_w = randn(rng, (n_tokens, hidden), device, 3.0), randn(rng, (hidden,), device)
    xw, _, inv = factors(x, norm_w)
    act = poisoned((n_tokens, ffn), device)
    K.moe_gate_up(QTYPE[layout], gw, uw, xw, None, act, n_tokens, 1, 0, 1, 1, ffn, hidden, scale=inv)
    assert not torch.isnan(act).any()
    # float64: the dequantized rows times xw as the kernels round it, scaled by inv
    xw64 = ref.dot_input(xw, qt)
    inv64 = inv.double().cpu()[:, None]
    want = ref._silu((xw64 @ g64.T) * inv64) * ((xw64 @ u64.T) * inv64)
    assert ref.rel_err(act, want) < 2e-5
    one_by_one = poisoned((n_tokens, ffn), device)
    for t in range(n_tokens):
        K.moe_gate_up(QTYPE[layout], gw, uw, xw[t:t + 1], None, one_by_one[t:t + 1], 1, 1, 0, 1, 1, ffn,
                      hidden, scale=inv[t:t + 1])
    assert torch.equal(act, one_by_one)


def gate_up_outputs(shape: tuple, device: str) -> list[torch.Tensor]:
    """h, ids, weights, act_sh and act of a router + gate-up call, poisoned."""
    n_tokens, _, top_k, ffn_sh, ffn, hidden = shape
    return [poisoned((n_tokens, hidden), device),
            torch.full((n_tokens, top_k), -1, dtype=torch.int32, device=device),
            poisoned((n_tokens, top_k), device), poisoned((n_tokens, ffn_sh), device),
            poisoned((n_tokens, top_k, ffn), device)]


def shared_then_routed(device: str, layout: str, shape: tuple, normalize: bool) -> tuple[dict, list]:
    """The inputs of a router_experts_gate_up call with xw and xss, and its outputs made by the calls it
    stands for: rmsnorm_router_topk, the shared moe_gate_up on xw scaled by rmsnorm_factors' inv (which the
    kernel computes from xss), the routed moe_gate_up on h."""
    n_tokens, n_experts, top_k, ffn_sh, ffn, hidden = shape
    rng = np.random.default_rng(23)
    i = {name: weights(rng, rows, layout, device) for name, rows in
         (("gs", (ffn_sh, hidden)), ("us", (ffn_sh, hidden)), ("g", (n_experts, ffn, hidden)),
          ("u", (n_experts, ffn, hidden)))}
    i["x"], i["norm_w"] = randn(rng, (n_tokens, hidden), device, 3.0), randn(rng, (hidden,), device)
    i["w_router"] = randn(rng, (n_experts, hidden), device, 0.05)
    i["gate_inp"] = randn(rng, (hidden,), device, 0.05) if normalize else None
    i["xw"], i["xss"], inv = factors(i["x"], i["norm_w"])
    out = h, ids, wt, sh, act = gate_up_outputs(shape, device)
    qt = QTYPE[layout]
    K.rmsnorm_router_topk(i["x"], i["norm_w"], EPS, h, i["w_router"], ids, wt, n_tokens, n_experts, hidden,
                          top_k, normalize)
    K.moe_gate_up(qt, i["gs"], i["us"], i["xw"], None, sh, n_tokens, 1, 0, 1, 1, ffn_sh, hidden, scale=inv)
    K.moe_gate_up(qt, i["g"], i["u"], h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden)
    assert not any(torch.isnan(t).any() for t in (h, wt, sh, act)) and (ids >= 0).all()
    return i, out


def router_gate_up(i: dict, layout: str, shape: tuple, normalize: bool, scratch: torch.Tensor,
                   out: list[torch.Tensor], gate: torch.Tensor | None = None, **deferred: torch.Tensor | None
                   ) -> None:
    n_tokens, n_experts, top_k, ffn_sh, ffn, hidden = shape
    h, ids, wt, sh, act = out
    K.router_experts_gate_up(i["x"], i["norm_w"], EPS, h, i["w_router"], ids, wt, QTYPE[layout], i["gs"],
                             i["us"], sh, ffn_sh, i["gate_inp"], gate, i["g"], i["u"], act, n_tokens,
                             n_experts, hidden, top_k, normalize, ffn, scratch, **deferred)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["gguf", "tiled", "f16"])
@pytest.mark.parametrize("with_groups", [True, False], ids=["xw-groups", "xw-floats"])
@pytest.mark.parametrize("shape", ROUTER_GATE_UP_SHAPES)
def test_router_experts_gate_up_with_xw_is_router_then_the_two_gate_ups(
        device: str, layout: str, with_groups: bool, shape: tuple) -> None:
    """Three calls back to back on one scratch (the sync words continue); on a GPU the one launch (one token,
    tiled rows with xw's groups, or other formats) or its fallback launches, the same bits either way."""
    if with_groups and layout != "tiled":
        pytest.skip("xw's groups are read by tiled rows")
    if layout == "f16":  # rows of an odd length
        shape = (*shape[:5], shape[5] + 1)
    n_tokens, n_experts, top_k, _, _, hidden = shape
    normalize = n_tokens % 2 == 1  # with the shared expert's gate row
    i, want = shared_then_routed(device, layout, shape, normalize)
    xw_groups = ref.act_groups(i["xw"]).to(device) if with_groups else None
    scratch = torch.zeros(K.router_gate_up_scratch_words(n_tokens, n_experts, hidden), dtype=torch.int32,
                          device=device)
    # the one launch moves the epoch where it takes the deferred form (tiled rows need xw's groups)
    one = takes_fused_router_launch(device, n_tokens, n_experts, top_k) and (layout != "tiled" or with_groups)
    for call in range(3):
        got = gate_up_outputs(shape, device)
        gate = poisoned((n_tokens,), device) if normalize else None
        router_gate_up(i, layout, shape, normalize, scratch, got, gate, xw=i["xw"], xss=i["xss"],
                       xw_groups=xw_groups)
        for name, a, b in zip(("h", "ids", "weights", "act_sh", "act"), got, want, strict=True):
            assert torch.equal(a, b), (call, name)
        assert scratch[:2].tolist() == [0, (call + 1) * one], call


@pytest.mark.parametrize("device", DEVICES)
def test_router_experts_ffn_with_xw_is_gate_up_then_down(device: str) -> None:
    """The deferred form is the two launches on a GPU even where the persistent launch is chosen (it takes
    h alone): router_experts_ffn_launches says 2, and the outputs are router_experts_gate_up's then the
    down's."""
    shape = (1, 8, 4, 512, 128, 256)
    n_tokens, n_experts, top_k, ffn_sh, ffn, hidden = shape
    i, _ = shared_then_routed(device, "tiled", shape, False)
    rng = np.random.default_rng(5)
    wd_sh = weights(rng, (hidden, ffn_sh), "tiled", device)
    wd = weights(rng, (n_experts, hidden, ffn), "tiled", device)
    deferred = dict(xw=i["xw"], xss=i["xss"], xw_groups=ref.act_groups(i["xw"]).to(device))
    words = K.router_experts_ffn_scratch_words(n_tokens, n_experts, hidden)
    x = i["x"].clone()
    want = h, ids, wt, sh, act = gate_up_outputs(shape, device)
    router_gate_up({**i, "x": x}, "tiled", shape, False, torch.zeros(words, dtype=torch.int32, device=device),
                   want, **deferred)
    K.experts_down_accumulate(Q8_0_TILED, wd_sh, sh, None, None, ffn_sh, wd, act, ids, wt, h, x, None, None,
                              None, n_tokens, top_k, n_experts, hidden, ffn)
    got = h, ids, wt, sh, act = gate_up_outputs(shape, device)
    x_got = i["x"].clone()
    try:
        K.set_ffn_one_launch(True)
        K.router_experts_ffn(x_got, i["norm_w"], EPS, h, i["w_router"], ids, wt, Q8_0_TILED, i["gs"], i["us"],
                             wd_sh, sh, ffn_sh, None, None, i["g"], i["u"], wd, act, n_tokens, n_experts,
                             hidden, top_k, False, ffn, torch.zeros(words, dtype=torch.int32, device=device),
                             **deferred)
        launches = K.router_experts_ffn_launches(device, Q8_0_TILED, n_tokens, n_experts, top_k, hidden,
                                                 ffn_sh, ffn, deferred_norm=True)
    finally:
        K.set_ffn_one_launch(None)
    assert launches == (1 if device == "cpu" else 2)
    assert not torch.equal(x, i["x"]) and torch.equal(x_got, x)
    for name, a, b in zip(("h", "ids", "weights", "act_sh", "act"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_norm_arguments_go_together(device: str) -> None:
    shape = (1, 8, 2, 16, 8, 256)
    hidden = shape[5]
    i, _ = shared_then_routed(device, "gguf", shape, False)
    scratch = torch.zeros(K.router_gate_up_scratch_words(1, 8, hidden), dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="give 'xw' and 'xss' together"):
        router_gate_up(i, "gguf", shape, False, scratch, gate_up_outputs(shape, device), xw=i["xw"])
    w = weights(np.random.default_rng(3), (40, hidden), "gguf", device)
    y, y_w = poisoned((1, 40), device), poisoned((1, 40), device)
    with pytest.raises(RuntimeError, match="give 'next_norm_w', 'y_w' and 'y_ss' together"):
        K.matmul(8, w, i["x"], None, y, 1, 40, hidden, y_w=y_w)
