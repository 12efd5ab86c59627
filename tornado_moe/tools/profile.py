"""``tornado-moe profile``: launches per layer and per token, kernel time and bytes per task, per variant.

For each variant (fused / per-slot experts, eager / CUDA graph, torch / Java route) the same prompt and
decode steps run through one Engine with the plan's profiler on:

- launches, as the task graphs declare them (``ImmutableTaskGraph.launch_count``,
  ``ExecutionPlan.launches_per_execution``) and as measured: on a GPU by ``torch.profiler`` (CUDA kernel
  events of a few decode steps, one event per kernel node of a graph replay, kernels from any library
  including JNI), on the CPU by the route's own counter (the ProfilerResult). Declared and measured must
  agree; the report names each task where they do not;
- time per task: the plan profiler's per-launch timing in eager mode (device events on CUDA, the host clock
  on CPU) and, on a GPU, torch.profiler's kernel durations (the only per-task times inside a graph replay);
- on a GPU, the chain time per task: how much later the step's kernels have all finished because of this
  one (its end minus the latest end before it, in start order). With programmatic dependent launch a kernel
  starts while its predecessor drains, so durations overlap and add up to more than the step; chain times
  add up to the step's kernel span (idle time before a kernel counts as its own) and say where the step's
  time goes. Read them for CUDA-graph variants: in eager mode the traced steps wait on the host, whose
  launches torch.profiler slows, so they mostly measure that;
- on a GPU, what the device does between decode steps (those per-step traces run each step alone): one
  generate() under torch.profiler, the device's idle time at each step boundary and its copies per step;
- bytes per task from the task arguments (:mod:`tornado_moe.tools.traffic`) and the achieved GB/s against
  the machine's copy bandwidth measured in the same run (:func:`copy_bandwidth_gb_s`).

The first generation of each variant is a warm-up (module loading, CUDA-graph capture); the profile is the
difference of the profiler counters over the following identical generations (``repeats``), each task's
time being its fastest run's (a launch preempted on a busy host does not skew the table).
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tornado_moe.graph.profiler import ProfilerResult
from tornado_moe.kernels.ops import KERNEL_ARGS
from tornado_moe.tools.traffic import task_bytes
from tornado_moe.tools.variants import Variant, variant_engine

__all__ = [
    "task_kind",
    "graph_kind",
    "profiler_summary_table",
    "copy_bandwidth_gb_s",
    "chain_times",
    "profile_variant",
    "profile_model",
    "bandwidth_targets",
    "below_bandwidth_target",
    "format_report",
    "plot_report",
]

_SLOT_SUFFIX = re.compile(r"_\d+$")
_LAYER = re.compile(r"^layer\d+$")


def task_kind(task: str) -> str:
    """A task's name without its slot index: ``routed_expert_gate_up_3`` -> ``routed_expert_gate_up``."""
    return _SLOT_SUFFIX.sub("", task)


def graph_kind(graph: str) -> str:
    """``layer17`` -> ``layer``; other graph names unchanged."""
    return "layer" if _LAYER.match(graph) else graph


def _is_routed(kernel: str, args: Sequence[Any]) -> bool:
    """A routed-expert launch: an expert kernel that reads per-token expert ids (shared/dense FFNs do not)."""
    if kernel not in ("moe_gate_up", "experts_gate_up", "router_experts_gate_up", "router_experts_ffn",
                      "moe_down_accumulate", "experts_down_accumulate"):
        return False
    return dict(zip(KERNEL_ARGS[kernel], args, strict=True))["ids"] is not None


# ---- the per-run table of `generate --profiler` -----------------------------------------------------------

