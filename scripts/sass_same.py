#!/usr/bin/env python3
"""Whether two builds hold the same kernels, instruction for instruction (results/NOTES.md lesson 145).

A change that only moves code, such as a source split into several translation units, must leave the machine
code of every kernel as it was; then no result can change and no timing needs a GPU to confirm it. This
disassembles two sets of objects or cubins (cuobjdump -sass: on PATH, or PyPI's nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels), matches the kernels by demangled name with every "(anonymous namespace)::"
removed (its mangled tag names the source file), and compares their instructions with addresses and encodings
dropped (branch targets are offsets within the function, so they compare as they are):

  python3 scripts/sass_same.py old/moe.cu.o --new new/moe_gate_up.cu.o new/moe_down.cu.o ...

Exit status 0 when both sides hold the same kernels with the same instructions, else 1 (the differences
listed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_loops import disassemble, instructions, split_functions  # noqa: E402

ANONYMOUS = "(anonymous namespace)::"


def demangle(names: list[str]) -> list[str]:
    """c++filt's reading of each mangled name, in order (binutils, which the CUDA host compiler brings)."""
    done = subprocess.run(["c++filt"], input="\n".join(names) + "\n", capture_output=True, text=True,
                          check=True)
    return done.stdout.splitlines()


def kernels(objects: list[Path]) -> dict[str, list[str]]:
    """{demangled kernel name without anonymous namespaces: its instruction texts} over all the objects."""
    out: dict[str, list[str]] = {}
    for obj in objects:
        funcs = split_functions(disassemble(obj))
        for mangled, name in zip(funcs, demangle(list(funcs)), strict=True):
            key = name.replace(ANONYMOUS, "")
            if key in out:
                raise SystemExit(f"{key} is defined twice among {', '.join(map(str, objects))}")
            out[key] = [text for _, text in instructions(funcs[mangled])]
    return out


def compare(old: dict[str, list[str]], new: dict[str, list[str]]) -> list[str]:
    """The differences between two builds' kernels, one line each (none: the same machine code)."""
    lines = [f"only in the old build: {k}" for k in sorted(old.keys() - new.keys())]
    lines += [f"only in the new build: {k}" for k in sorted(new.keys() - old.keys())]
    for k in sorted(old.keys() & new.keys()):
        a, b = old[k], new[k]
        if a != b:
            pairs = enumerate(zip(a, b, strict=False))
            first = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
            lines.append(f"differs: {k} ({len(a)} against {len(b)} instructions; "
                         f"first at instruction {first})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", nargs="+", type=Path, help="the old build's objects or cubins")
    parser.add_argument("--new", nargs="+", type=Path, required=True,
                        help="the new build's objects or cubins")
    args = parser.parse_args(argv)
    old, new = kernels(args.old), kernels(args.new)
    diffs = compare(old, new)
    for line in diffs:
        print(line)
    count = sum(len(v) for v in old.values())
    verdict = "different" if diffs else "the same"
    print(f"{len(old)} kernels ({count} instructions) against {len(new)}: {verdict}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
