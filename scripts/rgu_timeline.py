#!/usr/bin/env python3
"""Where router_experts_gate_up's time goes inside the decode chain (results/NOTES.md lesson 46 a).

Alone the fused launch takes ~3.8 us more than the same gate-ups without the router, and in the chain it is ~9
us a layer above a pure read of its bytes. This runs decode steps (fused, CUDA graph) of a model on a library
built with ``-DTM_RGU_TIMELINE=1`` (csrc/cuda/rgu_timeline.cuh: every block of the latest launch stamps the
global timer at its start, after pdl_wait, when its role is known, when its inputs are ready and when its
warps end; the experts_down launch after it stamps too, on the same clock: its start, pdl_wait, when its last
routed warp and its last shared warp finished their dot products, and its end), reads the stamps of the step's
last layer after each step, and prints, per role (router, shared expert, routed, down), when its blocks start,
wait and end relative to the gate-up launch's first block. The stamps cost the kernels a little (spills in the
measurement build), so read the shape of the timeline, not its total.

Run on a GPU machine against a measurement build, e.g. through scripts/device_run.sh's tuning stage:
  TUNING="tl:-DTM_RGU_TIMELINE=1" TIMELINE=tl ... bash scripts/device_run.sh
or by hand: PYTHONPATH=<tree built with the flag> python3 scripts/rgu_timeline.py --model model.gguf
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from tornado_moe.engine import Engine, EngineOptions
from tornado_moe.model.gguf_model import GGUFModel, load_model
from tornado_moe.native import native_dir
from tornado_moe.tools.run_info import run_info

T = TypeVar("T")
ROWS = 8192  # kTimelineRows in csrc/cuda/rgu_timeline.cuh
# rgu_timeline.cuh's TimelineRow (48 bytes, static_assert there): the timer at the five events (ns), role, SM
ROW = np.dtype([("t", "<u8", 5), ("role", "<u4"), ("sm", "<u4")])
ROWS_PER_BLOCK = 8  # kRowsPerBlock in csrc/cuda/moe.cuh: a gate-up block's rows of gate and of up
ROLES = ("router", "shared", "routed", "down")  # down: the experts_down launch after it
EVENTS = ("start", "after_wait", "role_known", "inputs_ready", "end")
# the down's blocks stamp their warps' dot products instead of a role and inputs (results/NOTES.md lesson 112)
DOWN_EVENTS = ("start", "after_wait", "routed_dots", "shared_dots", "end")


def events_of(role: str) -> tuple[str, ...]:
    return DOWN_EVENTS if role == "down" else EVENTS
TOPK_STEPS = ("poll start", "logits in", "softmax", "picks", "ids stored")  # role 4, the last row


def timeline_reader(kernel: str = "rgu") -> ctypes._CFuncPtr:
    """tm_cuda_<kernel>_timeline of a measurement build (-DTM_<KERNEL>_TIMELINE=1): (buffer, rows) -> int."""
    lib = ctypes.CDLL(str(native_dir() / "libtornado_moe.so"))  # the library the torch ops already loaded
    try:
        fn = getattr(lib, f"tm_cuda_{kernel}_timeline")
    except AttributeError:
        sys.exit(f"this tornado-moe library was built without -DTM_{kernel.upper()}_TIMELINE=1: no timeline "
                 "to read")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    fn.restype = ctypes.c_int64
    return fn


def read_launch(fn: ctypes._CFuncPtr) -> np.ndarray:
    """The latest launches' stamped rows (ROW), which the library zeroes after the copy."""
    rows = np.zeros(ROWS, dtype=ROW)
    if fn(rows.ctypes.data, ROWS) < 0:
        sys.exit("tm_cuda_rgu_timeline failed (a CUDA error)")
    return rows[rows["t"][:, 0] > 0]


def summarize(rows: np.ndarray, block_bytes: int | None = None) -> dict:
    """Per role and event: min / median / max microseconds after the gate-up launch's first block started.

    With block_bytes (the weight bytes of one gate-up block), also the launch's weight stream each
    microsecond: each shared and routed block's bytes spread evenly from its inputs to its end, summed over
    the blocks (TB/s), which shows a phase of the launch streaming slower than another (results/NOTES.md
    lesson 197)."""
    t = rows["t"].astype(np.int64)
    role = rows["role"].astype(np.int64)
    gate_up = role < 3
    t0 = int(t[gate_up, 0].min())
    rel = (t - t0) / 1e3
    out: dict = {"blocks": int(gate_up.sum()), "span_us": float(rel[gate_up, 4].max())}  # the gate-up launch
    for r, name in enumerate(ROLES):
        sel = rel[role == r]
        if not len(sel):
            continue
        out[name] = {"blocks": int(len(sel))}
        for k, ev in enumerate(events_of(name)):
            col = sel[:, k]
            out[name][ev] = [float(col.min()), float(np.median(col)), float(col.max())]
        if name == "down":  # per block: its routed and shared warps' dots after the wait, then its epilogue
            out[name]["routed_dots_us_median"] = float(np.median(sel[:, 2] - sel[:, 1]))
            out[name]["shared_dots_us_median"] = float(np.median(sel[:, 3] - sel[:, 1]))
            out[name]["epilogue_us_median"] = float(np.median(sel[:, 4] - np.maximum(sel[:, 2], sel[:, 3])))
        else:
            out[name]["waiting_us_median"] = float(np.median(sel[:, 3] - sel[:, 2]))
            out[name]["streaming_us_median"] = float(np.median(sel[:, 4] - sel[:, 3]))
    # The gate-up launch's blocks on the GPU each microsecond: resident (started, not ended) and streaming
    # (inputs in hand, not ended): where slots sit idle (waiting blocks, the tail).
    g = rel[gate_up]
    at = np.arange(0.0, out["span_us"], 1.0)
    out["occupancy"] = [[float(x), int(((g[:, 0] <= x) & (g[:, 4] > x)).sum()),
                         int(((g[:, 3] <= x) & (g[:, 4] > x)).sum())] for x in at]
    if block_bytes:
        streaming = (role == 1) | (role == 2)
        streams = rel[streaming]
        # a block without an inputs stamp (none at t = 0) streams from its wait
        begin = np.where(t[streaming, 3] > 0, streams[:, 3], streams[:, 1])
        length = np.maximum(streams[:, 4] - begin, 1e-3)
        out["weight_tb_s"] = [
            [float(x), float((np.clip(np.minimum(streams[:, 4], x + 1) - np.maximum(begin, x), 0, None)
                              / length).sum() * block_bytes / 1e6)] for x in at]
    topk = rel[role == 4]
    if len(topk):  # the publishing router block's top-k: poll start, logits in, softmax, picks, ids stored
        out["topk"] = [float(v) for v in topk[0]]
    if "router" in out and "routed" in out:
        router_done = out["router"]["end"][2]
        out["routed_started_before_the_ids"] = int((rel[role == 2][:, 2] < router_done).sum())
    return out


