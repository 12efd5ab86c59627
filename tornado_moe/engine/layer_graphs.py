"""Builds one task graph per transformer layer, plus the embedding and logits graphs.

A layer is as few launches as the contract allows (qwen2moe, fused: 5):
- ``attn_qkv``: RMSNorm, the q/k/v products with bias, RoPE and the KV-cache append in one kernel (bitwise
  the five unfused kernels; used when q, k and v share a weight format, else those five tasks; qwen3moe's
  per-head norms of q and k, and olmoe's norms of all of q and of k, are two more tasks between the products
  and RoPE). Its norm is
  deferred (rmsnorm_factors: dot(W, x * w) * inv): the previous layer's ``experts_down_accumulate`` writes
  xw = x * attn_norm and x's partial sums of squares beside x, so the kernel streams its weights at once and
  each warp evaluates inv alone after them;
- ``attention``, ``attn_output`` (+ residual; before the fused router + gate-up launch it also writes the FFN
  norm's factors xw = x * ffn_norm, x's partial sums of squares and xw's int8 groups, for the shared expert's
  gate-up);
- ``router_topk``: RMSNorm (writing h) + router + softmax + top-k in one kernel, unless the fused expert
  launch below takes it in (``ffn_norm`` stays a task of its own only for dense models);
- the shared expert (or dense FFN) and the routed experts, whose routed part comes in two shapes that must
  give bitwise identical hidden states:
  - fused (default): ``router_experts_gate_up`` (the router, the shared expert's gate-up and all slots' in one
    launch: the shared rows stream while the router runs) and ``experts_down_accumulate`` (the shared
    expert's down, then the slots in order, in one launch): 5 launches per layer (on a GPU a step of several
    tokens runs the first as the router's launch, then grouped expert GEMMs: tornado_moe.h); a decode step
    (one token) that the library runs as one call (``router_experts_ffn_launches``: the CPU; the GPU's
    persistent launch, ``set_ffn_one_launch``, takes h alone and so not the deferred form below) has
    ``router_experts_ffn`` instead: 4;
    when the shared expert's formats differ from the routed ones', or there is none, ``router_topk``,
    (``ffn_norm_factors``,) ``shared_expert_gate_up``, ``routed_experts_gate_up_swiglu``,
    ``shared_expert_down`` and ``routed_experts_down_accumulate``;
  - per-slot: ``router_topk``, ``ffn_norm_factors``, ``shared_expert_gate_up``, ``routed_expert_gate_up_<s>``,
    ``shared_expert_down`` and ``routed_expert_down_<s>`` for every slot s.
The shared expert's gate-up takes the FFN norm deferred, on every route and device: it multiplies xw and
scales its gate and up values by inv (the router's logits and the routed slots keep h = rmsnorm(x)), so that
its blocks in the fused launch stream their rows at once instead of normalising x first (results/NOTES.md
lesson 186); where no fused launch reads attn_output's factors, ``ffn_norm_factors`` (rmsnorm_factors)
writes xw and inv for moe_gate_up's scale.
Residual order of the FFN half of a layer, identical in both: x = (((x + shared) + w_0 y_0) + w_1 y_1) ...
(the shared expert, or the dense FFN, first; then the routed slots in slot order). Gate-up tasks come before
the down tasks so that every kernel whose weights are known before its inputs (the shared expert's) can
start streaming them while its predecessor still runs (programmatic dependent launch, csrc/cuda/common.cuh).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tornado_moe.engine.buffers import Activations, DeviceModel, DeviceWeight
from tornado_moe.errors import InputError
from tornado_moe.graph.task_graph import DataTransferMode, ImmutableTaskGraph, TaskGraph
from tornado_moe.kernels import ops as tm_ops
from tornado_moe.kernels.ops import u64_as_int64
from tornado_moe.quant.tiled import Q8_0_TILED


@dataclass(frozen=True)
class SamplerConfig:
    """temperature 0 = greedy (argmax); otherwise seeded sampling with top-k / top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        # One check for every caller (generate, determinism, library users); messages name the CLI flags.
        if not self.temperature >= 0:
            raise InputError(f"temperature (--temperature) must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top-p (--top-p) must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top-k (--top-k) must be >= 0 (0 = all tokens), got {self.top_k}")
        if not 0 <= self.seed < 1 << 64:
            raise InputError(f"seed (--seed) must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _w(layer: dict, key: str) -> DeviceWeight:
    w = layer[key]
    assert isinstance(w, DeviceWeight), key
    return w


def _f32(layer: dict, key: str) -> torch.Tensor | None:
    """An optional F32 tensor as the float pointer its kernel takes (None where the model has none)."""
    w = layer.get(key)
    return None if w is None else w.floats


def _same_format(*ws: DeviceWeight) -> int:
    qtypes = {w.qtype for w in ws}
    if len(qtypes) != 1:
        names = ", ".join(f"{w.name}={w.qtype}" for w in ws)
        raise ValueError(f"gate/up tensors must share one quant type to run in one kernel: {names}")
    return ws[0].qtype


def _qkv_fused(dm: DeviceModel, i: int) -> bool:
    """Whether layer i's attention input is one qkv_rope launch (q, k and v share a weight format, and no
    q/k norm comes between the products and RoPE)."""
    L = dm.layers[i]
    return (not dm.config.qk_norm
            and _w(L, "attn_q").qtype == _w(L, "attn_k").qtype == _w(L, "attn_v").qtype)


def _shared_norm_deferred(dm: DeviceModel) -> bool:
    """Whether the shared expert's gate-up takes the FFN norm deferred (module docstring): with a shared
    expert, on every route and device, so that the routes' bits agree."""
    return bool(dm.config.n_experts and dm.config.shared_ffn)


def _router_fused(dm: DeviceModel, i: int, fuse_experts: bool) -> bool:
    """Whether layer i's router, shared gate-up and routed gate-ups are one task (router_experts_gate_up or
    router_experts_ffn): fused, with a shared expert whose gate-up rows share the routed ones' format."""
    cfg, L = dm.config, dm.layers[i]
    return bool(fuse_experts and cfg.n_experts and cfg.shared_ffn
                and _same_format(_w(L, "ffn_gate_shexp"), _w(L, "ffn_up_shexp"))
                == _same_format(_w(L, "ffn_gate_exps"), _w(L, "ffn_up_exps")))


def _ffn_in_one_launch(dm: DeviceModel, i: int, n_tokens: int, fuse_experts: bool) -> bool:
    """Whether layer i's FFN half is the library's one-launch router_experts_ffn (module docstring)."""
    cfg, L = dm.config, dm.layers[i]
    if not (fuse_experts and cfg.n_experts and cfg.shared_ffn and n_tokens == 1):
        return False
    qt = _same_format(_w(L, "ffn_gate_exps"), _w(L, "ffn_up_exps"))
    if not (_same_format(_w(L, "ffn_gate_shexp"), _w(L, "ffn_up_shexp")) == qt
            == _w(L, "ffn_down_shexp").qtype == _w(L, "ffn_down_exps").qtype):
        return False
    return tm_ops.router_experts_ffn_launches(dm.device, qt, n_tokens, cfg.n_experts, cfg.top_k, cfg.hidden,
                                              cfg.shared_ffn, cfg.expert_ffn, _shared_norm_deferred(dm)) == 1


def _fused_down(dm: DeviceModel, i: int, n_tokens: int, fuse_experts: bool) -> bool:
    """Whether layer i's FFN ends with experts_down_accumulate, which can write the next layer's xw."""
    cfg, L = dm.config, dm.layers[i]
    return bool(fuse_experts and cfg.n_experts and cfg.shared_ffn
                and _w(L, "ffn_down_shexp").qtype == _w(L, "ffn_down_exps").qtype
                and not _ffn_in_one_launch(dm, i, n_tokens, fuse_experts))


def _takes_groups(w: DeviceWeight) -> bool:
    """Whether products with ``w`` read int8 activation groups that their producer wrote (tiled Q8_0 rows on
    the GPU; elsewhere the product rounds the floats itself, and writing the groups would be wasted work)."""
    return w.qtype == Q8_0_TILED


def _norm_after(dm: DeviceModel, i: int) -> tuple[torch.Tensor, DeviceWeight] | None:
    """The norm after layer i whose factors its down can write, and the weight of the product that reads
    them: the next layer's attn_norm for its qkv_rope (when fused), or after the last layer the output norm
    for the output head."""
    if i + 1 == dm.config.n_layers:
        return dm.output_norm.floats, dm.output
    if not _qkv_fused(dm, i + 1):
        return None
    return _f32(dm.layers[i + 1], "attn_norm"), _w(dm.layers[i + 1], "attn_q")


def _writes_next_xw(dm: DeviceModel, i: int, n_tokens: int, fuse_experts: bool) -> bool:
    """Whether layer i's down writes xw = x * the norm after it (and x's sums of squares), for the product
    that reads them (_norm_after)."""
    return _norm_after(dm, i) is not None and _fused_down(dm, i, n_tokens, fuse_experts)


def embedding_graph(dm: DeviceModel, act: Activations, n_tokens: int) -> ImmutableTaskGraph:
    cfg, e = dm.config, dm.token_embd
    g = TaskGraph("embedding").transfer_to_device(DataTransferMode.EVERY_EXECUTION, act.tokens)
    g.task("embedding", "embedding", e.qtype, e.data, act.tokens, act.x, n_tokens, cfg.vocab, cfg.hidden)
    return g.snapshot()


def layer_graph(dm: DeviceModel, act: Activations, i: int, n_tokens: int, *, fuse_experts: bool = True
                ) -> ImmutableTaskGraph:
    cfg, L, T = dm.config, dm.layers[i], n_tokens
    H, hd = cfg.hidden, cfg.head_dim
    g = TaskGraph(f"layer{i}")
    wq, wk, wv = _w(L, "attn_q"), _w(L, "attn_k"), _w(L, "attn_v")
    heads = (cfg.n_heads, cfg.n_kv_heads, hd, act.max_context, cfg.rope_theta, cfg.neox_rope)
    if _qkv_fused(dm, i):
        # xw and xss: x's factors as the previous layer's down wrote them, when it did (else computed here)
        given = i > 0 and _writes_next_xw(dm, i - 1, T, fuse_experts)
        xw, xss = (act.xw, act.xss) if given else (None, None)
        xw_groups = act.xw_groups if given and _takes_groups(wq) else None
        g.task("attn_qkv", "qkv_rope", wq.qtype, act.x, xw, xss, _f32(L, "attn_norm"), cfg.rms_eps, wq.data,
               wk.data, wv.data, _f32(L, "attn_q_bias"), _f32(L, "attn_k_bias"), _f32(L, "attn_v_bias"),
               act.q, act.k_cache[i], act.v_cache[i], act.position, T, H, *heads, xw_groups)
    else:  # the five tasks qkv_rope stands for: the deferred norm's factors, the products scaled by inv, rope
        g.task("attn_norm", "rmsnorm_factors", act.x, _f32(L, "attn_norm"), act.h, None, act.norm_inv, T, H,
               cfg.rms_eps)
        for name, w, out, rows in (("q", wq, act.q, cfg.n_heads * hd), ("k", wk, act.k, cfg.n_kv_heads * hd),
                                   ("v", wv, act.v, cfg.n_kv_heads * hd)):
            g.task(f"attn_{name}", "matmul", w.qtype, w.data, act.h, _f32(L, f"attn_{name}_bias"), out, T,
                   rows, H, False, act.norm_inv, None, None, 0.0, None, None, None, None)
        if cfg.qk_norm:  # q and k normalised in place, as rows of the norm's width (a head, or a token's all)
            for name, out, n, width in zip(("q", "k"), (act.q, act.k), (cfg.n_heads, cfg.n_kv_heads),
                                           cfg.qk_norm_widths, strict=True):
                g.task(f"attn_{name}_norm", "rmsnorm", out, _f32(L, f"attn_{name}_norm"), out,
                       T * n * hd // width, width, cfg.rms_eps)
        g.task("rope_kv_append", "rope_kv_append", act.q, act.k, act.v, act.k_cache[i], act.v_cache[i],
               act.position, T, *heads)
    wo = _w(L, "attn_output")
    # attention's int8 groups, for the output projection when its rows read them
    attn_groups = act.attn_groups if _takes_groups(wo) and hd % 4 == 0 else None
    g.task("attention", "attention", act.q, act.k_cache[i], act.v_cache[i], act.attn, act.position, T,
           cfg.n_heads, cfg.n_kv_heads, hd, act.max_context, act.attn_scratch, attn_groups)
    # the FFN norm's factors for the fused router + gate-up launch's deferred shared gate-up (their groups
    # where its rows read them)
    deferred = _shared_norm_deferred(dm)
    factors_read = _router_fused(dm, i, fuse_experts)  # fused implies a shared expert, so deferred
    ffn_factors = ((_f32(L, "ffn_norm"), act.ffn_xw, act.ffn_xss,
                    act.ffn_xw_groups if _takes_groups(_w(L, "ffn_gate_shexp")) else None)
                   if factors_read else (None, None, None, None))
    g.task("attn_output", "matmul", wo.qtype, wo.data, act.attn, None, act.x, T, H, cfg.n_heads * hd, True,
           None, attn_groups, None, 0.0, *ffn_factors)
    _, ffn_xw, ffn_xss, ffn_xw_groups = ffn_factors

    E, k, ffn = cfg.n_experts, cfg.top_k, cfg.expert_ffn
    # The FFN's first task: the router (RMSNorm fused), or ffn_norm for dense models; emitted below unless the
    # fused router + gate-up launch takes it in.
    # x, norm_w, eps, h, w_router, ids, weights: the first arguments of both kernels that contain the router
    router_io = (act.x, _f32(L, "ffn_norm"), cfg.rms_eps, act.h, _f32(L, "ffn_gate_inp"), act.expert_ids,
                 act.expert_weights)
    router_task: tuple | None = (
        ("router_topk", "rmsnorm_router_topk", *router_io, T, E, H, k, cfg.normalize_topk) if E
        else ("ffn_norm", "rmsnorm", act.x, _f32(L, "ffn_norm"), act.h, T, H, cfg.rms_eps))

    # Shared expert (qwen2moe) or dense FFN (llama): expert 0 of a one-expert stack, same kernels. Every
    # gate-up task comes first, then the shared/dense down, then the routed downs (slot order), either shape.
    gate_ups: list[tuple] = []
    downs: list[tuple] = []
    ids, wts = act.expert_ids, act.expert_weights
    if cfg.shared_ffn or cfg.dense_ffn:
        sfx = "_shexp" if cfg.shared_ffn else ""
        dffn = cfg.shared_ffn or cfg.dense_ffn
        sg, su, sd = _w(L, f"ffn_gate{sfx}"), _w(L, f"ffn_up{sfx}"), _w(L, f"ffn_down{sfx}")
        s_qt, s_gate = _same_format(sg, su), _f32(L, "ffn_gate_inp_shexp")
        label = "shared_expert" if cfg.shared_ffn else "ffn"
        # the shared expert on xw scaled by inv (deferred: their task first), the dense FFN on h
        s_in, s_scale = (act.ffn_xw, act.norm_inv) if deferred else (act.h, None)
        if deferred:
            gate_ups.append(("ffn_norm_factors", "rmsnorm_factors", act.x, _f32(L, "ffn_norm"), act.ffn_xw,
                             None, act.norm_inv, T, H, cfg.rms_eps))
        gate_ups.append((f"{label}_gate_up", "moe_gate_up", s_qt, sg.data, su.data, s_in, None,
                         act.act_dense, T, 1, 0, 1, 1, dffn, H, s_scale))
        downs.append((f"{label}_down", "moe_down_accumulate", sd.qtype, sd.data, act.act_dense, None, None,
                      s_gate, act.h, act.x, T, 1, 0, 1, 1, H, dffn))

    if E:
        wg, wu, wd = _w(L, "ffn_gate_exps"), _w(L, "ffn_up_exps"), _w(L, "ffn_down_exps")
        qt = _same_format(wg, wu)
        # (gate-up task, down task, first slot, slot count): one launch each over all slots, or one per slot
        shapes = ([("routed_experts_gate_up_swiglu", "routed_experts_down_accumulate", 0, k)] if fuse_experts
                  else [(f"routed_expert_gate_up_{s}", f"routed_expert_down_{s}", s, 1) for s in range(k)])
        gate_ups += [(name, "moe_gate_up", qt, wg.data, wu.data, act.h, ids, act.act, T, k, s0, n, E, ffn, H,
                      None) for name, _, s0, n in shapes]
        downs += [(name, "moe_down_accumulate", wd.qtype, wd.data, act.act, ids, wts, None, None, act.x, T, k,
                   s0, n, E, H, ffn) for _, name, s0, n in shapes]
        # Fused, with a shared expert of the same formats: the router and both gate-ups in one launch, whose
        # router blocks also compute the shared expert's gate (gate_sh) for the fused down to read.
        fuse_router = _router_fused(dm, i, fuse_experts)
        gate_sh = act.shared_gate[:T] if fuse_router and s_gate is not None else None
        fused_down = _fused_down(dm, i, T, fuse_experts)
        # the activations' int8 groups, from the fused gate-up to the fused down, where the down reads them
        groups = fuse_router and fused_down and _takes_groups(sd) and _takes_groups(wd)
        act_groups = (act.act_dense_groups, act.act_groups) if groups else (None, None)
        if fuse_router:
            router_task = None
            gate_ups = [("router_experts_gate_up", "router_experts_gate_up", *router_io, qt, sg.data,
                         su.data, act.act_dense, dffn, s_gate, gate_sh, wg.data, wu.data, act.act, T, E, H, k,
                         cfg.normalize_topk, ffn, act.router_scratch, *act_groups, ffn_xw, ffn_xss,
                         ffn_xw_groups)]
        if fused_down:
            gate_inp_sh = None if gate_sh is not None else s_gate  # the gate once: from the router or here
            # and the next layer's xw and xss (and xw's groups), which its qkv_rope then reads instead of
            # computing them
            writes_xw = _writes_next_xw(dm, i, T, fuse_experts)
            next_w, reader = _norm_after(dm, i) if writes_xw else (None, None)
            xw, xss = (act.xw, act.xss) if writes_xw else (None, None)
            xw_groups = act.xw_groups if writes_xw and _takes_groups(reader) else None
            downs = [("experts_down_accumulate", "experts_down_accumulate", wd.qtype, sd.data, act.act_dense,
                      gate_inp_sh, gate_sh, dffn, wd.data, act.act, ids, wts, act.h, act.x, next_w, xw, xss,
                      T, k, E, H, ffn, *act_groups, xw_groups)]
        # A decode step whose FFN half the library runs in one launch (csrc/cuda/moe_ffn.cu): one task.
        if _ffn_in_one_launch(dm, i, T, fuse_experts):
            gate_ups = [("router_experts_ffn", "router_experts_ffn", *router_io, qt, sg.data, su.data,
                         sd.data, act.act_dense, dffn, s_gate, gate_sh, wg.data, wu.data, wd.data, act.act, T,
                         E, H, k, cfg.normalize_topk, ffn, act.router_scratch, ffn_xw, ffn_xss,
                         ffn_xw_groups)]
            downs = []
    for task in ([router_task] if router_task else []) + gate_ups + downs:
        g.task(*task)
    return g.snapshot()


def logits_graph(dm: DeviceModel, act: Activations, n_tokens: int, sampler: SamplerConfig,
                 fuse_experts: bool = True) -> ImmutableTaskGraph:
    """Final norm and logits for the LAST token of the step, next-token choice, position advance (by the
    step's token count). The norm is deferred as qkv_rope's: the head multiplies xw = x * output_norm and
    scales by inv; where the last layer's down wrote xw and x's sums of squares (as it does for a next
    layer's qkv_rope) the head computes inv from those sums and no norm launch comes before it, else
    ``output_norm`` (rmsnorm_factors) writes xw and inv first: the same bits either way."""
    cfg, T, out = dm.config, n_tokens, dm.output
    row = slice(T - 1, T)
    logits = act.logits[:1]
    g = TaskGraph("logits")
    if _writes_next_xw(dm, cfg.n_layers - 1, T, fuse_experts):
        groups = act.xw_groups[row] if _takes_groups(out) else None
        g.task("output", "matmul", out.qtype, out.data, act.xw[row], None, logits, 1, cfg.vocab, cfg.hidden,
               False, None, groups, act.xss[row], cfg.rms_eps, None, None, None, None)
    else:
        g.task("output_norm", "rmsnorm_factors", act.x[row], dm.output_norm.floats, act.h[row], None,
               act.norm_inv[:1], 1, cfg.hidden, cfg.rms_eps)
        g.task("output", "matmul", out.qtype, out.data, act.h[row], None, logits, 1, cfg.vocab, cfg.hidden,
               False, act.norm_inv[:1], None, None, 0.0, None, None, None, None)
    next_token = act.tokens[:1]
    log = (act.token_log, act.token_log.numel())  # where the position's advance logs the token chosen
    if sampler.greedy:  # the choice and the position's advance by the step's tokens in one launch
        g.task("argmax_advance", "argmax_advance", logits, next_token, cfg.vocab, act.position, T, *log)
    else:
        # The sample is keyed by the position of the token whose logits it reads (the step's last), as when
        # tokens come one a step: a step of several first moves the device position to its last token.
        if T > 1:
            g.task("position_to_last", "advance_position", act.position, T - 1, None, None, 0)
        g.task("sample", "sample", logits, next_token, cfg.vocab, sampler.temperature, sampler.top_p,
               sampler.top_k, u64_as_int64(sampler.seed), act.position)
        g.task("advance_position", "advance_position", act.position, 1, next_token, *log)
    g.transfer_to_host(DataTransferMode.EVERY_EXECUTION, next_token)
    return g.snapshot()
