"""``tornado-moe generate``: text (or token-id) generation on the default model or a GGUF file.

The generated text goes to stdout (streamed token by token unless ``--no-stream``); everything else goes
to stderr and the last stderr line is always the run summary (prompt and generated tokens, prefill and
decode speed), so scripts can parse it. Flags follow llama-tornado where they make sense
(scripts/llama-tornado translates its spelling to this command).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tornado_moe.cli.common import (
    PREFILL_CHUNK_HELP_DEFAULT,
    add_device_argument,
    add_steps_per_graph_argument,
    load,
    need_text,
    paragraph,
    positive_int,
)
from tornado_moe.errors import InputError, UnsupportedModelError
from tornado_moe.model.tokenizer import CHAT_TEMPLATES

if TYPE_CHECKING:
    from tornado_moe.engine import Engine, GenerationStats
    from tornado_moe.model.tokenizer import Tokenizer

DEFAULT_PROMPT = "The capital of France is"

EPILOG = """\
examples:
  tornado-moe generate --prompt "The capital of France is" -n 16
  tornado-moe generate --model model.gguf --instruct -sp "You are terse." --prompt "Name a colour."
  tornado-moe generate --model tiny.gguf --prompt-ids 1,2,3 -n 8 --temperature 0.8 --seed 7
  tornado-moe generate -i                      # chat on stdin; /exit or end-of-file quits
  tornado-moe generate --device cuda --cuda-graphs --profiler --profiler-dump-dir prof/
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text from a prompt (or chat with -i)",
        description=paragraph(
            "Generate text with a GGUF MoE model through the tornado-moe kernels. The text goes to "
            "stdout; diagnostics and a final summary line (tokens, prefill and decode tok/s) go to "
            "stderr."),
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model and prompt")
    m.add_argument("--model", metavar="FILE",
                   help="GGUF model file (default: the embedded SmolLM2-135M-derived MoE, built and cached "
                        "on first use)")
    m.add_argument("--prompt", metavar="TEXT",
                   help=f"prompt text (default for text models: {DEFAULT_PROMPT!r}; with -i: the first "
                        "message)")
    m.add_argument("-f", "--file", metavar="FILE",
                   help="read the prompt text from FILE ('-': standard input), as --prompt takes it")
    m.add_argument("--prompt-ids", metavar="IDS",
                   help="the prompt as comma-separated token ids instead of text (the only way to prompt a "
                        "model without tokenizer)")
    m.add_argument("-sp", "--system-prompt", metavar="TEXT",
                   help="system message for the chat template (implies --instruct unless -i)")
    m.add_argument("--instruct", action="store_true",
                   help="wrap the prompt in the model's chat template as one user message and answer it")
    m.add_argument("-i", "--interactive", action="store_true",
                   help="chat loop: read user messages from stdin, one per line, answer each with the "
                        "model's chat template, keeping the conversation (and its KV cache); quit on /exit "
                        "or EOF")
    m.add_argument("--chat-template", metavar="NAME|FILE",
                   help="the chat template to use instead of the file's (implies --instruct unless -i): a "
                        f"name ({', '.join(sorted(CHAT_TEMPLATES))}) or a file holding a Jinja template "
                        "(default: the GGUF's tokenizer.chat_template, else chatml)")

    s = p.add_argument_group("sampling")
    s.add_argument("-n", "--max-tokens", type=positive_int, default=64, metavar="N",
                   help="most tokens to generate per answer; generation also stops at an end-of-sequence "
                        "token (default: %(default)s)")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy argmax (default: %(default)s)")
    s.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus sampling: keep the most likely tokens up to this probability mass, in "
                        "(0, 1] (default: %(default)s; ignored when greedy)")
    s.add_argument("--top-k", type=int, default=0,
                   help="keep only the K most likely tokens before top-p; 0 = all (default: %(default)s)")
    s.add_argument("--seed", type=int, default=42,
                   help="sampling seed: a given (prompt, seed) always gives the same text "
                        "(default: %(default)s)")

    o = p.add_argument_group("output")
    o.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print tokens as they are generated (--no-stream: print the answer at the end)")
    o.add_argument("--echo", action="store_true",
                   help="print the prompt (as the model sees it, chat template included) before the answer")

    x = p.add_argument_group("execution")
    add_device_argument(x)
    x.add_argument("--route", choices=("torch", "java"), default="torch",
                   help="how tasks reach the kernels: torch ops, or the Java TaskGraph API through JNI/JPype "
                        "(default: %(default)s)")
    x.add_argument("--cuda-graphs", action="store_true",
                   help="capture the whole decode step (all layers) as one CUDA graph, replayed per token "
                        "(needs a CUDA device)")
    add_steps_per_graph_argument(x)
    x.add_argument("--prefill-chunk", type=positive_int, default=PREFILL_CHUNK_HELP_DEFAULT, metavar="N",
                   help="prompt tokens run through the model in one step (one launch per task for all of "
                        "them); 1 feeds the prompt token by token. Any N gives bitwise the same tokens and "
                        "logits (default: %(default)s)")
    x.add_argument("--per-slot", action="store_true",
                   help="unfused routed experts: two launches per routed slot and layer instead of two per "
                        "layer (bitwise identical results; for comparisons)")
    x.add_argument("--gguf-layout", action="store_true",
                   help="keep Q8_0 weights in the file's block layout on CUDA instead of re-laying them out "
                        "for the GPU's loads at upload (bitwise identical results, slower; for comparisons)")
    x.add_argument("--max-context", type=positive_int, metavar="N",
                   help="KV-cache length in tokens (default: min(model context, 4096)); prompt plus answer "
                        "must fit")

    d = p.add_argument_group("diagnostics")
    d.add_argument("--profiler", action="store_true",
                   help="count launches and time kernels per task of the one-token steps (the decode, and "
                        "the prompt too with --prefill-chunk 1); print a per-task table on stderr at the end")
    d.add_argument("--profiler-dump-dir", metavar="DIR",
                   help="also write the profile as JSON into DIR (a name ending in .json is used as the file "
                        "itself); implies --profiler")
    d.add_argument("--verbose-init", action="store_true",
                   help="print model load, weight upload + graph build and warm-up step timings on stderr")
    p.set_defaults(func=run)


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse contradictory or out-of-range flags before anything is loaded."""
    from tornado_moe.engine import SamplerConfig

    SamplerConfig(args.temperature, args.top_p, args.top_k, args.seed)  # checks the sampling flags
    sources = (("--prompt", args.prompt), ("--file", args.file), ("--prompt-ids", args.prompt_ids))
    given = [flag for flag, value in sources if value is not None]
    if len(given) > 1:
        raise InputError(f"give one of --prompt, --file and --prompt-ids, not {' and '.join(given)}")
    if args.prompt_ids is not None:
        for flag, on in (("--interactive", args.interactive), ("--instruct", args.instruct),
                         ("--system-prompt", args.system_prompt is not None),
                         ("--chat-template", args.chat_template is not None)):
            if on:
                raise InputError(f"{flag} needs text (a chat template) and cannot be used with --prompt-ids")
    if args.interactive and args.echo:
        raise InputError("--echo cannot be used with --interactive (the conversation is on the terminal)")
    if args.cuda_graphs and args.device == "cpu":
        raise InputError("--cuda-graphs needs a CUDA device: use --device cuda (or auto on a GPU machine), "
                         "not --device cpu")


def _chat_template(name: str) -> str:
    """--chat-template: a built-in template by name, else the Jinja text of a file."""
    if name in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[name]
    path = Path(name).expanduser()
    if not path.is_file():
        names = ", ".join(sorted(CHAT_TEMPLATES))
        raise InputError(f"--chat-template {name}: neither a template name ({names}) nor a file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--chat-template {name}: cannot read the template: {e}") from None


def _read_prompt_file(name: str) -> str:
    """The text of ``--file`` (``-``: standard input), without a final newline."""
    if name == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(name).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--file {name}: cannot read the prompt: {e}") from None
    return text[:-1] if text.endswith("\n") else text


def run(args: argparse.Namespace) -> int:
    from tornado_moe.engine import Engine, EngineOptions, SamplerConfig
    from tornado_moe.model.tokenizer import IDS_INSTEAD, Tokenizer
    from tornado_moe.tools.prompts import check_token_ids, parse_token_ids

    _check_flags(args)
    if args.file is not None:  # read before the model loads: an unreadable file fails fast
        args.prompt = _read_prompt_file(args.file)
    profiler = args.profiler or args.profiler_dump_dir is not None
    log = sys.stderr
    t0 = time.perf_counter()
    path, model = load(args)
    t_load = time.perf_counter() - t0
    cfg = model.config
    try:
        tok = Tokenizer.from_metadata(model.metadata)
    except UnsupportedModelError as e:
        if args.prompt_ids is None:
            raise
        # token ids in, token ids out: the tokenizer is not needed
        reason = str(e).removesuffix(f"; {IDS_INSTEAD}")
        print(f"{path}: {reason}: the answer is printed as token ids", file=log)
        tok = Tokenizer.from_metadata(model.metadata, text=False)
    if args.chat_template is not None:
        tok.chat_template = _chat_template(args.chat_template)
    chat = (args.interactive or args.instruct or args.system_prompt is not None
            or args.chat_template is not None)

    prompt_ids: list[int] | None = None
    if args.prompt_ids is not None:
        prompt_ids = check_token_ids(parse_token_ids(args.prompt_ids), cfg.vocab)
    else:
        if args.prompt is not None:
            need_text(tok, path, "--prompt TEXT")
        elif chat:
            need_text(tok, path, "-i/--instruct/--system-prompt/--chat-template")
        elif not tok.has_text:
            raise InputError(f"{path}: this model has no tokenizer (token ids only): give the prompt with "
                             "--prompt-ids")
        if not args.interactive:
            text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
            if chat:
                text = tok.apply_chat_template(_messages(args.system_prompt, [("user", text)]),
                                               add_generation_prompt=True)
            prompt_ids = tok.encode(text)
            if not prompt_ids:
                raise InputError("--prompt: the text encodes to no tokens")
    if prompt_ids is not None:
        limit = min(args.max_context or cfg.context_length, cfg.context_length)
        _check_prompt_fits(len(prompt_ids), limit)

    sampler = SamplerConfig(args.temperature, args.top_p, args.top_k, args.seed)
    opts = EngineOptions(device=args.device, route=args.route, fuse_experts=not args.per_slot,
                         tile_weights=not args.gguf_layout,
                         cuda_graphs=args.cuda_graphs, steps_per_graph=args.steps_per_graph,
                         prefill_chunk=args.prefill_chunk,
                         profiler=profiler, max_context=args.max_context,
                         sampler=sampler, progress=args.verbose_init)
    t1 = time.perf_counter()
    engine = Engine(model, opts)
    t_init = time.perf_counter() - t1
    try:
        if args.verbose_init:
            _report_init(engine, path, t_load, t_init, log)
        if args.interactive:
            stats = _chat(engine, tok, args, sys.stdin, sys.stdout, log)
        else:
            assert prompt_ids is not None
            stats = _generate_once(engine, tok, prompt_ids, args, sys.stdout, log)
        if profiler:
            _report_profile(engine, args, path, stats, log)
    finally:
        engine.close()
    print(stats.summary(), file=log)
    return 0


def _messages(system: str | None, turns: list[tuple[str, str]]) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": r, "content": c} for r, c in turns]
    return msgs


def _check_prompt_fits(n_prompt: int, context: int) -> None:
    if n_prompt > context:
        raise InputError(f"the prompt has {n_prompt} tokens, longer than the context of {context} tokens "
                         "(raise --max-context up to the model's context length, or shorten the prompt)")


def _room(engine: Engine, n_prompt: int, wanted: int, log: TextIO) -> int:
    """Tokens that still fit after an ``n_prompt``-token prompt (the last one is produced, never fed)."""
    _check_prompt_fits(engine.position + n_prompt, engine.max_context)
    room = engine.max_context - engine.position - n_prompt + 1
    if wanted > room:
        print(f"note: -n {wanted} reduced to {room}: the context holds {engine.max_context} tokens",
              file=log)
        return room
    return wanted


def _warm_up(engine: Engine, token: int, log: TextIO) -> None:
    """One step (module loading, first-touch of weights) before timing; the KV row it wrote is reused."""
    sync = engine.device.type == "cuda"
    t = time.perf_counter()
    engine.feed(token)
    if sync:
        import torch

        torch.cuda.synchronize(engine.device)
    print(f"init: warm-up step {1e3 * (time.perf_counter() - t):.1f} ms", file=log)
    engine.reset()


def _report_init(engine: Engine, path: Path, t_load: float, t_init: float, log: TextIO) -> None:
    cfg = engine.config
    nbytes = sum(t.nbytes for t in engine.model.tensors.values())
    print(f"init: model {path} ({nbytes / 1e9:.3f} GB)", file=log)
    print(f"init: {cfg.describe()}", file=log)
    by_type: dict[str, list[int]] = {}
    for t in engine.model.tensors.values():
        n = by_type.setdefault(t.qtype.name, [0, 0])
        n[0] += 1
        n[1] += t.nbytes
    print("init: tensor formats: " + ", ".join(f"{name} {n} ({b / 1e9:.3f} GB)" for name, (n, b) in
                                             sorted(by_type.items(), key=lambda kv: -kv[1][1])), file=log)
    print(f"init: load (parse + mmap) {1e3 * t_load:.1f} ms", file=log)
    print(f"init: weight upload + task graphs on {engine.device} {1e3 * t_init:.1f} ms "
          f"({nbytes / 1e9 / max(t_init, 1e-9):.2f} GB/s)", file=log)
    o = engine.options
    print(f"init: route {o.route}, experts {'fused' if o.fuse_experts else 'per-slot'}, CUDA graphs "
          f"{'on' if o.cuda_graphs else 'off'}, {engine.launches_per_token} launches per token, context "
          f"{engine.max_context}", file=log)
    _warm_up(engine, 0, log)


class _Printer:
    """Writes generated tokens: streamed text, ids for token-id models, or all at the end."""

    def __init__(self, tok: Tokenizer, stream: bool, out: TextIO) -> None:
        self.tok, self.stream, self.out = tok, stream, out
        self.decoder = tok.stream(skip_special=True) if tok.has_text else None
        self.ids: list[int] = []

    def __call__(self, t: int) -> None:
        self.ids.append(t)
        if not self.stream:
            return
        piece = self.decoder.push(t) if self.decoder is not None else f" {t}"
        if piece:
            self.out.write(piece)
            self.out.flush()

    def finish(self) -> None:
        if self.stream:
            tail = self.decoder.flush() if self.decoder is not None else ""
        elif self.decoder is not None:
            tail = self.tok.decode(self.ids, skip_special=True)
        else:
            tail = "".join(f" {t}" for t in self.ids)
        self.out.write(tail + "\n")
        self.out.flush()


def _stop_ids(tok: Tokenizer) -> tuple[int, ...]:
    return tuple(sorted(tok.eos_ids))


def _generate_once(engine: Engine, tok: Tokenizer, prompt_ids: list[int], args: argparse.Namespace,
                   out: TextIO, log: TextIO) -> GenerationStats:
    n = _room(engine, len(prompt_ids), args.max_tokens, log)
    if args.echo:
        out.write(tok.decode(prompt_ids) if tok.has_text else " ".join(map(str, prompt_ids)))
        out.flush()
    printer = _Printer(tok, args.stream, out)
    _, stats = engine.generate(prompt_ids, n, stop_ids=_stop_ids(tok), on_token=printer)
    printer.finish()
    return stats


def _chat(engine: Engine, tok: Tokenizer, args: argparse.Namespace, stdin: TextIO, out: TextIO,
          log: TextIO) -> GenerationStats:
    """The conversation loop. Only new tokens are fed each turn: the KV cache keeps the conversation so far
    (re-encoding the whole conversation and feeding what extends the tokens already in the cache; if the
    re-encoding does not extend them, the cache is rebuilt)."""
    from tornado_moe.engine import GenerationStats

    total = GenerationStats()
    turns: list[tuple[str, str]] = []
    fed: list[int] = []  # tokens whose K/V rows are in the cache, in order
    pending = args.prompt
    stop = _stop_ids(tok)
    while True:
        if pending is not None:
            line, pending = pending, None
            out.write(f"> {line}\n")
        else:
            out.write("> ")
            out.flush()
            raw = stdin.readline()
            if raw == "":
                out.write("\n")
                break
            line = raw.rstrip("\r\n")
        if line.strip() == "/exit":
            break
        if not line.strip():
            continue
        turns.append(("user", line))
        ids = tok.encode(tok.apply_chat_template(_messages(args.system_prompt, turns),
                                                 add_generation_prompt=True))
        common = 0
        while common < min(len(fed), len(ids)) and fed[common] == ids[common]:
            common += 1
        if common < len(fed):
            engine.reset()
            fed, new = [], ids
        else:
            new = ids[len(fed):]
        if len(ids) > engine.max_context:
            print(f"note: the conversation ({len(ids)} tokens) no longer fits the context of "
                  f"{engine.max_context} tokens: starting a new one", file=log)
            turns = [("user", line)]
            engine.reset()
            fed = []
            new = tok.encode(tok.apply_chat_template(_messages(args.system_prompt, turns),
                                                     add_generation_prompt=True))
        n = _room(engine, len(new), args.max_tokens, log)
        printer = _Printer(tok, args.stream, out)
        reply, stats = engine.generate(new, n, stop_ids=stop, on_token=printer)
        printer.finish()
        fed += new + reply[:-1]  # the last token was produced but not fed yet
        turns.append(("assistant", tok.decode(reply, skip_special=True)))
        total.prompt_tokens += stats.prompt_tokens
        total.generated_tokens += stats.generated_tokens
        total.prefill_s += stats.prefill_s
        total.decode_s += stats.decode_s
    return total


def _report_profile(engine: Engine, args: argparse.Namespace, path: Path, stats: GenerationStats,
                    log: TextIO) -> None:
    from tornado_moe.cli.common import write_json
    from tornado_moe.tools.profile import profiler_summary_table
    from tornado_moe.tools.run_info import run_info

    result = engine.plan.profiler_result()
    print(profiler_summary_table(result, engine.launches_per_token), file=log)
    if args.profiler_dump_dir is None:
        return
    dest = Path(args.profiler_dump_dir).expanduser()
    if dest.suffix != ".json":
        from tornado_moe.tools.run_info import utc_now

        dest = dest / f"tornado-moe-profile-{utc_now().replace(':', '')}.json"
    report = run_info(getattr(args, "argv", None), engine.device, model=path,
                      variant=_variant_name(engine), launches_per_token_declared=engine.launches_per_token,
                      stats={"prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
                             "prefill_s": stats.prefill_s, "decode_s": stats.decode_s,
                             "prefill_tok_s": stats.prefill_tok_s, "decode_tok_s": stats.decode_tok_s},
                      profiler=result.to_dict())
    print(f"profile written to {write_json(dest, report)}", file=log)


def _variant_name(engine: Engine) -> str:
    from tornado_moe.tools.variants import Variant

    o = engine.options
    return Variant(o.fuse_experts, o.cuda_graphs, o.route, o.tile_weights, o.prefill_chunk > 1).name
