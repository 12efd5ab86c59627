"""CUDA launch limits: grid y/z <= 65535 and shared memory <= the device's opt-in limit, never hard-coded.

The CUDA launchers split big problems into chunks or loops. ``set_launch_limits_for_testing`` makes them plan
with tiny limits so that those paths run on small problems, where a result must be bitwise the one of the
default plan (reduction orders never depend on the launch configuration). Then real sizes: more than 65535
(token, slot) pairs in one gate-up call, and thousands of experts.

The CPU kernels have no grid or shared-memory limit (they loop over rows and tokens), so the limit-forcing and
>65535-pairs tests are CUDA-only; the thousands-of-experts case is cheap and runs on the CPU too.
"""

from __future__ import annotations

from collections.abc import Iterator

import kernel_reference as ref
import numpy as np
import pytest
import torch
from conftest import attention_scratch, device_params

from tornado_moe import kernels as K

TOL = 1e-5  # ||out - ref|| / ||ref||, float32 accumulation against float64 (see test_kernels.py)
Q8_0 = ref.QTYPES["Q8_0"]


def cuda_kernels_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA-only: the CPU kernels have no grid/shared-memory limits to force")
    if not K.cuda_compiled():
        pytest.skip("the kernel library was built without CUDA")


@pytest.fixture
def limits() -> Iterator[None]:
    """Skips without CUDA kernels; restores the device's own limits after the test, whatever happens."""
    cuda_kernels_or_skip()
    yield
    K.set_launch_limits_for_testing(0, 0)


def run_kernels(seed: int) -> dict[str, torch.Tensor]:
    """A MoE block's kernels plus attention at sizes whose default CUDA plans use several y/z blocks."""
    device = "cuda"
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    # router over many experts
    n_tokens, n_experts, hidden, top_k, ffn = 37, 256, 96, 8, 64
    w_router = torch.randn(n_experts, hidden, generator=gen).to(device) * 0.3
    h = torch.randn(n_tokens, hidden, generator=gen).to(device)
    ids = torch.full((n_tokens, top_k), -1, dtype=torch.int32, device=device)
    weights = torch.full((n_tokens, top_k), float("nan"), device=device)
    K.router_topk(w_router, h, ids, weights, n_tokens, n_experts, hidden, top_k, False)
    out["router_ids"], out["router_weights"] = ids, weights
    # routed experts, fused and per slot
    wg = ref.make_weights(rng, (n_experts, ffn, hidden), Q8_0, 0.2)[0].to(device)
    wu = ref.make_weights(rng, (n_experts, ffn, hidden), Q8_0, 0.2)[0].to(device)
    wd = ref.make_weights(rng, (n_experts, hidden, ffn), Q8_0, 0.2)[0].to(device)
    act = torch.full((n_tokens, top_k, ffn), float("nan"), device=device)
    K.moe_gate_up(Q8_0, wg, wu, h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden)
    out["act"] = act
    gate_inp = torch.randn(hidden, generator=gen).to(device) * 0.1
    x = torch.randn(n_tokens, hidden, generator=gen).to(device)
    K.moe_down_accumulate(
        Q8_0, wd, act, ids, weights, gate_inp, h, x, n_tokens, top_k, 0, top_k, n_experts, hidden, ffn
    )
    out["x"] = x
    # attention with a long context and GQA
    n_q, n_heads, n_kv, head_dim, pos0 = 9, 16, 4, 128, 700
    max_ctx = pos0 + n_q
    q = torch.randn(n_q, n_heads, head_dim, generator=gen).to(device)
    k_cache = torch.randn(max_ctx, n_kv, head_dim, generator=gen).to(device)
    v_cache = torch.randn(max_ctx, n_kv, head_dim, generator=gen).to(device)
    attn = torch.full((n_q, n_heads, head_dim), float("nan"), device=device)
    pos = torch.tensor([pos0], dtype=torch.int32, device=device)
    K.attention(q, k_cache, v_cache, attn, pos, n_q, n_heads, n_kv, head_dim, max_ctx,
                attention_scratch(n_q, n_heads, head_dim, device))
    out["attention"] = attn
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("smem,grid_yz", [(0, 3), (16384, 0), (16384, 3)], ids=["grid3", "smem16k", "both"])
def test_forced_small_limits_give_the_same_bits(limits: None, smem: int, grid_yz: int) -> None:
    default = run_kernels(seed=1)
    K.set_launch_limits_for_testing(smem, grid_yz)
    limited = run_kernels(seed=1)
    for name, value in default.items():
        assert not torch.isnan(value.float()).any(), name
        assert torch.equal(value, limited[name]), f"{name} changed under limits smem={smem} grid_yz={grid_yz}"


