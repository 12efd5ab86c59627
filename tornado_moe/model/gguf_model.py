"""Load a GGUF model: metadata, validated config and memory-mapped raw (still quantized) tensors.

Nothing is dequantized here: kernels read the GGUF blocks as stored, so the loader only checks that the file
is complete and consistent, and hands out zero-copy views of the mapped bytes. Every problem raises a
:class:`~tornado_moe.errors.ModelFileError` or :class:`~tornado_moe.errors.UnsupportedModelError` whose
message names the file and the tensor or key at fault.

Shapes are reported in numpy (row-major) order, i.e. GGUF/ggml ``ne`` reversed: ``attn_q`` is
``[out, in]``, ``ffn_gate_exps`` ``[E, I, H]``, ``ffn_down_exps`` ``[E, H, I]``, norms ``[H]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tornado_moe.errors import ModelFileError, UnsupportedModelError
from tornado_moe.model.config import SUPPORTED_ARCHS, ModelConfig
from tornado_moe.quant.formats import QuantType, dequantize, row_bytes

# Architectures whose files are always MoE: NEOX RoPE, the expert keys required (llama files may be dense)
MOE_ONLY_ARCHS = ("qwen2moe", "qwen3moe", "olmoe")

__all__ = ["QTensor", "GGUFModel", "load_model", "LAYER_TENSOR_NAMES", "GGUF_MAGIC"]

GGUF_MAGIC = b"GGUF"

# Short key used by layer(i) -> tensor name suffix inside "blk.{i}.".
LAYER_TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "attn_norm.weight",
    "attn_q": "attn_q.weight",
    "attn_k": "attn_k.weight",
    "attn_v": "attn_v.weight",
    "attn_q_bias": "attn_q.bias",
    "attn_k_bias": "attn_k.bias",
    "attn_v_bias": "attn_v.bias",
    "attn_q_norm": "attn_q_norm.weight",
    "attn_k_norm": "attn_k_norm.weight",
    "attn_output": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "ffn_gate_inp": "ffn_gate_inp.weight",
    "ffn_gate_exps": "ffn_gate_exps.weight",
    "ffn_up_exps": "ffn_up_exps.weight",
    "ffn_down_exps": "ffn_down_exps.weight",
    "ffn_gate_inp_shexp": "ffn_gate_inp_shexp.weight",
    "ffn_gate_shexp": "ffn_gate_shexp.weight",
    "ffn_up_shexp": "ffn_up_shexp.weight",
    "ffn_down_shexp": "ffn_down_shexp.weight",
    "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight",
    "ffn_down": "ffn_down.weight",
}

# Small tensors that the kernels read as plain float32 vectors/matrices: must be stored F32.
_F32_ONLY = frozenset(
    {
        "attn_norm",
        "ffn_norm",
        "attn_q_bias",
        "attn_k_bias",
        "attn_v_bias",
        "attn_q_norm",
        "attn_k_norm",
        "ffn_gate_inp",
        "ffn_gate_inp_shexp",
    }
)


@dataclass(frozen=True, eq=False)
class QTensor:
    """One tensor of the file, as stored (quantized or float), memory-mapped.

    ``shape`` is in numpy order. ``data`` is a read-only, C-contiguous uint8 view of the mapped file:
    for a tensor of two or more dimensions it has shape ``[prod(shape[:-1]), row_bytes]`` (one row of GGML
    blocks per output row; experts are stacked: row ``e * I + i`` of ``ffn_gate_exps`` is expert e, row i);
    for a 1-D tensor (norms, biases) it is 1-D ``[row_bytes]``. ``file_offset`` is the byte offset of the
    data in the file (GGUF data alignment applies).
    """

    name: str
    qtype: QuantType
    shape: tuple[int, ...]
    data: np.ndarray
    file_offset: int = -1

    @property
    def cols(self) -> int:
        """Values per row (the innermost, contiguous dimension)."""
        return self.shape[-1]

    @property
    def rows(self) -> int:
        """Number of rows: prod(shape[:-1]) (1 for a vector)."""
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of GGML blocks."""
        return row_bytes(self.qtype, self.cols)

    @property
    def nbytes(self) -> int:
        """Total bytes of the stored tensor."""
        return self.rows * self.row_bytes

    def dequantize(self) -> np.ndarray:
        """Decode to a new float32 array of ``shape`` (for references and tests, never the hot path)."""
        return dequantize(self.data, self.qtype, self.shape)

    def __repr__(self) -> str:
        return f"QTensor({self.name!r}, {self.qtype.name}, shape={self.shape})"


