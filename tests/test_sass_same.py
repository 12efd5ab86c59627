"""scripts/sass_same.py: its comparison of two builds' kernels, and, where nvcc and cuobjdump are installed,
real objects compiled from differently named sources (the anonymous namespace's tag differs), split over two
objects, and changed by one constant."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import load_script

SCALE = "  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = x[i] * a + {c};\n"
SHIFT = "  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] += a;\n"


def test_compare_lists_missing_extra_and_changed_kernels() -> None:
    s = load_script("sass_same")
    old = {"k1()": ["MOV R1, c[0x0][0x28]", "EXIT"], "k2()": ["EXIT"], "gone()": ["EXIT"]}
    assert s.compare(old, dict(old)) == []
    new = {"k1()": ["MOV R1, c[0x0][0x28]", "FADD R2, R2, R3", "EXIT"], "k2()": ["EXIT"], "extra()": ["EXIT"]}
    assert s.compare(old, new) == [
        "only in the old build: gone()",
        "only in the new build: extra()",
        "differs: k1() (2 against 3 instructions; first at instruction 1)",
    ]


def kernel_source(*bodies: tuple[str, str]) -> str:
    """A source with one kernel per (name, body line) in an anonymous namespace, each launched from a host
    function so that the compiler keeps it."""
    kernels = "".join(f"__global__ void {name}(float* x, int n, float a) {{\n{body}}}\n"
                      for name, body in bodies)
    launches = "".join(f"  {name}<<<1, 32>>>(x, n, 2.0f);\n" for name, _ in bodies)
    return f"namespace {{\n{kernels}}}\nvoid launch_all(float* x, int n) {{\n{launches}}}\n"


def compile_object(tmp_path: Path, name: str, source: str) -> Path:
    src, obj = tmp_path / f"{name}.cu", tmp_path / f"{name}.o"
    src.write_text(source)
    cmd = ["nvcc", "-O3", "-arch=sm_90", "-c", str(src), "-o", str(obj)]
    subprocess.run(cmd, check=True, capture_output=True)
    return obj


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("c++filt") is None,
                    reason="needs nvcc and c++filt")
def test_real_objects_moved_between_sources_are_the_same_and_a_change_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = load_script("sass_same")
    try:
        load_script("sass_loops").find_cuobjdump()
    except SystemExit:
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump)")
    scale_src = ("scale", SCALE.format(c="1.0f"))
    both = compile_object(tmp_path, "both", kernel_source(scale_src, ("shift", SHIFT)))
    scale = compile_object(tmp_path, "scale_part", kernel_source(scale_src))
    shift = compile_object(tmp_path, "shift_part", kernel_source(("shift", SHIFT)))
    assert s.main([str(both), "--new", str(scale), str(shift)]) == 0
    assert "2 kernels" in capsys.readouterr().out

    changed = compile_object(tmp_path, "changed", kernel_source(("scale", SCALE.format(c="2.0f"))))
    assert s.main([str(both), "--new", str(changed), str(shift)]) == 1
    out = capsys.readouterr().out
    assert "differs: (anonymous namespace)::scale" not in out  # the namespace is no part of the name compared
    assert "differs: scale(float*, int, float)" in out
    assert s.main([str(both), "--new", str(scale)]) == 1
    assert "only in the old build: shift(float*, int, float)" in capsys.readouterr().out
