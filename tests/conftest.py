"""Shared fixtures: devices to test on and small real GGUF models written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GPU = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if GPU else [])


def device_params() -> list:
    """``cpu`` always; ``cuda`` (marked gpu) when a GPU is visible."""
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)] if GPU else ["cpu"]


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synth 'tiny' preset (qwen2moe, random weights, token ids only)."""
    from tornado_moe.synth.random_model import PRESETS, write_random_model

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_random_model(path, PRESETS["tiny"], seed=1, progress=False)
    return path


@pytest.fixture(scope="session")
def default_model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model (SmolLM2-135M split into 8 experts), converted into a temporary folder."""
    from tornado_moe.synth.default_model import convert_dense_to_moe, smollm2_source_path

    dst = tmp_path_factory.mktemp("default") / "smollm2-moe.gguf"
    return convert_dense_to_moe(smollm2_source_path(), dst, progress=False)


def attention_scratch(n_tokens: int, n_heads: int, head_dim: int, device: str | torch.device) -> torch.Tensor:
    """A fresh (zero) scratch for K.attention at this shape."""
    from tornado_moe import kernels as K

    words = K.attention_scratch_words(n_tokens, n_heads, head_dim)
    return torch.zeros(words, dtype=torch.int32, device=device)


def write_late(dst: torch.Tensor, value: int) -> None:
    """Writes `value` into the int32 word `dst` from a kernel that outlasts the start of the next one: an
    argmax over ~16 MB of logits, which triggers its dependents at its start and writes at its end. The kernel
    launched right after it starts under PDL while dst still holds its old value (the predecessor tests)."""
    vocab = 1 << 22
    logits = torch.zeros((1, vocab), dtype=torch.float32, device=dst.device)
    logits[0, value] = 1.0
    if dst.is_cuda:
        torch.cuda.synchronize()  # the logits' fill done: nothing but the argmax before the kernel under test
    from tornado_moe import kernels as K

    K.argmax(logits, dst, 1, vocab)