@dataclass(eq=False)
class GGUFModel:
    """A loaded GGUF model: path, validated config, all metadata and the memory-mapped tensors."""

    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    tensors: dict[str, QTensor]
    _layers: list[dict[str, QTensor | None]] = field(default_factory=list, repr=False)
    _reader: Any = field(default=None, repr=False)  # keeps the memory map alive

    def tensor(self, name: str) -> QTensor:
        """The tensor called ``name``; ModelFileError naming the file and tensor if absent."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} not found in the file")
        return t

    def get(self, name: str) -> QTensor | None:
        """The tensor called ``name``, or None."""
        return self.tensors.get(name)

    def layer(self, i: int) -> dict[str, QTensor | None]:
        """Tensors of layer ``i`` by short key (see LAYER_TENSOR_NAMES); None where the layer has none."""
        if not 0 <= i < self.config.n_layers:
            raise IndexError(f"layer {i} out of range 0..{self.config.n_layers - 1}")
        return dict(self._layers[i])

    @property
    def token_embd(self) -> QTensor:
        """Token embedding table [vocab, hidden]."""
        return self.tensor("token_embd.weight")

    @property
    def output_norm(self) -> QTensor:
        """Final RMSNorm weight [hidden]."""
        return self.tensor("output_norm.weight")

    @property
    def output(self) -> QTensor | None:
        """LM head [vocab, hidden]; None when tied to token_embd."""
        return self.tensors.get("output.weight")

    @property
    def logits_weight(self) -> QTensor:
        """The matrix the logits are computed with: ``output`` or, if tied, ``token_embd``."""
        return self.output if self.output is not None else self.token_embd

    def __repr__(self) -> str:
        return f"GGUFModel({str(self.path)!r}, {self.config.describe()})"


# ----------------------------------------------------------------------------------------------------------
# reading


def _decode_field(fld: Any) -> Any:
    """Turn a gguf ReaderField into a plain Python value (str, int, float, bool or list of them)."""
    from gguf import GGUFValueType

    types = fld.types
    if not types:
        return None
    if (
        types[0] == GGUFValueType.ARRAY
        and len(types) == 2
        and types[1]
        not in (
            GGUFValueType.STRING,
            GGUFValueType.ARRAY,
        )
    ):
        # Fast path for long numeric arrays (token types, scores): one concatenation instead of a loop.
        if not fld.data:
            return []
        return np.concatenate([fld.parts[i] for i in fld.data]).tolist()
    return fld.contents()


def _open_reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises assorted errors on damaged files
        raise ModelFileError(
            f"{path}: truncated or corrupt GGUF file ({path.stat().st_size} bytes): reading its header, "
            f"metadata and tensor table failed with {type(e).__name__}: {e}"
        ) from e


def _check_magic(path: Path) -> None:
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (first bytes {head!r}, expected {GGUF_MAGIC!r})")


class _Keys:
    """Typed access to the metadata of one file, with errors that name the file and key."""

    def __init__(self, path: Path, metadata: dict[str, Any], arch: str) -> None:
        self.path, self.md, self.arch = path, metadata, arch

    def _get(self, key: str, kind: type, default: Any, required: bool) -> Any:
        full = key.format(arch=self.arch)
        if full not in self.md:
            if required:
                raise ModelFileError(f"{self.path}: required metadata key {full!r} is missing")
            return default
        v = self.md[full]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else isinstance(v, kind)
        if kind is int and isinstance(v, bool):
            ok = False
        if not ok:
            raise ModelFileError(
                f"{self.path}: metadata key {full!r} should be {kind.__name__}, "
                f"found {type(v).__name__} {v!r}"
            )
        return kind(v)

    def get_int(self, key: str, default: int | None = None, *, required: bool = False) -> Any:
        return self._get(key, int, default, required)

    def get_float(self, key: str, default: float | None = None, *, required: bool = False) -> Any:
        return self._get(key, float, default, required)

    def get_str(self, key: str, default: str | None = None, *, required: bool = False) -> Any:
        return self._get(key, str, default, required)


def _positive(path: Path, key: str, value: int) -> int:
    if value <= 0:
        raise ModelFileError(f"{path}: metadata key {key!r} must be > 0, found {value}")
    return value


def _read_tensors(path: Path, reader: Any) -> tuple[dict[str, QTensor], dict[str, str]]:
    """Wrap every tensor of a supported type as a QTensor; return also {name: type name} of the others."""
    import gguf

    file_size = path.stat().st_size
    tensors: dict[str, QTensor] = {}
    unsupported: dict[str, str] = {}
    for rt in reader.tensors:
        ggml_type = int(rt.tensor_type)
        end = int(rt.data_offset) + int(rt.n_bytes)
        if end > file_size:
            raise ModelFileError(
                f"{path}: truncated file: tensor {rt.name!r} needs bytes up to {end} but the file has "
                f"{file_size} bytes"
            )
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        try:
            qtype = QuantType(ggml_type)
        except ValueError:
            unsupported[rt.name] = gguf.GGMLQuantizationType(ggml_type).name
            continue
        rb = row_bytes(qtype, shape[-1])
        raw = np.asarray(reader.data[int(rt.data_offset) : end])  # plain ndarray view of the memmap
        data = raw.reshape(-1, rb) if len(shape) > 1 else raw.reshape(rb)
        tensors[rt.name] = QTensor(rt.name, qtype, shape, data, int(rt.data_offset))
    return tensors, unsupported


def _squeeze_to(found: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """Drop leading unit dimensions beyond ``ndim`` (ggml pads ``ne`` with trailing 1s, e.g. [1, H] ~ [H])."""
    while len(found) > ndim and found[0] == 1:
        found = found[1:]
    return found


class _Validator:
    def __init__(self, path: Path, tensors: dict[str, QTensor], unsupported: dict[str, str]) -> None:
        self.path, self.tensors, self.unsupported = path, tensors, unsupported

    def present(self, name: str) -> bool:
        return name in self.tensors or name in self.unsupported

    def take(
        self, name: str, shape: tuple[int, ...] | None, *, f32: bool = False, required: bool = True
    ) -> QTensor | None:
        """Fetch ``name``, check type and shape; the stored QTensor is normalised to ``shape``."""
        if name in self.unsupported:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} has type {self.unsupported[name]}, which tornado-moe does not "
                f"support (supported: {', '.join(t.name for t in QuantType)})"
            )
        t = self.tensors.get(name)
        if t is None:
            if required:
                raise ModelFileError(f"{self.path}: required tensor {name!r} is missing")
            return None
        if f32 and t.qtype != QuantType.F32:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} has type {t.qtype.name}; tornado-moe needs it stored as F32"
            )
        if shape is not None:
            found = _squeeze_to(t.shape, len(shape))
            if found != shape:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                    "(numpy order)"
                )
            if found != t.shape:
                rb = row_bytes(t.qtype, shape[-1])
                data = t.data.reshape(-1, rb) if len(shape) > 1 else t.data.reshape(rb)
                t = QTensor(t.name, t.qtype, shape, data, t.file_offset)
                self.tensors[name] = t
        return t


def _build(path: Path, metadata: dict[str, Any], tensors: dict[str, QTensor], unsupported: dict[str, str]):
    arch_val = metadata.get("general.architecture")
    if arch_val is None:
        raise ModelFileError(f"{path}: required metadata key 'general.architecture' is missing")
    arch = str(arch_val)
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    k = _Keys(path, metadata, arch)
    v = _Validator(path, tensors, unsupported)

    n_layers = _positive(path, f"{arch}.block_count", k.get_int("{arch}.block_count", required=True))
    hidden = _positive(path, f"{arch}.embedding_length", k.get_int("{arch}.embedding_length", required=True))
    n_heads = _positive(
        path, f"{arch}.attention.head_count", k.get_int("{arch}.attention.head_count", required=True)
    )
    n_kv = _positive(
        path, f"{arch}.attention.head_count_kv", k.get_int("{arch}.attention.head_count_kv", n_heads)
    )
    ctx = _positive(path, f"{arch}.context_length", k.get_int("{arch}.context_length", required=True))
    eps = k.get_float("{arch}.attention.layer_norm_rms_epsilon", required=True)
    theta = k.get_float("{arch}.rope.freq_base", 10000.0)
    if n_heads % n_kv != 0:
        raise ModelFileError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv}")

    key_len = k.get_int("{arch}.attention.key_length")
    val_len = k.get_int("{arch}.attention.value_length")
    if key_len is not None:
        head_dim = key_len
    else:
        if hidden % n_heads != 0:
            raise ModelFileError(
                f"{path}: embedding_length {hidden} is not a multiple of head_count {n_heads} and "
                f"'{arch}.attention.key_length' is absent"
            )
        head_dim = hidden // n_heads
    if val_len is not None and val_len != head_dim:
        raise UnsupportedModelError(
            f"{path}: '{arch}.attention.value_length' {val_len} differs from the key length {head_dim}"
        )
    rope_dim = k.get_int("{arch}.rope.dimension_count")
    if rope_dim is not None and rope_dim != head_dim:
        raise UnsupportedModelError(
            f"{path}: partial RoPE ('{arch}.rope.dimension_count' {rope_dim} != head dim {head_dim}) "
            "is not supported"
        )
    clamp = k.get_float("{arch}.attention.clamp_kqv")
    if clamp is not None:
        raise UnsupportedModelError(
            f"{path}: clamped q/k/v ('{arch}.attention.clamp_kqv' = {clamp:g}) is not supported"
        )
    scaling = k.get_str("{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(
            f"{path}: RoPE scaling '{arch}.rope.scaling.type' = {scaling!r} not supported"
        )

    # Vocabulary size comes from the embedding table; the optional key must agree.
    embd = v.take("token_embd.weight", None)
    assert embd is not None
    if len(embd.shape) != 2 or _squeeze_to(embd.shape, 2)[1] != hidden:
        raise ModelFileError(
            f"{path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, expected [vocab, {hidden}]"
        )
    vocab = embd.shape[0]
    vocab_key = k.get_int("{arch}.vocab_size")
    if vocab_key is not None and vocab_key != vocab:
        raise ModelFileError(
            f"{path}: metadata '{arch}.vocab_size' = {vocab_key} but 'token_embd.weight' has {vocab} rows"
        )
    v.take("output_norm.weight", (hidden,), f32=True)
    out = v.take("output.weight", (vocab, hidden), required=False)

    qkv_bias = v.present("blk.0.attn_q.bias")
    if arch in MOE_ONLY_ARCHS:
        n_exp = _positive(path, f"{arch}.expert_count", k.get_int("{arch}.expert_count", required=True))
        top_k = _positive(
            path, f"{arch}.expert_used_count", k.get_int("{arch}.expert_used_count", required=True)
        )
    else:
        n_exp = k.get_int("{arch}.expert_count", 0)
        top_k = k.get_int("{arch}.expert_used_count", 0) if n_exp else 0
        if n_exp and top_k <= 0:
            raise ModelFileError(f"{path}: required metadata key 'llama.expert_used_count' is missing or 0")
    if n_exp and top_k > n_exp:
        raise ModelFileError(f"{path}: expert_used_count {top_k} exceeds expert_count {n_exp}")

    def ffn_size(key: str, tensor: str, axis: int) -> int:
        """A FFN width from its key, else from blk.0's tensor (the key wins and is checked later)."""
        val = k.get_int(key)
        if val is not None:
            return _positive(path, key.format(arch=arch), val)
        t = v.take(tensor, None)
        assert t is not None
        return t.shape[axis]

    expert_ffn = shared_ffn = dense_ffn = 0
    if n_exp and not v.present("blk.0.ffn_gate_exps.weight") and v.present("blk.0.ffn_gate.0.weight"):
        raise UnsupportedModelError(
            f"{path}: the experts are stored one tensor each ('blk.0.ffn_gate.0.weight', llama.cpp's layout "
            "before April 2024); tornado-moe reads them stacked ('ffn_gate_exps' and its kind): convert the "
            "model again with a current llama.cpp"
        )
    if n_exp:
        expert_ffn = ffn_size("{arch}.expert_feed_forward_length", "blk.0.ffn_gate_exps.weight", -2)
        if arch == "qwen2moe":
            shared_ffn = ffn_size(
                "{arch}.expert_shared_feed_forward_length", "blk.0.ffn_gate_shexp.weight", -2
            )
    else:
        dense_ffn = _positive(
            path, f"{arch}.feed_forward_length", k.get_int("{arch}.feed_forward_length", required=True)
        )

    try:
        config = ModelConfig(
            arch=arch,
            n_layers=n_layers,
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            vocab=vocab,
            context_length=ctx,
            rms_eps=eps,
            rope_theta=theta,
            neox_rope=arch in MOE_ONLY_ARCHS,
            n_experts=n_exp,
            top_k=top_k,
            expert_ffn=expert_ffn,
            shared_ffn=shared_ffn,
            dense_ffn=dense_ffn,
            # llama.cpp renormalises Mixtral's and qwen3moe's top-k weights, never qwen2moe's or olmoe's
            normalize_topk=arch in ("llama", "qwen3moe") and n_exp > 0,
            qkv_bias=qkv_bias,
            tied_output=out is None,
            qk_norm={"qwen3moe": "head", "olmoe": "full"}.get(arch, ""),
        )
    except ValueError as e:
        raise ModelFileError(f"{path}: inconsistent hyper-parameters: {e}") from e

    layers = [_validate_layer(v, config, i) for i in range(n_layers)]
    return config, layers