@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("n_experts,top_k", [(60, 4), (64, 8), (33, 3)])
def test_router_shortcut_is_the_chunked_router_bitwise(limits: None, normalize: bool, n_experts: int,
                                                       top_k: int) -> None:
    """Up to 64 experts in one chunk take warp 0's shortcut; a shared-memory cap that leaves room for chunks
    of 32 experts only forces the block passes over two or more chunks: the same ids and weights, bit for
    bit."""
    n_tokens, hidden = 3, 2048
    gen = torch.Generator().manual_seed(n_experts)
    w_router = (torch.randn(n_experts, hidden, generator=gen) * 0.05).cuda()
    w_router[1] = w_router[0]  # a tie: the lower id first, in both
    x = torch.randn(n_tokens, hidden, generator=gen).cuda()
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).cuda()
    results = []
    for smem in (0, 8600):  # 8600 bytes: h (8 KB) and the scratch of one 32-expert chunk
        K.set_launch_limits_for_testing(smem, 0)
        h = torch.full((n_tokens, hidden), float("nan"), device="cuda")
        ids = torch.full((n_tokens, top_k), -1, dtype=torch.int32, device="cuda")
        wts = torch.full((n_tokens, top_k), float("nan"), device="cuda")
        K.rmsnorm_router_topk(x, norm_w, 1e-6, h, w_router, ids, wts, n_tokens, n_experts, hidden, top_k,
                              normalize)
        results.append((h, ids, wts))
    K.set_launch_limits_for_testing(0, 0)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    ids = results[0][1]
    assert (ids >= 0).all() and not torch.isnan(results[0][2]).any()
    assert all(len(set(row)) == top_k for row in ids.tolist())


def grouped_gate_up(
    w_gate: torch.Tensor, w_up: torch.Tensor, h: torch.Tensor, ids: torch.Tensor, qtype: int
) -> torch.Tensor:
    """float64 reference of gate-up for many pairs, one matrix product per expert (no [T, k, ffn, hidden])."""
    n_tokens, top_k = ids.shape
    dev = h.device
    act = torch.empty(n_tokens, top_k, w_gate.shape[1], dtype=torch.float64, device=dev)
    h64, ids_l = ref.dot_input(h, qtype).to(dev), ids.long()
    for e in torch.unique(ids_l).tolist():
        t, s = torch.nonzero(ids_l == e, as_tuple=True)
        g = h64[t] @ w_gate[e].to(dev).T
        u = h64[t] @ w_up[e].to(dev).T
        act[t, s] = g / (1.0 + torch.exp(-g)) * u
    return act