def profiler_summary_table(result: ProfilerResult, launches_per_token: int) -> str:
    """Per-task launches and time summed over layers (``layer*/attn_q`` is one row), plus totals."""
    agg: dict[tuple[str, str], list[float]] = {}
    for r in result.rows:
        key = (graph_kind(r.graph), task_kind(r.task))
        a = agg.setdefault(key, [0, 0.0, 0])
        a[0] += r.launches
        a[1] += r.time_ns
    steps = result.kernel_count / launches_per_token if launches_per_token else 0
    total_ns = sum(a[1] for a in agg.values()) or 1
    lines = ["profiler: per task, summed over layers",
             f"{'graph':<10} {'task':<34} {'launches':>9} {'per token':>9} {'time ms':>10} {'us/token':>10} "
             f"{'share':>6}"]
    for (g, t), (launches, ns, _) in agg.items():
        per_tok = launches / steps if steps else 0
        us_tok = ns / 1e3 / steps if steps else 0
        lines.append(f"{g:<10} {t:<34} {launches:>9} {per_tok:>9.1f} {ns / 1e6:>10.3f} {us_tok:>10.1f} "
                     f"{100 * ns / total_ns:>5.1f}%")
    lines.append(f"steps: {steps:.0f}, kernel launches: {result.kernel_count} "
                 f"({launches_per_token} per token declared by the task graphs), "
                 f"timed launches: {sum(r.time_ns for r in result.rows) / 1e6:.3f} ms")
    if result.graph_replays:
        per_step = result.graph_replay_ns / 1e3 / result.graph_replays
        lines.append(f"CUDA graph replays: {result.graph_replays}, {result.graph_replay_ns / 1e6:.3f} ms "
                     f"({per_step:.1f} us per step; kernels inside a replay are not timed one by one: use "
                     "`tornado-moe profile` for per-kernel times)")
    return "\n".join(lines)


# ---- machine copy bandwidth -------------------------------------------------------------------------------

