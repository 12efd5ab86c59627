"""Whole-model checks shared by the test modules: an engine's greedy trace, its error against the float64
reference, and the bitwise promises between engine variants."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tornado_moe.engine import Engine, EngineOptions
from tornado_moe.model.gguf_model import GGUFModel
from tornado_moe.reference.model64 import ReferenceModel


def trace(engine: Engine, tokens: Sequence[int], n_new: int) -> tuple[list[int], bytes]:
    """Greedy tokens after the prompt and the bytes of every step's logits row (the engine is closed)."""
    rows: list[np.ndarray] = []
    out, _ = engine.generate(tokens, n_new, on_logits=lambda r: rows.append(r.cpu().numpy().copy()))
    engine.close()
    return out, np.stack(rows).tobytes()


def rel_err_vs_reference(model: GGUFModel, tokens: Sequence[int], device: str = "cpu") -> float:
    """max |engine logits - float64 logits| / max |float64 logits| over the tokens fed one by one."""
    eng = Engine(model, EngineOptions(device=device))
    got = []
    for t in tokens:
        eng.feed(t)
        got.append(eng.last_logits().cpu().numpy().astype(np.float64))
    eng.close()
    ref_model = ReferenceModel(model)
    ref = ref_model.forward(list(tokens), ref_model.new_cache(len(tokens))).numpy()
    return float(np.abs(np.stack(got) - ref).max() / np.abs(ref).max())


def assert_reference_and_variants_agree(model: GGUFModel, device: str, prompt: Sequence[int]) -> None:
    """Logits within float32 rounding of the float64 reference; fused == per-slot and the prompt in one step
    == token by token, bit for bit (tokens and every step's logits)."""
    assert rel_err_vs_reference(model, prompt, device) < 2e-4
    options = [EngineOptions(device=device, fuse_experts=fuse, prefill_chunk=chunk)
               for fuse in (True, False) for chunk in (1, 128)]
    runs = [trace(Engine(model, o), prompt, 5) for o in options]
    assert all(r == runs[0] for r in runs)