@pytest.mark.gpu
def test_gate_up_with_more_than_65535_token_slot_pairs() -> None:
    cuda_kernels_or_skip()
    rng = np.random.default_rng(2)
    n_tokens, top_k, n_experts, ffn, hidden = 16_411, 4, 8, 32, 64
    assert n_tokens * top_k > 65_535
    wg_raw, wg = ref.make_weights(rng, (n_experts, ffn, hidden), Q8_0, 0.2)
    wu_raw, wu = ref.make_weights(rng, (n_experts, ffn, hidden), Q8_0, 0.2)
    wd_raw, wd = ref.make_weights(rng, (n_experts, hidden, ffn), Q8_0, 0.2)
    h = torch.randn(n_tokens, hidden, device="cuda")
    ids = torch.argsort(torch.rand(n_tokens, n_experts, device="cuda"), dim=1)[:, :top_k].int().contiguous()
    act = torch.full((n_tokens, top_k, ffn), float("nan"), device="cuda")
    K.moe_gate_up(
        Q8_0, wg_raw.cuda(), wu_raw.cuda(), h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden
    )
    assert not torch.isnan(act).any()
    assert ref.rel_err(act, grouped_gate_up(wg, wu, h, ids, Q8_0)) < TOL
    # the down projection over the same pairs
    weights = torch.rand(n_tokens, top_k, device="cuda")
    x0 = torch.randn(n_tokens, hidden, device="cuda")
    x = x0.clone()
    K.moe_down_accumulate(
        Q8_0,
        wd_raw.cuda(),
        act,
        ids,
        weights,
        None,
        None,
        x,
        n_tokens,
        top_k,
        0,
        top_k,
        n_experts,
        hidden,
        ffn,
    )
    x_ref, wd_cuda = x0.double(), wd.cuda()
    for s in range(top_k):
        y = torch.einsum("thf,tf->th", wd_cuda[ids[:, s].long()], ref.dot_input(act[:, s], Q8_0).cuda())
        x_ref = x_ref + weights[:, s, None].double() * y
    assert ref.rel_err(x, x_ref) < TOL


@pytest.mark.parametrize("device", device_params())
def test_thousands_of_experts(device: str) -> None:
    """4096 experts, top-8: router vs the float64 reference, then gate-up and down over those ids."""
    if device == "cuda":
        cuda_kernels_or_skip()
    rng = np.random.default_rng(3)
    n_tokens, n_experts, hidden, top_k, ffn = 5, 4096, 64, 8, 32
    w_router = torch.from_numpy(rng.standard_normal((n_experts, hidden)).astype(np.float32) * 0.5)
    h = torch.from_numpy(rng.standard_normal((n_tokens, hidden)).astype(np.float32))
    ids = torch.full((n_tokens, top_k), -1, dtype=torch.int32, device=device)
    weights = torch.full((n_tokens, top_k), float("nan"), device=device)
    K.router_topk(w_router.to(device), h.to(device), ids, weights, n_tokens, n_experts, hidden, top_k, True)
    p_ref, ids_ref, w_ref = ref.router_topk(w_router, h, top_k, True)
    got = ids.cpu().long()
    assert torch.allclose(p_ref.gather(1, got), p_ref.gather(1, ids_ref), rtol=TOL, atol=0)
    assert torch.equal(got, ids_ref)
    assert ref.rel_err(weights, w_ref) < TOL

    wg_raw, wg = ref.make_weights(rng, (n_experts, ffn, hidden), Q8_0, 0.2)
    wu_raw, wu = ref.make_weights(rng, (n_experts, ffn, hidden), Q8_0, 0.2)
    wd_raw, wd = ref.make_weights(rng, (n_experts, hidden, ffn), Q8_0, 0.2)
    hd = h.to(device)
    act = torch.full((n_tokens, top_k, ffn), float("nan"), device=device)
    K.moe_gate_up(
        Q8_0,
        wg_raw.to(device),
        wu_raw.to(device),
        hd,
        ids,
        act,
        n_tokens,
        top_k,
        0,
        top_k,
        n_experts,
        ffn,
        hidden,
    )
    assert ref.rel_err(act, ref.moe_gate_up(wg, wu, h, ids, top_k, Q8_0)) < TOL
    x = torch.from_numpy(rng.standard_normal((n_tokens, hidden)).astype(np.float32)).to(device)
    x_ref = ref.moe_down_accumulate(wd, act, ids, weights, None, None, x, range(top_k), Q8_0)
    K.moe_down_accumulate(
        Q8_0,
        wd_raw.to(device),
        act,
        ids,
        weights,
        None,
        None,
        x,
        n_tokens,
        top_k,
        0,
        top_k,
        n_experts,
        hidden,
        ffn,
    )
    assert ref.rel_err(x, x_ref) < TOL
