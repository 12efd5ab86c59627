"""Thin Python wrappers over ``torch.ops.tornado_moe``: one function per kernel of the C ABI.

Each wrapper takes the torch op's arguments without the trailing ``stream`` and passes the current CUDA
stream of its tensors' device (0 on the CPU), so a call made inside ``torch.cuda.graph`` or
``with torch.cuda.stream(s)`` launches where torch would. Outputs are written in place; every wrapper
returns ``None``. Semantics, argument meanings and shapes: ``csrc/include/tornado_moe.h``. Weights are GGUF
tensors as stored (uint8 bytes, or the float dtype for F32/F16/BF16); ``qtype`` is the GGML type id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tornado_moe.native import load_torch_ops

__all__ = [
    "KERNEL_ARGS",
    "KERNEL_NAMES",
    "NORM_GROUP",
    "DeviceProps",
    "act_groups_bytes",
    "advance_position",
    "argmax",
    "argmax_advance",
    "attention",
    "attention_scratch_words",
    "cuda_compiled",
    "cuda_device_count",
    "device_props",
    "embedding",
    "experts_down_accumulate",
    "experts_gate_up",
    "matmul",
    "moe_down_accumulate",
    "moe_gate_up",
    "native_version",
    "norm_groups",
    "qkv_rope",
    "rmsnorm",
    "rmsnorm_factors",
    "rmsnorm_router_topk",
    "rope_kv_append",
    "router_experts_ffn",
    "router_experts_ffn_launches",
    "router_experts_ffn_scratch_words",
    "router_experts_gate_up",
    "router_gate_up_scratch_words",
    "router_topk",
    "sample",
    "set_ffn_one_launch",
    "set_launch_limits_for_testing",
    "stream_of",
    "u64_as_int64",
]

#: Argument names of every kernel, in C ABI order without ``device`` and ``stream``
#: (csrc/include/tornado_moe.h), keyed in the order of the C kernel table (tm_kernel_name(i)). Graph tasks
#: name their kernel by these keys and pass exactly these arguments.
KERNEL_ARGS: dict[str, tuple[str, ...]] = {
    "embedding": ("qtype", "table", "ids", "out", "n_tokens", "vocab", "dim"),
    "rmsnorm": ("x", "w", "y", "n_tokens", "dim", "eps"),
    "rmsnorm_factors": ("x", "w", "xw", "xss", "inv", "n_tokens", "dim", "eps"),
    "matmul": ("qtype", "w", "x", "bias", "y", "n_tokens", "rows", "cols", "accumulate", "scale", "x_groups",
               "x_sums", "eps", "next_norm_w", "y_w", "y_ss", "y_w_groups"),
    "rope_kv_append": ("q", "k", "v", "k_cache", "v_cache", "pos", "n_tokens", "n_heads", "n_kv_heads",
                       "head_dim", "max_ctx", "freq_base", "neox"),
    "qkv_rope": ("qtype", "x", "xw", "xss", "norm_w", "eps", "w_q", "w_k", "w_v", "b_q", "b_k", "b_v", "q",
                 "k_cache", "v_cache", "pos", "n_tokens", "hidden", "n_heads", "n_kv_heads", "head_dim",
                 "max_ctx", "freq_base", "neox", "xw_groups"),
    "attention": ("q", "k_cache", "v_cache", "out", "pos", "n_tokens", "n_heads", "n_kv_heads", "head_dim",
                  "max_ctx", "scratch", "out_groups"),
    "router_topk": ("w_router", "h", "ids", "weights", "n_tokens", "n_experts", "hidden", "top_k",
                    "normalize"),
    "rmsnorm_router_topk": ("x", "norm_w", "eps", "h", "w_router", "ids", "weights", "n_tokens", "n_experts",
                            "hidden", "top_k", "normalize"),
    "moe_gate_up": ("qtype", "w_gate", "w_up", "h", "ids", "act", "n_tokens", "top_k", "slot_begin",
                    "slot_count", "n_experts", "ffn", "hidden", "scale"),
    "experts_gate_up": ("qtype", "w_gate_sh", "w_up_sh", "act_sh", "ffn_sh", "w_gate", "w_up", "h", "ids",
                        "act", "n_tokens", "top_k", "n_experts", "ffn", "hidden"),
    "router_experts_gate_up": ("x", "norm_w", "eps", "h", "w_router", "ids", "weights", "qtype",
                               "w_gate_sh", "w_up_sh", "act_sh", "ffn_sh", "gate_inp_sh", "gate_sh", "w_gate",
                               "w_up", "act", "n_tokens", "n_experts", "hidden", "top_k", "normalize", "ffn",
                               "scratch", "act_groups_sh", "act_groups", "xw", "xss", "xw_groups"),
    "router_experts_ffn": ("x", "norm_w", "eps", "h", "w_router", "ids", "weights", "qtype", "w_gate_sh",
                           "w_up_sh", "w_down_sh", "act_sh", "ffn_sh", "gate_inp_sh", "gate_sh", "w_gate",
                           "w_up", "w_down", "act", "n_tokens", "n_experts", "hidden", "top_k", "normalize",
                           "ffn", "scratch", "xw", "xss", "xw_groups"),
    "moe_down_accumulate": ("qtype", "w_down", "act", "ids", "weights", "gate_inp", "h", "x", "n_tokens",
                            "top_k", "slot_begin", "slot_count", "n_experts", "hidden", "ffn"),
    "experts_down_accumulate": ("qtype", "w_down_sh", "act_sh", "gate_inp_sh", "gate_sh", "ffn_sh", "w_down",
                                "act", "ids", "weights", "h", "x", "next_norm_w", "xw", "xss", "n_tokens",
                                "top_k", "n_experts", "hidden", "ffn", "act_groups_sh", "act_groups",
                                "xw_groups"),
    "argmax": ("logits", "out", "n_tokens", "vocab"),
    "sample": ("logits", "out", "vocab", "temperature", "top_p", "top_k", "seed", "step"),
    "advance_position": ("pos", "delta", "token", "log", "log_len"),
    "argmax_advance": ("logits", "out", "vocab", "pos", "delta", "log", "log_len"),
}
KERNEL_NAMES: tuple[str, ...] = tuple(KERNEL_ARGS)

_U64 = 1 << 64


def _ops() -> Any:
    load_torch_ops()
    return torch.ops.tornado_moe


def u64_as_int64(value: int) -> int:
    """A C uint64 argument (the sampling seed) as the int64 with the same 64 bits: torch and Java ints are
    signed. Raises ValueError outside [0, 2**64)."""
    if not 0 <= value < _U64:
        raise ValueError(f"a uint64 argument must be in [0, 2**64), got {value}")
    return value - _U64 if value >= 1 << 63 else value


def stream_of(tensor: torch.Tensor) -> int:
    """The raw handle of the current CUDA stream of ``tensor``'s device; 0 for CPU tensors."""
    if tensor.is_cuda:
        return torch.cuda.current_stream(tensor.device).cuda_stream
    return 0


