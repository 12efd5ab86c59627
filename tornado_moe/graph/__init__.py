"""Task graphs, execution plans and profiling (TornadoVM-style)."""

from tornado_moe.graph.plan import ExecutionPlan, TornadoExecutionPlan, stream_handle
from tornado_moe.graph.profiler import ProfilerResult, TaskProfile
from tornado_moe.graph.task_graph import KERNELS, DataTransferMode, ImmutableTaskGraph, Task, TaskGraph

__all__ = [
    "KERNELS",
    "DataTransferMode",
    "ExecutionPlan",
    "ImmutableTaskGraph",
    "ProfilerResult",
    "Task",
    "TaskGraph",
    "TaskProfile",
    "TornadoExecutionPlan",
    "stream_handle",
]
