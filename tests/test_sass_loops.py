"""scripts/sass_loops.py: its reading of cuobjdump's SASS listing and of ptxas's resource report (written here
in the tools' formats), and, where nvcc and cuobjdump are installed, a real kernel compiled and read back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import load_script


def line(addr: int, text: str) -> str:
    return f"        /*{addr:04x}*/                   {text} ;   /* 0x000000082f2f7226 */"


def listing(name: str, body: list[str]) -> str:
    return f"\n\t\tFunction : {name}\n\t.headerflags\t@\"EF_CUDA_SM90\"\n" + "\n".join(body) + "\n"


def test_loops_are_backward_branches_that_hold_the_op() -> None:
    s = load_script("sass_loops")
    body = [line(0x00, "MOV R1, c[0x0][0x28]"),
            line(0x10, "LDG.E.128 R8, desc[UR4][R2.64]"),  # loop A: 0x10 .. 0x40, 4 instructions, with IDP
            line(0x20, "IDP.4A.S8.S8 R9, R9, R8, RZ"),
            line(0x30, "ISETP.GE.AND P0, PT, R4, R5, PT"),
            line(0x40, "@!P0 BRA 0x10"),
            line(0x50, "FADD R6, R6, R7"),  # loop B: 0x50 .. 0x60, no IDP
            line(0x60, "@P1 BRA 0x50"),
            line(0x70, "BRA 0x80"),  # a forward branch is no loop
            line(0x80, "EXIT")]
    sass = "header\n" + listing("_Z1kv", body) + listing("_Z1jv", [line(0, "EXIT")])
    funcs = s.split_functions(sass)
    assert sorted(funcs) == ["_Z1jv", "_Z1kv"]
    assert len(s.instructions(funcs["_Z1kv"])) == 9
    assert s.loops(funcs["_Z1kv"], "IDP") == [4]
    assert s.loops(funcs["_Z1kv"], "FADD") == [2]
    assert s.loops(funcs["_Z1jv"], "IDP") == []


def test_ptxas_report_gives_registers_and_spills_per_kernel() -> None:
    s = load_script("sass_loops")
    report = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
              "ptxas info    : Function properties for _Z1kv\n"
              "    8 bytes stack frame, 16 bytes spill stores, 24 bytes spill loads\n"
              "ptxas info    : Used 48 registers, used 1 barriers, 32 bytes smem\n"
              "ptxas info    : Compiling entry function '_Z1jv' for 'sm_90'\n"
              "ptxas info    : Function properties for _Z1jv\n"
              "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
              "ptxas info    : Used 63 registers, used 1 barriers, 48 bytes smem\n")
    assert s.ptxas_resources(report) == {"_Z1kv": (48, 16), "_Z1jv": (63, 0)}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_real_kernel_compiled_and_read_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = load_script("sass_loops")
    try:
        s.find_cuobjdump()
    except SystemExit:
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump)")
    src = tmp_path / "k.cu"
    src.write_text("__global__ void scale_kernel(float* x, int n, float a) {\n"
                   "  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = x[i] * a + 1.0f;\n}\n")
    assert s.main([str(src), "--kernel", "scale_kernel", "--op", "FFMA"]) == 0
    out = capsys.readouterr().out
    assert "scale_kernel" in out and "registers" in out and "loops with FFMA: [" in out
    assert "loops with FFMA: []" not in out  # the grid-stride loop holds the multiply-add
    assert s.main([str(src), "--kernel", "no_such_kernel"]) == 1
