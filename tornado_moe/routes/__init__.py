"""Routes: how an execution plan's tasks reach the kernel set (torch ops, or Java through JNI)."""

from __future__ import annotations

from typing import Protocol

from tornado_moe.graph.profiler import TaskProfile


class Program(Protocol):
    """A set of immutable task graphs compiled for one route: what an ExecutionPlan drives."""

    def launch_all(self, stream: int) -> None:
        """Launches every task of every graph in order on ``stream`` (replays the CUDA graph if enabled)."""

    def launch_task(self, graph_index: int, task_index: int, stream: int) -> None: ...

    def enable_cuda_graph(self) -> None:
        """The next launch_all captures all tasks as one CUDA graph; later ones replay it."""

    def enable_profiler(self) -> None: ...

    def disable_profiler(self) -> None:
        """Stops counting and timing launches (which synchronises each one); the rows so far stay readable."""

    def profiler_rows(self) -> tuple[list[TaskProfile], int, int]:
        """(per-task rows, graph replays, graph replay ns)."""

    def close(self) -> None: ...
