#!/usr/bin/env python3
"""Per-kernel decode timings at the real Qwen1.5-MoE-A2.7B shapes (Q8_0, one token) via tornado_moe.kernels.

Every kernel is launched `reps` times inside one CUDA graph (as a decode step launches it) and the graph is
replayed; a launch's time is the replay time / reps (median of `--trials` replays). Weights rotate over enough
copies (or, for routed experts, over different experts) that no launch finds its weights in the 60 MB L2, as
in decode. Works with any tree of the package on PYTHONPATH (the baseline commit too): kernels a tree lacks
are skipped. --layout tiled times the Q8_0 weight kernels on rows re-laid out as TM_Q8_0_TILED (what the
engine uploads on CUDA). The last entries are a whole fused layer, its five launches chained, and the same
with the FFN half in one launch (router_experts_ffn). Prints a table; --json writes {command, date,
git_commit, gpu_name, copy_gb_s, pdl, layout, kernels}.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
from collections.abc import Callable

import torch

from tornado_moe import kernels as K
from tornado_moe.tools.profile import copy_bandwidth_gb_s
from tornado_moe.tools.run_info import run_info

Q8_0 = 8
QT = Q8_0  # the qtype the weight kernels get (--layout)
H, HEADS, HD, E, TOPK, FFN, SFFN, VOCAB, CTX, POS = 2048, 16, 128, 60, 4, 1408, 5632, 151936, 4096, 143
POOL_BYTES = 160 << 20  # weight copies per kernel: at least this many bytes, well past L2


def q8_0(rows: int, cols: int, copies: int = 1) -> torch.Tensor:
    """Random Q8_0 rows as stored in GGUF (fp16 scale + 32 int8 per block), `copies` matrices back to back."""
    nb = cols // 32
    blocks = torch.empty(copies * rows, nb, 34, dtype=torch.uint8, device="cuda")
    scale = (torch.rand(copies * rows, nb, device="cuda") * 0.002 + 0.001).half()
    blocks[..., :2] = scale.view(torch.uint8).view(copies * rows, nb, 2)
    blocks[..., 2:] = torch.randint(-128, 128, (copies * rows, nb, 32), dtype=torch.int8, device="cuda").view(
        torch.uint8)
    w = blocks.view(copies, rows * nb * 34)
    if QT != Q8_0:
        from tornado_moe.quant.tiled import tile_q8_0

        w = tile_q8_0(w, cols)
    return w


# Whether qkv_rope reads xw (and x's partial sums xss) and experts_down_accumulate writes them (the deferred
# norm, results/NOTES.md v10-v11): the baseline's trees, whose kernels this script also times, take neither.
_QKV_ARGS = getattr(K, "KERNEL_ARGS", {}).get("qkv_rope", ())
DEFERRED_NORM, PARTIAL_SUMS = "xw" in _QKV_ARGS, "xss" in _QKV_ARGS
# Whether the kernels take the shared-expert gate from the router (v4q): a baseline tree's kernels may not.
GATE_SH = hasattr(K, "experts_down_accumulate") and (
    "gate_sh" in inspect.signature(K.experts_down_accumulate).parameters)
# Whether the producers write int8 activation groups for the next Q8_0 product (the q8-act path): then the
# kernels are timed reading and writing them, as in the model.
GROUPS = hasattr(K, "act_groups_bytes")
# Whether the shared expert's gate-up takes the FFN norm deferred (attn_output writes xw, its sums and groups;
# results/NOTES.md lesson 189): then attn_output and the gate-up are timed in that form, as in the model.
DEFERRED_FFN = "xw" in getattr(K, "KERNEL_ARGS", {}).get("router_experts_gate_up", ())
HOT_L2 = False  # --hot-l2: one copy of every weight and fixed experts, so weights stay in L2 between launches


def copies_for(nbytes: int) -> int:
    return 1 if HOT_L2 else max(1, min(64, math.ceil(POOL_BYTES / nbytes)))


def graph_time_us(launch: Callable[[int], None], reps: int, trials: int) -> float:
    """Median time of one launch: `reps` launches (launch(i) uses rotation slot i) captured in one graph."""
    for i in range(3):
        launch(i)  # warm-up outside capture (module load, smem opt-in)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            launch(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def kernels(att_contexts: tuple[int, ...] = (POS + 1,)
            ) -> list[tuple[str, int, Callable[[], Callable[[int], None]]]]:
    """(name, weight bytes per launch, builder of launch(i)); attention once per context length (the layer
    chain takes the first)."""
    f32 = dict(dtype=torch.float32, device="cuda")
    x = torch.randn(1, H, **f32)
    h = torch.randn(1, H, **f32)
    h_next = torch.randn(1, H, **f32)  # the down's xw output
    sums, sums_next = torch.rand(1, H // 4, **f32), torch.empty(1, H // 4, **f32)  # xss read, xss written

    def groups_of(*shape: int) -> torch.Tensor:  # int8 groups of rows of shape[-1] values
        return torch.zeros(*shape[:-1], K.act_groups_bytes(shape[-1]), dtype=torch.uint8, device="cuda")

    xw_groups = groups_of(1, H) if GROUPS else None  # the down writes them, qkv_rope reads them
    norm_w = 1 + 0.1 * torch.randn(H, **f32)
    pos = torch.tensor([POS], dtype=torch.int32, device="cuda")
    k_cache = torch.randn(CTX, H, **f32)
    v_cache = torch.randn(CTX, H, **f32)
    q = torch.randn(1, H, **f32)
    attn = torch.empty(1, H, **f32)
    # trees before attention's scratch take none
    att_scratch = ((torch.zeros(K.attention_scratch_words(1, HEADS, HD), dtype=torch.int32, device="cuda"),)
                   if hasattr(K, "attention_scratch_words") else ())
    rb = H // 32 * 34  # row bytes at hidden 2048
    out: list = []

    # the FFN norm's factors attn_output writes and the shared gate-up reads (the deferred FFN norm)
    ffn_factors = dict(xw=torch.randn(1, H, **f32), xss=torch.rand(1, H // 4, **f32),
                       xw_groups=groups_of(1, H))

    def matmul(name: str, rows: int, cols: int, xin: torch.Tensor, y: torch.Tensor, acc: bool,
               **factors: torch.Tensor) -> None:
        nbytes = rows * cols // 32 * 34
        def build() -> Callable[[int], None]:
            w = q8_0(rows, cols, copies_for(nbytes))
            return lambda i: K.matmul(QT, w[i % w.shape[0]], xin, None, y, 1, rows, cols, acc, **factors)
        out.append((name, nbytes, build))

    if hasattr(K, "qkv_rope"):
        def qkv() -> Callable[[int], None]:
            n = copies_for(3 * H * rb)
            wq, wk, wv = q8_0(H, H, n), q8_0(H, H, n), q8_0(H, H, n)
            b = torch.randn(H, **f32)
            # xw as the previous layer's down writes it (trees before the deferred norm take no xw)
            xs = (x, h, sums) if PARTIAL_SUMS else (x, h) if DEFERRED_NORM else (x,)
            groups = (xw_groups,) if GROUPS else ()
            return lambda i: K.qkv_rope(QT, *xs, norm_w, 1e-6, wq[i % n], wk[i % n], wv[i % n], b, b, b, q,
                                        k_cache, v_cache, pos, 1, H, HEADS, HEADS, HD, CTX, 1e6, True,
                                        *groups)
        out.append(("attn_qkv (qkv_rope)", 3 * H * rb, qkv))
    matmul("attn_q (one of q/k/v)", H, H, h, q, False)

    for n_ctx in att_contexts:
        def attention(n_ctx: int = n_ctx) -> Callable[[int], None]:
            # the position whose context is n_ctx positions long
            at = torch.tensor([n_ctx - 1], dtype=torch.int32, device="cuda")
            return lambda i: K.attention(q, k_cache, v_cache, attn, at, 1, HEADS, HEADS, HD, CTX,
                                         *att_scratch)
        out.append((f"attention (ctx {n_ctx})", 0, attention))
    matmul("attn_output (+residual)", H, H, attn, x, True,
           **(dict(next_norm_w=norm_w, y_w=ffn_factors["xw"], y_ss=ffn_factors["xss"],
                   y_w_groups=ffn_factors["xw_groups"]) if DEFERRED_FFN else {}))

    ids = torch.zeros(1, TOPK, dtype=torch.int32, device="cuda")
    wts = torch.rand(1, TOPK, **f32)
    w_router = 0.02 * torch.randn(E, H, **f32)
    if hasattr(K, "rmsnorm_router_topk"):
        out.append(("router_topk (rmsnorm fused)", E * H * 4, lambda: (
            lambda i: K.rmsnorm_router_topk(x, norm_w, 1e-6, h, w_router, ids, wts, 1, E, H, TOPK, False))))
    out.append(("rmsnorm", 0, lambda: (lambda i: K.rmsnorm(x, norm_w, h, 1, H, 1e-6))))
    out.append(("router_topk", E * H * 4, lambda: (
        lambda i: K.router_topk(w_router, h, ids, wts, 1, E, H, TOPK, False))))

    act_sh = torch.randn(1, SFFN, **f32) * 0.1
    act = torch.randn(1, TOPK, FFN, **f32) * 0.1
    act_sh_groups, act_groups = (groups_of(1, SFFN), groups_of(1, TOPK, FFN)) if GROUPS else (None, None)
    gate_inp = 0.02 * torch.randn(H, **f32)
    gate_sh = torch.rand(1, **f32)

    def shared_gate_up() -> Callable[[int], None]:
        n = copies_for(2 * SFFN * rb)
        wg, wu = q8_0(SFFN, H, n), q8_0(SFFN, H, n)
        return lambda i: K.moe_gate_up(QT, wg[i % n], wu[i % n], h, None, act_sh, 1, 1, 0, 1, 1, SFFN, H)
    out.append(("shared_expert_gate_up", 2 * SFFN * rb, shared_gate_up))

    # Routed experts: each launch picks 4 distinct experts of 60 (rotating, so weights come from DRAM; the
    # same 4 with --hot-l2).
    rot = torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(64)]).to(torch.int32)
    ids_rot = [rot[j:j + 1].contiguous() for j in ([0] * 64 if HOT_L2 else range(64))]

    def routed_gate_up() -> Callable[[int], None]:
        wg, wu = q8_0(E * FFN, H)[0], q8_0(E * FFN, H)[0]
        return lambda i: K.moe_gate_up(QT, wg, wu, h, ids_rot[i % 64], act, 1, TOPK, 0, TOPK, E, FFN, H)
    out.append(("routed_experts_gate_up (4 of 60)", 2 * TOPK * FFN * rb, routed_gate_up))

    if hasattr(K, "experts_gate_up"):
        def experts_gate_up() -> Callable[[int], None]:
            n = copies_for(2 * SFFN * rb)
            sg, su = q8_0(SFFN, H, n), q8_0(SFFN, H, n)
            wg, wu = q8_0(E * FFN, H)[0], q8_0(E * FFN, H)[0]
            return lambda i: K.experts_gate_up(QT, sg[i % n], su[i % n], act_sh, SFFN, wg, wu, h,
                                               ids_rot[i % 64], act, 1, TOPK, E, FFN, H)
        out.append(("experts_gate_up (shared + 4 of 60)", 2 * (SFFN + TOPK * FFN) * rb, experts_gate_up))

    if hasattr(K, "router_experts_gate_up"):
        def router_experts_gate_up() -> Callable[[int], None]:
            n = copies_for(2 * SFFN * rb)
            sg, su = q8_0(SFFN, H, n), q8_0(SFFN, H, n)
            wg, wu = q8_0(E * FFN, H)[0], q8_0(E * FFN, H)[0]
            # other inputs, other experts: rows from DRAM
            xs = [torch.randn(1, H, **f32) for _ in range(1 if HOT_L2 else 16)]
            scratch = torch.zeros(K.router_gate_up_scratch_words(1, E, H), dtype=torch.int32, device="cuda")
            gate = (gate_inp, gate_sh) if GATE_SH else ()  # the router blocks compute the shared gate (v4q)
            groups = (act_sh_groups, act_groups) if GROUPS else ()
            deferred = ffn_factors if DEFERRED_FFN else {}
            return lambda i: K.router_experts_gate_up(
                xs[i % len(xs)], norm_w, 1e-6, h, w_router, ids, wts, QT, sg[i % n], su[i % n], act_sh, SFFN,
                *gate, wg, wu, act, 1, E, H, TOPK, False, FFN, scratch, *groups, **deferred)
        out.append(("router_experts_gate_up (router + shared + 4 of 60)",
                    E * H * 4 + 2 * (SFFN + TOPK * FFN) * rb, router_experts_gate_up))

    def shared_down() -> Callable[[int], None]:
        nbytes = H * SFFN // 32 * 34
        n = copies_for(nbytes)
        wd = q8_0(H, SFFN, n)
        return lambda i: K.moe_down_accumulate(QT, wd[i % n], act_sh, None, None, gate_inp, h, x, 1, 1, 0,
                                               1, 1, H, SFFN)
    out.append(("shared_expert_down (+residual)", H * SFFN // 32 * 34, shared_down))

    def routed_down() -> Callable[[int], None]:
        wd = q8_0(E * H, FFN)[0]
        return lambda i: K.moe_down_accumulate(QT, wd, act, ids_rot[i % 64], wts, None, None, x, 1, TOPK, 0,
                                               TOPK, E, H, FFN)
    out.append(("routed_experts_down (4 of 60)", TOPK * H * FFN // 32 * 34, routed_down))

    if hasattr(K, "experts_down_accumulate"):
        def experts_down() -> Callable[[int], None]:
            n = copies_for(H * SFFN // 32 * 34)
            sd, wd = q8_0(H, SFFN, n), q8_0(E * H, FFN)[0]
            gate = (None, gate_sh) if GATE_SH else (gate_inp,)  # the gate as the router wrote it (v4q on)
            # and the next layer's xw (and xss), as in the model
            xw = (norm_w, h_next, sums_next) if PARTIAL_SUMS else (norm_w, h_next) if DEFERRED_NORM else ()
            groups = (act_sh_groups, act_groups, xw_groups) if GROUPS else ()
            return lambda i: K.experts_down_accumulate(QT, sd[i % n], act_sh, *gate, SFFN, wd, act,
                                                       ids_rot[i % 64], wts, h, x, *xw, 1, TOPK, E, H, FFN,
                                                       *groups)
        out.append(("experts_down_accumulate (shared + 4 of 60)", H * (SFFN + TOPK * FFN) // 32 * 34,
                    experts_down))

    if hasattr(K, "router_experts_ffn"):
        def router_experts_ffn() -> Callable[[int], None]:
            n = copies_for(2 * SFFN * rb + H * SFFN // 32 * 34)
            sg, su, sd = q8_0(SFFN, H, n), q8_0(SFFN, H, n), q8_0(H, SFFN, n)
            wg, wu, wd = q8_0(E * FFN, H)[0], q8_0(E * FFN, H)[0], q8_0(E * H, FFN)[0]
            xs = [torch.randn(1, H, **f32) for _ in range(1 if HOT_L2 else 16)]  # other experts each
            words = K.router_experts_ffn_scratch_words(1, E, H)
            scratch = torch.zeros(words, dtype=torch.int32, device="cuda")
            return lambda i: K.router_experts_ffn(
                xs[i % len(xs)], norm_w, 1e-6, h, w_router, ids, wts, QT, sg[i % n], su[i % n], sd[i % n],
                act_sh, SFFN, gate_inp, gate_sh, wg, wu, wd, act, 1, E, H, TOPK, False, FFN, scratch)
        out.append(("router_experts_ffn (the whole FFN half)",
                    E * H * 4 + 2 * (SFFN + TOPK * FFN) * rb + H * (SFFN + TOPK * FFN) // 32 * 34,
                    router_experts_ffn))

    logits = torch.empty(1, VOCAB, **f32)
    matmul("output (151936 x 2048)", VOCAB, H, h, logits, False)

    # A whole fused layer, its 5 launches back to back on the same buffers as in decode: what a kernel costs
    # inside the chain can differ from its time alone (results/NOTES.md, lesson 24); this is the time per
    # layer to hold against tornado-moe profile's chain per layer.
    by_name = {name: (nbytes, build) for name, nbytes, build in out}
    parts = ["attn_qkv (qkv_rope)", f"attention (ctx {att_contexts[0]})", "attn_output (+residual)",
             "router_experts_gate_up (router + shared + 4 of 60)",
             "experts_down_accumulate (shared + 4 of 60)"]
    ffn_parts = parts[:3] + ["router_experts_ffn (the whole FFN half)"]
    for label, chain in (("layer (the 5 fused launches, chained)", parts),
                         ("layer (4 launches: the FFN half in one)", ffn_parts)):
        if all(p in by_name for p in chain):
            def layer(chain: list[str] = chain) -> Callable[[int], None]:
                launches = [by_name[p][1]() for p in chain]

                def launch(i: int) -> None:
                    for f in launches:
                        f(i)
                return launch
            out.append((label, sum(by_name[p][0] for p in chain), layer))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40, help="launches per captured graph (default: 40)")
    ap.add_argument("--trials", type=int, default=7, help="graph replays, median reported (default: 7)")
    ap.add_argument("--label", default="", help="a name for this tree in the report (e.g. baseline)")
    ap.add_argument("--only", default="", help="comma list: only kernels whose name contains one")
    ap.add_argument("--layout", choices=("gguf", "tiled"), default="gguf",
                    help="Q8_0 rows as stored in GGUF, or re-laid out as TM_Q8_0_TILED "
                         "(default: %(default)s)")
    ap.add_argument("--hot-l2", action="store_true",
                    help="no weight rotation: every launch finds its weights in L2 (what an L2 prefetch of a "
                         "kernel's whole weights ahead of it could at best give)")
    ap.add_argument("--att-contexts", default=str(POS + 1), metavar="N[,M...]",
                    help=f"context lengths attention is timed at, 1..{CTX} (default: %(default)s)")
    ap.add_argument("--json", help="write the report as JSON")
    args = ap.parse_args()
    att_contexts = tuple(int(n) for n in args.att_contexts.split(","))
    if not all(1 <= n <= CTX for n in att_contexts):
        ap.error(f"--att-contexts: every length must be in 1..{CTX}, got {args.att_contexts}")
    global QT, HOT_L2
    HOT_L2 = args.hot_l2
    if args.layout == "tiled":
        from tornado_moe.quant.tiled import Q8_0_TILED

        QT = Q8_0_TILED
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    bw = copy_bandwidth_gb_s(torch.device("cuda"))  # the ceiling tornado-moe profile uses
    rows = []
    only = [o for o in args.only.split(",") if o]
    for name, nbytes, build in kernels(att_contexts):
        if only and not any(o in name for o in only):
            continue
        us = graph_time_us(build(), args.reps, args.trials)
        gbs = nbytes / (us * 1e3) if nbytes else 0.0
        rows.append({"kernel": name, "us": round(us, 2), "weight_bytes": nbytes, "gb_s": round(gbs, 1),
                     "fraction_of_copy_bandwidth": round(gbs / bw, 3)})
        torch.cuda.empty_cache()
    pdl = os.environ.get("TORNADO_MOE_PDL", "1") != "0"
    print(f"{args.label or 'tree'}: copy bandwidth {bw:.0f} GB/s, PDL {'on' if pdl else 'off'}, "
          f"{args.layout} rows")
    print(f"{'kernel':36s} {'us':>8s} {'MB':>8s} {'GB/s':>8s} {'% copy':>7s}")
    for r in rows:
        print(f"{r['kernel']:36s} {r['us']:8.2f} {r['weight_bytes'] / 1e6:8.2f} {r['gb_s']:8.1f} "
              f"{100 * r['fraction_of_copy_bandwidth']:7.1f}")
    if args.json:
        report = run_info(sys.argv[1:], "cuda", label=args.label, copy_gb_s=round(bw, 1), pdl=pdl,
                          layout=args.layout, hot_l2=args.hot_l2, reps=args.reps, trials=args.trials,
                          kernels=rows)
        report["command"] = " ".join(["python3", "scripts/kernel_bench.py", *sys.argv[1:]])
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
