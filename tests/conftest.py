"""Shared fixtures: devices to test on and small real GGUF models written once per session."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

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


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN and -0.0 included, which torch.equal does not give) of two float32 or int32
    tensors of one dtype and shape, on any devices."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {torch.float32: torch.int32, torch.int32: torch.int32}[a.dtype]
    return torch.equal(a.contiguous().view(view).cpu(), b.contiguous().view(view).cpu())


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


_SPM_WORDS = ["the", "capital", "of", "France", "is", "Paris", "mixture", "experts", "naïve", "café",
              "über", "déjà", "vu", "tokens", "42", "2048", "hello", "world", "  ", "\t", "\n", "Ωmega",
              "日本語", "テキスト"]


@pytest.fixture(scope="session")
def spm_vocab() -> tuple[dict, object]:
    """A SentencePiece BPE model trained here with llama's settings (byte fallback, identity normalisation, a
    dummy prefix, whitespace kept; 400 pieces, <unk> 0, <s> 1, </s> 2): the GGUF tokenizer metadata of its
    vocabulary, and the sentencepiece processor (the oracle). Skipped without sentencepiece."""
    import io
    import random

    spm = pytest.importorskip("sentencepiece")
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(_SPM_WORDS) for _ in range(12)) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, model_type="bpe", vocab_size=400,
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True, unk_id=0,
        bos_id=1, eos_id=2, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1
             for i in range(n)]
    assert types.count(6) == 256 and types.count(1) > 100  # byte pieces, and merges to order by score
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    return metadata, sp


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
