"""The Java route: the Python task graphs rebuilt as Java TaskGraph objects and run by a Java
TornadoExecutionPlan, whose tasks reach the kernel set through JNI (``tm_invoke``).

Each tensor becomes a ``tornadomoe.runtime.DeviceBuffer`` wrapping its ``data_ptr()``: no copy, the kernels
work on the tensor's memory. Python keeps the tensors alive for as long as the program lives, and marks the
buffers released when it is closed, so a stale Java plan can never touch freed memory. Arguments are checked
in Java against the native kernel table's signatures (the same table ``tm_invoke`` uses); Java exceptions come
back as the ``JavaRouteError`` subclasses below, with the Java message.

CUDA graphs: whole-stream capture through the native functions needs a stream other than the legacy default
one, so the program captures and replays on a private stream ordered after and before the caller's stream
with events (``wait_stream``): to the caller, a replay is just more work on its stream.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from tornado_moe.errors import DeviceError, TornadoMoeError
from tornado_moe.graph.profiler import TaskProfile
from tornado_moe.graph.task_graph import ImmutableTaskGraph, Task
from tornado_moe.kernels.ops import u64_as_int64
from tornado_moe.routes.jvm import start_jvm

__all__ = [
    "JavaArgumentError",
    "JavaIndexError",
    "JavaKernelError",
    "JavaProgram",
    "JavaRoute",
    "JavaRouteError",
    "JavaStateError",
]

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class JavaRouteError(TornadoMoeError):
    """An exception thrown by the Java side, with its message; ``java_class`` names the Java type."""

    def __init__(self, message: str, java_class: str = "") -> None:
        super().__init__(message)
        self.java_class = java_class


class JavaArgumentError(JavaRouteError, ValueError):
    """A graph, task or argument the Java side refused (IllegalArgumentException)."""


class JavaIndexError(JavaRouteError, IndexError):
    """A graph or task index out of range (IndexOutOfBoundsException)."""


class JavaStateError(JavaRouteError, RuntimeError):
    """An operation the plan's state forbids: closed plan, released buffer (IllegalStateException)."""


class JavaKernelError(JavaRouteError, RuntimeError):
    """A kernel launch failed in the native library (TornadoKernelException); ``status`` is the tm_status."""

    def __init__(self, message: str, java_class: str = "", status: int = 0) -> None:
        super().__init__(message, java_class)
        self.status = status


class _J:
    """The Java classes, resolved once after the JVM has started."""

    def __init__(self) -> None:
        import jpype

        self.jpype = jpype
        self.JObjectArray = jpype.JArray(jpype.JObject)
        self.JLong, self.JFloat, self.JBoolean = jpype.JLong, jpype.JFloat, jpype.JBoolean
        self.TaskGraph = jpype.JClass("tornadomoe.api.TaskGraph")
        self.ImmutableTaskGraphArray = jpype.JArray(jpype.JClass("tornadomoe.api.ImmutableTaskGraph"))
        self.TornadoExecutionPlan = jpype.JClass("tornadomoe.api.TornadoExecutionPlan")
        self.ProfilerMode = jpype.JClass("tornadomoe.api.ProfilerMode")
        self.DataTransferMode = jpype.JClass("tornadomoe.api.DataTransferMode")
        self.DeviceBuffer = jpype.JClass("tornadomoe.runtime.DeviceBuffer")
        self.Device = jpype.JClass("tornadomoe.runtime.Device")
        self.KernelSet = jpype.JClass("tornadomoe.runtime.KernelSet")
        self.TornadoKernelException = jpype.JClass("tornadomoe.runtime.TornadoKernelException")
        self.IllegalArgumentException = jpype.JClass("java.lang.IllegalArgumentException")
        self.IndexOutOfBoundsException = jpype.JClass("java.lang.IndexOutOfBoundsException")
        self.IllegalStateException = jpype.JClass("java.lang.IllegalStateException")


_java: _J | None = None


def _classes() -> _J:
    global _java
    if _java is None:
        start_jvm()
        _java = _J()
    return _java


