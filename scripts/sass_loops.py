#!/usr/bin/env python3
"""The hot loops of a kernel's SASS, read without a GPU (results/NOTES.md lesson 143).

Compiles one CUDA source of csrc/cuda to an sm_90 cubin with the nvcc flags given (e.g. a knob's -D),
disassembles it with cuobjdump (on PATH, or from PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
wheels, which run on a machine without a GPU), and prints for every kernel whose mangled name matches
--kernel: its instruction count, ptxas's registers and spills, and the length of each loop (a backward
branch and the instructions it jumps over) that holds an instruction matching --op (default IDP: the int8
reader's DP4A). Run it on two builds, with and without a change, to see whether the change moved a
reader's loop before spending device time on it:

  python3 scripts/sass_loops.py csrc/cuda/moe_router_gate_up.cu \
      --kernel 'router_experts_gate_up_kernel.*FmtE2ELb1'
  python3 scripts/sass_loops.py csrc/cuda/moe_gate_up.cu --kernel '...' --flags=-DTM_PROBE_GU_GROUPS=0
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# cuobjdump -sass lines: /*0a30*/  [@P0] OPCODE operands ;
_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA\S*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")
_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_USE = re.compile(r"(\d+) bytes spill stores.*?Used (\d+) registers", re.S)


def find_cuobjdump() -> str:
    """cuobjdump from PATH, or from the nvidia-cuda-cuobjdump wheel (made executable if unpacking lost it)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels
    except ImportError:
        nvidia = None
    for base in getattr(nvidia, "__path__", []):
        for candidate in sorted(Path(base).glob("*/bin/cuobjdump")):
            candidate.chmod(candidate.stat().st_mode | 0o111)
            return str(candidate)
    raise SystemExit("cuobjdump not found: `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, or PATH")


def split_functions(sass: str) -> dict[str, str]:
    """cuobjdump -sass output as {mangled kernel name: its listing}."""
    parts = re.split(r"\n\s*Function : ", sass)
    return {part.split("\n", 1)[0].strip(): part for part in parts[1:]}


def instructions(listing: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction of one function's listing, in order."""
    return [(int(addr, 16), " ".join(text.split())) for addr, text in _INSTRUCTION.findall(listing)]


def disassemble(path: Path) -> str:
    """cuobjdump -sass of an object or cubin (cuobjdump runs nvdisasm, which the wheels install beside it)."""
    cuobjdump = find_cuobjdump()
    env = {**os.environ, "PATH": f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    dump = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True, env=env)
    if dump.returncode != 0:
        raise SystemExit(f"cuobjdump {path} failed: {dump.stderr.strip()}")
    return dump.stdout


def loops(listing: str, op: str) -> list[int]:
    """The instruction counts of the loops (a backward branch to an earlier instruction of the function,
    and the span between them) that hold an instruction whose text contains `op`, spans of at most 400
    instructions (the inner loops), in the order of their branches."""
    ins = instructions(listing)
    index = {addr: k for k, (addr, _) in enumerate(ins)}
    found = []
    for k, (addr, text) in enumerate(ins):
        m = _BRANCH.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr or target not in index:
            continue
        span = [t for _, t in ins[index[target] : k + 1]]
        if len(span) <= 400 and any(op in t for t in span):
            found.append(len(span))
    return found


def ptxas_resources(report: str) -> dict[str, tuple[int, int]]:
    """{mangled kernel name: (registers, spill store bytes)} from ptxas -v output."""
    pieces = _PTXAS_ENTRY.split(report)
    out = {}
    for name, body in zip(pieces[1::2], pieces[2::2], strict=False):
        m = _PTXAS_USE.search(body)
        if m:
            out[name] = (int(m.group(2)), int(m.group(1)))
    return out


def compile_cubin(source: Path, flags: list[str], cubin: Path) -> str:
    """nvcc source -> cubin for sm_90 with the repository's include paths; returns ptxas's resource report."""
    cmd = ["nvcc", "-DTM_WITH_CUDA=1", *(f"-I{ROOT / 'csrc' / d}" for d in ("include", "common", "cuda")),
           "-O3", "-arch=sm_90", "--expt-relaxed-constexpr", "-std=c++17", "-cubin", "-Xptxas", "-v", *flags,
           str(source), "-o", str(cubin)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed ({' '.join(cmd)}):\n{done.stderr}")
    return done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="a CUDA source of csrc/cuda, e.g. csrc/cuda/moe_down.cu")
    parser.add_argument("--kernel", required=True, help="regular expression matched against mangled names")
    parser.add_argument("--op", default="IDP", help="an opcode the reported loops must hold (default: IDP)")
    parser.add_argument("--flags", default="", help="extra nvcc flags in one string: --flags='-DA=1 -DB=0'")
    args = parser.parse_args(argv)
    find_cuobjdump()  # before the compilation: a missing tool says so at once
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        resources = ptxas_resources(compile_cubin(args.source, shlex.split(args.flags), cubin))
        sass = disassemble(cubin)
    matched = 0
    for name, listing in split_functions(sass).items():
        if not re.search(args.kernel, name):
            continue
        matched += 1
        regs, spills = resources.get(name, (-1, -1))
        count = len(instructions(listing))
        print(f"{name}\n  {count} instructions, {regs} registers, {spills} bytes spilled; "
              f"loops with {args.op}: {loops(listing, args.op)}")
    if not matched:
        print(f"no kernel matches {args.kernel!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
