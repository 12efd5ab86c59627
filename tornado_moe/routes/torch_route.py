"""The torch route: every task is a call of its ``torch.ops.tornado_moe`` op."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from tornado_moe.graph.profiler import TaskProfile
from tornado_moe.graph.task_graph import ImmutableTaskGraph


class TorchRoute:
    name = "torch"

    def compile(self, graphs: Sequence[ImmutableTaskGraph], device: torch.device) -> TorchProgram:
        return TorchProgram(graphs, device)


class TorchProgram:
    """Pre-resolved op calls, so that an eager step costs one Python call per launch and nothing more."""

    def __init__(self, graphs: Sequence[ImmutableTaskGraph], device: torch.device) -> None:
        from tornado_moe.native import load_torch_ops

        load_torch_ops()
        self.graphs = list(graphs)
        self.device = device
        ops = torch.ops.tornado_moe
        self._calls: list[list[tuple[Callable[..., None], tuple]]] = [
            [(getattr(ops, t.kernel), t.args) for t in g.tasks] for g in self.graphs
        ]
        self._rows = [TaskProfile(g.name, t.name, t.kernel) for g in self.graphs for t in g.tasks]
        self._profile = False
        self._use_graph = False
        self._cuda_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # steps per replay -> its graph
        self._replays = 0
        self._replay_ns = 0

    def enable_cuda_graph(self) -> None:
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need the CUDA device")
        self._use_graph = True

    def enable_profiler(self) -> None:
        self._profile = True

    def disable_profiler(self) -> None:
        self._profile = False

    def _launch_eager(self, stream: int) -> None:
        for calls in self._calls:
            for fn, args in calls:
                fn(*args, stream)

    def launch_all(self, stream: int, steps: int = 1) -> None:
        """Every task of every graph, ``steps`` times over (with CUDA graphs: one replay of a graph that holds
        them all, captured at its first use)."""
        if self._use_graph:
            graph = self._cuda_graphs.get(steps)
            self._replay(graph if graph is not None else self._capture(steps), steps)
            return
        for _ in range(steps):
            if self._profile:
                i = 0
                for gi, calls in enumerate(self._calls):
                    for ti in range(len(calls)):
                        self._timed(i, gi, ti, stream)
                        i += 1
            else:
                self._launch_eager(stream)

    def launch_task(self, graph_index: int, task_index: int, stream: int) -> None:
        fn, args = self._calls[graph_index][task_index]
        fn(*args, stream)

    def _timed(self, row: int, gi: int, ti: int, stream: int) -> None:
        r = self._rows[row]
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.launch_task(gi, ti, stream)
            end.record()
            end.synchronize()
            r.time_ns += int(start.elapsed_time(end) * 1e6)
        else:
            t0 = time.perf_counter_ns()
            self.launch_task(gi, ti, stream)
            r.time_ns += time.perf_counter_ns() - t0
        r.launches += 1

    def _capture(self, steps: int) -> torch.cuda.CUDAGraph:
        # No warm-up run here: a step has side effects (KV append, position advance). Callers execute the
        # plan eagerly at least once before enabling graphs, so every kernel module is already loaded.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stream = torch.cuda.current_stream(self.device).cuda_stream
            for _ in range(steps):
                self._launch_eager(stream)
        self._cuda_graphs[steps] = graph
        return graph

    def _replay(self, graph: torch.cuda.CUDAGraph, steps: int) -> None:
        if self._profile:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            self._replay_ns += int(start.elapsed_time(end) * 1e6)
            for r in self._rows:
                r.launches += steps
        else:
            graph.replay()
        self._replays += steps

    def profiler_rows(self) -> tuple[list[TaskProfile], int, int]:
        return self._rows, self._replays, self._replay_ns

    def close(self) -> None:
        self._cuda_graphs.clear()
