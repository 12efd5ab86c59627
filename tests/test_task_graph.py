"""The Python task-graph API: construction rules, snapshots, plan life cycle, profiler counts."""

from __future__ import annotations

import pytest
import torch

from tornado_moe.graph import DataTransferMode, ExecutionPlan, TaskGraph


def _rmsnorm_graph(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> TaskGraph:
    g = TaskGraph("norm").transfer_to_device(DataTransferMode.FIRST_EXECUTION, x, w)
    g.task("n0", "rmsnorm", x, w, y, x.shape[0], x.shape[1], 1e-6)
    return g.transfer_to_host(DataTransferMode.EVERY_EXECUTION, y)


def test_unknown_kernel_and_duplicate_task_are_rejected() -> None:
    g = TaskGraph("g")
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        g.task("t", "nope")
    x = torch.ones(1, 4)
    g.task("t", "rmsnorm", x, x[0], x, 1, 4, 1e-6)
    with pytest.raises(ValueError, match="duplicate task name 't'"):
        g.task("t", "rmsnorm", x, x[0], x, 1, 4, 1e-6)


def test_snapshot_is_frozen_and_counts_launches() -> None:
    x, w, y = torch.randn(2, 8), torch.rand(8) + 0.5, torch.empty(2, 8)
    g = _rmsnorm_graph(x, w, y)
    snap = g.snapshot()
    g.task("n1", "rmsnorm", x, w, y, 2, 8, 1e-6)  # later tasks do not leak into the snapshot
    assert snap.launch_count == 1 and g.snapshot().launch_count == 2
    with pytest.raises(AttributeError):
        snap.name = "other"  # type: ignore[misc]


def test_plan_executes_profiles_and_closes() -> None:
    x, w, y = torch.randn(3, 16), torch.rand(16) + 0.5, torch.full((3, 16), float("nan"))
    plan = ExecutionPlan(_rmsnorm_graph(x, w, y).snapshot(), device="cpu").with_profiler()
    plan.execute().execute()
    ref = (x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6)
    prof = plan.profiler_result()
    assert prof.kernel_count == 2 and prof.rows[0].launches == 2 and prof.rows[0].time_ns > 0
    counted = [(r.launches, r.time_ns) for r in prof.rows]
    plan.without_profiler().execute()  # not counted; what was counted stays
    assert [(r.launches, r.time_ns) for r in plan.profiler_result().rows] == counted
    plan.close()
    with pytest.raises(RuntimeError, match="closed"):
        plan.execute()


def test_unknown_route_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown route"):
        ExecutionPlan(device="cpu", route="opencl")


def test_wrong_argument_count_is_rejected_at_construction() -> None:
    x = torch.ones(1, 4)
    expected = r"kernel 'rmsnorm' takes 6 arguments \(x, w, y, n_tokens, dim, eps\), got 5"
    with pytest.raises(ValueError, match=expected):
        TaskGraph("g").task("t", "rmsnorm", x, x[0], x, 1, 4)
