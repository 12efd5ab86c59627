"""Execution plans (TornadoVM's TornadoExecutionPlan): run immutable task graphs through a route."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tornado_moe.graph.profiler import ProfilerResult
from tornado_moe.graph.task_graph import ImmutableTaskGraph

ROUTES = ("torch", "java")


def stream_handle(device: torch.device) -> int:
    """The raw handle of the current CUDA stream (0 on the CPU): kernels of both routes launch on it."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


class ExecutionPlan:
    """Runs a sequence of immutable task graphs, in order, as one step.

    ``with_cuda_graph()``: the first ``execute()`` captures every task of every graph into one CUDA graph
    and replays it; later calls replay it (state that changes per step must live in device memory, e.g. the
    position; ``execute(steps)`` has one graph per step count). Execute the plan eagerly at least once
    before, so capture never loads modules lazily.
    ``with_profiler()``: per-task launch counts and kernel time (see ProfilerResult).
    """

    def __init__(self, *graphs: ImmutableTaskGraph, device: torch.device | str, route: str = "torch") -> None:
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r} (choose from {', '.join(ROUTES)})")
        self.graphs: Sequence[ImmutableTaskGraph] = graphs
        self.device = torch.device(device)
        self.route = route
        if route == "torch":
            from tornado_moe.routes.torch_route import TorchRoute

            self._program = TorchRoute().compile(graphs, self.device)
        else:
            from tornado_moe.routes.java_route import JavaRoute

            self._program = JavaRoute().compile(graphs, self.device)
        self._closed = False

    @property
    def launches_per_execution(self) -> int:
        """Launches one execute() makes, as the graphs declare them (one per task)."""
        return sum(g.launch_count for g in self.graphs)

    def with_cuda_graph(self) -> ExecutionPlan:
        self._program.enable_cuda_graph()
        return self

    def with_profiler(self) -> ExecutionPlan:
        self._program.enable_profiler()
        return self

    def without_profiler(self) -> ExecutionPlan:
        """Stops the per-task profile (it synchronises every launch); profiler_result() keeps what it has."""
        self._program.disable_profiler()
        return self

    def execute(self, steps: int = 1) -> ExecutionPlan:
        """Runs the graphs ``steps`` times over (with a CUDA graph: one replay of a graph of that many steps,
        so that the device does not wait between them for the host's next launch)."""
        if self._closed:
            raise RuntimeError("execution plan is closed")
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        self._program.launch_all(stream_handle(self.device), steps)
        return self

    def execute_task(self, graph_index: int, task_index: int) -> None:
        """One launch of one task (debugging and per-task replays)."""
        self._program.launch_task(graph_index, task_index, stream_handle(self.device))

    def profiler_result(self) -> ProfilerResult:
        rows, replays, replay_ns = self._program.profiler_rows()
        return ProfilerResult(list(rows), replays, replay_ns)

    def close(self) -> None:
        if not self._closed:
            self._program.close()
            self._closed = True

    def __enter__(self) -> ExecutionPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


TornadoExecutionPlan = ExecutionPlan
