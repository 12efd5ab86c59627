"""Write GGUF files: from a ModelConfig + float weights, or from a transformers model object.

Two layers:

- :func:`write_gguf` writes any supported model given its :class:`ModelConfig` and a dict of float weights
  named as in GGUF (``"blk.0.attn_q.weight"``, numpy order shapes, see ARCHITECTURE.md section 6). It writes
  the standard ``{arch}.*`` keys, ``tokenizer.ggml.model = "none"`` unless tokenizer metadata is given,
  norms / biases / router weights as F32 and every other matrix in the requested ``qtype``.
- :func:`write_hf_model_to_gguf` maps a transformers ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``,
  ``OlmoeForCausalLM``, ``MixtralForCausalLM`` or ``LlamaForCausalLM`` onto that, following llama.cpp's
  conventions: for ``llama`` files the Q/K rows of each head are permuted from HF's rotate-half layout to
  interleaved pairs (so the loader sees a real GGUF llama layout and uses "normal" RoPE); ``qwen2moe``,
  ``qwen3moe`` and ``olmoe`` stay unpermuted (NEOX RoPE); Mixtral and OLMoE experts are stored as 3-D
  ``ffn_{gate,up,down}_exps`` tensors without ``*.expert_feed_forward_length`` (as llama.cpp does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tornado_moe.errors import UnsupportedModelError
from tornado_moe.model.config import ModelConfig
from tornado_moe.quant.formats import FILE_TYPE, QuantType, quantize

__all__ = [
    "write_gguf",
    "write_hf_model_to_gguf",
    "hf_config_to_model_config",
    "permute_for_interleaved_rope",
]

# Tensor-name endings that are always written as F32 (the loader requires it).
_F32_SUFFIXES = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "output_norm.weight",
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp_shexp.weight",
)


def permute_for_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of a Q or K projection (or bias) from HF rotate-half to interleaved RoPE pairs.

    Within each head of size d, output row 2j comes from input row j and row 2j+1 from row j + d/2,
    so rotating pairs (2j, 2j+1) equals HF's rotation of pairs (j, j + d/2).
    """
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_config_keys(writer: Any, c: ModelConfig, name: str) -> None:
    a = c.arch
    writer.add_name(name)
    writer.add_uint32(f"{a}.block_count", c.n_layers)
    writer.add_uint32(f"{a}.context_length", c.context_length)
    writer.add_uint32(f"{a}.embedding_length", c.hidden)
    writer.add_uint32(f"{a}.attention.head_count", c.n_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", c.n_kv_heads)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.rms_eps)
    writer.add_float32(f"{a}.rope.freq_base", c.rope_theta)
    if c.head_dim * c.n_heads != c.hidden:
        writer.add_uint32(f"{a}.attention.key_length", c.head_dim)
        writer.add_uint32(f"{a}.attention.value_length", c.head_dim)
    if c.arch == "llama":
        writer.add_uint32("llama.vocab_size", c.vocab)
        writer.add_uint32("llama.rope.dimension_count", c.head_dim)
        writer.add_uint32("llama.feed_forward_length", c.expert_ffn if c.is_moe else c.dense_ffn)
        if c.is_moe:
            writer.add_uint32("llama.expert_count", c.n_experts)
            writer.add_uint32("llama.expert_used_count", c.top_k)
    else:  # qwen2moe, qwen3moe, olmoe
        writer.add_uint32(f"{a}.expert_count", c.n_experts)
        writer.add_uint32(f"{a}.expert_used_count", c.top_k)
        if a == "olmoe":  # as llama.cpp's converter writes it: the expert width under the dense key
            writer.add_uint32("olmoe.feed_forward_length", c.expert_ffn)
        else:
            writer.add_uint32(f"{a}.expert_feed_forward_length", c.expert_ffn)
        if c.shared_ffn:
            writer.add_uint32(f"{a}.expert_shared_feed_forward_length", c.shared_ffn)


def write_gguf(
    path: str | os.PathLike[str],
    config: ModelConfig,
    weights: Mapping[str, np.ndarray],
    *,
    qtype: QuantType = QuantType.F32,
    name: str = "tornado-moe model",
    tokenizer_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``weights`` (GGUF names -> float arrays in numpy order) as a GGUF file for ``config``.

    Norms, biases and router weights are F32; all other tensors are encoded as ``qtype`` (rows must be a
    multiple of 32 for the block types). ``tokenizer_metadata`` ({"tokenizer.ggml.*": value}) is copied in;
    without it the file says ``tokenizer.ggml.model = "none"``. Returns the path written.
    """
    import gguf

    qtype = QuantType(qtype)
    p = Path(path)
    writer = gguf.GGUFWriter(p, config.arch)
    _add_config_keys(writer, config, name)
    writer.add_file_type(FILE_TYPE[qtype])
    if qtype not in (QuantType.F32, QuantType.F16, QuantType.BF16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer_metadata:
        for key, val in tokenizer_metadata.items():
            add_metadata_value(writer, key, val)
    else:
        writer.add_tokenizer_model("none")

    for tname, values in weights.items():
        arr = np.asarray(values)
        t = QuantType.F32 if tname.endswith(_F32_SUFFIXES) or arr.ndim == 1 else qtype
        raw = quantize(arr.astype(np.float32), t)
        writer.add_tensor(tname, raw, raw_dtype=gguf.GGMLQuantizationType(int(t)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return p


def add_metadata_value(writer: Any, key: str, val: Any) -> None:
    """Add a metadata value with the GGUF type tokenizer keys conventionally use."""
    if isinstance(val, bool):
        writer.add_bool(key, val)
    elif isinstance(val, int):
        writer.add_uint32(key, val)
    elif isinstance(val, float):
        writer.add_float32(key, val)
    elif isinstance(val, str):
        writer.add_string(key, val)
    elif isinstance(val, (list, tuple)):
        writer.add_array(key, list(val))
    else:
        raise TypeError(f"metadata {key!r}: unsupported value type {type(val).__name__}")


# ----------------------------------------------------------------------------------------------------------
# transformers -> GGUF


def _rope_theta(hf_cfg: Any) -> float:
    # transformers 5 keeps theta and type in `rope_parameters`; 4.x used `rope_theta` and `rope_scaling`.
    params = getattr(hf_cfg, "rope_parameters", None) or {}
    for cfg in (params, getattr(hf_cfg, "rope_scaling", None)):
        if isinstance(cfg, dict):
            rope_type = cfg.get("rope_type", cfg.get("type", "default"))
            if rope_type != "default":
                raise UnsupportedModelError(f"transformers model: RoPE type {rope_type!r} is not supported")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = getattr(hf_cfg, "rope_theta", None)
    if theta is None:
        raise UnsupportedModelError("transformers model: cannot find rope_theta in the config")
    return float(theta)


def hf_config_to_model_config(hf_cfg: Any) -> ModelConfig:
    """The :class:`ModelConfig` a GGUF written from a transformers config of that model type describes."""
    mt = hf_cfg.model_type
    n_heads = hf_cfg.num_attention_heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // n_heads
    common = dict(
        n_layers=hf_cfg.num_hidden_layers,
        hidden=hf_cfg.hidden_size,
        n_heads=n_heads,
        n_kv_heads=hf_cfg.num_key_value_heads or n_heads,
        head_dim=head_dim,
        vocab=hf_cfg.vocab_size,
        context_length=hf_cfg.max_position_embeddings,
        rms_eps=float(hf_cfg.rms_norm_eps),
        rope_theta=_rope_theta(hf_cfg),
        tied_output=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
    )
    if getattr(hf_cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"transformers {mt}: activation {hf_cfg.hidden_act!r} is not supported")
    if mt in ("qwen2_moe", "qwen3_moe"):
        qwen3 = mt == "qwen3_moe"
        if hf_cfg.mlp_only_layers or hf_cfg.decoder_sparse_step != 1:
            raise UnsupportedModelError(f"transformers {mt}: dense layers (mlp_only_layers / sparse step)")
        if getattr(hf_cfg, "use_sliding_window", False):
            raise UnsupportedModelError(f"transformers {mt}: sliding-window attention is not supported")
        # GGUF has no key for it: llama.cpp renormalises qwen3moe's top-k weights and never qwen2moe's
        if bool(hf_cfg.norm_topk_prob) != qwen3:
            raise UnsupportedModelError(
                f"transformers {mt}: norm_topk_prob={hf_cfg.norm_topk_prob} cannot be expressed in GGUF"
            )
        return ModelConfig(
            arch="qwen3moe" if qwen3 else "qwen2moe",
            neox_rope=True,
            n_experts=hf_cfg.num_experts,
            top_k=hf_cfg.num_experts_per_tok,
            expert_ffn=hf_cfg.moe_intermediate_size,
            shared_ffn=0 if qwen3 else hf_cfg.shared_expert_intermediate_size,
            dense_ffn=0,
            normalize_topk=qwen3,
            qkv_bias=bool(getattr(hf_cfg, "attention_bias" if qwen3 else "qkv_bias", False)),
            qk_norm="head" if qwen3 else "",
            **common,
        )
    if mt == "olmoe":
        if getattr(hf_cfg, "clip_qkv", None) is not None:
            raise UnsupportedModelError("transformers olmoe: clip_qkv is not supported")
        # GGUF has no key for it: llama.cpp never renormalises olmoe's top-k weights
        if hf_cfg.norm_topk_prob:
            raise UnsupportedModelError(
                "transformers olmoe: norm_topk_prob=True cannot be expressed in GGUF"
            )
        if head_dim * n_heads != hf_cfg.hidden_size:  # its q/k norm weights are sized by hidden / heads
            raise UnsupportedModelError("transformers olmoe: head_dim * heads must equal hidden_size")
        return ModelConfig(
            arch="olmoe",
            neox_rope=True,
            n_experts=hf_cfg.num_experts,
            top_k=hf_cfg.num_experts_per_tok,
            expert_ffn=hf_cfg.intermediate_size,
            shared_ffn=0,
            dense_ffn=0,
            normalize_topk=False,
            qkv_bias=bool(getattr(hf_cfg, "attention_bias", False)),
            qk_norm="full",
            **common,
        )
    if mt == "mixtral":
        if getattr(hf_cfg, "sliding_window", None):
            raise UnsupportedModelError("transformers mixtral: sliding-window attention is not supported")
        return ModelConfig(
            arch="llama",
            neox_rope=False,
            n_experts=hf_cfg.num_local_experts,
            top_k=hf_cfg.num_experts_per_tok,
            expert_ffn=hf_cfg.intermediate_size,
            shared_ffn=0,
            dense_ffn=0,
            normalize_topk=True,
            qkv_bias=False,
            **common,
        )
    if mt == "llama":
        if getattr(hf_cfg, "mlp_bias", False):
            raise UnsupportedModelError("transformers llama: mlp_bias is not supported")
        if getattr(hf_cfg, "attention_bias", False):
            raise UnsupportedModelError(
                "transformers llama: attention_bias (incl. o_proj bias) is not supported"
            )
        return ModelConfig(
            arch="llama",
            neox_rope=False,
            n_experts=0,
            top_k=0,
            expert_ffn=0,
            shared_ffn=0,
            dense_ffn=hf_cfg.intermediate_size,
            normalize_topk=False,
            qkv_bias=False,
            **common,
        )
    raise UnsupportedModelError(
        f"transformers model type {mt!r} is not supported (qwen2_moe, qwen3_moe, olmoe, mixtral, llama)"
    )


def _np(t: Any) -> np.ndarray:
    return t.detach().to("cpu").double().numpy()


def _hf_weights(hf_model: Any, c: ModelConfig) -> dict[str, np.ndarray]:
    base = hf_model.model
    w: dict[str, np.ndarray] = {"token_embd.weight": _np(base.embed_tokens.weight)}
    permute = c.arch == "llama"
    for i, layer in enumerate(base.layers):
        p = f"blk.{i}."
        att = layer.self_attn
        q, k = _np(att.q_proj.weight), _np(att.k_proj.weight)
        if permute:
            q, k = permute_for_interleaved_rope(q, c.n_heads), permute_for_interleaved_rope(k, c.n_kv_heads)
        w[p + "attn_norm.weight"] = _np(layer.input_layernorm.weight)
        w[p + "attn_q.weight"] = q
        w[p + "attn_k.weight"] = k
        w[p + "attn_v.weight"] = _np(att.v_proj.weight)
        if c.qkv_bias:
            qb, kb = _np(att.q_proj.bias), _np(att.k_proj.bias)
            if permute:
                qb, kb = (
                    permute_for_interleaved_rope(qb, c.n_heads),
                    permute_for_interleaved_rope(kb, c.n_kv_heads),
                )
            w[p + "attn_q.bias"] = qb
            w[p + "attn_k.bias"] = kb
            w[p + "attn_v.bias"] = _np(att.v_proj.bias)
        if c.qk_norm:
            w[p + "attn_q_norm.weight"] = _np(att.q_norm.weight)
            w[p + "attn_k_norm.weight"] = _np(att.k_norm.weight)
        w[p + "attn_output.weight"] = _np(att.o_proj.weight)
        w[p + "ffn_norm.weight"] = _np(layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        if c.is_moe:
            gate_up = _np(mlp.experts.gate_up_proj)  # [E, 2I, H]: gate rows first, then up rows
            w[p + "ffn_gate_inp.weight"] = _np(mlp.gate.weight)
            w[p + "ffn_gate_exps.weight"] = np.ascontiguousarray(gate_up[:, : c.expert_ffn])
            w[p + "ffn_up_exps.weight"] = np.ascontiguousarray(gate_up[:, c.expert_ffn :])
            w[p + "ffn_down_exps.weight"] = _np(mlp.experts.down_proj)
            if c.shared_ffn:
                w[p + "ffn_gate_inp_shexp.weight"] = _np(mlp.shared_expert_gate.weight).reshape(c.hidden)
                w[p + "ffn_gate_shexp.weight"] = _np(mlp.shared_expert.gate_proj.weight)
                w[p + "ffn_up_shexp.weight"] = _np(mlp.shared_expert.up_proj.weight)
                w[p + "ffn_down_shexp.weight"] = _np(mlp.shared_expert.down_proj.weight)
        else:
            w[p + "ffn_gate.weight"] = _np(mlp.gate_proj.weight)
            w[p + "ffn_up.weight"] = _np(mlp.up_proj.weight)
            w[p + "ffn_down.weight"] = _np(mlp.down_proj.weight)
    w["output_norm.weight"] = _np(base.norm.weight)
    if not c.tied_output:
        w["output.weight"] = _np(hf_model.lm_head.weight)
    return w


def write_hf_model_to_gguf(
    hf_model: Any, path: str | os.PathLike[str], *, qtype: QuantType = QuantType.F32
) -> ModelConfig:
    """Write a transformers Qwen2Moe / Mixtral / Llama causal-LM (any dtype) to ``path`` as GGUF.

    Matrices are stored as ``qtype`` (F32 keeps float32-representable weights exact); the file carries no
    tokenizer (``tokenizer.ggml.model = "none"``). Returns the ModelConfig the file describes.
    """
    c = hf_config_to_model_config(hf_model.config)
    weights = _hf_weights(hf_model, c)
    write_gguf(path, c, weights, qtype=qtype, name=f"tornado-moe {hf_model.config.model_type} conversion")
    return c
