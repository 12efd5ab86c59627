"""Float64 references for the kernel tests: what each kernel of csrc/include/tornado_moe.h must compute.

Nothing here goes through the C code. Weights are quantized with gguf's own quantizers (libgguf's, llama.cpp's
reference, for the K types) and turned back into numbers with ``gguf.quants.dequantize``; the math is torch
float64. rmsnorm, RoPE and the router's top-k come
from the package's float64 reference model (one definition of those formulas); the rest is written out here.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tornado_moe.quant.tiled import Q8_0_TILED
from tornado_moe.reference.model64 import q8_groups, q8_round, rmsnorm, rope, route_topk

__all__ = [
    "K_QTYPES",
    "dot_input",
    "QTYPES",
    "QTYPE_NAMES",
    "attention",
    "dequantize",
    "make_weights",
    "moe_down_accumulate",
    "moe_gate_up",
    "quantize",
    "rel_err",
    "rmsnorm",
    "rope",
    "route_topk",
    "router_topk",
    "sample_distribution",
    "sample_uniform",
]

F64 = torch.float64

# GGML type ids of the supported weight formats: rows of any multiple of 32 values ...
QTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "IQ4_NL": 20, "BF16": 30}
# ... and of a multiple of 256 (the K types and IQ4_XS)
K_QTYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_XS": 23}
QTYPE_NAMES = {v: k for k, v in {**QTYPES, **K_QTYPES}.items()}
# the types gguf-py cannot quantize: llama.cpp's own quantizers (libgguf) write them
LIBGGUF_QTYPES = {*K_QTYPES.values(), QTYPES["IQ4_NL"]}


def quantize(values: np.ndarray, qtype: int) -> np.ndarray:
    """Raw GGUF bytes of ``values`` [..., cols] as uint8 [..., row_bytes] (gguf quantizers, F16 via numpy)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == QTYPES["F32"]:
        raw = values
    elif qtype == QTYPES["F16"]:
        raw = values.astype(np.float16)
    elif qtype in LIBGGUF_QTYPES:
        import libgguf

        raw = libgguf.quantize_rows(values.reshape(-1, values.shape[-1]), qtype)
    else:
        raw = gguf_quantize(values, GGMLQuantizationType(qtype))
    raw = np.ascontiguousarray(raw).view(np.uint8)
    return raw.reshape(*values.shape[:-1], -1)


def dequantize(raw: np.ndarray, qtype: int) -> np.ndarray:
    """float32 values of raw GGUF bytes [..., row_bytes] (gguf.quants.dequantize)."""
    return np.asarray(
        gguf_dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(qtype)), dtype=np.float32
    )


