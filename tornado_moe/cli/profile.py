"""``tornado-moe profile``: launches per layer/token (declared vs measured), time and bytes per task."""

from __future__ import annotations

import argparse
import sys

from tornado_moe.cli.common import (
    add_device_argument,
    add_model_argument,
    add_prompt_arguments,
    load,
    non_negative_float,
    non_negative_int,
    paragraph,
    percent,
    positive_int,
    prompt_token_ids,
    write_json,
)

EPILOG = """\
variants: a comma list from fused,per-slot,eager,graphs,torch,java,tiled,gguf-layout; both values of a
pair make it an axis, one value fixes it, an axis not named keeps the default (fused, graphs on CUDA / eager
on CPU, torch, tiled Q8_0 weights on CUDA). The prompt is fed token by token, so that every step profiled is
a one-token step of the plan the decode runs.
Default: fused,per-slot on CPU; fused,per-slot,eager,graphs on CUDA.

Bandwidth target: after each variant's table, every task kind whose launches read at least --large-mb MB
each (default 10: qkv, the expert gate-up and down, the output head of a Qwen1.5-MoE layer; not the output
projection's 4.5 MB) against --bandwidth-target percent of the copy bandwidth (default 70) by chain time, for
the CUDA-graph variants on a GPU (eager chains wait on the host; the CPU has none).

exit status: 0 when declared and measured launch counts agree for every variant, 1 when they do not,
2 on bad input, 3 with --check-bandwidth when they agree but a judged kind is below the target.

JSON: {command, date, git_commit, device, gpu_name, model, torch_version, copy_bandwidth_gb_s,
       prompt_tokens, max_tokens, repeats, variants: [{variant, fuse_experts, cuda_graphs, route, steps,
       launches_per_token_declared, launches_per_token_measured, launch_counter, launch_counts_agree,
       launch_mismatches, routed_launches_per_layer_declared, graphs: [{graph, launches_declared,
       launches_measured, routed_launches_declared}], step_wall_us, step_gap_us (GPU: {decode_steps,
       median_us, max_us, copy_us_per_step, span_median_us, period_median_us}),
       kernel_time_us_per_token,
       chain_us_per_token,
       bytes_per_token, weight_bytes_per_token, achieved_gb_s, fraction_of_copy_bandwidth,
       floor_us_per_token, by_kind: [...], tasks: [{graph, task, kernel, kind, routed, launches_declared,
       launches_measured, time_us, kernel_time_us, chain_us, weight_bytes, activation_bytes, bytes, gb_s,
       fraction_of_copy_bandwidth, chain_gb_s, chain_fraction_of_copy_bandwidth}],
       bandwidth_target: {fraction, min_bytes_per_launch, judged, all_meet, kinds: [{kind,
       bytes_per_launch, chain_fraction_of_copy_bandwidth, meets}]}}]}
       (by_kind rows: kind, launches, time_us, chain_us, bytes, weight_bytes and the same four rates)
chain_us (GPU only): how much later the step's kernels finish because of this one (its end minus the latest
earlier end); durations overlap under programmatic dependent launch, chain times add up to the step's
kernel span. Read them for the CUDA-graph variants (eager steps under the tracer wait on the host).
% copy: bytes per second of kernel time against the copy bandwidth; % chain: bytes per second of chain time,
the rate at which the step gets through a task's bytes (above 100% for small tasks hidden under others).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="kernel launches per layer and token, time and bytes per task, per variant",
        description=paragraph(
            "Profile decode steps per variant: kernel launches per layer and per token as the task graphs"
            " declare them and as measured (torch.profiler CUDA kernel events on a GPU, the route's "
            "counter on CPU), kernel time per task, bytes moved per task and the achieved GB/s against "
            "this machine's copy bandwidth (measured in the same run)."),
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(p, presets=True)
    add_device_argument(p)
    add_prompt_arguments(p, default_tokens=4)
    p.add_argument("-n", "--max-tokens", type=positive_int, default=16, metavar="T",
                   help="tokens generated per profiled run; steps = prompt tokens + T - 1 "
                        "(default: %(default)s)")
    p.add_argument("--variants", metavar="LIST",
                   help="variants to profile (see below; default depends on the device)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="R",
                   help="timed generations per variant after one warm-up; each task's time is its fastest "
                        "run's (default: %(default)s)")
    p.add_argument("--cuda-steps", type=non_negative_int, default=3, metavar="N",
                   help="decode steps traced with torch.profiler on a GPU, each in its own session, right "
                        "after the prompt: the per-kernel times are at the prompt's context length "
                        "(default: %(default)s; 0 = skip)")
    p.add_argument("--max-context", type=positive_int, metavar="N",
                   help="KV-cache length (default: min(model context, 4096))")
    p.add_argument("--bandwidth-target", type=percent, default=70.0, metavar="PCT",
                   help="the chain rate, in percent of the copy bandwidth, that kinds reading at least "
                        "--large-mb a launch are judged against (default: %(default)g)")
    p.add_argument("--large-mb", type=non_negative_float, default=10.0, metavar="MB",
                   help="bytes a launch, in MB (1e6), from which a task kind is judged against "
                        "--bandwidth-target (default: %(default)g)")
    p.add_argument("--check-bandwidth", action="store_true",
                   help="exit 3 when a judged kind is below --bandwidth-target (needs a GPU)")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--png", metavar="FILE", help="write a bar chart of time per token per task kind (PNG)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tornado_moe.engine import resolve_device
    from tornado_moe.errors import InputError
    from tornado_moe.tools.profile import (
        bandwidth_targets,
        below_bandwidth_target,
        format_report,
        plot_report,
        profile_model,
    )
    from tornado_moe.tools.run_info import run_info
    from tornado_moe.tools.variants import parse_variants

    device = resolve_device(args.device)
    if args.check_bandwidth and device.type != "cuda":
        raise InputError("--check-bandwidth needs a CUDA device: chain times come from the GPU's trace")
    spec = args.variants or ("fused,per-slot,eager,graphs" if device.type == "cuda" else "fused,per-slot")
    variants = parse_variants(spec, device, flag="--variants")
    if args.max_tokens < 2 and device.type == "cuda" and args.cuda_steps:
        raise InputError("-n must be at least 2 on CUDA (the traced steps are decode steps)")
    path, model = load(args)
    prompt = prompt_token_ids(args, model, path)
    body = profile_model(model, variants, device, prompt, args.max_tokens,
                         cuda_steps=min(args.cuda_steps, args.max_tokens - 1), repeats=args.repeats,
                         max_context=args.max_context,
                         progress=lambda m: print(m, file=sys.stderr))
    for v in body["variants"]:
        v["bandwidth_target"] = bandwidth_targets(v, args.bandwidth_target / 100, args.large_mb * 1e6)
    report = run_info(getattr(args, "argv", None), device, model=path, **body)
    print(format_report(report))
    if args.json:
        print(f"JSON report: {write_json(args.json, report)}", file=sys.stderr)
    if args.png:
        print(f"chart: {plot_report(report, args.png)}", file=sys.stderr)
    if not all(v["launch_counts_agree"] for v in report["variants"]):
        return 1
    below = below_bandwidth_target(report)
    if args.check_bandwidth and below:
        print(f"below {args.bandwidth_target:g}% of copy by chain time: {'; '.join(below)}", file=sys.stderr)
        return 3
    return 0
