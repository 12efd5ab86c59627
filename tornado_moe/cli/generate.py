"""``tornado-moe generate``: text generation on the default model or a GGUF file."""

from __future__ import annotations

import argparse
import sys

from tornado_moe.errors import InputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate text with a GGUF MoE model through the tornado-moe kernels.")
    p.add_argument("--model", metavar="FILE",
                   help="GGUF model file (default: the embedded SmolLM2-135M-Instruct MoE, built on first use)")
    p.add_argument("--prompt", default="The capital of France is", help="prompt text (default: %(default)r)")
    p.add_argument("--prompt-ids", metavar="IDS",
                   help="comma-separated token ids instead of text (for models without a tokenizer)")
    p.add_argument("-sp", "--system-prompt", help="system prompt, used with --instruct/--interactive")
    p.add_argument("-n", "--max-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=42, help="sampling seed (default: %(default)s)")
    p.add_argument("--instruct", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the kernels run (default: auto = CUDA when available)")
    p.add_argument("--route", choices=("torch", "java"), default="torch",
                   help="torch ops, or the Java API through JNI/JPype (default: %(default)s)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="capture the whole decode step as one CUDA graph, replayed per token")
    p.add_argument("--per-slot", action="store_true",
                   help="unfused routed experts: two launches per routed slot instead of two per layer")
    p.add_argument("--max-context", type=int, help="KV-cache length (default: min(model context, 4096))")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tornado_moe.engine import Engine, EngineOptions, SamplerConfig
    from tornado_moe.model.gguf_model import load_model
    from tornado_moe.model.tokenizer import Tokenizer

    if args.max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    path = args.model
    if path is None:
        from tornado_moe.synth.default_model import default_model_path

        path = default_model_path(progress=True)
    model = load_model(path)
    tok = Tokenizer.from_metadata(model.metadata)
    if args.prompt_ids:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as e:
            raise InputError(f"--prompt-ids must be comma-separated integers: {e}") from None
    else:
        text = args.prompt
        if args.instruct:
            msgs = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else [])
            msgs.append({"role": "user", "content": text})
            text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        prompt_ids = tok.encode(text)
    sampler = SamplerConfig(args.temperature, args.top_p, args.top_k, args.seed)
    engine = Engine(model, EngineOptions(device=args.device, route=args.route, fuse_experts=not args.per_slot,
                                         cuda_graphs=args.cuda_graphs, max_context=args.max_context,
                                         sampler=sampler))
    stream = tok.streaming_decoder() if tok.has_text else None
    if stream is not None and not args.instruct:
        sys.stdout.write(args.prompt)

    def emit(t: int) -> None:
        if stream is not None:
            sys.stdout.write(stream.push(t))
        else:
            sys.stdout.write(f" {t}")
        sys.stdout.flush()

    stop = tok.eos_ids if tok.has_text else ()
    _, stats = engine.generate(prompt_ids, args.max_tokens, stop_ids=stop, on_token=emit)
    if stream is not None:
        sys.stdout.write(stream.flush())
    sys.stdout.write("\n")
    print(stats.summary(), file=sys.stderr)
    engine.close()
    return 0