def embedding(
    qtype: int, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, n_tokens: int, vocab: int, dim: int
) -> None:
    _ops().embedding(qtype, table, ids, out, n_tokens, vocab, dim, stream_of(out))


def rmsnorm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, n_tokens: int, dim: int, eps: float) -> None:
    _ops().rmsnorm(x, w, y, n_tokens, dim, eps, stream_of(y))


#: Values per group of the deferred norm's grouped sum of squares (tornado_moe.h's TM_NORM_GROUP).
NORM_GROUP = 4


def norm_groups(dim: int) -> int:
    """Floats of a row's partial sums of squares (``xss``) for a row of ``dim`` values."""
    return -(-dim // NORM_GROUP)


def rmsnorm_factors(x: torch.Tensor, w: torch.Tensor, xw: torch.Tensor, xss: torch.Tensor | None,
                    inv: torch.Tensor, n_tokens: int, dim: int, eps: float) -> None:
    """The deferred RMSNorm's factors: xw = x * w and inv[t] = 1 / rms(x[t]), so that (x * inv) * w is the
    normalised row and matmul(x=xw, scale=inv) the normalised product. The sum of squares has its own order
    (tornado_moe.h: groups of NORM_GROUP values, whose sums ``xss`` [n_tokens, norm_groups(dim)] also
    receives, so that a kernel that writes x can leave them for its consumer)."""
    _ops().rmsnorm_factors(x, w, xw, xss, inv, n_tokens, dim, eps, stream_of(xw))


def matmul(
    qtype: int,
    w: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    n_tokens: int,
    rows: int,
    cols: int,
    accumulate: bool = False,
    scale: torch.Tensor | None = None,
    x_groups: torch.Tensor | None = None,
    x_sums: torch.Tensor | None = None,
    eps: float = 0.0,
    next_norm_w: torch.Tensor | None = None,
    y_w: torch.Tensor | None = None,
    y_ss: torch.Tensor | None = None,
    y_w_groups: torch.Tensor | None = None,
) -> None:
    """y = W x (* scale[t]) (+ bias) (+ y when accumulating). ``x_groups`` (uint8): x's int8 groups as the
    kernel that wrote x wrote them (attention's out_groups), which Q8_0 products read instead of rounding
    x. ``x_sums`` (instead of ``scale``): x = rmsnorm_factors' xw and these its xss; the product is scaled
    by the inv rmsnorm_factors computes from them with ``eps`` (the same bits), so that no norm launch
    need come between the kernel that wrote xw and xss (the down) and this one (the output head).
    ``next_norm_w``, ``y_w``, ``y_ss`` (all or none): also the next norm's factors of y, y_w = y * next_norm_w
    and y's grouped sums of squares as rmsnorm_factors writes xw and xss; ``y_w_groups`` (uint8, with y_w):
    y_w's int8 groups too (tornado_moe.h, tm_matmul)."""
    _ops().matmul(qtype, w, x, bias, y, n_tokens, rows, cols, accumulate, scale, x_groups, x_sums, eps,
                  next_norm_w, y_w, y_ss, y_w_groups, stream_of(y))


def rope_kv_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    n_tokens: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    max_ctx: int,
    freq_base: float,
    neox: bool,
) -> None:
    _ops().rope_kv_append(
        q,
        k,
        v,
        k_cache,
        v_cache,
        pos,
        n_tokens,
        n_heads,
        n_kv_heads,
        head_dim,
        max_ctx,
        freq_base,
        neox,
        stream_of(q),
    )


