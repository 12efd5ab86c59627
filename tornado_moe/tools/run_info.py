"""Run metadata shared by every JSON report (determinism, profile, bench, generate's profiler dump).

One place decides how a report records what ran where: the command line, the UTC date, the git commit of
the source tree, the device and its name, and the library versions. Numbers without this context cannot be
compared later.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

import tornado_moe

__all__ = ["command_line", "utc_now", "git_commit", "gpu_name", "run_info"]

_SOURCE_ROOT = Path(tornado_moe.__file__).resolve().parent.parent


def command_line(argv: Sequence[str] | None, prog: str = "tornado-moe") -> str:
    """The command as a user would retype it (shell-quoted)."""
    return " ".join([prog, *(shlex.quote(a) for a in (argv or ()))])


def utc_now() -> str:
    """ISO-8601 UTC timestamp, second resolution (e.g. ``2025-01-31T12:00:00Z``)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@lru_cache(maxsize=1)
def git_commit() -> str:
    """``git rev-parse HEAD`` of the source tree, or ``"unknown"`` (installed wheel, no git, no repo).

    ``$TORNADO_MOE_GIT_COMMIT`` wins: a copy of the tree without ``.git`` (the GPU machine) still records it.
    """
    if os.environ.get("TORNADO_MOE_GIT_COMMIT"):
        return os.environ["TORNADO_MOE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_SOURCE_ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and len(sha) >= 7 else "unknown"


def gpu_name(device: torch.device | str) -> str:
    """The CUDA device's marketing name (``torch.cuda.get_device_name``), or ``"cpu"``."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return "cpu"


def run_info(argv: Sequence[str] | None, device: torch.device | str, *, model: str | Path | None = None,
             **extra: Any) -> dict[str, Any]:
    """The common head of every report; ``extra`` keys are appended after it."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "command": command_line(argv),
        "date": utc_now(),
        "git_commit": git_commit(),
        "device": device.type,
        "gpu_name": gpu_name(device),
        "model": str(model) if model is not None else None,
        "torch_version": torch.__version__,
        "tornado_moe_version": tornado_moe.__version__,
        "python_version": platform.python_version(),
        "host_cpu_count": os.cpu_count() or 1,
    }
    info.update(extra)
    return info

