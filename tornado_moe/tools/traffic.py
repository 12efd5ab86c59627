"""Bytes each task moves through memory, read from the task's own arguments (the C ABI order).

Decode is memory-bound: a task's floor is (bytes it must move) / (machine copy bandwidth). The count is the
minimum a kernel must touch, as the ABI defines the work:

- weights: the raw GGUF blocks of the uint8 weight tensors a task reads (float32 norms, biases and router
  matrices count too); for routed-expert tasks only the selected experts' share of the stack, i.e.
  ``slot_count / n_experts`` of it per token (at most the whole stack); the embedding reads one row per token;
- activations: float32 inputs read and outputs written at the sizes the task's integer arguments give
  (not the buffers' capacity); attention reads the KV cache rows up to the position (``context`` rows);
  ``accumulate`` outputs count as read + write.

The routed share assumes the experts picked are distinct across the tokens of a step, the decode case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tornado_moe.graph.task_graph import Task
from tornado_moe.kernels.ops import KERNEL_ARGS, norm_groups

__all__ = ["TaskBytes", "task_bytes"]

F32 = 4
I32 = 4



@dataclass(frozen=True)
class TaskBytes:
    """Bytes one execution of a task moves: weights read and activations read + written."""

    weights: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.activations


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _norm_factors(T: int, given: object, dim: int) -> int:
    """A norm's deferred factors (xw and the partial sums of squares, rmsnorm_factors'), when given."""
    return F32 * T * (dim + norm_groups(dim)) if given is not None else 0


def _expert_share(T: int, ids: torch.Tensor | None, slots: int, n_experts: int) -> float:
    """The part of an expert stack a launch reads: all without ids, else the experts T * slots can pick."""
    return 1.0 if ids is None else min(T * slots, n_experts) / n_experts


def _gate_up_bytes(T: int, w_gate: torch.Tensor, w_up: torch.Tensor, ids: torch.Tensor | None, slots: int,
                   n_experts: int, ffn: int, hidden: int) -> TaskBytes:
    w = _expert_share(T, ids, slots, n_experts) * (_nbytes(w_gate) + _nbytes(w_up))
    act = F32 * T * hidden + F32 * T * slots * ffn + (I32 * T * slots if ids is not None else 0)
    return TaskBytes(w, act)


def _down_bytes(T: int, w_down: torch.Tensor, ids: torch.Tensor | None, weights: torch.Tensor | None,
                gate_inp: torch.Tensor | None, slots: int, n_experts: int, ffn: int, hidden: int
                ) -> TaskBytes:
    w = _expert_share(T, ids, slots, n_experts) * _nbytes(w_down) + _nbytes(gate_inp)
    act = F32 * T * slots * ffn + 2 * F32 * T * hidden  # activations read; x read and written
    if gate_inp is not None:
        act += F32 * T * hidden  # h
    if weights is not None:
        act += F32 * T * slots
    if ids is not None:
        act += I32 * T * slots
    return TaskBytes(w, act)


def _rmsnorm_router_bytes(T: int, a: dict) -> TaskBytes:
    io = 2 * F32 * T * a["hidden"] + (F32 + I32) * T * a["top_k"]  # x read, h written, picks written
    return TaskBytes(_nbytes(a["w_router"]) + _nbytes(a["norm_w"]), io)


def _experts_gate_up_bytes(T: int, a: dict) -> TaskBytes:
    """Both halves of experts_gate_up, h read once."""
    sh = _gate_up_bytes(T, a["w_gate_sh"], a["w_up_sh"], None, 1, 1, a["ffn_sh"], a["hidden"])
    rt = _gate_up_bytes(T, a["w_gate"], a["w_up"], a["ids"], a["top_k"], a["n_experts"], a["ffn"],
                        a["hidden"])
    return TaskBytes(sh.weights + rt.weights, sh.activations + rt.activations - F32 * T * a["hidden"])


def _router_experts_gate_up_bytes(T: int, a: dict) -> TaskBytes:
    """The two tasks it stands for, and the shared gate (its row, T written)."""
    r, g = _rmsnorm_router_bytes(T, a), _experts_gate_up_bytes(T, a)
    gate_out = F32 * T if a["gate_sh"] is not None else 0
    # with the shared expert's deferred norm, xw and x's sums read too
    return TaskBytes(r.weights + g.weights + _nbytes(a["gate_inp_sh"]),
                     r.activations + g.activations + gate_out + _norm_factors(T, a.get("xw"), a["hidden"]))


def _experts_down_bytes(T: int, a: dict) -> TaskBytes:
    """Both halves, x read and written once; gate_sh read as shared weights."""
    sh = _down_bytes(T, a["w_down_sh"], None, a["gate_sh"], a["gate_inp_sh"], 1, 1, a["ffn_sh"], a["hidden"])
    rt = _down_bytes(T, a["w_down"], a["ids"], a["weights"], None, a["top_k"], a["n_experts"], a["ffn"],
                     a["hidden"])
    # the next norm's factor and partial sums written beside x
    xw = _norm_factors(T, a.get("next_norm_w"), a["hidden"])
    return TaskBytes(sh.weights + rt.weights + _nbytes(a.get("next_norm_w")),
                     sh.activations + rt.activations - 2 * F32 * T * a["hidden"] + xw)


def task_bytes(task: Task, context: float = 1.0) -> TaskBytes:
    """Bytes of one execution of ``task``; ``context`` = KV rows attention reads (position + 1, averaged)."""
    names = KERNEL_ARGS.get(task.kernel)
    if names is None or len(names) != len(task.args):
        raise ValueError(f"task {task.name!r}: kernel {task.kernel!r} has {len(task.args)} arguments, the "
                         f"byte model expects {len(names) if names else 'a known kernel'}")
    a = dict(zip(names, task.args, strict=True))
    k = task.kernel
    T = int(a.get("n_tokens", 1) or 1)
    if k == "embedding":
        return TaskBytes(T * _nbytes(a["table"]) / a["vocab"], T * I32 + F32 * T * a["dim"])
    if k == "rmsnorm":
        return TaskBytes(_nbytes(a["w"]), 2 * F32 * T * a["dim"])
    if k == "rmsnorm_factors":
        xss = F32 * T * norm_groups(a["dim"]) if a["xss"] is not None else 0
        return TaskBytes(_nbytes(a["w"]), 2 * F32 * T * a["dim"] + F32 * T + xss)
    if k == "matmul":
        out = F32 * T * a["rows"] * (2 if a["accumulate"] else 1)
        sums = F32 * T * norm_groups(a["cols"]) if a["x_sums"] is not None else 0
        factors = _norm_factors(T, a["y_w"], a["rows"])  # the next norm's, written beside y
        return TaskBytes(_nbytes(a["w"]) + _nbytes(a["bias"]) + _nbytes(a["next_norm_w"]),
                         F32 * T * a["cols"] + out + sums + factors)
    if k == "rope_kv_append":
        q = F32 * T * a["n_heads"] * a["head_dim"]
        kv = F32 * T * a["n_kv_heads"] * a["head_dim"]
        return TaskBytes(0, 2 * q + 2 * kv + 2 * kv + I32)  # q in place; k, v read; k, v cache rows written
    if k == "qkv_rope":
        q = F32 * T * a["n_heads"] * a["head_dim"]
        kv = F32 * T * a["n_kv_heads"] * a["head_dim"]
        w = sum(_nbytes(a[n]) for n in ("w_q", "w_k", "w_v", "b_q", "b_k", "b_v", "norm_w"))
        # x read, or xw and the partial sums when given
        x = F32 * T * (a["hidden"] + (norm_groups(a["hidden"]) if a["xw"] is not None else 0))
        return TaskBytes(w, x + q + 2 * kv + I32)  # q, k and v cache rows written
    if k == "attention":
        q = F32 * T * a["n_heads"] * a["head_dim"]
        cache = 2 * F32 * T * (context + (T - 1) / 2) * a["n_kv_heads"] * a["head_dim"]
        return TaskBytes(0, 2 * q + cache + I32)
    if k == "router_topk":
        return TaskBytes(_nbytes(a["w_router"]), F32 * T * a["hidden"] + (F32 + I32) * T * a["top_k"])
    if k == "rmsnorm_router_topk":
        return _rmsnorm_router_bytes(T, a)
    if k == "moe_gate_up":
        g = _gate_up_bytes(T, a["w_gate"], a["w_up"], a["ids"], a["slot_count"], a["n_experts"], a["ffn"],
                           a["hidden"])
        return TaskBytes(g.weights, g.activations + (F32 * T if a["scale"] is not None else 0))
    if k == "moe_down_accumulate":
        return _down_bytes(T, a["w_down"], a["ids"], a["weights"], a["gate_inp"], a["slot_count"],
                           a["n_experts"], a["ffn"], a["hidden"])
    if k == "experts_gate_up":
        return _experts_gate_up_bytes(T, a)
    if k == "router_experts_gate_up":
        return _router_experts_gate_up_bytes(T, a)
    if k == "experts_down_accumulate":
        return _experts_down_bytes(T, a)
    if k == "router_experts_ffn":  # the two tasks it stands for, the down reading the gate factors gate_sh
        g, d = _router_experts_gate_up_bytes(T, a), _experts_down_bytes(T, {**a, "gate_inp_sh": None})
        return TaskBytes(g.weights + d.weights, g.activations + d.activations)
    if k == "argmax":
        return TaskBytes(0, F32 * T * a["vocab"] + I32 * T)
    if k == "sample":
        return TaskBytes(0, F32 * a["vocab"] + 2 * I32)
    if k == "advance_position":  # the position read and written; with a log, the token read and logged
        return TaskBytes(0, (4 if a["log"] is not None else 2) * I32)
    if k == "argmax_advance":  # argmax's row and token, the position read and written, the token logged
        return TaskBytes(0, F32 * a["vocab"] + (4 if a["log"] is not None else 3) * I32)
    raise ValueError(f"task {task.name!r}: no byte model for kernel {k!r}")
