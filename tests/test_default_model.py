"""The default model: SmolLM2-135M-Instruct split into 8 always-active experts equal to the dense FFN.

Checked three ways: the expert tensors decode (with gguf's own dequantizer) to exactly the dense rows and 8x
the dense columns; the float64 reference gives the same logits (to rounding) and the same greedy tokens for
the MoE file and the original dense file; and the MoE model writes real text (" Paris").
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tornado_moe.errors import UnsupportedModelError
from tornado_moe.model.gguf_model import GGUFModel, load_model
from tornado_moe.model.tokenizer import Tokenizer
from tornado_moe.reference.model64 import ReferenceModel
from tornado_moe.synth.default_model import (
    DEFAULT_MODEL_VERSION,
    DEFAULT_N_EXPERTS,
    VERSION_KEY,
    convert_dense_to_moe,
    default_model_path,
    smollm2_source_path,
)

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache dir, MoE path): built from scratch into a private cache dir, as a first run would."""
    cache = tmp_path_factory.mktemp("tm_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORNADO_MOE_CACHE", str(cache))
        path = default_model_path(progress=False)
    return cache, path


@pytest.fixture(scope="module")
def models(built: tuple[Path, Path]) -> tuple[GGUFModel, GGUFModel]:
    """(MoE, dense original), loaded once."""
    return load_model(built[1]), load_model(smollm2_source_path())


@pytest.fixture(scope="module")
def refs(models: tuple[GGUFModel, GGUFModel]) -> tuple[ReferenceModel, ReferenceModel]:
    """Float64 reference models of (MoE, dense), shared by the tests of this module."""
    return ReferenceModel(models[0]), ReferenceModel(models[1])


def _reader_tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _deq(t: gguf.ReaderTensor) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)


def test_built_once_into_the_cache_and_reused(
    built: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, path = built
    assert path.parent == cache and path.is_file()
    assert f"-v{DEFAULT_MODEL_VERSION}-" in path.name
    assert not list(cache.glob("*.part"))  # written atomically: no temporary left behind
    stamp = path.stat().st_mtime_ns
    monkeypatch.setenv("TORNADO_MOE_CACHE", str(cache))
    assert default_model_path(progress=False) == path
    assert path.stat().st_mtime_ns == stamp  # reused, not rewritten


def test_config_and_metadata(models: tuple[GGUFModel, GGUFModel]) -> None:
    moe, dense = models
    c, d = moe.config, dense.config
    assert (c.arch, c.n_experts, c.top_k, c.expert_ffn, c.dense_ffn) == ("llama", 8, 8, 192, 0)
    assert c.normalize_topk and c.tied_output and d.dense_ffn == 1536 and not d.is_moe
    for f in (
        "n_layers",
        "hidden",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "vocab",
        "context_length",
        "rms_eps",
        "rope_theta",
        "neox_rope",
        "qkv_bias",
    ):
        assert getattr(c, f) == getattr(d, f), f
    md_moe, md_dense = moe.metadata, dense.metadata
    assert md_moe[VERSION_KEY] == DEFAULT_MODEL_VERSION
    assert md_moe["llama.expert_count"] == md_moe["llama.expert_used_count"] == DEFAULT_N_EXPERTS
    assert "tornado-moe" in md_moe["general.name"]
    changed = {"general.name", "llama.feed_forward_length"}
    added = {"llama.expert_count", "llama.expert_used_count", "llama.expert_feed_forward_length", VERSION_KEY}
    assert set(md_moe) == set(md_dense) | added
    for key in set(md_dense) - changed:  # tokenizer, chat template, everything else: unchanged
        assert md_moe[key] == md_dense[key], key


def test_expert_tensors_are_exactly_the_dense_ones(built: tuple[Path, Path]) -> None:
    """By gguf's dequantizer: gate/up rows equal, down columns exactly 8x, router 0, the rest byte-equal."""
    moe, dense = _reader_tensors(built[1]), _reader_tensors(smollm2_source_path())
    E, n_layers = DEFAULT_N_EXPERTS, 30
    for i in range(n_layers):
        b = f"blk.{i}."
        for w in ("gate", "up"):
            dv = _deq(dense[b + f"ffn_{w}.weight"])  # [1536, 576]
            ev = _deq(moe[b + f"ffn_{w}_exps.weight"])  # [8, 192, 576]
            assert ev.shape == (E, dv.shape[0] // E, dv.shape[1])
            assert np.array_equal(ev.reshape(dv.shape), dv)
        dv = _deq(dense[b + "ffn_down.weight"])  # [576, 1536]
        ev = _deq(moe[b + "ffn_down_exps.weight"])  # [8, 576, 192]
        assert ev.shape == (E, dv.shape[0], dv.shape[1] // E)
        assert np.all(np.isfinite(ev))
        for e in range(E):
            assert np.array_equal(ev[e], 8.0 * dv[:, e * 192 : (e + 1) * 192]), (i, e)
        router = moe[b + "ffn_gate_inp.weight"]
        assert router.tensor_type == gguf.GGMLQuantizationType.F32
        assert tuple(int(x) for x in reversed(router.shape.tolist())) == (E, 576)
        assert not np.any(np.asarray(router.data))
    kept = [n for n in dense if not any(f"ffn_{w}.weight" in n for w in ("gate", "up", "down"))]
    assert len(kept) == len(dense) - 3 * n_layers
    for name in kept:
        assert moe[name].tensor_type == dense[name].tensor_type, name
        assert np.array_equal(np.asarray(moe[name].data), np.asarray(dense[name].data)), name
    assert "output.weight" not in moe  # still tied


def test_moe_and_dense_give_the_same_greedy_tokens(
    refs: tuple[ReferenceModel, ReferenceModel], models: tuple[GGUFModel, GGUFModel]
) -> None:
    moe, dense = refs
    tok = Tokenizer.from_metadata(models[0].metadata)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        # same function up to float64 summation order over the FFN neurons
        lm = moe.forward(ids, moe.new_cache(len(ids)))
        ld = dense.forward(ids, dense.new_cache(len(ids)))
        assert float((lm - ld).abs().max()) < 1e-9 * float(ld.abs().max()), prompt
        assert moe.generate_greedy(ids, 8) == dense.generate_greedy(ids, 8), prompt


def test_moe_model_knows_the_capital_of_france(
    refs: tuple[ReferenceModel, ReferenceModel], models: tuple[GGUFModel, GGUFModel]
) -> None:
    """The plain prompt (no chat template: this 135M instruct model completes raw text) gives " Paris"."""
    tok = Tokenizer.from_metadata(models[0].metadata)
    ids = tok.encode("The capital of France is")
    text = tok.decode(refs[0].generate_greedy(ids, 3))
    assert text.startswith(" Paris"), text


def test_conversion_refuses_unsuitable_inputs(tmp_path: Path, tiny_model_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="only dense 'llama' models"):
        convert_dense_to_moe(tiny_model_path, tmp_path / "x.gguf", progress=False)
    with pytest.raises(ValueError, match="power of two"):
        convert_dense_to_moe(smollm2_source_path(), tmp_path / "x.gguf", n_experts=3, progress=False)
    assert not list(tmp_path.iterdir())
