"""Arguments and helpers shared by the ``tornado-moe`` subcommands (model choice, device, prompts, JSON).

One place decides how a subcommand finds its model (``--model FILE``, a synthetic ``--preset`` or the
embedded default model), how a prompt becomes token ids, and how reports are written, so that every
subcommand behaves the same way and fails with the same messages.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tornado_moe.errors import InputError

if TYPE_CHECKING:
    from tornado_moe.model.gguf_model import GGUFModel
    from tornado_moe.model.tokenizer import Tokenizer

__all__ = [
    "add_model_argument",
    "add_device_argument",
    "add_prompt_arguments",
    "add_steps_per_graph_argument",
    "model_path",
    "preset_model_path",
    "prompt_token_ids",
    "write_json",
    "positive_int",
    "non_negative_int",
    "paragraph",
]

DEFAULT_MODEL_HELP = "the embedded default model (a SmolLM2-135M-derived MoE, built and cached on first use)"


def paragraph(text: str, width: int = 90) -> str:
    """A help description wrapped by hand (the raw formatter, kept for the epilogs, does not wrap)."""
    return textwrap.fill(" ".join(text.split()), width)


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v

    return parse


#: argparse type: an integer >= 1.
positive_int = _int_at_least(1, "a positive integer")
#: argparse type: an integer >= 0.
non_negative_int = _int_at_least(0, "an integer >= 0")


def _float_in(low: float, high: float, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= v <= high:  # also refuses nan
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return v

    return parse


#: argparse type: a percentage, 0 to 100.
percent = _float_in(0.0, 100.0, "a percentage from 0 to 100")
#: argparse type: a finite number >= 0.
non_negative_float = _float_in(0.0, sys.float_info.max, "a finite number >= 0")


def _positive_int_list(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",")]


#: EngineOptions.steps_per_graph's default, as the help texts state it (a test ties the two together).
STEPS_PER_GRAPH_HELP_DEFAULT = 8
#: EngineOptions.prefill_chunk's default, as ``generate --help`` states it (tied by the same test).
PREFILL_CHUNK_HELP_DEFAULT = 128


def add_steps_per_graph_argument(p: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--steps-per-graph``: one count, or (``several``) a comma list that runs every variant per count."""
    what = ("decode steps launched at once, as one CUDA-graph replay with --cuda-graphs: the GPU then runs "
            "them back to back instead of idling ~13 us at each graph boundary; tokens come back once per "
            "launch (steps past a stop token are discarded)")
    if several:
        p.add_argument("--steps-per-graph", type=_positive_int_list, metavar="N[,M...]",
                       help=f"{what}; a comma list runs every variant once per count "
                            f"(default: {STEPS_PER_GRAPH_HELP_DEFAULT})")
    else:
        p.add_argument("--steps-per-graph", type=positive_int, default=STEPS_PER_GRAPH_HELP_DEFAULT,
                       metavar="N", help=f"{what} (default: %(default)s)")


def add_model_argument(p: argparse.ArgumentParser, *, presets: bool = False) -> None:
    """``--model FILE`` (and, with ``presets``, ``--preset NAME``, a synthetic model cached on disk)."""
    if presets:
        from tornado_moe.synth.random_model import PRESETS

        g = p.add_mutually_exclusive_group()
        g.add_argument("--model", metavar="FILE", help=f"GGUF model file (default: {DEFAULT_MODEL_HELP})")
        g.add_argument("--preset", choices=sorted(PRESETS),
                       help="a synthetic random-weight model with a preset's real shapes, written to the "
                            "tornado-moe cache folder ($TORNADO_MOE_CACHE) on first use and reused after")
    else:
        p.add_argument("--model", metavar="FILE", help=f"GGUF model file (default: {DEFAULT_MODEL_HELP})")


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the kernels run: auto = CUDA when a GPU is visible, else CPU (default: auto)")


def add_prompt_arguments(p: argparse.ArgumentParser, *, default_tokens: int) -> None:
    """``--prompt TEXT`` / ``--prompt-ids IDS`` / ``--prompt-tokens N`` (seeded random ids, the default)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", metavar="TEXT", help="prompt text (needs a model with a tokenizer)")
    g.add_argument("--prompt-ids", metavar="IDS", help="prompt as comma-separated token ids")
    p.add_argument("--prompt-tokens", type=positive_int, default=default_tokens, metavar="N",
                   help="without --prompt/--prompt-ids: N token ids drawn uniformly from the vocabulary with "
                        "--prompt-seed, identical on every machine (default: %(default)s)")
    p.add_argument("--prompt-seed", type=int, default=0, metavar="S",
                   help="seed of the random prompt ids (default: %(default)s)")


def preset_model_path(name: str) -> Path:
    """Where the synthetic model of preset ``name`` (seed 0) is cached."""
    from tornado_moe.synth.cache import cache_dir

    return cache_dir() / f"synth-{name}-seed0.gguf"


def model_path(args: argparse.Namespace) -> Path:
    """The model file a subcommand runs: ``--model``, else ``--preset`` (written if missing), else default."""
    if getattr(args, "model", None):
        return Path(args.model).expanduser()
    preset = getattr(args, "preset", None)
    if preset:
        from tornado_moe.synth.random_model import PRESETS, write_random_model

        path = preset_model_path(preset)
        if not path.exists():
            write_random_model(path, PRESETS[preset], seed=0, progress=True)
        return path
    from tornado_moe.synth.default_model import default_model_path

    return Path(default_model_path(progress=True))


def load(args: argparse.Namespace) -> tuple[Path, GGUFModel]:
    """(path, loaded model) for ``args``; loader errors name the file."""
    from tornado_moe.model.gguf_model import load_model

    path = model_path(args)
    return path, load_model(path)


def need_text(tok: Tokenizer, path: Path, what: str) -> None:
    """InputError unless the model has a tokenizer (``what`` names the flag that needs text)."""
    if not tok.has_text:
        raise InputError(f"{path}: this model has no tokenizer (token ids only), so {what} cannot be used: "
                         "give the prompt as token ids with --prompt-ids")


def prompt_token_ids(args: argparse.Namespace, model: GGUFModel, path: Path) -> list[int]:
    """Token ids of the prompt the flags select (see add_prompt_arguments), checked against the vocabulary."""
    from tornado_moe.tools.prompts import check_token_ids, parse_token_ids, random_prompt_ids

    vocab = model.config.vocab
    if args.prompt_ids:
        return check_token_ids(parse_token_ids(args.prompt_ids), vocab)
    if args.prompt is not None:
        from tornado_moe.model.tokenizer import Tokenizer

        tok = Tokenizer.from_metadata(model.metadata)
        need_text(tok, path, "--prompt TEXT")
        ids = tok.encode(args.prompt)
        if not ids:
            raise InputError("--prompt: the text encodes to no tokens")
        return ids
    return random_prompt_ids(vocab, args.prompt_tokens, args.prompt_seed)


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _finite(o: Any) -> Any:
    """NaN/inf are not JSON: report them as null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(path: str | Path, report: dict[str, Any]) -> Path:
    """Write ``report`` as indented, strictly valid JSON (parents created)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(report), indent=2, default=_json_default, allow_nan=False) + "\n")
    return path
