"""Entry point of the ``tornado-moe`` command: one subcommand module per tool.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets ``func``. Errors a
user can cause (bad files, bad flags, missing GPU) end as one line on stderr and exit code 2, no traceback:
library errors are :class:`~tornado_moe.errors.TornadoMoeError` subclasses; operating-system errors on the
user's files (permissions, a directory given as a file) are reported the same way. Anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tornado_moe import __version__

SUBCOMMANDS = ("generate", "determinism", "profile", "bench", "synth")


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


def _os_error_text(e: OSError) -> str:
    where = e.filename if e.filename is not None else None
    what = e.strerror or str(e)
    return f"{where}: {what}" if where is not None else what


def _error_line(command: str, message: str) -> None:
    """Exactly one line, whatever the message holds, so scripts can grep for it."""
    one_line = " ".join(message.split())
    print(f"tornado-moe {command}: error: {one_line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from tornado_moe.errors import TornadoMoeError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in JSON reports (tornado_moe.tools.run_info)
    try:
        return int(args.func(args) or 0)
    except TornadoMoeError as e:
        _error_line(args.command, str(e))
        return 2
    except OSError as e:
        _error_line(args.command, _os_error_text(e))
        return 2
    except KeyboardInterrupt:
        print(f"tornado-moe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
