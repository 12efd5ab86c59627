"""Float64 reference model: the oracle every kernel and route is tested against.

It dequantizes each weight once (with :func:`tornado_moe.quant.formats.dequantize`, exact) to
``torch.float64`` and runs the transformer exactly as ARCHITECTURE.md section 2 specifies, written for
clarity, not speed:

- ``rmsnorm(x) = x / sqrt(mean(x^2) + eps) * w``
- q, k, v = W x (+ bias); qwen3moe: an RMSNorm of each head of q and k (weights of head_dim), olmoe: one of
  all of q and one of all of k; RoPE on q and k with angle ``pos * theta^(-2i/d)`` for pair i: NEOX pairs
  (i, i + d/2) for qwen2moe, qwen3moe and olmoe, interleaved pairs (2i, 2i+1) for GGUF llama files (their
  Q/K rows are permuted)
- grouped-query causal attention, softmax of ``q.k / sqrt(head_dim)``; ``x += Wo attn``
- FFN on ``h = rmsnorm(x)``: dense ``down(silu(gate h) * up h)``, or MoE: ``p = softmax(Wr h)`` over all
  experts, top-k by p (ties to the lowest expert id), weights = selected p (renormalised to sum 1 for
  qwen3moe and Mixtral-style llama files), routed ``sum_s w_s down_e(silu(gate_e h) * up_e h)`` in slot
  order, plus the qwen2moe shared expert ``sigmoid(w_sh . h) * down_sh(silu(gate_sh h) * up_sh h)`` (its gate
  and up products in the deferred form below);
  ``x += routed + shared``
- logits = ``output`` (or ``token_embd`` when tied) @ ``rmsnorm(x) * output_norm``, in the deferred form below

Every product with a Q8_0 weight takes its activations rounded to int8 groups (:func:`q8_round`, as the
kernels do: csrc/common/act_quant.h). The rounding applies to the vector the kernels multiply: for q, k, v
that is ``x * attn_norm``, the product then scaled by ``1 / rms(x)`` (the kernels' deferred norm), and for the
output head ``x * output_norm``, scaled the same way, and for the shared expert's gate and up
``x * ffn_norm``, scaled the same way before the SwiGLU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tornado_moe.errors import InputError
from tornado_moe.model.config import ModelConfig
from tornado_moe.model.gguf_model import GGUFModel, QTensor
from tornado_moe.quant.formats import QuantType

__all__ = ["KVCache", "ReferenceModel", "q8_groups", "q8_round", "rmsnorm", "rope", "route_topk"]

_F64 = torch.float64


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """sqrt(mean(x^2) + eps) over the last dimension (kept)."""
    return torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def rms_inv(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms(x): the deferred norm's scale."""
    return 1.0 / _rms(x, eps)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dimension."""
    return x / _rms(x, eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, neox: bool) -> torch.Tensor:
    """Rotate ``x`` [T, heads, d] by position; ``neox`` picks pairs (i, i+d/2), else (2i, 2i+1)."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=_F64)
    inv_freq = theta ** (-2.0 * i / d)
    ang = positions.to(_F64)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def q8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 groups of ``x`` (csrc/common/act_quant.h), in x's dtype: codes [..., n / 4, 4] (integers in
    [-127, 127]) and scales [..., n / 4, 1].

    Groups of 4 consecutive values of the last dimension; per group the scale 2^e is the smallest power of
    two with max |x| * 2^-e < 127.5, and the codes are rint(x * 2^-e) (ties to even). Groups whose largest
    magnitude is below 2^-100 get codes 0 and scale 0, groups with a NaN or an infinity codes 0 and scale NaN
    (computed in x's dtype, so a float32 input gives the kernels' groups exactly).
    """
    g = x.reshape(*x.shape[:-1], -1, 4)
    amax = g.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(g).all(dim=-1, keepdim=True)
    _, k = torch.frexp(torch.where(finite, amax, torch.ones_like(amax)))  # amax in [2^(k-1), 2^k)
    e = k - 7
    e = torch.where(torch.ldexp(amax, -e) >= 127.5, e + 1, e)
    tiny = amax < 2.0**-100
    codes = torch.where(finite & ~tiny, torch.round(torch.ldexp(g, -e)), torch.zeros_like(g))
    scale = torch.ldexp(torch.ones_like(amax), e)
    scale = torch.where(tiny, torch.zeros_like(scale), scale)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    return codes, scale


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """The values the int8 groups of ``x`` stand for (q8_groups: codes * scale): what a dot product with Q8_0
    weights multiplies."""
    codes, scale = q8_groups(x)
    return (codes * scale).reshape(x.shape)


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then the ``top_k`` largest probabilities, ties to the lowest expert id.

    Returns (expert ids [T, k] int64, weights [T, k]); weights renormalised to sum 1 when ``normalize``.
    """
    p = torch.softmax(router_logits, dim=-1)
    # A stable descending sort keeps equal probabilities in increasing id order.
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = torch.gather(p, -1, order)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return order, w


