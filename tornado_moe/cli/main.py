"""Entry point of the ``tornado-moe`` command: one subcommand module per tool.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets ``func``. Errors a
user can cause (bad files, bad flags, missing GPU) end as one line on stderr and exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tornado_moe import __version__

SUBCOMMANDS = ("generate", "synth")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tornado-moe",
        description="Deterministic Mixture-of-Experts inference for GGUF models (torch ops or Java route).",
    )
    parser.add_argument("--version", action="version", version=f"tornado-moe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f"tornado_moe.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tornado_moe.errors import TornadoMoeError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TornadoMoeError as e:
        print(f"tornado-moe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tornado-moe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
