"""``tornado-moe determinism``: bitwise identical tokens and logits across runs and variants."""

from __future__ import annotations

import argparse
import sys

from tornado_moe.cli.common import (
    add_device_argument,
    add_model_argument,
    add_prompt_arguments,
    add_steps_per_graph_argument,
    load,
    paragraph,
    positive_int,
    prompt_token_ids,
    write_json,
)

EPILOG = """\
variants (--compare): a comma list from fused,per-slot,eager,graphs,torch,java,tiled,gguf-layout,
batched-prefill,per-token-prefill. Both values of a pair (fused vs per-slot, graphs vs eager, torch vs java,
tiled vs gguf-layout Q8_0 weights on CUDA, the prompt in one step vs one step per token) add that pair as an
axis; one value fixes the axis; an axis not named keeps the default (fused, CUDA graphs on a GPU / eager on
CPU, torch, tiled, batched-prefill). Default: runs only.

exit status: 0 when every run of every variant gives bitwise identical tokens and logits, 1 when any
differs (the first diverging step and layer are reported), 2 on bad input.

JSON: {command, date, git_commit, device, gpu_name, model, torch_version, prompt_tokens, max_tokens,
       temperature, top_p, top_k, seed, vary_seed, variants: [names],
       runs: [{variant, run, seed, tokens_sha256, logits_sha256, n_tokens, tokens}],
       identical, mismatches: [{variant, run, step, kind}],
       divergence: null | {variants, runs, step, kind, step_position, position, layer, graph, note}}
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "determinism", help="check bitwise identical tokens and logits across runs and variants",
        description=paragraph(
            "Run the same prompt and seed several times per variant and compare sha256 digests of the "
            "generated token ids and of every step's logits (float32 bytes). On a difference, report the "
            "first diverging step and, by re-running both sides eagerly task by task, the first layer "
            "whose hidden state differs."),
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(p)
    add_device_argument(p)
    add_prompt_arguments(p, default_tokens=8)
    p.add_argument("--runs", type=positive_int, default=3, metavar="N",
                   help="runs per variant (default: %(default)s)")
    p.add_argument("-n", "--max-tokens", type=positive_int, default=32, metavar="T",
                   help="tokens generated per run; end-of-sequence tokens do not stop it "
                        "(default: %(default)s)")
    p.add_argument("--compare", metavar="VARIANTS",
                   help="variants to compare (see below; default: runs only)")
    add_steps_per_graph_argument(p, several=True)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples with --seed, which must be just as reproducible")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus mass when sampling (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="top-k when sampling, 0 = all (default: %(default)s)")
    p.add_argument("--seed", type=int, default=42, help="sampling seed of every run (default: %(default)s)")
    p.add_argument("--vary-seed", action="store_true",
                   help="self-test of this checker: run i samples with seed + i, so sampled runs MUST differ "
                        "and the command must report the divergence and exit 1")
    p.add_argument("--max-context", type=positive_int, metavar="N",
                   help="KV-cache length (default: min(model context, 4096))")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tornado_moe.engine import SamplerConfig, resolve_device
    from tornado_moe.tools.determinism import check_determinism, format_report
    from tornado_moe.tools.run_info import run_info
    from tornado_moe.tools.variants import parse_variants

    sampler = SamplerConfig(args.temperature, args.top_p, args.top_k, args.seed)  # checks the flags
    device = resolve_device(args.device)
    variants = parse_variants(args.compare, device, steps_per_graph=args.steps_per_graph)
    path, model = load(args)
    prompt = prompt_token_ids(args, model, path)
    body = check_determinism(model, variants, device.type, prompt, args.max_tokens, sampler, args.runs,
                             vary_seed=args.vary_seed, max_context=args.max_context,
                             progress=lambda m: print(m, file=sys.stderr))
    report = run_info(getattr(args, "argv", None), device, model=path, **body)
    print(format_report(report))
    if args.json:
        print(f"JSON report: {write_json(args.json, report)}", file=sys.stderr)
    return 0 if report["identical"] else 1