def qkv_rope(
    qtype: int,
    x: torch.Tensor,
    xw: torch.Tensor | None,
    xss: torch.Tensor | None,
    norm_w: torch.Tensor,
    eps: float,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    b_q: torch.Tensor | None,
    b_k: torch.Tensor | None,
    b_v: torch.Tensor | None,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    n_tokens: int,
    hidden: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    max_ctx: int,
    freq_base: float,
    neox: bool,
    xw_groups: torch.Tensor | None = None,
) -> None:
    """rmsnorm_factors + the q, k, v products scaled by inv + RoPE and KV append in one launch (bitwise those
    five kernels). ``xw`` and ``xss``: x * norm_w and x's partial sums of squares as the kernel that wrote x
    wrote them (experts_down_accumulate), or both None (computed here). ``xw_groups`` (uint8, with xw): xw's
    int8 groups as that kernel wrote them (``act_groups_bytes``), which Q8_0 products read instead of rounding
    xw in every warp: the same values.
    """
    _ops().qkv_rope(qtype, x, xw, xss, norm_w, eps, w_q, w_k, w_v, b_q, b_k, b_v, q, k_cache, v_cache, pos,
                    n_tokens, hidden, n_heads, n_kv_heads, head_dim, max_ctx, freq_base, neox, xw_groups,
                    stream_of(q))


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    pos: torch.Tensor,
    n_tokens: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    max_ctx: int,
    scratch: torch.Tensor,
    out_groups: torch.Tensor | None = None,
) -> None:
    """``scratch``: int32, ``attention_scratch_words(n_tokens, n_heads, head_dim)`` elements, zero before the
    first call (each call leaves it so); CUDA merges contexts above 128 positions through it. ``out_groups``
    (uint8, [n_tokens, act_groups_bytes(n_heads * head_dim)]): also out's int8 groups, for the output
    projection."""
    _ops().attention(q, k_cache, v_cache, out, pos, n_tokens, n_heads, n_kv_heads, head_dim, max_ctx, scratch,
                     out_groups, stream_of(out))


