#!/usr/bin/env python3
"""Where router_experts_ffn's time goes inside the decode chain: the persistent FFN launch's per-block events.

Runs decode steps (fused, CUDA graph) of a model on a library built with ``-DTM_FFN_TIMELINE=1``
(csrc/cuda/moe_ffn.cu: every block of the latest launch stamps the global timer at its start, when its
consumers are past pdl_wait, when h is ready, when each consumer group ends each phase and ends its wait
for the other blocks before a phase, when it has written x, when its producer has the ids and has issued
its last copy, when its router warp has the top-k and has seen every block's act_sh and act flags, and for
its first 24 chunks when their copies were issued, landed (warp 0 of the group past the wait) and were done
with (that warp's job), reads the last layer's stamps after
each step and prints, per event, min / median / max over the blocks in microseconds after the launch's first
block started (median over steps). Phases in ring order: SG, RG, SD, RD (the build's TM_FFN_SD_FIRST=1: SG,
SD, RG, RD).

Through scripts/device_run.sh: TUNING="tl:-DTM_FFN_TIMELINE=1" FFN_TIMELINE=tl STAGES=build,tuning ...
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys

import numpy as np
import torch
from rgu_timeline import decode_step_parser, decode_step_stamps, timeline_reader

from tornado_moe.kernels import ops as K
from tornado_moe.model.gguf_model import load_model
from tornado_moe.tools.run_info import run_info

MAX_BLOCKS = 1024  # TM_FFN_MAX_BLOCKS
EVENTS = (["start", "waited", "h"] + [f"end p{p} g{g}" for p in range(4) for g in range(2)]
          + [f"wait p{p} g{g}" for p in range(4) for g in range(2)]
          + ["done", "ids", "issued all", "published", "sh ready", "rt ready"]
          + [f"chunk {q} {what}" for q in range(24) for what in ("issued", "ready", "done")])


def read_launch(fn: ctypes._CFuncPtr) -> np.ndarray:
    """[blocks, events] ns of the latest launch (the rows it stamped), zeroed on the device after the copy."""
    rows = np.zeros((MAX_BLOCKS, len(EVENTS)), dtype=np.uint64)
    if fn(rows.ctypes.data, MAX_BLOCKS) != len(EVENTS):
        sys.exit("tm_cuda_ffn_timeline failed or has other events than this script")
    return rows[rows[:, 0] > 0]


def summarize(rows: np.ndarray) -> dict[str, list[float]]:
    """Per event stamped by some block: [min, median, max] us after the first block's start."""
    t = rows.astype(np.int64)
    t0 = int(t[:, 0].min())
    out = {}
    for k, ev in enumerate(EVENTS):
        col = t[:, k][t[:, k] > 0]
        if len(col):
            rel = (col - t0) / 1e3
            out[ev] = [float(rel.min()), float(np.median(rel)), float(rel.max())]
    return out


def main(argv: list[str] | None = None) -> int:
    args = decode_step_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    fn = timeline_reader("ffn")
    K.set_ffn_one_launch(True)  # the persistent launch is opt-in (the timeline is of that launch)
    rows = decode_step_stamps(load_model(args.model), args.prompt_tokens, args.steps, lambda: read_launch(fn))
    samples = [summarize(r) for r in rows]
    print(f"router_experts_ffn, the last layer's launch, {len(samples)} decode steps: us after its first "
          "block started, min / median / max over blocks (median over steps)")
    for ev in EVENTS:
        have = [s[ev] for s in samples if ev in s]
        if have and not ev.startswith("chunk"):
            v = [statistics.median(h[i] for h in have) for i in range(3)]
            print(f"  {ev:12s} {v[0]:7.2f} {v[1]:7.2f} {v[2]:7.2f}")
    print("  chunk q: issued / landed / done, medians over blocks (median over steps)")
    for q in range(24):
        have = [[s[f"chunk {q} {w}"][1] for s in samples if f"chunk {q} {w}" in s]
                for w in ("issued", "ready", "done")]
        if all(have):
            print(f"  chunk {q:2d} " + " ".join(f"{statistics.median(h):7.2f}" for h in have))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run_info(sys.argv[1:], "cuda", model=args.model, samples=samples), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
