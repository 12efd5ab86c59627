"""Engine variants compared by the tools: expert fusion x execution (eager / CUDA graph) x route x weights x
prefill.

Every variant must produce bitwise identical tokens and logits (the determinism contract), and the tools
measure what each one costs. A comma list such as ``fused,per-slot,graphs`` selects them: naming both
values of a pair (fused/per-slot, eager/graphs, torch/java, tiled/gguf-layout weights, batched-prefill/
per-token-prefill) makes that pair an axis of the comparison; naming one value fixes the axis to it; an
axis not named keeps the device's default. The variants are the product of the axes, in a fixed order; a
list of steps per CUDA graph (``--steps-per-graph 1,8``) multiplies them once more.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tornado_moe.errors import InputError

if TYPE_CHECKING:
    from tornado_moe.engine import EngineOptions

__all__ = ["AXES", "VARIANT_NAMES", "Variant", "default_variant", "free_device_memory", "parse_variants",
           "variant_engine"]

#: axis -> its two values, the first being the variant field's "False"/first state.
AXES: dict[str, tuple[str, str]] = {
    "experts": ("fused", "per-slot"),
    "execution": ("eager", "graphs"),
    "route": ("torch", "java"),
    "weights": ("tiled", "gguf-layout"),
    "prefill": ("batched-prefill", "per-token-prefill"),
}
VARIANT_NAMES: tuple[str, ...] = tuple(v for pair in AXES.values() for v in pair)


@dataclass(frozen=True)
class Variant:
    """One way of running the same model: the choices an EngineOptions takes."""

    fuse_experts: bool = True
    cuda_graphs: bool = False
    route: str = "torch"
    tile_weights: bool = True
    batched_prefill: bool = True  # the prompt in chunks of the engine's default size, or token by token
    steps_per_graph: int | None = None  # None: the engine's default

    @property
    def name(self) -> str:
        """E.g. ``fused/graphs/torch``: stable, used as the key in every report. The defaults (tiled
        weights, batched prefill) are not named; ``/gguf-layout`` marks Q8_0 weights read in the file's
        layout on CUDA, ``/per-token-prefill`` a prompt fed token by token, ``/N-step`` a steps-per-graph
        count that was asked for."""
        name = "/".join((self.experts, "graphs" if self.cuda_graphs else "eager", self.route))
        if not self.tile_weights:
            name += "/gguf-layout"
        if not self.batched_prefill:
            name += "/per-token-prefill"
        return name if self.steps_per_graph is None else f"{name}/{self.steps_per_graph}-step"

    @property
    def experts(self) -> str:
        return "fused" if self.fuse_experts else "per-slot"

    def as_dict(self) -> dict[str, object]:
        from tornado_moe.engine.engine import DEFAULT_PREFILL_CHUNK, DEFAULT_STEPS_PER_GRAPH

        steps = DEFAULT_STEPS_PER_GRAPH if self.steps_per_graph is None else self.steps_per_graph
        return {"variant": self.name, "fuse_experts": self.fuse_experts, "cuda_graphs": self.cuda_graphs,
                "route": self.route, "tile_weights": self.tile_weights, "steps_per_graph": steps,
                "prefill_chunk": DEFAULT_PREFILL_CHUNK if self.batched_prefill else 1}

    def engine_options(self, device: str, **kw: Any) -> EngineOptions:
        """EngineOptions for this variant on ``device``; ``kw`` sets the other fields (sampler, ...)."""
        from tornado_moe.engine import EngineOptions

        if self.steps_per_graph is not None:
            kw["steps_per_graph"] = self.steps_per_graph
        if not self.batched_prefill:
            kw["prefill_chunk"] = 1
        return EngineOptions(device=device, route=self.route, fuse_experts=self.fuse_experts,
                             cuda_graphs=self.cuda_graphs, tile_weights=self.tile_weights, **kw)


def default_variant(device: torch.device) -> Variant:
    """The fastest configuration for the device: fused experts, CUDA graphs on a GPU, torch route."""
    return Variant(fuse_experts=True, cuda_graphs=device.type == "cuda", route="torch")


def parse_variants(spec: str | None, device: torch.device, *, flag: str = "--compare",
                   steps_per_graph: Sequence[int] | None = None) -> list[Variant]:
    """The variants a comma list selects (see the module docstring); ``None``/empty: the default only.
    ``steps_per_graph``: each variant once per count (None: the engine's default, not named)."""
    base = default_variant(device)
    names = [s.strip() for s in (spec or "").split(",") if s.strip()]
    unknown = [n for n in names if n not in VARIANT_NAMES]
    if unknown:
        raise InputError(f"{flag}: unknown variant {', '.join(map(repr, unknown))} "
                         f"(choose from {', '.join(VARIANT_NAMES)})")
    defaults = {"experts": base.experts, "execution": "graphs" if base.cuda_graphs else "eager",
                "route": base.route, "weights": "tiled", "prefill": "batched-prefill"}
    values: list[list[str]] = []
    for axis, pair in AXES.items():
        chosen = [v for v in pair if v in names]
        values.append(chosen or [defaults[axis]])
    if "graphs" in values[1] and device.type != "cuda":
        raise InputError(f"{flag}: 'graphs' (CUDA graphs) needs --device cuda; this run is on {device.type}")
    steps: Sequence[int | None] = steps_per_graph or [None]
    return [Variant(fuse_experts=e == "fused", cuda_graphs=x == "graphs", route=r, tile_weights=w == "tiled",
                    batched_prefill=b == "batched-prefill", steps_per_graph=k)
            for e, x, r, w, b, k in itertools.product(*values, steps)]


def free_device_memory() -> None:
    """Releases freed engines' device memory so the next variant's weights fit (one engine at a time)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def variant_engine(model: Any, variant: Variant, device: str, **kw: Any) -> Iterator[Any]:
    """An Engine for ``variant`` that is closed and whose memory is released when the block ends."""
    from tornado_moe.engine import Engine

    engine = Engine(model, variant.engine_options(device, **kw))
    try:
        yield engine
    finally:
        engine.close()
        del engine
        free_device_memory()
