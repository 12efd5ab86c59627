"""``tornado-moe bench``: decode and prefill throughput per variant, with warm-up and repetitions.

Each variant gets its own Engine over ONE loaded model (the memory-mapped file is shared), built, measured
and closed before the next one is built, with device memory released in between: on a 15 GB model two
engines would not fit side by side. Every repetition resets the engine and generates the same fixed number
of tokens greedily from the same prompt (end-of-sequence tokens do not stop it), so runs are comparable and
their tokens must be identical across repetitions and variants (reported).

Beside the speed, each variant's bandwidth floor: the bytes one decode step moves
(:mod:`tornado_moe.tools.traffic`: the weights, the selected experts' share of the routed ones, and the
activations) at the machine's copy bandwidth, measured in the same run, and the fraction of that floor the
median decode reaches.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tornado_moe.tools.determinism import tokens_digest
from tornado_moe.tools.profile import copy_bandwidth_gb_s
from tornado_moe.tools.traffic import task_bytes
from tornado_moe.tools.variants import Variant, variant_engine

__all__ = ["decode_step_bytes", "bench_variant", "bench_model", "format_report"]


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def decode_step_bytes(engine: Any, context: float) -> float:
    """Bytes one decode step of ``engine`` moves, every task of its one-token plan counted by the traffic
    model (``context``: the KV rows attention reads, averaged over the decode)."""
    return sum(task_bytes(t, context).total for g in engine.plan.graphs for t in g.tasks)


def bench_variant(model: Any, variant: Variant, device: str, prompt_ids: Sequence[int], n_tokens: int, *,
                  repeats: int, warmup: int, copy_gb_s: float, max_context: int | None = None
                  ) -> dict[str, Any]:
    """Warm-up runs, then ``repeats`` timed runs of one variant; its report entry."""
    with variant_engine(model, variant, device, max_context=max_context) as engine:
        for _ in range(warmup):
            engine.reset()
            engine.generate(prompt_ids, n_tokens)
        decode, prefill, digests = [], [], []
        for _ in range(repeats):
            engine.reset()
            tokens, stats = engine.generate(prompt_ids, n_tokens)
            decode.append(stats.decode_tok_s)
            prefill.append(stats.prefill_tok_s)
            digests.append(tokens_digest(tokens))
        launches = engine.launches_per_token
        # decode steps feed positions len(prompt) .. len(prompt) + n_tokens - 2: attention's mean KV rows
        step_bytes = decode_step_bytes(engine, len(prompt_ids) + n_tokens / 2)
    d, p = _spread(decode), _spread(prefill)
    floor_us = step_bytes / (copy_gb_s * 1e3)
    return {
        **variant.as_dict(),
        "decode_tok_s_median": d["median"],
        "decode_tok_s_min": d["min"],
        "decode_tok_s_max": d["max"],
        "decode_tok_s_stdev": d["stdev"],
        "decode_tok_s_runs": decode,
        "decode_ms_per_token_median": 1e3 / d["median"] if d["median"] > 0 else None,
        "prefill_tok_s_median": p["median"],
        "prefill_tok_s_min": p["min"],
        "prefill_tok_s_max": p["max"],
        "prefill_tok_s_runs": prefill,
        "launches_per_token": launches,
        "decode_bytes_per_token": step_bytes,
        "decode_floor_us_per_token": floor_us,
        "decode_fraction_of_floor": floor_us * d["median"] / 1e6,
        "tokens_sha256": digests[0],
        "tokens_identical_across_repeats": len(set(digests)) == 1,
    }


def bench_model(model: Any, variants: Sequence[Variant], device: torch.device, prompt_ids: Sequence[int],
                n_tokens: int, *, repeats: int, warmup: int, max_context: int | None = None,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The copy bandwidth, then every variant in turn; the report body (without run metadata)."""
    copy_gb_s = copy_bandwidth_gb_s(device)
    rows = []
    for v in variants:
        if progress is not None:
            progress(f"bench {v.name}: {warmup} warm-up + {repeats} runs of {n_tokens} tokens")
        rows.append(bench_variant(model, v, device.type, prompt_ids, n_tokens, repeats=repeats, warmup=warmup,
                                  copy_gb_s=copy_gb_s, max_context=max_context))
    return {
        "copy_bandwidth_gb_s": copy_gb_s,
        "prompt_tokens": len(prompt_ids),
        "max_tokens": n_tokens,
        "repeats": repeats,
        "warmup": warmup,
        "tokens_identical_across_variants": len({r["tokens_sha256"] for r in rows}) == 1
        and all(r["tokens_identical_across_repeats"] for r in rows),
        "variants": rows,
    }


def format_report(report: dict[str, Any]) -> str:
    w = max([22] + [len(r["variant"]) for r in report["variants"]])
    lines = [f"model: {report.get('model')}  device: {report.get('gpu_name')}  prompt "
             f"{report['prompt_tokens']} tokens, {report['max_tokens']} generated, {report['warmup']} "
             f"warm-up + {report['repeats']} runs",
             f"{'variant':<{w}} {'decode tok/s':>12} {'min':>9} {'max':>9} {'stdev':>8} {'ms/token':>9} "
             f"{'floor us':>9} {'% floor':>8} {'prefill tok/s':>14} {'launches/token':>15}"]
    for r in report["variants"]:
        ms = r["decode_ms_per_token_median"]
        lines.append(f"{r['variant']:<{w}} {r['decode_tok_s_median']:>12.1f} {r['decode_tok_s_min']:>9.1f} "
                     f"{r['decode_tok_s_max']:>9.1f} {r['decode_tok_s_stdev']:>8.2f} "
                     f"{(f'{ms:.3f}' if ms else '-'):>9} {r['decode_floor_us_per_token']:>9.1f} "
                     f"{100 * r['decode_fraction_of_floor']:>8.1f} "
                     f"{r['prefill_tok_s_median']:>14.1f} {r['launches_per_token']:>15}")
    lines.append(f"floor: the bytes a decode step moves at this machine's copy bandwidth "
                 f"({report['copy_bandwidth_gb_s']:.1f} GB/s); % floor: the median decode against it")
    same = "yes" if report["tokens_identical_across_variants"] else "NO"
    lines.append(f"tokens identical across repeats and variants: {same}")
    return "\n".join(lines)
