"""Task graphs, execution plans and profiling (TornadoVM-style)."""

from tornado_moe.graph.task_graph import (
    KERNELS,
    DataTransferMode,
    ImmutableTaskGraph,
    Task,
    TaskGraph,
)

__all__ = ["KERNELS", "DataTransferMode", "ImmutableTaskGraph", "Task", "TaskGraph"]

from tornado_moe.graph.plan import ExecutionPlan, TornadoExecutionPlan, stream_handle  # noqa: E402
from tornado_moe.graph.profiler import ProfilerResult, TaskProfile  # noqa: E402

__all__ += ["ExecutionPlan", "TornadoExecutionPlan", "stream_handle", "ProfilerResult", "TaskProfile"]
