"""Prompts for the measurement tools: fixed, reproducible token ids.

Benchmarks and determinism checks must feed the same tokens on every machine and every run, whatever the
model's tokenizer: a seeded draw of ids below the vocabulary size does that (the synthetic Qwen1.5-MoE file
has the real vocabulary, so these are real token ids).
"""

from __future__ import annotations

import numpy as np

from tornado_moe.errors import InputError

__all__ = ["random_prompt_ids", "parse_token_ids", "check_token_ids"]


def random_prompt_ids(vocab: int, n_tokens: int, seed: int = 0) -> list[int]:
    """``n_tokens`` ids uniform in [0, vocab), a pure function of (vocab, n_tokens, seed)."""
    if n_tokens < 1:
        raise InputError(f"the prompt needs at least one token (got {n_tokens})")
    rng = np.random.Generator(np.random.PCG64(seed))
    return [int(t) for t in rng.integers(0, vocab, size=n_tokens)]


def parse_token_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    """Comma- and/or space-separated integers, e.g. ``"1,2,3"`` or ``"1 2 3"``."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        bad = next(p for p in parts if not p.lstrip("-").isdigit())
        raise InputError(f"{flag}: {bad!r} is not an integer token id (give e.g. 1,2,3)") from None
    if not ids:
        raise InputError(f"{flag}: no token ids given")
    return ids


def check_token_ids(ids: list[int], vocab: int, flag: str = "--prompt-ids") -> list[int]:
    """``ids`` unchanged, or InputError naming the first id outside the vocabulary."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InputError(f"{flag}: token id {t} (position {i}) is outside the model's vocabulary "
                             f"0..{vocab - 1}")
    return ids