def decode_step_stamps(model: GGUFModel, prompt_tokens: int, steps: int, read: Callable[[], T]) -> list[T]:
    """Feeds a prompt of token ids 1..prompt_tokens (fused, CUDA graph), clears the stamps (read() once), then
    returns read() after each of `steps` decode steps: what a measurement build stamped in that step."""
    engine = Engine(model, EngineOptions(device="cuda", cuda_graphs=True))
    try:
        for tok in range(1, prompt_tokens + 1):
            engine.feed(tok)
        torch.cuda.synchronize()
        read()  # the prompt's stamps, cleared
        out = []
        for _ in range(steps):
            engine.decode_next()
            torch.cuda.synchronize()
            out.append(read())
        return out
    finally:
        engine.close()


def decode_step_parser(description: str) -> argparse.ArgumentParser:
    """The options of a timeline script: the model, the prompt, the measured steps, a JSON report."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True, help="GGUF model with routed and shared experts (the synth)")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="prompt length before the measured steps")
    ap.add_argument("--steps", type=int, default=8, help="decode steps, one timeline sample after each")
    ap.add_argument("--json", help="write every sample's summary here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = decode_step_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--raw", help="write every sample's rows here (.npz, one array per step)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    read = timeline_reader()
    model = load_model(args.model)
    gate = model.layer(0)["ffn_gate_shexp"]
    block_bytes = 2 * ROWS_PER_BLOCK * gate.data.shape[-1] if gate is not None else None
    rows = decode_step_stamps(model, args.prompt_tokens, args.steps, lambda: read_launch(read))
    raw = {f"step{step}": r for step, r in enumerate(rows)}
    samples = [summarize(r, block_bytes) for r in rows]
    print(f"router_experts_gate_up, the last layer's launch, {len(samples)} decode steps (median over steps "
          "of each figure; us after the launch's first block started: min / median / max over its blocks)")
    print(f"span {statistics.median(s['span_us'] for s in samples):.2f} us, "
          f"{samples[-1]['blocks']} blocks")
    for name in ROLES:
        if name not in samples[-1]:
            continue
        print(f"  {name:7s} {samples[-1][name]['blocks']:5d} blocks")
        for ev in events_of(name):
            v = [statistics.median(s[name][ev][i] for s in samples) for i in range(3)]
            print(f"    {ev:13s} {v[0]:7.2f} {v[1]:7.2f} {v[2]:7.2f}")

        def med(key: str, name: str = name) -> float:
            return statistics.median(s[name][key] for s in samples)
        if name == "down":
            print(f"    after the wait, medians over blocks: routed dots {med('routed_dots_us_median'):.2f} "
                  f"us, shared dots {med('shared_dots_us_median'):.2f} us; epilogue (end - the later of the "
                  f"two) {med('epilogue_us_median'):.2f} us")
        else:
            print(f"    waiting (inputs_ready - role_known), median {med('waiting_us_median'):.2f} us; "
                  f"streaming (end - inputs_ready), median {med('streaming_us_median'):.2f} us")
    if "topk" in samples[-1]:
        steps = [statistics.median(s["topk"][i] for s in samples) for i in range(5)]
        print("  top-k (router block 0): " + ", ".join(
            f"{name} {v:.2f}" for name, v in zip(TOPK_STEPS, steps, strict=True)))
    occ = samples[-1]["occupancy"]
    print("  gate-up blocks resident / streaming each us (last step): " +
          " ".join(f"{x:.0f}:{r}/{st}" for x, r, st in occ))
    if "weight_tb_s" in samples[-1]:
        rate = [statistics.median(s["weight_tb_s"][i][1] for s in samples if i < len(s["weight_tb_s"]))
                for i in range(len(samples[-1]["weight_tb_s"]))]
        print("  gate-up weight stream each us, TB/s (median over steps): " +
              " ".join(f"{i}:{r:.2f}" for i, r in enumerate(rate)))
    if "routed_started_before_the_ids" in samples[-1]:
        print(f"  routed blocks that had their ticket before the last router block ended: "
              f"{statistics.median(s['routed_started_before_the_ids'] for s in samples)}")
    if args.raw:
        np.savez_compressed(args.raw, **raw)
    if args.json:
        report = run_info(sys.argv[1:], "cuda", model=args.model, samples=samples)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
