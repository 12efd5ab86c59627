"""Device-resident weights, activations and KV cache of one model instance.

Everything a task graph references lives here at a fixed address for the engine's lifetime, which is what
lets a captured CUDA graph be replayed for every token.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from tornado_moe.kernels import ops as tm_ops
from tornado_moe.model.config import ModelConfig
from tornado_moe.model.gguf_model import GGUFModel, QTensor
from tornado_moe.quant.tiled import Q8_0_TILED, can_tile, tile_q8_0


@dataclass(frozen=True)
class DeviceWeight:
    """A weight as stored in the GGUF file (raw bytes) on the device, with its format and shape."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    data: torch.Tensor  # the raw GGUF bytes (uint8)

    @property
    def floats(self) -> torch.Tensor:
        """The same memory as float32, for kernel arguments that are float pointers (norms, bias, router)."""
        if self.qtype != 0:
            raise ValueError(f"{self.name}: the kernels read it as float32, but it is stored as GGML type "
                             f"{self.qtype}")
        return self.data.view(torch.float32)


def _to_device(raw: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copies a (read-only, memory-mapped) array to ``device`` without an extra host copy on the way."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns on read-only arrays; we only read them
        shared = torch.from_numpy(raw)
    return shared.to(device) if device.type != "cpu" else shared.clone()


def upload(t: QTensor, device: torch.device, tile: bool = False) -> DeviceWeight:
    """``t`` on ``device``; with ``tile`` (CUDA only), a Q8_0 matrix whose rows allow it tiled."""
    raw = np.ascontiguousarray(t.data).reshape(-1)
    data = _to_device(raw, device)
    if tile and device.type == "cuda" and len(t.shape) >= 2 and can_tile(t.qtype, t.shape[-1]):
        return DeviceWeight(t.name, Q8_0_TILED, tuple(t.shape), tile_q8_0(data, t.shape[-1]))
    return DeviceWeight(t.name, int(t.qtype), tuple(t.shape), data)


class Activations:
    """Scratch buffers for up to ``max_tokens`` tokens per step, plus the KV cache."""

    def __init__(self, cfg: ModelConfig, device: torch.device, max_tokens: int, max_context: int) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        T = max_tokens
        self.max_tokens = T
        self.max_context = max_context
        self.x = torch.zeros(T, cfg.hidden, **f32)
        self.h = torch.zeros(T, cfg.hidden, **f32)
        # the deferred norm's factors (rmsnorm_factors): xw = x * norm_w and x's partial sums of squares xss,
        # written by the kernel that writes x (experts_down_accumulate) for the next qkv_rope, and inv where a
        # task computes it
        self.xw = torch.zeros(T, cfg.hidden, **f32)
        self.xss = torch.zeros(T, tm_ops.norm_groups(cfg.hidden), **f32)
        self.norm_inv = torch.zeros(T, **f32)
        # the FFN norm's factors for the shared expert's deferred gate-up, written by attn_output (its y_w,
        # y_ss and y_w_groups) and read in the same layer
        self.ffn_xw = torch.zeros(T, cfg.hidden, **f32)
        self.ffn_xss = torch.zeros(T, tm_ops.norm_groups(cfg.hidden), **f32)
        self.q = torch.zeros(T, cfg.n_heads * cfg.head_dim, **f32)
        self.k = torch.zeros(T, cfg.n_kv_heads * cfg.head_dim, **f32)
        self.v = torch.zeros(T, cfg.n_kv_heads * cfg.head_dim, **f32)
        self.attn = torch.zeros(T, cfg.n_heads * cfg.head_dim, **f32)
        # attention's arrival counters (zero at first; each call leaves them so) and partial results
        self.attn_scratch = torch.zeros(tm_ops.attention_scratch_words(T, cfg.n_heads, cfg.head_dim), **i32)
        k = max(cfg.top_k, 1)
        self.expert_ids = torch.zeros(T, k, **i32)
        self.expert_weights = torch.zeros(T, k, **f32)
        # router_experts_gate_up's and router_experts_ffn's sync words (zero at first; each call leaves them
        # for the next) and logits
        words = tm_ops.router_experts_ffn_scratch_words(T, max(cfg.n_experts, 1), cfg.hidden)
        self.router_scratch = torch.zeros(words, **i32)
        self.act = torch.zeros(T, k, max(cfg.expert_ffn, 1), **f32)
        ffn_dense = cfg.shared_ffn or cfg.dense_ffn
        self.act_dense = torch.zeros(T, max(ffn_dense, 1), **f32)
        # the shared-expert gate factors, written by router_experts_gate_up for experts_down_accumulate
        self.shared_gate = torch.zeros(T, **f32)
        # int8 groups (tm_act_groups_bytes) of act_dense, act, xw and attn, written beside them for the
        # next Q8_0 product (the down, the next qkv_rope, attn_output), which then reads them instead of
        # rounding the floats itself
        u8 = dict(dtype=torch.uint8, device=device)
        self.act_dense_groups = torch.zeros(T, tm_ops.act_groups_bytes(max(ffn_dense, 1)), **u8)
        self.act_groups = torch.zeros(T, k, tm_ops.act_groups_bytes(max(cfg.expert_ffn, 1)), **u8)
        self.xw_groups = torch.zeros(T, tm_ops.act_groups_bytes(cfg.hidden), **u8)
        self.ffn_xw_groups = torch.zeros(T, tm_ops.act_groups_bytes(cfg.hidden), **u8)
        self.attn_groups = torch.zeros(T, tm_ops.act_groups_bytes(cfg.n_heads * cfg.head_dim), **u8)
        self.logits = torch.zeros(1, cfg.vocab, **f32)  # a step's last token's only (logits_graph)
        self.tokens = torch.zeros(T, **i32)
        self.position = torch.zeros(1, **i32)
        # token_log[p]: the token chosen for position p (advance_position writes it; max_context + 1 entries
        # so that the token chosen after the last position is kept too): how the host reads back the tokens
        # of a CUDA graph that holds several decode steps
        self.token_log = torch.zeros(max_context + 1, **i32)
        kv = (max_context, cfg.n_kv_heads * cfg.head_dim)
        self.k_cache = [torch.zeros(kv, **f32) for _ in range(cfg.n_layers)]
        self.v_cache = [torch.zeros(kv, **f32) for _ in range(cfg.n_layers)]


class DeviceModel:
    """All weights of a GGUF model uploaded once, grouped per layer with the loader's short names.

    ``tile`` re-lays Q8_0 matrices out for the GPU's loads (tornado_moe.quant.tiled; CUDA only): the same
    results, bit for bit, faster.
    """

    def __init__(self, model: GGUFModel, device: torch.device, progress: bool = False,
                 tile: bool = False) -> None:
        from tqdm import tqdm

        self.config = model.config
        self.device = device
        self.layers: list[dict[str, DeviceWeight | None]] = []
        it = range(self.config.n_layers)
        for i in tqdm(it, desc="upload weights", unit="layer", disable=not progress):
            self.layers.append({key: None if t is None else upload(t, device, tile)
                                for key, t in model.layer(i).items()})
        self.token_embd = upload(model.tensor("token_embd.weight"), device, tile)
        self.output_norm = upload(model.tensor("output_norm.weight"), device)
        out = model.get("output.weight")
        self.output = upload(out, device, tile) if out is not None else self.token_embd