def attention_scratch_words(n_tokens: int, n_heads: int, head_dim: int) -> int:
    """int32 elements of the scratch attention needs for this many tokens and heads."""
    return int(_ops().attention_scratch_words(n_tokens, n_heads, head_dim))


def router_topk(
    w_router: torch.Tensor,
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    n_tokens: int,
    n_experts: int,
    hidden: int,
    top_k: int,
    normalize: bool,
) -> None:
    _ops().router_topk(
        w_router, h, ids, weights, n_tokens, n_experts, hidden, top_k, normalize, stream_of(ids)
    )


def rmsnorm_router_topk(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    h: torch.Tensor,
    w_router: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    n_tokens: int,
    n_experts: int,
    hidden: int,
    top_k: int,
    normalize: bool,
) -> None:
    """h = rmsnorm(x) and the router's top-k in one launch (bitwise rmsnorm followed by router_topk)."""
    _ops().rmsnorm_router_topk(x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts, hidden, top_k,
                               normalize, stream_of(ids))


def moe_gate_up(
    qtype: int,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    h: torch.Tensor,
    ids: torch.Tensor | None,
    act: torch.Tensor,
    n_tokens: int,
    top_k: int,
    slot_begin: int,
    slot_count: int,
    n_experts: int,
    ffn: int,
    hidden: int,
    scale: torch.Tensor | None = None,
) -> None:
    """``scale`` (float32 [n_tokens]): gate and up of token t times scale[t] before the SwiGLU; with h =
    rmsnorm_factors' xw and scale its inv, the deferred norm's gate-up (tornado_moe.h)."""
    _ops().moe_gate_up(
        qtype,
        w_gate,
        w_up,
        h,
        ids,
        act,
        n_tokens,
        top_k,
        slot_begin,
        slot_count,
        n_experts,
        ffn,
        hidden,
        scale,
        stream_of(act),
    )


def experts_gate_up(
    qtype: int,
    w_gate_sh: torch.Tensor,
    w_up_sh: torch.Tensor,
    act_sh: torch.Tensor,
    ffn_sh: int,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    h: torch.Tensor,
    ids: torch.Tensor,
    act: torch.Tensor,
    n_tokens: int,
    top_k: int,
    n_experts: int,
    ffn: int,
    hidden: int,
) -> None:
    """The shared expert's gate-up and all routed slots' in one launch (bitwise the two moe_gate_up calls)."""
    _ops().experts_gate_up(qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, h, ids, act, n_tokens,
                           top_k, n_experts, ffn, hidden, stream_of(act))


