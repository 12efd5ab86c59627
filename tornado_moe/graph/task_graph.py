"""TornadoVM-style task graphs: the per-layer description of a decode step.

A ``TaskGraph`` is built once per layer; each ``task`` is exactly one kernel launch of the C kernel set,
with its arguments in C ABI order (without ``device`` and ``stream``, which the route supplies). A
``snapshot()`` freezes it into an ``ImmutableTaskGraph`` that either route (torch ops or Java) can run. The
names mirror TornadoVM's Java API (TaskGraph, ImmutableTaskGraph, DataTransferMode) in snake_case.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tornado_moe.kernels.ops import KERNEL_ARGS, KERNEL_NAMES

#: One kernel argument: a tensor (passed as a device pointer), an integer, a float, a flag, or None for a
#: nullable pointer.
Arg = torch.Tensor | int | float | bool | None

KERNELS = KERNEL_NAMES  # graph tasks name their kernel by the C kernel table's names


class DataTransferMode(enum.Enum):
    """When declared data moves between host and device (TornadoVM's DataTransferMode)."""

    FIRST_EXECUTION = "first_execution"
    EVERY_EXECUTION = "every_execution"
    UNDER_DEMAND = "under_demand"


@dataclass(frozen=True)
class Task:
    """One kernel launch: ``kernel`` from the kernel set with ``args`` in C ABI order."""

    name: str
    kernel: str
    args: tuple[Arg, ...]

    def tensors(self) -> Iterator[torch.Tensor]:
        return (a for a in self.args if isinstance(a, torch.Tensor))


@dataclass(frozen=True)
class Transfer:
    direction: str  # "to_device" | "to_host"
    mode: DataTransferMode
    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class ImmutableTaskGraph:
    """A frozen task graph: what an execution plan runs."""

    name: str
    tasks: tuple[Task, ...]
    transfers: tuple[Transfer, ...] = ()

    @property
    def launch_count(self) -> int:
        """Kernel launches one execution of this graph makes (one per task, by construction)."""
        return len(self.tasks)


@dataclass
class TaskGraph:
    """A mutable graph under construction; ``snapshot()`` freezes it."""

    name: str
    _tasks: list[Task] = field(default_factory=list)
    _transfers: list[Transfer] = field(default_factory=list)

    def task(self, name: str, kernel: str, *args: Arg) -> TaskGraph:
        if kernel not in KERNELS:
            raise ValueError(f"task graph {self.name!r}: unknown kernel {kernel!r} for task {name!r}")
        expected = KERNEL_ARGS[kernel]
        if len(args) != len(expected):
            raise ValueError(f"task graph {self.name!r}, task {name!r}: kernel {kernel!r} takes "
                             f"{len(expected)} arguments ({', '.join(expected)}), got {len(args)}")
        if any(t.name == name for t in self._tasks):
            raise ValueError(f"task graph {self.name!r}: duplicate task name {name!r}")
        self._tasks.append(Task(name, kernel, tuple(args)))
        return self

    def transfer_to_device(self, mode: DataTransferMode, *tensors: torch.Tensor) -> TaskGraph:
        """Declares inputs copied to the device (weights and caches live there already: a record only)."""
        self._transfers.append(Transfer("to_device", mode, tensors))
        return self

    def transfer_to_host(self, mode: DataTransferMode, *tensors: torch.Tensor) -> TaskGraph:
        """Declares outputs the host reads after execution (e.g. the next token id)."""
        self._transfers.append(Transfer("to_host", mode, tensors))
        return self

    def snapshot(self) -> ImmutableTaskGraph:
        return ImmutableTaskGraph(self.name, tuple(self._tasks), tuple(self._transfers))