def _translate(j: _J, e: Any) -> JavaRouteError:
    """The Python exception for a Java one, keeping the Java message."""
    java_class = str(e.getClass().getName())
    message = e.getMessage()
    text = str(message) if message is not None else java_class
    if isinstance(e, j.TornadoKernelException):
        return JavaKernelError(text, java_class, int(e.getStatus()))
    if isinstance(e, j.IllegalArgumentException):
        return JavaArgumentError(text, java_class)
    if isinstance(e, j.IndexOutOfBoundsException):
        return JavaIndexError(text, java_class)
    if isinstance(e, j.IllegalStateException):
        return JavaStateError(text, java_class)
    return JavaRouteError(f"{java_class}: {text}", java_class)


@contextmanager
def _java_errors(j: _J) -> Iterator[None]:
    try:
        yield
    except j.jpype.JException as e:
        raise _translate(j, e) from e


class JavaRoute:
    """Compiles immutable task graphs into a JavaProgram (one Java execution plan over all of them)."""

    name = "java"

    def compile(self, graphs: Sequence[ImmutableTaskGraph], device: torch.device) -> JavaProgram:
        return JavaProgram(graphs, device)


class JavaProgram:
    """One Java TaskGraph per Python graph, and one TornadoExecutionPlan over all of them.

    Implements the route Program protocol (tornado_moe.routes.Program): launch_all, launch_task,
    enable_cuda_graph, enable_profiler, disable_profiler, profiler_rows, close.
    """

    def __init__(self, graphs: Sequence[ImmutableTaskGraph], device: torch.device | str) -> None:
        self._j = j = _classes()
        self.graphs = list(graphs)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise DeviceError(f"the Java route runs on cpu or cuda, not {self.device}")
        self._tensors: list[torch.Tensor] = []  # keeps every wrapped tensor's memory alive
        self._buffers: dict[tuple[int, int, str], Any] = {}
        self._signatures: dict[str, str] = {}
        with _java_errors(j):
            table = j.KernelSet.nativeSet()
            for k in table.kernels():
                self._signatures[str(k.name())] = str(k.signature())
            java_graphs = [self._java_graph(g) for g in self.graphs]
            self._plan = j.TornadoExecutionPlan(j.ImmutableTaskGraphArray(java_graphs))
            self._plan.withDevice(j.Device.CUDA if self.device.type == "cuda" else j.Device.CPU)
        self._stream: int | None = None
        self._use_graph = False
        self._graph_stream: torch.cuda.Stream | None = None
        self._profiled = False  # enable_profiler was called: profiler_rows has a Java profile to read
        self._closed = False

    # ---- building ------------------------------------------------------------------------------------------

    def _java_graph(self, g: ImmutableTaskGraph) -> Any:
        j = self._j
        tg = j.TaskGraph(g.name)
        for task in g.tasks:
            letters = self._signatures.get(task.kernel, "")
            values = [self._value(g, task, i, a, letters[i] if i < len(letters) else "")
                      for i, a in enumerate(task.args)]
            tg.task(task.name, task.kernel, j.JObjectArray(values))
        for tr in g.transfers:
            mode = getattr(j.DataTransferMode, tr.mode.name)
            bufs = j.JObjectArray([self._buffer(t, f"{g.name}:{tr.direction}") for t in tr.tensors])
            if tr.direction == "to_host":
                tg.transferToHost(mode, bufs)
            else:
                tg.transferToDevice(mode, bufs)
        return tg.snapshot()

    def _value(self, g: ImmutableTaskGraph, task: Task, i: int, a: Any, letter: str) -> Any:
        """A Python argument as the Java object the signature letter expects (Java checks the type)."""
        j = self._j
        where = f"task graph {g.name!r}, task {task.name!r} (kernel {task.kernel!r}): argument {i}"
        if a is None:
            return None
        if isinstance(a, torch.Tensor):
            return self._buffer(a, f"{g.name}.{task.name}[{i}]", where)
        if isinstance(a, bool):
            return j.JBoolean(a)
        if isinstance(a, numbers.Integral):
            v = int(a)
            if letter == "f":
                return j.JFloat(float(v))  # as the torch op's float parameter takes an int
            if letter == "u":
                try:
                    v = u64_as_int64(v)  # the same 64 bits, as a Java long
                except ValueError as e:
                    raise JavaArgumentError(f"{where}: {e}") from None
            if not _I64_MIN <= v <= _I64_MAX:
                raise JavaArgumentError(f"{where} = {v} does not fit a 64-bit integer")
            return j.JLong(v)
        if isinstance(a, numbers.Real):
            return j.JFloat(float(a))  # rounded to float32 like the C shells' static_cast<float>
        raise JavaArgumentError(f"{where} has unsupported Python type {type(a).__name__} "
                                "(expected a tensor, int, float, bool or None)")

    def _buffer(self, t: torch.Tensor, owner: str, where: str = "") -> Any:
        """One DeviceBuffer per distinct (address, size, device): shared by every task using the tensor."""
        where = where or owner
        if not t.is_contiguous():
            raise JavaArgumentError(f"{where}: tensor must be contiguous (shape {tuple(t.shape)}, "
                                    f"stride {t.stride()})")
        if t.device.type not in ("cpu", "cuda"):
            raise DeviceError(f"{where}: tensor on {t.device}; the Java route runs on cpu or cuda")
        if t.is_cuda and self.device.type == "cuda" and t.device != self.device:
            raise DeviceError(f"{where}: tensor on {t.device}, the program runs on {self.device}")
        nbytes = t.numel() * t.element_size()
        key = (t.data_ptr(), nbytes, str(t.device))
        buf = self._buffers.get(key)
        if buf is None:
            j = self._j
            device = j.Device.CUDA if t.is_cuda else j.Device.CPU
            with _java_errors(j):
                buf = j.DeviceBuffer.wrap(t.data_ptr(), nbytes, device, owner)
            self._buffers[key] = buf
            self._tensors.append(t)
        return buf

    # ---- running -------------------------------------------------------------------------------------------

    def _set_stream(self, stream: int) -> None:
        if stream != self._stream:
            self._plan.withStream(stream)
            self._stream = stream

    def launch_all(self, stream: int, steps: int = 1) -> None:
        """Every task of every graph, in order, ``steps`` times over, on ``stream`` (CUDA graphs on: one graph
        per step count, captured once, then replayed)."""
        with _java_errors(self._j):
            if self._use_graph:
                self._launch_graph(stream, steps)
            else:
                self._set_stream(stream)
                self._plan.execute(steps)

    def _launch_graph(self, stream: int, steps: int) -> None:
        caller = (torch.cuda.ExternalStream(stream, device=self.device) if stream
                  else torch.cuda.default_stream(self.device))
        if self._graph_stream is None:
            self._graph_stream = torch.cuda.Stream(self.device)
        side = self._graph_stream
        side.wait_stream(caller)
        self._set_stream(side.cuda_stream)
        self._plan.execute(steps)
        caller.wait_stream(side)

    def launch_task(self, graph_index: int, task_index: int, stream: int) -> None:
        """One eager launch of one task on ``stream`` (also when a CUDA graph is enabled)."""
        with _java_errors(self._j):
            self._set_stream(stream)
            self._plan.executeTask(graph_index, task_index)

    def enable_cuda_graph(self) -> None:
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need the CUDA device")
        with _java_errors(self._j):
            self._plan.withCUDAGraph()
        self._use_graph = True

    def enable_profiler(self) -> None:
        """Counts and times every launch from now on (the Java profiler: see TornadoProfilerResult)."""
        with _java_errors(self._j):
            self._plan.withProfiler(self._j.ProfilerMode.SILENT)
        self._profiled = True

    def disable_profiler(self) -> None:
        with _java_errors(self._j):
            self._plan.withoutProfiler()

    def profiler_rows(self) -> tuple[list[TaskProfile], int, int]:
        """(per-task rows, CUDA-graph replays, replay ns) since enable_profiler; zeros before it."""
        if not self._profiled:
            return [TaskProfile(g.name, t.name, t.kernel) for g in self.graphs for t in g.tasks], 0, 0
        with _java_errors(self._j):
            r = self._plan.getProfilerResult()
            rows = [TaskProfile(str(p.getGraphName()), str(p.getTaskName()), str(p.getKernelName()),
                                int(p.getLaunches()), int(p.getKernelTimeNanos()))
                    for p in r.getTaskProfiles()]
            return rows, int(r.getCudaGraphReplays()), int(r.getCudaGraphTimeNanos())

    @property
    def java_plan(self) -> Any:
        """The underlying tornadomoe.api.TornadoExecutionPlan (for Java-side inspection)."""
        return self._plan

    def close(self) -> None:
        """Destroys the CUDA graph, marks every buffer released and lets the tensors go. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with _java_errors(self._j):
            self._plan.close()
            for buf in self._buffers.values():
                buf.release()
        self._tensors.clear()
        self._graph_stream = None