def make_weights(
    rng: np.random.Generator, shape: tuple[int, ...], qtype: int, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights of ``shape``: (raw uint8 bytes as stored in a GGUF, their float64 values)."""
    raw = quantize(rng.standard_normal(shape).astype(np.float32) * scale, qtype)
    return torch.from_numpy(raw.copy()), torch.from_numpy(dequantize(raw, qtype).astype(np.float64))


# the types whose dot products round their activations to int8 groups (Q8_0 and its tiled layout)
Q8_ACT_QTYPES = {QTYPES["Q8_0"], Q8_0_TILED}


def dot_input(x: torch.Tensor, qtype: int) -> torch.Tensor:
    """What a dot product with ``qtype`` weights multiplies ``x`` (float32, as given to the kernel) with, as
    float64: the values of its int8 groups for Q8_0 (model64.q8_round on the float32 values, exactly the
    kernels'), x itself for every other type."""
    x = x.detach().cpu()
    return (q8_round(x.float()) if qtype in Q8_ACT_QTYPES else x).to(F64)


def act_groups(x: torch.Tensor) -> torch.Tensor:
    """The bytes a producer writes for the int8 groups of the rows of ``x`` (float32 [..., n], n a multiple of
    4): tornado_moe.h's layout, written out here from model64.q8_groups. Per 512 values 1024 bytes; group j
    (values 4j .. 4j+3) is step j // 32 of lane j % 32: its 4 codes (int8) at 16 lane + 4 (step % 4) of block
    j // 128, its float32 scale 512 bytes further. Bytes a short last block does not use stay 0 (as in a
    buffer that started zeroed)."""
    x = x.detach().cpu().float()
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    codes, scale = q8_groups(rows)  # [R, G, 4], [R, G, 1]
    out = np.zeros((rows.shape[0], (n + 511) // 512 * 1024), dtype=np.uint8)
    j = np.arange(n // 4)
    off = (j // 128) * 1024 + 16 * (j % 32) + 4 * ((j // 32) % 4)
    code_bytes = codes.numpy().astype(np.int8).view(np.uint8)  # [R, G, 4]
    scale_bytes = scale.numpy().astype(np.float32).view(np.uint8)  # [R, G, 4]
    for b in range(4):
        out[:, off + b] = code_bytes[:, :, b]
        out[:, off + 512 + b] = scale_bytes[:, :, b]
    return torch.from_numpy(out).reshape(*x.shape[:-1], -1)


def grouped_sum_sq(x: torch.Tensor, group: int = 4, lanes: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The deferred norm's sum of squares in float32, in its own order (tornado_moe.h, tm_rmsnorm_factors),
    for bitwise checks: per row, the group sums ((x0*x0 + x1*x1) + x2*x2) + x3*x3 ([T, groups]; a short last
    group), lane l's sum of its chunk of ceil(groups / 32) consecutive groups in increasing order, then the
    butterfly over the 32 lane sums ([T]). Zero padding leaves every sum exact: adding +0 to a sum of squares
    does not round."""
    x = x.detach().cpu().float()
    T, dim = x.shape
    groups = -(-dim // group)
    sq = torch.nn.functional.pad(x * x, (0, groups * group - dim)).view(T, groups, group)
    xss = sq[:, :, 0]
    for j in range(1, group):
        xss = xss + sq[:, :, j]
    chunk = -(-groups // lanes)
    by_lane = torch.nn.functional.pad(xss, (0, chunk * lanes - groups)).view(T, lanes, chunk)
    s = torch.zeros(T, lanes)
    for k in range(chunk):
        s = s + by_lane[:, :, k]
    idx = torch.arange(lanes)
    m = lanes // 2
    while m >= 1:
        s = s + s[:, idx ^ m]
        m //= 2
    return xss, s[:, 0]


def grouped_inv(ss: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """inv = 1 / sqrt(ss / dim + eps) in float32, each step correctly rounded as the kernels' C arithmetic is.
    numpy, not torch: torch's vectorised CPU sqrt is not correctly rounded on every instruction set (one ulp
    off for ~15% of values on some machines), which a bitwise check must not depend on."""
    s = ss.detach().cpu().numpy().astype(np.float32)
    return torch.from_numpy(np.float32(1.0) / np.sqrt(s / np.float32(dim) + np.float32(eps)))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out64, ref64 = out.detach().cpu().to(F64), ref.detach().cpu().to(F64)
    return float(torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int) -> torch.Tensor:
    """Causal grouped-query attention: q [T, H, D] at positions pos0 + t over the cache [ctx, KVH, D]."""
    n_tokens, n_heads, head_dim = q.shape
    group = n_heads // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=F64)
    for t in range(n_tokens):
        n_ctx = pos0 + t + 1
        k = k_cache[:n_ctx].to(F64).repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v_cache[:n_ctx].to(F64).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,jhd->hj", q[t].to(F64), k) / head_dim**0.5
        out[t] = torch.einsum("hj,jhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def router_topk(
    w_router: torch.Tensor, h: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(all probabilities [T, E], selected ids [T, k], weights [T, k]) in float64."""
    logits = h.to(F64) @ w_router.to(F64).T
    ids, weights = route_topk(logits, top_k, normalize)
    return torch.softmax(logits, dim=-1), ids, weights


def _silu(g: torch.Tensor) -> torch.Tensor:
    return g / (1.0 + torch.exp(-g))


def moe_gate_up(
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    h: torch.Tensor,
    ids: torch.Tensor | None,
    top_k: int,
    qtype: int,
) -> torch.Tensor:
    """act [T, top_k, ffn] = silu(W_gate[e] h) * (W_up[e] h), e = ids[t, s] (expert 0 when ids is None), with
    h as weights of ``qtype`` take it (:func:`dot_input`)."""
    n_tokens = h.shape[0]
    e = torch.zeros(n_tokens, top_k, dtype=torch.long) if ids is None else ids.cpu().long()
    h64 = dot_input(h, qtype)
    g = torch.einsum("tsfh,th->tsf", w_gate[e], h64)
    u = torch.einsum("tsfh,th->tsf", w_up[e], h64)
    return _silu(g) * u


def moe_down_accumulate(
    w_down: torch.Tensor,
    act: torch.Tensor,
    ids: torch.Tensor | None,
    weights: torch.Tensor | None,
    gate_inp: torch.Tensor | None,
    h: torch.Tensor | None,
    x: torch.Tensor,
    slots: range,
    qtype: int,
) -> torch.Tensor:
    """x + sum over slots of w_eff[t, s] * (W_down[e] act[t, s]); w_eff = weight (or 1) * sigmoid gate; act as
    weights of ``qtype`` take it (:func:`dot_input`)."""
    n_tokens, top_k = act.shape[0], act.shape[1]
    e = torch.zeros(n_tokens, top_k, dtype=torch.long) if ids is None else ids.cpu().long()
    w = torch.ones(n_tokens, top_k, dtype=F64) if weights is None else weights.cpu().to(F64)
    if gate_inp is not None:
        w = w * torch.sigmoid(h.cpu().to(F64) @ gate_inp.cpu().to(F64))[:, None]
    out = x.cpu().to(F64).clone()
    act64 = dot_input(act, qtype)
    for s in slots:
        y = torch.einsum("thf,tf->th", w_down[e[:, s]], act64[:, s])
        out += w[:, s, None] * y
    return out


def sample_distribution(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The probability of each token under tm_sample's rule (float64): softmax(logits / T); keep the top_k
    most probable (ties: lower id first); keep the shortest prefix whose mass reaches top_p of the kept mass;
    renormalise.
    """
    p = torch.softmax(logits.cpu().to(F64) / temperature, dim=-1)
    vocab = p.shape[0]
    order = torch.sort(p, descending=True, stable=True).indices
    n_keep = top_k if 0 < top_k < vocab else vocab
    kept = order[:n_keep]
    if top_p < 1.0:
        c = torch.cumsum(p[kept], dim=0)
        n = int(torch.searchsorted(c, top_p * c[-1]).item()) + 1
        kept = kept[: min(n, n_keep)]
    q = torch.zeros(vocab, dtype=F64)
    q[kept] = p[kept] / p[kept].sum()
    return q


_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sample_uniform(seed: int, step: int) -> float:
    """u of tm_sample for (seed, step), as documented in csrc/common/sampling_rng.h (SplitMix64, 24 bits)."""
    counter = (step + 1) & _M64
    bits = _mix64((_mix64(seed) + 0x9E3779B97F4A7C15 * counter) & _M64)
    return (bits >> 40) / float(1 << 24)
