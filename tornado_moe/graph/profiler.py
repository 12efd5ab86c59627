"""Profiler results shared by both routes: launches and kernel time per task."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass
class TaskProfile:
    graph: str
    task: str
    kernel: str
    launches: int = 0
    time_ns: int = 0


@dataclass
class ProfilerResult:
    """Per-task launch counts and times of an execution plan since profiling was enabled.

    Eager launches are timed one by one (device events around each launch on CUDA, a host clock on CPU); a
    CUDA-graph replay counts one launch per task and step it holds, ``graph_replays`` counts the steps
    replayed (a graph may hold several), and their time is reported for the whole replay in
    ``graph_replay_ns`` (kernels inside a replay are not separable without a device profiler).
    """

    rows: list[TaskProfile]
    graph_replays: int = 0
    graph_replay_ns: int = 0

    @property
    def kernel_count(self) -> int:
        return sum(r.launches for r in self.rows)

    @property
    def total_time_ns(self) -> int:
        return sum(r.time_ns for r in self.rows) + self.graph_replay_ns

    def launches_by_graph(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.graph] = out.get(r.graph, 0) + r.launches
        return out

    def to_dict(self) -> dict:
        return {
            "kernel_count": self.kernel_count,
            "total_time_ns": self.total_time_ns,
            "graph_replays": self.graph_replays,
            "graph_replay_ns": self.graph_replay_ns,
            "tasks": [asdict(r) for r in self.rows],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        lines = [f"{'graph':<12} {'task':<34} {'kernel':<20} {'launches':>8} {'time_us':>10}"]
        for r in self.rows:
            us = r.time_ns / 1e3
            lines.append(f"{r.graph:<12} {r.task:<34} {r.kernel:<20} {r.launches:>8} {us:>10.1f}")
        lines.append(f"total kernel launches: {self.kernel_count}, time: {self.total_time_ns / 1e6:.3f} ms")
        return "\n".join(lines)
