"""``tornado-moe determinism``: the same prompt and seed, run after run and variant after variant, must give
bitwise identical tokens and logits.

Each run records the generated token ids and every step's logits row (float32, copied to the host as the
engine produces it) and reduces them to two sha256 digests: tokens (int32 little-endian bytes) and logits
(all rows' bytes concatenated in step order). Every run is compared with the first run of the first variant.
Reading each step's logits makes generate() run one step at a time, so every run is then repeated as
generate() runs without a reader (steps launched several at a time, one CUDA graph per launch): its tokens,
and the state both runs leave (every KV-cache row written and the last logits), must be those of the stepwise
run.

On a difference, the run pair that diverges earliest is localized: its first diverging step (the first step
whose token or logits row differs), then, by re-running both sides eagerly token by token over the common
prefix with the residual stream hashed after every graph (:meth:`Engine.feed_traced`), the first position
and layer whose hidden state differs. When hidden states and logits agree but tokens differ, the sampler is
the cause (e.g. different seeds); when nothing differs eagerly, the difference comes from the variant's
execution mode (a CUDA-graph replay) and does not reproduce eagerly.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tornado_moe.tools.variants import Variant, variant_engine

__all__ = ["RunTrace", "tokens_digest", "run_variants", "first_divergence", "localize", "check_determinism",
           "format_report"]


def _row_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def tokens_digest(tokens: Sequence[int]) -> str:
    """sha256 of the token ids as little-endian int32."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


@dataclass
class RunTrace:
    """One generation: its tokens, each step's logits digest and the two whole-run digests."""

    variant: Variant
    run: int
    seed: int
    tokens: list[int] = field(default_factory=list)
    step_digests: list[str] = field(default_factory=list)
    logits_sha256: str = ""
    state_sha256: str = ""  # KV-cache rows and last logits after the stepwise run
    pipelined_tokens: list[int] = field(default_factory=list)  # the same generation without a logits reader
    pipelined_state_sha256: str = ""

    @property
    def tokens_sha256(self) -> str:
        return tokens_digest(self.tokens)

    def as_dict(self) -> dict[str, Any]:
        return {"variant": self.variant.name, "run": self.run, "seed": self.seed,
                "tokens_sha256": self.tokens_sha256, "logits_sha256": self.logits_sha256,
                "state_sha256": self.state_sha256,
                "pipelined_tokens_sha256": tokens_digest(self.pipelined_tokens),
                "pipelined_state_sha256": self.pipelined_state_sha256,
                "n_tokens": len(self.tokens), "tokens": list(self.tokens)}

    @property
    def pipelined_matches(self) -> bool:
        return self.pipelined_tokens == self.tokens and self.pipelined_state_sha256 == self.state_sha256


def _state_digest(engine: Any) -> str:
    """sha256 of every KV-cache row below the engine's position (layer order) and of the last logits row."""
    h = hashlib.sha256()
    for cache in (*engine.act.k_cache, *engine.act.v_cache):
        h.update(_row_bytes(cache[: engine.position]))
    h.update(_row_bytes(engine.last_logits()))
    return h.hexdigest()


def _trace_run(engine: Any, variant: Variant, run: int, seed: int, prompt_ids: Sequence[int],
               n_tokens: int) -> RunTrace:
    """One generation on ``engine`` from position 0, with the digest of every step's logits row, then the
    same generation pipelined (no logits reader)."""
    engine.reset()
    tr = RunTrace(variant, run, seed)
    h = hashlib.sha256()

    def on_logits(row: torch.Tensor) -> None:
        b = _row_bytes(row)
        h.update(b)
        tr.step_digests.append(hashlib.sha256(b).hexdigest())

    tr.tokens, _ = engine.generate(prompt_ids, n_tokens, on_logits=on_logits)
    tr.logits_sha256 = h.hexdigest()
    tr.state_sha256 = _state_digest(engine)
    engine.reset()
    tr.pipelined_tokens, _ = engine.generate(prompt_ids, n_tokens)
    tr.pipelined_state_sha256 = _state_digest(engine)
    return tr


