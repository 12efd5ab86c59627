"""``tornado-moe bench``: decode and prefill tok/s per variant (median and spread over repetitions)."""

from __future__ import annotations

import argparse
import sys

from tornado_moe.cli.common import (
    add_device_argument,
    add_model_argument,
    add_prompt_arguments,
    add_steps_per_graph_argument,
    load,
    non_negative_int,
    paragraph,
    positive_int,
    prompt_token_ids,
    write_json,
)

EPILOG = """\
variants (--compare): a comma list from fused,per-slot,eager,graphs,torch,java,tiled,gguf-layout,
batched-prefill,per-token-prefill; both values of a pair make it an axis (all combinations run side by side
in one process, one engine at a time over one loaded model), one value fixes it, an axis not named keeps the
default (fused, CUDA graphs on a GPU / eager on CPU, torch, tiled: Q8_0 weights re-laid out for the GPU at
upload; gguf-layout reads them as stored in the file; batched-prefill: the prompt in one step of up to 128
tokens, per-token-prefill one step per token). Default: that single variant.

examples:
  tornado-moe bench --preset qwen1.5-moe-a2.7b --compare fused,per-slot,eager,graphs --json bench.json
  tornado-moe bench --model tiny.gguf --device cpu -n 16 --repeats 3

% floor: the median decode speed against the bandwidth floor, the bytes one decode step moves (the weights,
of the routed experts only the selected ones' share, and the activations; as `tornado-moe profile` counts
them) at this machine's copy bandwidth (read + write of a large device copy, measured at the run's start).

JSON: {command, date, git_commit, device, gpu_name, model, torch_version, prompt_tokens, max_tokens,
       repeats, warmup, copy_bandwidth_gb_s, tokens_identical_across_variants,
       variants: [{variant, fuse_experts, cuda_graphs, route, tile_weights, steps_per_graph,
                   prefill_chunk, decode_tok_s_median,
                   decode_tok_s_min, decode_tok_s_max, decode_tok_s_stdev, decode_tok_s_runs,
                   decode_ms_per_token_median, prefill_tok_s_median, prefill_tok_s_min, prefill_tok_s_max,
                   prefill_tok_s_runs, launches_per_token, decode_bytes_per_token, decode_floor_us_per_token,
                   decode_fraction_of_floor, tokens_sha256, tokens_identical_across_repeats}]}
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="decode and prefill throughput per variant",
        description=paragraph(
            "Measure decode and prefill tokens per second: warm-up runs, then repeated timed runs of the "
            "same prompt (fixed random token ids) and length; median, min/max and stdev per variant."),
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(p, presets=True)
    add_device_argument(p)
    add_prompt_arguments(p, default_tokens=16)
    p.add_argument("-n", "--max-tokens", type=positive_int, default=128, metavar="T",
                   help="tokens generated per run, >= 2 (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=5, metavar="R",
                   help="timed runs per variant (default: %(default)s; use >= 5 for numbers you publish)")
    p.add_argument("--warmup", type=non_negative_int, default=1, metavar="W",
                   help="untimed runs per variant first (module loading, CUDA-graph capture) "
                        "(default: %(default)s)")
    p.add_argument("--compare", metavar="VARIANTS", help="variants to run side by side (see below)")
    add_steps_per_graph_argument(p, several=True)
    p.add_argument("--max-context", type=positive_int, metavar="N",
                   help="KV-cache length (default: min(model context, 4096))")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tornado_moe.engine import resolve_device
    from tornado_moe.errors import InputError
    from tornado_moe.tools.bench import bench_model, format_report
    from tornado_moe.tools.run_info import run_info
    from tornado_moe.tools.variants import parse_variants

    if args.max_tokens < 2:
        raise InputError("-n must be at least 2: decode speed is measured over the tokens after the first")
    device = resolve_device(args.device)
    variants = parse_variants(args.compare, device, steps_per_graph=args.steps_per_graph)
    path, model = load(args)
    prompt = prompt_token_ids(args, model, path)
    body = bench_model(model, variants, device, prompt, args.max_tokens, repeats=args.repeats,
                       warmup=args.warmup, max_context=args.max_context,
                       progress=lambda m: print(m, file=sys.stderr))
    report = run_info(getattr(args, "argv", None), device, model=path, **body)
    print(format_report(report))
    if args.json:
        print(f"JSON report: {write_json(args.json, report)}", file=sys.stderr)
    return 0
