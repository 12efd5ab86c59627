"""Where tornado-moe keeps files it builds once and reuses (the default model, rebuilt tokenizer merges).

One place decides the folder so every cached artefact lands in the same, user-overridable spot:
``$TORNADO_MOE_CACHE`` if set, else ``$XDG_CACHE_HOME/tornado-moe``, else ``~/.cache/tornado-moe``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["cache_dir", "atomic_output"]


def cache_dir() -> Path:
    """Return the tornado-moe cache folder, creating it if needed."""
    env = os.environ.get("TORNADO_MOE_CACHE")
    if env:
        root = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tornado-moe"
    root.mkdir(parents=True, exist_ok=True)
    return root


def atomic_output(path: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a temporary file next to ``path``, then rename it onto ``path``.

    Readers (another process, a later run) never see a half-written file: either the old one, none,
    or the complete new one. The temporary file is removed if ``write`` fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    # mkstemp makes the file owner-only; give the final file the permissions a plain open() would.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