def router_experts_gate_up(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    h: torch.Tensor,
    w_router: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    qtype: int,
    w_gate_sh: torch.Tensor,
    w_up_sh: torch.Tensor,
    act_sh: torch.Tensor,
    ffn_sh: int,
    gate_inp_sh: torch.Tensor | None,
    gate_sh: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    act: torch.Tensor,
    n_tokens: int,
    n_experts: int,
    hidden: int,
    top_k: int,
    normalize: bool,
    ffn: int,
    scratch: torch.Tensor,
    act_groups_sh: torch.Tensor | None = None,
    act_groups: torch.Tensor | None = None,
    xw: torch.Tensor | None = None,
    xss: torch.Tensor | None = None,
    xw_groups: torch.Tensor | None = None,
) -> None:
    """rmsnorm_router_topk then experts_gate_up in one launch, bitwise: on CUDA the shared expert's rows
    stream while the router runs. ``scratch``: int32, ``router_gate_up_scratch_words(n_tokens, n_experts,
    hidden)`` elements, 16-byte aligned, zero before the first call (each call leaves the synchronisation
    words for the next to continue from, whatever its token count; the rest holds the router logits and h's
    int8 groups); calls sharing it must not overlap, and nothing else may write it. With the shared expert's
    gate row ``gate_inp_sh`` it also writes ``gate_sh[t] = sigmoid(gate_inp_sh . h[t])`` (float32
    [n_tokens]), the factor experts_down_accumulate then reads instead of computing it in each of its
    blocks. ``act_groups_sh`` and ``act_groups`` (uint8, both or neither: [n_tokens, act_groups_bytes(ffn_sh)]
    and [n_tokens, top_k, act_groups_bytes(ffn)]): act_sh's and act's int8 groups instead of the floats, for
    the down, which then reads only them: act_sh and act become work space that the one-launch CUDA path does
    not write (the floats' stores cost its blocks ~0.5% of the decode step). ``xw`` and ``xss`` (both or
    neither; ``xw_groups``, uint8, only with xw): the FFN norm deferred for the shared expert, x * norm_w,
    x's grouped sums of squares and xw's int8 groups as matmul's y_w, y_ss, y_w_groups wrote them
    (tornado_moe.h)."""
    _ops().router_experts_gate_up(x, norm_w, eps, h, w_router, ids, weights, qtype, w_gate_sh, w_up_sh,
                                  act_sh, ffn_sh, gate_inp_sh, gate_sh, w_gate, w_up, act, n_tokens,
                                  n_experts, hidden, top_k, normalize, ffn, scratch, act_groups_sh,
                                  act_groups, xw, xss, xw_groups, stream_of(act))


def router_gate_up_scratch_words(n_tokens: int, n_experts: int, hidden: int) -> int:
    """int32 elements of the scratch router_experts_gate_up needs for this many tokens and experts (and h's
    int8 groups, of ``hidden`` values a token)."""
    return int(_ops().router_gate_up_scratch_words(n_tokens, n_experts, hidden))


def act_groups_bytes(n: int) -> int:
    """Bytes of the int8 activation groups of a row of ``n`` values (tornado_moe.h, tm_act_groups_bytes): the
    buffers router_experts_gate_up and experts_down_accumulate write for the next Q8_0 product."""
    return int(_ops().act_groups_bytes(n))