@dataclass
class KVCache:
    """Per-layer key/value cache: k[l], v[l] are [max_ctx, n_kv_heads, head_dim] float64."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    max_ctx: int
    length: int = 0


class ReferenceModel:
    """Float64 forward pass of a loaded GGUF model (see the module docstring for the exact semantics)."""

    def __init__(self, model: GGUFModel) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        c = self.config

        def deq(t: QTensor | None) -> torch.Tensor | None:
            return None if t is None else torch.from_numpy(t.dequantize()).to(_F64)

        def q8(t: QTensor | None) -> bool:
            return t is not None and t.qtype == QuantType.Q8_0

        self.token_embd = deq(model.token_embd)
        self.output_norm = deq(model.output_norm)
        out = model.output
        self.output = self.token_embd if out is None else deq(out)
        self.output_q8 = q8(model.token_embd if out is None else out)
        self.layers: list[dict[str, torch.Tensor | None]] = []
        self.q8_keys: list[set[str]] = []  # per layer, the weights whose products round their activations
        for i in range(c.n_layers):
            tensors = model.layer(i)
            self.layers.append({key: deq(t) for key, t in tensors.items()})
            self.q8_keys.append({key for key, t in tensors.items() if q8(t)})

    def _mm(self, i: int, key: str, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for layer i's 2-D weight ``key``, x as the kernels multiply it (:meth:`_act`)."""
        return self._act(i, key, x) @ self.layers[i][key].T

    def _act(self, i: int, key: str, x: torch.Tensor) -> torch.Tensor:
        """The activations a product with layer i's weight ``key`` multiplies."""
        return q8_round(x) if key in self.q8_keys[i] else x

    # -----------------------------------------------------------------------------------------------
    def new_cache(self, max_ctx: int) -> KVCache:
        """An empty KV cache for up to ``max_ctx`` positions."""
        c = self.config
        if not 0 < max_ctx <= c.context_length:
            raise InputError(
                f"max_ctx must be in 1..{c.context_length} (the model's context length), got {max_ctx}"
            )
        shape = (max_ctx, c.n_kv_heads, c.head_dim)
        return KVCache(
            k=[torch.zeros(shape, dtype=_F64) for _ in range(c.n_layers)],
            v=[torch.zeros(shape, dtype=_F64) for _ in range(c.n_layers)],
            max_ctx=max_ctx,
        )

    def _attention(self, i: int, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        c, L = self.config, self.layers[i]
        T = x.shape[0]
        # the kernels' deferred norm: W (x * attn_norm), then / rms(x) (the same as W rmsnorm(x) unrounded)
        xw, inv = x * L["attn_norm"], rms_inv(x, c.rms_eps)
        q, k, v = (self._mm(i, key, xw) * inv for key in ("attn_q", "attn_k", "attn_v"))
        if c.qkv_bias:
            q, k, v = q + L["attn_q_bias"], k + L["attn_k_bias"], v + L["attn_v_bias"]
        if c.qk_norm:  # an RMSNorm over each stretch of the norm's width: a head, or all of q / all of k
            wq, wk = c.qk_norm_widths
            q = rmsnorm(q.reshape(T, -1, wq), L["attn_q_norm"], c.rms_eps).reshape(T, -1)
            k = rmsnorm(k.reshape(T, -1, wk), L["attn_k_norm"], c.rms_eps).reshape(T, -1)
        q = q.view(T, c.n_heads, c.head_dim)
        k = k.view(T, c.n_kv_heads, c.head_dim)
        v = v.view(T, c.n_kv_heads, c.head_dim)
        pos = torch.arange(pos0, pos0 + T)
        q = rope(q, pos, c.rope_theta, c.neox_rope)
        k = rope(k, pos, c.rope_theta, c.neox_rope)
        cache.k[i][pos0 : pos0 + T] = k
        cache.v[i][pos0 : pos0 + T] = v
        n_ctx = pos0 + T
        keys, vals = cache.k[i][:n_ctx], cache.v[i][:n_ctx]  # [S, kvh, d]
        group = c.n_heads // c.n_kv_heads
        keys = keys.repeat_interleave(group, dim=1)  # query head h uses kv head h // group
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(c.head_dim)
        # causal: query at absolute position pos0 + t sees keys 0..pos0 + t
        mask = torch.arange(n_ctx)[None, :] > pos[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        attn = torch.einsum("hts,shd->thd", probs, vals).reshape(T, c.n_heads * c.head_dim)
        return self._mm(i, "attn_output", attn)

    def _ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c, L = self.config, self.layers[i]
        h = rmsnorm(x, L["ffn_norm"], c.rms_eps)
        silu = torch.nn.functional.silu

        def ffn(gate: str, up: str, down: str) -> torch.Tensor:
            return self._mm(i, down, silu(self._mm(i, gate, h)) * self._mm(i, up, h))

        if not c.is_moe:
            return ffn("ffn_gate", "ffn_up", "ffn_down")
        ids, w = route_topk(h @ L["ffn_gate_inp"].T, c.top_k, c.normalize_topk)
        out = torch.zeros_like(h)
        gate, up, down = L["ffn_gate_exps"], L["ffn_up_exps"], L["ffn_down_exps"]
        hg, hu = self._act(i, "ffn_gate_exps", h), self._act(i, "ffn_up_exps", h)
        for t in range(h.shape[0]):
            for s in range(c.top_k):  # fixed slot order
                e = int(ids[t, s])
                a = silu(gate[e] @ hg[t]) * (up[e] @ hu[t])
                out[t] += w[t, s] * (down[e] @ self._act(i, "ffn_down_exps", a))
        if c.shared_ffn:
            g = torch.sigmoid(h @ L["ffn_gate_inp_shexp"])[:, None]  # [T, 1]
            # the kernels' deferred norm, as for q, k and v: W (x * ffn_norm), then / rms(x)
            xw, inv = x * L["ffn_norm"], rms_inv(x, c.rms_eps)
            a = silu(self._mm(i, "ffn_gate_shexp", xw) * inv) * (self._mm(i, "ffn_up_shexp", xw) * inv)
            out = out + g * self._mm(i, "ffn_down_shexp", a)
        return out

    def forward(
        self, tokens: Sequence[int], cache: KVCache, *, return_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Run ``tokens`` at positions cache.length.. and append them to ``cache``.

        Returns float64 logits [T, vocab]; with ``return_hidden`` also the residual stream after each layer
        (a list of n_layers tensors [T, hidden]).
        """
        c = self.config
        ids = [int(t) for t in tokens]
        T = len(ids)
        if T == 0:
            raise InputError("forward: no tokens given")
        bad = [t for t in ids if not 0 <= t < c.vocab]
        if bad:
            raise InputError(f"forward: token ids {bad[:5]} out of range 0..{c.vocab - 1}")
        pos0 = cache.length
        if pos0 + T > cache.max_ctx:
            raise InputError(f"forward: {T} tokens at position {pos0} exceed the cache size {cache.max_ctx}")
        x = self.token_embd[torch.tensor(ids)]
        hidden: list[torch.Tensor] = []
        for i in range(c.n_layers):
            x = x + self._attention(i, x, cache, pos0)
            x = x + self._ffn(i, x)
            if return_hidden:
                hidden.append(x.clone())
        cache.length = pos0 + T
        # the deferred norm, as for q, k and v
        xw = x * self.output_norm
        logits = ((q8_round(xw) if self.output_q8 else xw) @ self.output.T) * rms_inv(x, c.rms_eps)
        return (logits, hidden) if return_hidden else logits

    def generate_greedy(self, prompt_ids: Sequence[int], n_new: int) -> list[int]:
        """Greedy decode ``n_new`` tokens after ``prompt_ids``; returns only the new ids.

        Argmax ties go to the lowest token id.
        """
        if n_new < 0:
            raise InputError(f"n_new must be >= 0, got {n_new}")
        if len(prompt_ids) == 0:
            raise InputError("generate_greedy: empty prompt")
        cache = self.new_cache(len(prompt_ids) + n_new)
        out: list[int] = []
        if n_new == 0:
            return out
        logits = self.forward(prompt_ids, cache)
        for step in range(n_new):
            nxt = int(torch.argmax(logits[-1]))  # torch.argmax returns the first maximal index
            out.append(nxt)
            if step + 1 < n_new:
                logits = self.forward([nxt], cache)
        return out
