"""Where the native parts of tornado-moe live, and loading them.

The build (``pip install -e .`` or ``make build``, both running CMake) puts the kernel library, the torch-op
extension, the JNI library and the Java classes into ``tornado_moe/_native`` next to this file. The
environment variable ``TORNADO_MOE_NATIVE_DIR`` points elsewhere (e.g. libraries built on another machine and
brought along).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from tornado_moe.errors import TornadoMoeError

__all__ = [
    "NativeLibraryNotFoundError",
    "jar_path",
    "jni_library_path",
    "library_path",
    "load_torch_ops",
    "native_dir",
]

ENV_NATIVE_DIR = "TORNADO_MOE_NATIVE_DIR"
JAR_NAME = "tornado-moe.jar"

_load_lock = threading.Lock()
_torch_ops_loaded = False


class NativeLibraryNotFoundError(TornadoMoeError, FileNotFoundError):
    """A native library or the Java classes are missing: the package has not been built (or not here)."""


def native_dir() -> Path:
    """The native libraries' folder: ``$TORNADO_MOE_NATIVE_DIR`` if set, else ``tornado_moe/_native``."""
    override = os.environ.get(ENV_NATIVE_DIR)
    if override:
        return Path(override).expanduser().resolve()
    return Path(__file__).resolve().parent / "_native"


def _library_filename(name: str) -> str:
    if sys.platform == "darwin":
        return f"lib{name}.dylib"
    if sys.platform == "win32":
        return f"{name}.dll"
    return f"lib{name}.so"


def _missing(path: Path, what: str) -> NativeLibraryNotFoundError:
    where = f"${ENV_NATIVE_DIR}" if os.environ.get(ENV_NATIVE_DIR) else "tornado_moe/_native"
    return NativeLibraryNotFoundError(
        f"{what} not found at {path} ({where}). Build the native parts first: run `pip install -e .` "
        f"(or `make build`) in the tornado-moe source tree, or point {ENV_NATIVE_DIR} at a folder holding "
        "them."
    )


def library_path(name: str) -> Path:
    """Path of native library ``name`` (e.g. ``"tornado_moe"``, ``"tornado_moe_torch"``), which must exist."""
    path = native_dir() / _library_filename(name)
    if not path.is_file():
        raise _missing(path, f"native library {name!r}")
    return path


def load_torch_ops() -> None:
    """Registers ``torch.ops.tornado_moe.*``: loads the torch-op extension once, later calls return."""
    global _torch_ops_loaded
    if _torch_ops_loaded:
        return
    with _load_lock:
        if _torch_ops_loaded:
            return
        import torch

        torch.ops.load_library(str(library_path("tornado_moe_torch")))
        _torch_ops_loaded = True


def jar_path() -> Path:
    """Path of ``tornado-moe.jar`` (the Java classes of the Java route), which must exist."""
    path = native_dir() / JAR_NAME
    if not path.is_file():
        raise _missing(path, "Java classes (tornado-moe.jar)")
    return path


def jni_library_path() -> Path:
    """Path of the JNI library the Java classes load, which must exist."""
    return library_path("tornado_moe_jni")