def router_experts_ffn(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    h: torch.Tensor,
    w_router: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    qtype: int,
    w_gate_sh: torch.Tensor,
    w_up_sh: torch.Tensor,
    w_down_sh: torch.Tensor,
    act_sh: torch.Tensor,
    ffn_sh: int,
    gate_inp_sh: torch.Tensor | None,
    gate_sh: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    act: torch.Tensor,
    n_tokens: int,
    n_experts: int,
    hidden: int,
    top_k: int,
    normalize: bool,
    ffn: int,
    scratch: torch.Tensor,
    xw: torch.Tensor | None = None,
    xss: torch.Tensor | None = None,
    xw_groups: torch.Tensor | None = None,
) -> None:
    """The whole MoE FFN half of a layer: router_experts_gate_up then experts_down_accumulate (with the gate
    factors gate_sh), bitwise. When chosen (``set_ffn_one_launch`` or ``TORNADO_MOE_FFN_ONE_LAUNCH=1``; off
    by default, as it measured slower on the H200), a decode step (``n_tokens == 1``, tiled Q8_0) on an sm_90
    GPU is ONE persistent launch whose weights stream through shared memory while the router runs (see
    ``router_experts_ffn_launches``). ``scratch``: int32, ``router_experts_ffn_scratch_words(n_tokens,
    n_experts, hidden)`` elements, zero before the first call; it may also serve router_experts_gate_up.
    ``xw``, ``xss``, ``xw_groups``: router_experts_gate_up's (the shared expert's deferred norm;
    tornado_moe.h)."""
    _ops().router_experts_ffn(x, norm_w, eps, h, w_router, ids, weights, qtype, w_gate_sh, w_up_sh,
                              w_down_sh, act_sh, ffn_sh, gate_inp_sh, gate_sh, w_gate, w_up, w_down, act,
                              n_tokens, n_experts, hidden, top_k, normalize, ffn, scratch, xw, xss, xw_groups,
                              stream_of(x))


def router_experts_ffn_scratch_words(n_tokens: int, n_experts: int, hidden: int) -> int:
    """int32 elements of the scratch router_experts_ffn needs (enough for router_experts_gate_up too)."""
    return int(_ops().router_experts_ffn_scratch_words(n_tokens, n_experts, hidden))


def router_experts_ffn_launches(device: torch.device | str, qtype: int, n_tokens: int, n_experts: int,
                                top_k: int, hidden: int, ffn_sh: int, ffn: int,
                                deferred_norm: bool = False) -> int:
    """Kernel launches router_experts_ffn makes for these shapes on ``device``'s current GPU: 1 (the
    persistent launch) or 2 (its two-launch form); 1 on the CPU (one call). ``deferred_norm``: whether the
    call passes xw (tornado_moe.h)."""
    cuda = torch.device(device).type == "cuda"
    return int(_ops().router_experts_ffn_launches(cuda, qtype, n_tokens, n_experts, top_k, hidden, ffn_sh,
                                                  ffn, deferred_norm))


def moe_down_accumulate(
    qtype: int,
    w_down: torch.Tensor,
    act: torch.Tensor,
    ids: torch.Tensor | None,
    weights: torch.Tensor | None,
    gate_inp: torch.Tensor | None,
    h: torch.Tensor | None,
    x: torch.Tensor,
    n_tokens: int,
    top_k: int,
    slot_begin: int,
    slot_count: int,
    n_experts: int,
    hidden: int,
    ffn: int,
) -> None:
    _ops().moe_down_accumulate(
        qtype,
        w_down,
        act,
        ids,
        weights,
        gate_inp,
        h,
        x,
        n_tokens,
        top_k,
        slot_begin,
        slot_count,
        n_experts,
        hidden,
        ffn,
        stream_of(x),
    )


def experts_down_accumulate(
    qtype: int,
    w_down_sh: torch.Tensor,
    act_sh: torch.Tensor,
    gate_inp_sh: torch.Tensor | None,
    gate_sh: torch.Tensor | None,
    ffn_sh: int,
    w_down: torch.Tensor,
    act: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    h: torch.Tensor | None,
    x: torch.Tensor,
    next_norm_w: torch.Tensor | None,
    xw: torch.Tensor | None,
    xss: torch.Tensor | None,
    n_tokens: int,
    top_k: int,
    n_experts: int,
    hidden: int,
    ffn: int,
    act_groups_sh: torch.Tensor | None = None,
    act_groups: torch.Tensor | None = None,
    xw_groups: torch.Tensor | None = None,
) -> None:
    """The shared expert's down and every routed slot's into x in one launch (bitwise the two calls). The
    shared term's gate comes from at most one of ``gate_inp_sh`` (computed here from h) and ``gate_sh`` (the
    factors router_experts_gate_up wrote: the same bits). With ``next_norm_w`` also ``xw`` = x * next_norm_w
    and ``xss``, x's partial sums of squares: the next normalisation's factors as rmsnorm_factors writes them,
    for the next layer's qkv_rope. ``act_groups_sh``/``act_groups`` (qtype Q8_0_TILED): the activations'
    int8 groups as router_experts_gate_up wrote them, read instead of the floats (act_sh and act are then not
    read; the groups' values are what Q8_0 rows multiply, so the same bits); ``xw_groups`` (with xw): also
    xw's groups, for qkv_rope."""
    _ops().experts_down_accumulate(qtype, w_down_sh, act_sh, gate_inp_sh, gate_sh, ffn_sh, w_down, act, ids,
                                   weights, h, x, next_norm_w, xw, xss, n_tokens, top_k, n_experts, hidden,
                                   ffn, act_groups_sh, act_groups, xw_groups, stream_of(x))


