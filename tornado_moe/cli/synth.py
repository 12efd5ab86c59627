"""``tornado-moe synth``: write a random-weight GGUF MoE model with real shapes.

Examples::

    tornado-moe synth -o tiny.gguf                                  # CI-sized qwen2moe, seconds
    tornado-moe synth --preset qwen1.5-moe-a2.7b -o qwen-moe.gguf   # full shape, ~15 GB
    tornado-moe synth --preset qwen1.5-moe-a2.7b --layers 2 --qtype Q4_0 -o small.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tornado_moe.cli.common import non_negative_int, positive_int
from tornado_moe.errors import InputError

__all__ = ["register", "run"]

_QTYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
           "F16")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``synth`` subcommand to the ``tornado-moe`` parser."""
    from tornado_moe.synth.random_model import PRESETS

    parser = subparsers.add_parser(
        "synth",
        help="write a random-weight GGUF MoE model with real shapes (test and benchmark model)",
        description=(
            "Write a qwen2moe, qwen3moe or olmoe GGUF file with random weights: the real tensor names, "
            "shapes, quant types and metadata of the chosen preset, with random codes and fp16 scales in the "
            "block formats (no trained weights). The file depends only on the options and --seed."
        ),
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="model shape: 'tiny' (qwen2moe, 2 layers, hidden 256, 8 experts top-2, no tokenizer; seconds "
        "on a CPU), 'tiny-qwen3moe' (the same size as qwen3moe: per-head q/k norms, heads of 128, no shared "
        "expert), 'tiny-olmoe' (the same size as olmoe: q and k each normalised as a whole, no shared "
        "expert), "
        "'qwen1.5-moe-a2.7b' (24 layers, hidden 2048, 60 experts top-4, shared expert, real Qwen2 "
        "tokenizer; ~15 GB at Q8_0), 'qwen3-30b-a3b' (48 layers, hidden 2048, 32 heads of 128, 128 experts "
        "top-8; ~32 GB at Q8_0) or 'olmoe-1b-7b' (16 layers, hidden 2048, 64 experts top-8 of 1024, no "
        "tokenizer; ~7.3 GB at Q8_0) (default: %(default)s)",
    )
    parser.add_argument("-o", "--output", required=True, type=Path, metavar="FILE", help="GGUF file to write")
    parser.add_argument(
        "--layers", type=positive_int, metavar="N", help="number of layers (overrides preset)"
    )
    parser.add_argument(
        "--experts", type=positive_int, metavar="E", help="routed experts per layer (overrides preset)"
    )
    parser.add_argument(
        "--top-k",
        type=positive_int,
        metavar="K",
        help="experts used per token, <= --experts (overrides preset)",
    )
    parser.add_argument(
        "--qtype",
        choices=_QTYPES,
        help="storage type of all weight matrices; norms, biases and router weights stay F32; a 256-value "
        "super-block type stores matrices whose rows are not whole super-blocks as llama.cpp does: Q2_K, "
        "Q3_K and IQ4_XS in IQ4_NL, Q4_K in Q5_0, Q5_K in Q5_1, Q6_K in Q8_0 (default: the preset's, Q8_0)",
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="random seed; same seed, same bytes (default: 0)"
    )
    parser.add_argument(
        "--threads", type=positive_int, metavar="N", help="generator threads (default: all CPU cores)"
    )
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    parser.set_defaults(func=run, synth_parser=parser)


def run(args: argparse.Namespace) -> int:
    """Write the model described by ``args``; print ``path, size, seconds`` on one line. Returns 0."""
    from tornado_moe.synth.random_model import PRESETS, write_random_model

    try:
        spec = PRESETS[args.preset].with_overrides(
            n_layers=args.layers, n_experts=args.experts, top_k=args.top_k, qtype=args.qtype
        )
    except InputError as e:
        parser = getattr(args, "synth_parser", None)
        if parser is None:
            raise
        parser.error(str(e))  # exits with status 2 and the usage line, like any other bad flag
    t0 = time.perf_counter()
    try:
        path = write_random_model(
            args.output, spec, seed=args.seed, threads=args.threads, progress=not args.no_progress
        )
    except OSError as e:  # unwritable folder, disk full...: a user error, reported in one line
        raise InputError(f"cannot write {args.output}: {e.strerror or e}") from e
    seconds = time.perf_counter() - t0
    size = path.stat().st_size
    print(
        f"{path}: {args.preset} ({spec.n_layers} layers, {spec.n_experts} experts top-{spec.top_k}, "
        f"{spec.qtype.name}), {size / 1e9:.3f} GB in {seconds:.1f} s",
        file=sys.stdout,
    )
    return 0