def copy_bandwidth_gb_s(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Best-of-``repeats`` GB/s of one large copy, counting read + write bytes (2 x size).

    CUDA: a device-to-device ``copy_`` of 1 GiB (or a quarter of the free memory), timed with device events.
    CPU: a ``copy_`` of 256 MiB, timed with the host clock. This is the practical ceiling a memory-bound
    kernel can reach on this machine, measured in the same run as the kernels it is compared with.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        n = nbytes or min(1 << 30, free // 4)
        src = torch.ones(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
    else:
        n = nbytes or (256 << 20)
        src = torch.ones(n, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
    return 2 * n / best / 1e9


# ---- CUDA kernel events (torch.profiler) ------------------------------------------------------------------

@dataclass
class _StepTrace:
    """The CUDA kernels of one decode step, in start order, and the kernels each torch op launched."""

    kernels: list[tuple[str, float]]  # (name, duration us)
    chain: list[float] = field(default_factory=list)  # per kernel: its end minus the latest earlier end (us)
    op_kernels: list[tuple[int, float]] = field(default_factory=list)  # per tornado_moe op: (count, us)


def _is_kernel_name(name: str) -> bool:
    """Device activities that are not kernel launches: copies, memsets, synchronization records."""
    return not (name.startswith(("Memcpy", "Memset")) or "Sync" in name)


def _is_kernel(evt: Any) -> bool:
    from torch.autograd import DeviceType

    return evt.device_type == DeviceType.CUDA and _is_kernel_name(evt.name)


def chain_times(spans: Sequence[tuple[float, float]]) -> list[float]:
    """Per kernel (spans (start, end) in start order): its end minus the latest end before it, or minus the
    first start for the first kernel; 0 for a kernel that ends before an earlier one. The values add up to
    the span from the first start to the last end."""
    out: list[float] = []
    latest = spans[0][0] if spans else 0.0
    for _, end in spans:
        out.append(max(0.0, end - latest))
        latest = max(latest, end)
    return out


def _whole_steps(spans: Sequence[tuple[float, float]], per_step: int) -> list[Sequence[tuple[float, float]]]:
    """``spans`` cut into consecutive steps of ``per_step`` kernels; a partial step at the end is left out."""
    return [spans[k:k + per_step] for k in range(0, len(spans) - per_step + 1, per_step)]


def step_gaps(spans: Sequence[tuple[float, float]], per_step: int) -> list[float]:
    """GPU idle time at each boundary between consecutive steps: ``spans`` (start, end) are the kernels of
    whole steps in start order, ``per_step`` kernels each; per boundary, the next step's first start minus the
    latest end so far (0 where a step starts before the previous one has drained)."""
    out: list[float] = []
    latest = -math.inf
    for k, step in enumerate(_whole_steps(spans, per_step)):
        if k > 0:
            out.append(max(0.0, step[0][0] - latest))
        latest = max(latest, max(end for _, end in step))
    return out


def _traced(engine: Any, run: Callable[[], Any]) -> tuple[Any, list[Any], list[Any]]:
    """run() under one torch.profiler session (CPU and CUDA activity), synchronised before and after: its
    result, every event, and the CUDA kernels in start order."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(engine.device)
    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": intended here
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = run()
            torch.cuda.synchronize(engine.device)
    events = list(prof.events())
    return result, events, sorted((e for e in events if _is_kernel(e)), key=lambda e: e.time_range.start)


def _trace_decode_loop(engine: Any, prompt_ids: list[int], n_tokens: int,
                       per_step: int) -> dict[str, Any] | None:
    """One generate() under torch.profiler: what the device does between its decode steps (the per-step
    traces below run each step alone, so they cannot see it). None if fewer kernels ran than the steps
    launch (``per_step`` each)."""
    from torch.autograd import DeviceType

    engine.reset()
    (_, stats), events, kernels = _traced(engine, lambda: engine.generate(prompt_ids, n_tokens))
    decode_steps = stats.generated_tokens - 1
    # the decode steps' kernels come last (the prompt steps before them also load their tokens)
    if decode_steps < 2 or len(kernels) < (len(prompt_ids) + decode_steps) * per_step:
        return None
    decode = kernels[len(kernels) - decode_steps * per_step:]
    spans = [(e.time_range.start, e.time_range.end) for e in decode]
    gaps = step_gaps(spans, per_step)
    first = decode[0].time_range.start
    copies = [e for e in events if e.device_type == DeviceType.CUDA and e.name.startswith("Memcpy")
              and e.time_range.start >= first]
    steps = _whole_steps(spans, per_step)
    # a step's kernel span inside the loop, and the period from one step's first start to the next one's
    span = [max(e for _, e in st) - st[0][0] for st in steps]
    period = [b[0][0] - a[0][0] for a, b in itertools.pairwise(steps)]
    return {"decode_steps": decode_steps, "median_us": statistics.median(gaps), "max_us": max(gaps),
            "copy_us_per_step": sum(e.time_range.elapsed_us() for e in copies) / decode_steps,
            "span_median_us": statistics.median(span), "period_median_us": statistics.median(period)}


def _trace_cuda_steps(engine: Any, steps: int) -> list[_StepTrace]:
    """Runs ``steps`` decode steps, each under its own torch.profiler session."""
    from torch.autograd import DeviceType

    traces = []
    for _ in range(steps):
        _, events, kernels = _traced(engine, engine.decode_next)
        ops = sorted((e for e in events
                      if e.device_type == DeviceType.CPU and e.name.startswith("tornado_moe::")),
                     key=lambda e: e.time_range.start)
        traces.append(_StepTrace(
            kernels=[(e.name, e.time_range.elapsed_us()) for e in kernels],
            chain=chain_times([(e.time_range.start, e.time_range.end) for e in kernels]),
            op_kernels=[(sum(1 for k in o.kernels if _is_kernel_name(k.name)),
                         float(sum(k.duration for k in o.kernels if _is_kernel_name(k.name)))) for o in ops]))
    return traces


def _attribute(traces: list[_StepTrace], n_tasks: int) -> tuple[list[float] | None, list[float] | None, str]:
    """Per-task (launches, kernel us) averaged over the traced steps, or None where it cannot be attributed.

    Eager torch route: each task is one ``tornado_moe::<kernel>`` op and the profiler links the kernels it
    launched to it, so counts are exact per task. Otherwise (graph replays, the Java route) kernels are
    assigned in start order, one per task, which is only valid when the totals agree.
    """
    per_task_n = [0.0] * n_tasks
    per_task_us = [0.0] * n_tasks
    how = "op-linked"
    for tr in traces:
        if len(tr.op_kernels) == n_tasks:
            for i, (c, us) in enumerate(tr.op_kernels):
                per_task_n[i] += c
                per_task_us[i] += us
        elif len(tr.kernels) == n_tasks:
            how = "start order"
            for i, (_, us) in enumerate(tr.kernels):
                per_task_n[i] += 1
                per_task_us[i] += us
        else:
            return None, None, "unattributed"
    s = len(traces)
    return [c / s for c in per_task_n], [us / s for us in per_task_us], how


def _chain_per_task(traces: list[_StepTrace], n_tasks: int) -> list[float] | None:
    """Per-task chain time (us) averaged over the traced steps: kernel i is task i (start order), so only
    when every step launched exactly one kernel per task."""
    if not traces or any(len(tr.chain) != n_tasks for tr in traces):
        return None
    return [sum(tr.chain[i] for tr in traces) / len(traces) for i in range(n_tasks)]


# ---- one variant ------------------------------------------------------------------------------------------

def _snapshot(result: ProfilerResult) -> tuple[dict[tuple[str, str], tuple[int, int]], int, int]:
    rows = {(r.graph, r.task): (r.launches, r.time_ns) for r in result.rows}
    return rows, result.graph_replays, result.graph_replay_ns


def profile_variant(model: Any, variant: Variant, device: str, prompt_ids: Sequence[int], n_tokens: int, *,
                    copy_gb_s: float, cuda_steps: int = 3, repeats: int = 3, max_context: int | None = None
                    ) -> dict[str, Any]:
    """Profile one variant (see the module docstring); returns its report entry."""
    # The prompt token by token: every step of a generate() is then one of the profiled (decode) plan.
    with variant_engine(model, variant, device, profiler=True, max_context=max_context,
                        prefill_chunk=1) as engine:
        return _profile_engine(engine, variant, list(prompt_ids), n_tokens, copy_gb_s, cuda_steps, repeats)


def _profile_engine(engine: Any, variant: Variant, prompt_ids: list[int], n_tokens: int, copy_gb_s: float,
                    cuda_steps: int, repeats: int) -> dict[str, Any]:
    plan = engine.plan
    tasks = [(gi, g, t) for gi, g in enumerate(plan.graphs) for t in g.tasks]
    engine.generate(prompt_ids, n_tokens)  # warm-up (and CUDA-graph capture)
    counted: list[float] = []
    timed_us: list[float] = []
    replay_us: float | None = None
    wall_s = float("inf")
    steps = 0
    # Identical runs; per task the fastest run's time counts (robust to a preempted launch on a busy host).
    for _ in range(max(repeats, 1)):
        rows0, rep0, rep_ns0 = _snapshot(plan.profiler_result())
        engine.reset()
        _, stats = engine.generate(prompt_ids, n_tokens)
        rows1, rep1, rep_ns1 = _snapshot(plan.profiler_result())
        steps = len(prompt_ids) + stats.generated_tokens - 1
        wall_s = min(wall_s, stats.prefill_s + stats.decode_s)
        delta = [(rows1[(g.name, t.name)][0] - rows0.get((g.name, t.name), (0, 0))[0],
                  rows1[(g.name, t.name)][1] - rows0.get((g.name, t.name), (0, 0))[1]) for _, g, t in tasks]
        counted = [n / steps for n, _ in delta]
        us = [ns / 1e3 / steps for _, ns in delta]
        timed_us = us if not timed_us else [min(a, b) for a, b in zip(timed_us, us, strict=True)]
        if rep1 > rep0:
            r_us = (rep_ns1 - rep_ns0) / 1e3 / steps
            replay_us = r_us if replay_us is None else min(replay_us, r_us)
    context = (steps + 1) / 2  # mean KV rows attention reads over positions 0..steps-1

    on_gpu = engine.device.type == "cuda"
    kernel_n = kernel_us = None
    attribution = None
    chain_us: list[float] | None = None
    traced_per_step: list[int] = []
    gap: dict[str, Any] | None = None
    if on_gpu and cuda_steps > 0:
        # Everything below is timed by torch.profiler: the plan's own profiler, which synchronises each launch
        # (each replay), would serialise generate()'s pipelined steps and show its host time as device idle.
        plan.without_profiler()
        gap = _trace_decode_loop(engine, prompt_ids, n_tokens, plan.launches_per_execution)
        engine.reset()
        engine.generate(prompt_ids, 1)  # prefill; the traced steps are pure decode steps
        traces = _trace_cuda_steps(engine, cuda_steps)
        traced_per_step = [len(tr.kernels) for tr in traces]
        kernel_n, kernel_us, attribution = _attribute(traces, len(tasks))
        chain_us = _chain_per_task(traces, len(tasks))
        measured = kernel_n if kernel_n is not None else None
        counter = "torch.profiler (CUDA kernel events)"
    else:
        measured = counted
        counter = "route counter (plan profiler; no CUDA device for torch.profiler)"

    declared_total = plan.launches_per_execution
    measured_total = statistics.mean(traced_per_step) if traced_per_step else sum(counted)
    agree = abs(measured_total - declared_total) < 1e-9 and (
        measured is None or all(abs(m - 1) < 1e-9 for m in measured))
    mismatches: list[dict[str, Any]] = []
    if measured is not None:
        for (_, g, t), m in zip(tasks, measured, strict=True):
            if abs(m - 1) > 1e-9:
                mismatches.append({"graph": g.name, "task": t.name, "declared": 1, "measured": m})
    elif abs(measured_total - declared_total) > 1e-9:
        mismatches.append({"graph": "*", "task": "*", "declared": declared_total, "measured": measured_total,
                           "note": "kernels per step differ from the declared launches; not attributable to "
                                   "tasks (graph replay or Java route)"})

    def rates(nbytes: float, us: float | None) -> tuple[float | None, float | None]:
        """GB/s of nbytes in us, and its fraction of the copy bandwidth (None without a positive time)."""
        if not us or us <= 0:
            return None, None
        gb_s = nbytes / (us * 1e-6) / 1e9
        return gb_s, gb_s / copy_gb_s

    task_rows: list[dict[str, Any]] = []
    for i, (_, g, t) in enumerate(tasks):
        b = task_bytes(t, context)
        time_us = timed_us[i] if timed_us[i] > 0 else None
        k_us = kernel_us[i] if kernel_us is not None else None
        gb_s, frac = rates(b.total, k_us if k_us else time_us)
        chain = chain_us[i] if chain_us is not None else None
        chain_gb_s, chain_frac = rates(b.total, chain)
        task_rows.append({
            "graph": g.name, "task": t.name, "kernel": t.kernel, "kind": task_kind(t.name),
            "routed": _is_routed(t.kernel, t.args),
            "launches_declared": 1,
            "launches_counted": counted[i],
            "launches_measured": measured[i] if measured is not None else None,
            "time_us": time_us, "kernel_time_us": k_us,
            "chain_us": chain,
            "weight_bytes": b.weights, "activation_bytes": b.activations, "bytes": b.total,
            "gb_s": gb_s, "fraction_of_copy_bandwidth": frac,
            "chain_gb_s": chain_gb_s, "chain_fraction_of_copy_bandwidth": chain_frac,
        })

    graphs = []
    for gi, g in enumerate(plan.graphs):
        idx = [i for i, (j, _, _) in enumerate(tasks) if j == gi]
        graphs.append({
            "graph": g.name,
            "launches_declared": g.launch_count,
            "launches_measured": sum(measured[i] for i in idx) if measured is not None else None,
            "routed_launches_declared": sum(1 for t in g.tasks if _is_routed(t.kernel, t.args)),
        })
    layer_graphs = [x for x in graphs if graph_kind(x["graph"]) == "layer"]

    by_kind: dict[str, dict[str, Any]] = {}
    for r in task_rows:
        k = by_kind.setdefault(r["kind"], {"kind": r["kind"], "launches": 0.0, "time_us": 0.0, "bytes": 0.0,
                                           "weight_bytes": 0.0, "_timed": False,
                                           "chain_us": 0.0 if chain_us is not None else None})
        if chain_us is not None:
            k["chain_us"] += r["chain_us"]
        k["launches"] += r["launches_measured"] if r["launches_measured"] is not None else 1
        t_us = r["kernel_time_us"] or r["time_us"]
        if t_us:
            k["time_us"] += t_us
            k["_timed"] = True
        k["bytes"] += r["bytes"]
        k["weight_bytes"] += r["weight_bytes"]
    for k in by_kind.values():
        timed = k.pop("_timed")
        k["time_us"] = k["time_us"] if timed else None
        k["gb_s"], k["fraction_of_copy_bandwidth"] = rates(k["bytes"], k["time_us"])
        k["chain_gb_s"], k["chain_fraction_of_copy_bandwidth"] = rates(k["bytes"], k["chain_us"])

    total_bytes = sum(r["bytes"] for r in task_rows)
    kernel_total = sum(r["kernel_time_us"] or 0 for r in task_rows) if kernel_us is not None else None
    timed_total = sum(timed_us) or None
    step_us = wall_s * 1e6 / steps
    best_total = kernel_total or replay_us or timed_total
    achieved_gb_s, achieved_fraction = rates(total_bytes, best_total)
    return {
        **variant.as_dict(),
        "steps": steps,
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": stats.generated_tokens,
        "launches_per_token_declared": declared_total,
        "launches_per_token_measured": measured_total,
        "launch_counter": counter,
        "kernel_attribution": attribution,
        "kernels_per_traced_step": traced_per_step,
        "launch_counts_agree": agree,
        "launch_mismatches": mismatches,
        "routed_launches_per_layer_declared": (layer_graphs[0]["routed_launches_declared"]
                                               if layer_graphs else 0),
        "graphs": graphs,
        "step_wall_us": step_us,
        "graph_replay_us_per_token": replay_us,
        "timed_launch_us_per_token": timed_total,
        "kernel_time_us_per_token": kernel_total,
        "chain_us_per_token": sum(chain_us) if chain_us is not None else None,
        "step_gap_us": gap,
        "weight_bytes_per_token": sum(r["weight_bytes"] for r in task_rows),
        "bytes_per_token": total_bytes,
        "achieved_gb_s": achieved_gb_s,
        "fraction_of_copy_bandwidth": achieved_fraction,
        "floor_us_per_token": total_bytes / (copy_gb_s * 1e9) * 1e6,
        "by_kind": list(by_kind.values()),
        "tasks": task_rows,
    }


def profile_model(model: Any, variants: Sequence[Variant], device: torch.device, prompt_ids: Sequence[int],
                  n_tokens: int, *, cuda_steps: int = 3, repeats: int = 3, max_context: int | None = None,
                  progress: Any = None) -> dict[str, Any]:
    """Copy bandwidth, then every variant one after the other (one engine alive at a time)."""
    copy_gb_s = copy_bandwidth_gb_s(device)
    out = []
    for v in variants:
        if progress is not None:
            progress(f"profiling {v.name} ...")
        out.append(profile_variant(model, v, device.type, prompt_ids, n_tokens, copy_gb_s=copy_gb_s,
                                   cuda_steps=cuda_steps, repeats=repeats, max_context=max_context))
    return {"copy_bandwidth_gb_s": copy_gb_s, "prompt_tokens": len(prompt_ids), "max_tokens": n_tokens,
            "repeats": repeats, "variants": out}


def bandwidth_targets(variant: dict[str, Any], fraction: float, min_bytes_per_launch: float
                      ) -> dict[str, Any]:
    """Each task kind of ``variant`` whose launches read at least ``min_bytes_per_launch`` on average, judged
    by its chain rate against ``fraction`` of the copy bandwidth (the decode-speed target: every kernel that
    reads >= 10 MB at >= 70% of copy). The chain rate, not the kernel-time rate: under programmatic dependent
    launch a kernel's duration includes the wait for its predecessor, and only the chain says how much later
    the step ends because of it. Small kinds (norms, router, the output projection) are left out: their
    latency, not their rate, is what counts. ``meets`` is None where no chain time exists (CPU) and for eager
    variants, whose traced steps wait on the host; ``all_meet`` is None when no kind was judged."""
    judged = bool(variant.get("cuda_graphs")) and variant.get("chain_us_per_token") is not None
    kinds = []
    for k in variant["by_kind"]:
        per_launch = k["bytes"] / k["launches"] if k["launches"] else 0.0
        if per_launch < min_bytes_per_launch:
            continue
        chain = k["chain_fraction_of_copy_bandwidth"]
        kinds.append({"kind": k["kind"], "bytes_per_launch": per_launch,
                      "chain_fraction_of_copy_bandwidth": chain,
                      "meets": chain >= fraction if judged and chain is not None else None})
    verdicts = [r["meets"] for r in kinds if r["meets"] is not None]
    return {"fraction": fraction, "min_bytes_per_launch": min_bytes_per_launch, "judged": judged,
            "kinds": kinds, "all_meet": all(verdicts) if verdicts else None}


def below_bandwidth_target(report: dict[str, Any]) -> list[str]:
    """``variant: kind`` for every judged kind below its variant's target (the report's ``bandwidth_target``
    entries, as :func:`bandwidth_targets` wrote them)."""
    return [f"{v['variant']}: {r['kind']}" for v in report["variants"]
            for r in v.get("bandwidth_target", {}).get("kinds", []) if r["meets"] is False]


# ---- output -----------------------------------------------------------------------------------------------

def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_report(report: dict[str, Any]) -> str:
    """The terminal table: one block per variant, rows per task kind."""
    bw = report["copy_bandwidth_gb_s"]
    lines = [f"copy bandwidth (read + write) of this machine: {bw:.1f} GB/s"]
    for v in report["variants"]:
        agree = "agree" if v["launch_counts_agree"] else "DISAGREE"
        pct = 100 * v["fraction_of_copy_bandwidth"] if v["fraction_of_copy_bandwidth"] else None
        lines.append("")
        lines.append(f"== {v['variant']}: {v['launches_per_token_declared']} launches/token declared, "
                     f"{v['launches_per_token_measured']:.1f} measured by {v['launch_counter']} ({agree}); "
                     f"routed launches per layer: {v['routed_launches_per_layer_declared']}")
        for m in v["launch_mismatches"]:
            lines.append(f"   mismatch: {m['graph']}/{m['task']}: declared {m['declared']}, measured "
                         f"{m['measured']}")
        lines.append(f"   per token: {v['bytes_per_token'] / 1e6:.3f} MB moved "
                     f"(weights {v['weight_bytes_per_token'] / 1e6:.3f} MB), floor "
                     f"{v['floor_us_per_token']:.1f} us at copy bandwidth; step wall (profiler on) "
                     f"{v['step_wall_us']:.1f} us; kernels {_fmt(v['kernel_time_us_per_token'], '.1f')} us "
                     f"(chain {_fmt(v['chain_us_per_token'], '.1f')} us); "
                     f"achieved {_fmt(v['achieved_gb_s'], '.1f')} GB/s ({_fmt(pct, '.1f')}% of copy)")
        if v.get("step_gap_us"):
            g = v["step_gap_us"]
            lines.append(f"   between decode steps (one generate() under torch.profiler): the GPU idles "
                         f"{g['median_us']:.1f} us (median of {g['decode_steps'] - 1} boundaries, max "
                         f"{g['max_us']:.1f}); copies "
                         f"{g['copy_us_per_step']:.1f} us per step; a step's kernels span "
                         f"{g['span_median_us']:.1f} us, one starts every {g['period_median_us']:.1f} us")
        lines.append(f"   {'task kind':<34} {'launches':>8} {'us/token':>10} {'chain us':>9} "
                     f"{'MB/token':>10} {'GB/s':>9} {'% copy':>7} {'% chain':>8}")
        for k in v["by_kind"]:
            frac, chain_frac = k["fraction_of_copy_bandwidth"], k["chain_fraction_of_copy_bandwidth"]
            lines.append(f"   {k['kind']:<34} {k['launches']:>8.1f} {_fmt(k['time_us'], '10.1f'):>10} "
                         f"{_fmt(k['chain_us'], '9.1f'):>9} {k['bytes'] / 1e6:>10.4f} "
                         f"{_fmt(k['gb_s'], '9.1f'):>9} {_fmt(frac and 100 * frac, '7.1f'):>7} "
                         f"{_fmt(chain_frac and 100 * chain_frac, '8.1f'):>8}")
        if "bandwidth_target" in v:
            lines.append(_format_targets(v["bandwidth_target"]))
    return "\n".join(lines)


def _format_targets(t: dict[str, Any]) -> str:
    """One line: the large kinds' chain rates against the target, or why they were not judged."""
    head = (f"   kinds reading >= {t['min_bytes_per_launch'] / 1e6:g} MB a launch against "
            f"{100 * t['fraction']:g}% of copy by chain time:")
    if not t["kinds"]:
        return f"{head} none"
    if not t["judged"]:
        return f"{head} not judged (chain times are the CUDA-graph variants' on a GPU)"
    verdict = {True: "meets", False: "BELOW", None: "no chain time"}
    def pct(f: float | None) -> str:
        return _fmt(f and 100 * f, ".1f")

    parts = [f"{r['kind']} {r['bytes_per_launch'] / 1e6:.1f} MB "
             f"{pct(r['chain_fraction_of_copy_bandwidth'])}% {verdict[r['meets']]}" for r in t["kinds"]]
    return f"{head} {', '.join(parts)}"


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """A PNG bar chart of time per token per task kind, one bar per variant (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = report["variants"]
    kinds: list[str] = []
    for v in variants:
        for k in v["by_kind"]:
            if k["kind"] not in kinds:
                kinds.append(k["kind"])
    height = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(10, min(30.0, 2 + 0.16 * len(kinds) * max(len(variants), 2))))
    for j, v in enumerate(variants):
        t = {k["kind"]: (k["time_us"] or 0.0) for k in v["by_kind"]}
        ys = [i + j * height for i in range(len(kinds))]
        ax.barh(ys, [t.get(k, 0.0) for k in kinds], height=height, label=v["variant"])
    ax.set_yticks([i + height * (len(variants) - 1) / 2 for i in range(len(kinds))])
    ax.set_yticklabels(kinds)
    ax.invert_yaxis()
    ax.set_xlabel("time per token (us), summed over layers")
    ax.set_title(f"tornado-moe kernel time per task kind ({report.get('gpu_name', '')})")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