def run_variants(model: Any, variants: Sequence[Variant], device: str, prompt_ids: Sequence[int],
                 n_tokens: int, sampler: Any, runs: int, *, vary_seed: bool = False,
                 max_context: int | None = None, progress: Callable[[str], None] | None = None
                 ) -> list[RunTrace]:
    """``runs`` generations per variant, one engine alive at a time. The seed is part of the logits
    graph, so ``vary_seed`` (run i samples with seed + i) builds an engine per run; otherwise one engine
    per variant serves all its runs."""
    import dataclasses

    def engine_for(v: Variant, seed: int) -> Any:
        return variant_engine(model, v, device, sampler=dataclasses.replace(sampler, seed=seed),
                              max_context=max_context)

    def trace(engine: Any, v: Variant, r: int, seed: int) -> RunTrace:
        if progress is not None:
            progress(f"{v.name}: run {r} (seed {seed})")
        return _trace_run(engine, v, r, seed, prompt_ids, n_tokens)

    traces: list[RunTrace] = []
    for v in variants:
        if vary_seed:
            for r in range(runs):
                with engine_for(v, sampler.seed + r) as engine:
                    traces.append(trace(engine, v, r, sampler.seed + r))
        else:
            with engine_for(v, sampler.seed) as engine:
                traces += [trace(engine, v, r, sampler.seed) for r in range(runs)]
    return traces


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where two token lists differ (the shorter length when one is the other's prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def first_divergence(a: RunTrace, b: RunTrace) -> tuple[int, str] | None:
    """(first step whose token or logits row differs, "logits" or "tokens"), or None if identical."""
    n = min(len(a.tokens), len(b.tokens))
    for s in range(n):
        if a.step_digests[s] != b.step_digests[s]:
            return s, "logits"
        if a.tokens[s] != b.tokens[s]:
            return s, "tokens"
    if len(a.tokens) != len(b.tokens):
        return n, "length"
    return None


def _hidden_trace(model: Any, variant: Variant, device: str, sampler: Any, max_context: int | None,
                  fed: Sequence[int]) -> tuple[list[list[str]], list[int], list[str]]:
    """Eager, task by task: per position, the digest after every graph (residual stream x after the
    embedding and each layer graph, the logits row after the logits graph), and the chosen next tokens."""
    eager = dataclasses.replace(variant, cuda_graphs=False)
    with variant_engine(model, eager, device, sampler=sampler, max_context=max_context) as engine:
        names = [g.name for g in engine.plan.graphs]
        last = len(names) - 1
        act = engine.act
        digests: list[list[str]] = []
        nxt: list[int] = []
        for tok in fed:
            row: list[str] = []

            def after(gi: int, _g: Any, row: list[str] = row) -> None:
                buf = act.logits[0] if gi == last else act.x[0]
                row.append(hashlib.sha256(_row_bytes(buf)).hexdigest())

            nxt.append(engine.feed_traced(tok, after))
            digests.append(row)
    return digests, nxt, names


def localize(model: Any, a: RunTrace, b: RunTrace, step: int, kind: str, prompt_ids: Sequence[int],
             device: str, sampler: Any, max_context: int | None) -> dict[str, Any]:
    """The first (position, graph) whose hidden state differs between the two runs' eager replays."""
    import dataclasses

    fed = list(prompt_ids) + a.tokens[:step]  # identical on both sides up to the diverging step
    da, na, names = _hidden_trace(model, a.variant, device, dataclasses.replace(sampler, seed=a.seed),
                                  max_context, fed)
    db, nb, _ = _hidden_trace(model, b.variant, device, dataclasses.replace(sampler, seed=b.seed),
                              max_context, fed)
    out: dict[str, Any] = {"variants": [a.variant.name, b.variant.name], "runs": [a.run, b.run],
                           "step": step, "kind": kind, "step_position": len(fed) - 1,
                           "position": None, "layer": None, "graph": None}
    for p, (ra, rb) in enumerate(zip(da, db, strict=True)):
        for gi, (ha, hb) in enumerate(zip(ra, rb, strict=True)):
            if ha != hb:
                name = names[gi]
                out.update(position=p, graph=name,
                           layer=int(name[5:]) if name.startswith("layer") and name[5:].isdigit() else None)
                where = f"layer {out['layer']}" if out["layer"] is not None else f"the {name} graph"
                out["note"] = (f"the hidden state first differs after {where} at position {p}" +
                               (" (an earlier position: its KV-cache rows feed the diverging step)"
                                if p < len(fed) - 1 else ""))
                return out
    if na[-1] != nb[-1]:  # tokens sampled at prompt positions are discarded: only the step's own counts
        out.update(position=len(fed) - 1, graph="sampler",
                   note="hidden states and logits are identical; the sampled token differs (sampler seed)")
        return out
    out["note"] = ("no difference when both sides re-run eagerly task by task: the divergence comes from the "
                   "execution mode (e.g. a CUDA-graph replay) or is not reproducible")
    return out


def check_determinism(model: Any, variants: Sequence[Variant], device: str, prompt_ids: Sequence[int],
                      n_tokens: int, sampler: Any, runs: int, *, vary_seed: bool = False,
                      max_context: int | None = None, progress: Callable[[str], None] | None = None
                      ) -> dict[str, Any]:
    """The determinism report body (without run metadata): runs, identical, mismatches, divergence."""
    traces = run_variants(model, variants, device, prompt_ids, n_tokens, sampler, runs, vary_seed=vary_seed,
                          max_context=max_context, progress=progress)
    ref = traces[0]
    mismatches = []
    for tr in traces[1:]:
        d = first_divergence(ref, tr)
        if d is not None:
            mismatches.append({"variant": tr.variant.name, "run": tr.run, "step": d[0], "kind": d[1],
                               "_t": tr})
    # a pipelined run that differs from its own stepwise run (its "step": the first differing token, or the
    # token count when only the state differs); not localized: the eager re-runs are stepwise too
    pipelined = [{"variant": tr.variant.name, "run": tr.run, "kind": "pipelined",
                  "step": _first_difference(tr.tokens, tr.pipelined_tokens)}
                 for tr in traces if not tr.pipelined_matches]
    divergence = None
    if mismatches:
        worst = min(mismatches, key=lambda m: m["step"])  # earliest; ties: first in run order
        if progress is not None:
            progress(f"localizing the divergence at step {worst['step']} (eager re-runs, task by task)")
        divergence = localize(model, ref, worst["_t"], worst["step"], worst["kind"], prompt_ids, device,
                              sampler, max_context)
    for m in mismatches:
        del m["_t"]
    mismatches += pipelined
    return {
        "prompt_tokens": len(prompt_ids),
        "max_tokens": n_tokens,
        "temperature": sampler.temperature, "top_p": sampler.top_p, "top_k": sampler.top_k,
        "seed": sampler.seed, "vary_seed": vary_seed,
        "variants": [v.name for v in variants],
        "runs": [t.as_dict() for t in traces],
        "identical": not mismatches,
        "mismatches": mismatches,
        "divergence": divergence,
    }


def format_report(report: dict[str, Any]) -> str:
    w = max([22] + [len(r["variant"]) for r in report["runs"]])
    lines = [f"{'variant':<{w}} {'run':>3} {'seed':>6} {'tokens sha256':<18} {'logits sha256':<18} {'n':>5}"]
    for r in report["runs"]:
        lines.append(f"{r['variant']:<{w}} {r['run']:>3} {r['seed']:>6} {r['tokens_sha256'][:16]:<18} "
                     f"{r['logits_sha256'][:16]:<18} {r['n_tokens']:>5}")
    if report["identical"]:
        n = len(report["runs"])
        lines.append(f"identical: all {n} runs give bitwise identical tokens and logits, and each one run "
                     "again pipelined (steps launched several at a time) gives its tokens, KV cache and last "
                     "logits")
        return "\n".join(lines)
    for m in report["mismatches"]:
        if m["kind"] == "pipelined":
            lines.append(f"DIFFERENT: {m['variant']} run {m['run']} run pipelined differs from its stepwise "
                         f"run (first differing token: {m['step']}; else the KV cache or the last logits)")
        else:
            lines.append(f"DIFFERENT: {m['variant']} run {m['run']} diverges from the first run at step "
                         f"{m['step']} ({m['kind']})")
    d = report["divergence"]
    if d is None:
        return "\n".join(lines)
    lines.append(f"first divergence: {d['variants'][0]} run {d['runs'][0]} vs {d['variants'][1]} run "
                 f"{d['runs'][1]}, step {d['step']} ({d['kind']}), layer {d['layer']}: {d.get('note', '')}")
    return "\n".join(lines)