def _validate_layer(v: _Validator, c: ModelConfig, i: int) -> dict[str, QTensor | None]:
    H, q, kv = c.hidden, c.q_dim, c.kv_dim
    E, I, S, F = c.n_experts, c.expert_ffn, c.shared_ffn, c.dense_ffn
    expect: dict[str, tuple[int, ...]] = {
        "attn_norm": (H,),
        "attn_q": (q, H),
        "attn_k": (kv, H),
        "attn_v": (kv, H),
        "attn_output": (H, q),
        "ffn_norm": (H,),
    }
    if c.qkv_bias:
        expect.update({"attn_q_bias": (q,), "attn_k_bias": (kv,), "attn_v_bias": (kv,)})
    if c.qk_norm:
        wq, wk = c.qk_norm_widths
        expect.update({"attn_q_norm": (wq,), "attn_k_norm": (wk,)})
    if c.is_moe:
        expect.update(
            {
                "ffn_gate_inp": (E, H),
                "ffn_gate_exps": (E, I, H),
                "ffn_up_exps": (E, I, H),
                "ffn_down_exps": (E, H, I),
            }
        )
        if S:
            expect.update(
                {
                    "ffn_gate_inp_shexp": (H,),
                    "ffn_gate_shexp": (S, H),
                    "ffn_up_shexp": (S, H),
                    "ffn_down_shexp": (H, S),
                }
            )
    else:
        expect.update({"ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F)})

    out: dict[str, QTensor | None] = {}
    for key, suffix in LAYER_TENSOR_NAMES.items():
        name = f"blk.{i}.{suffix}"
        if key in expect:
            out[key] = v.take(name, expect[key], f32=key in _F32_ONLY)
        else:
            out[key] = None
    return out


def load_model(path: str | os.PathLike[str]) -> GGUFModel:
    """Open ``path`` (memory-mapped), validate it and return a :class:`GGUFModel`.

    Supported: ``qwen2moe`` (routed + shared experts), ``qwen3moe`` (routed experts, renormalised, and an
    RMSNorm per head on q and k), ``olmoe`` (routed experts, and one RMSNorm over all of q and one over all of
    k) and ``llama``, dense or with experts stored as Mixtral GGUFs do (3-D
    ``ffn_*_exps`` tensors). Weight types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (any mix, per tensor, as llama.cpp's K-quant and IQ4
    files have); norms, biases and router weights must be F32.
    """
    p = Path(path)
    _check_magic(p)
    reader = _open_reader(p)
    try:
        metadata = {
            name: _decode_field(fld) for name, fld in reader.fields.items() if not name.startswith("GGUF.")
        }
    except Exception as e:
        raise ModelFileError(
            f"{p}: cannot decode the metadata (corrupt file?): {type(e).__name__}: {e}"
        ) from e
    tensors, unsupported = _read_tensors(p, reader)
    config, layers = _build(p, metadata, tensors, unsupported)
    return GGUFModel(
        path=p, config=config, metadata=metadata, tensors=tensors, _layers=layers, _reader=reader
    )