def argmax(logits: torch.Tensor, out: torch.Tensor, n_tokens: int, vocab: int) -> None:
    _ops().argmax(logits, out, n_tokens, vocab, stream_of(out))


def sample(
    logits: torch.Tensor,
    out: torch.Tensor,
    vocab: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    step: torch.Tensor,
) -> None:
    """``seed`` is any integer in [0, 2**64) (the C uint64); it is passed to the op as the same 64 bits."""
    try:
        folded = u64_as_int64(seed)
    except ValueError as e:
        raise ValueError(f"sample: seed: {e}") from None
    _ops().sample(logits, out, vocab, temperature, top_p, top_k, folded, step, stream_of(out))


def advance_position(pos: torch.Tensor, delta: int, token: torch.Tensor | None = None,
                     log: torch.Tensor | None = None, log_len: int = 0) -> None:
    """pos[0] += delta; with ``log``, log[new pos] = token[0] when the new position is below ``log_len``."""
    _ops().advance_position(pos, delta, token, log, log_len, stream_of(pos))


def argmax_advance(logits: torch.Tensor, out: torch.Tensor, vocab: int, pos: torch.Tensor, delta: int,
                   log: torch.Tensor | None = None, log_len: int = 0) -> None:
    """``argmax`` of one row, then ``advance_position(pos, delta, out, log, log_len)``, in one launch: a
    greedy decode step's last two tasks, one launch a token fewer."""
    _ops().argmax_advance(logits, out, vocab, pos, delta, log, log_len, stream_of(out))


@dataclass(frozen=True)
class DeviceProps:
    """Properties of the current CUDA device as the kernel library reads them (never hard-coded)."""

    sm_count: int
    max_grid_y: int
    max_grid_z: int
    smem_per_block_optin: int
    l2_bytes: int
    name: str


def device_props() -> DeviceProps:
    """The current CUDA device's properties; raises RuntimeError without CUDA."""
    return DeviceProps(*_ops().cuda_device_props())


def cuda_compiled() -> bool:
    """True when the kernel library was built with its CUDA kernels."""
    return bool(_ops().cuda_compiled())


def cuda_device_count() -> int:
    return int(_ops().cuda_device_count())


def set_launch_limits_for_testing(smem_per_block: int = 0, max_grid_yz: int = 0) -> None:
    """Caps the shared memory and grid y/z the CUDA launchers plan with (0, 0 restores the device values)."""
    _ops().set_launch_limits_for_testing(smem_per_block, max_grid_yz)


def set_ffn_one_launch(on: bool | None) -> None:
    """Whether router_experts_ffn may run as one persistent launch where it applies (True) or always as its
    two launches (False); None restores the default (the environment's ``TORNADO_MOE_FFN_ONE_LAUNCH=1``, else
    off: slower than the two launches on the H200). Graphs built afterwards follow it."""
    _ops().set_ffn_one_launch(-1 if on is None else int(bool(on)))


def native_version() -> str:
    """Version string of the loaded kernel library."""
    return str(_ops().version())
