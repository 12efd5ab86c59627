"""The decode engine: weights on a device, one execution plan per step, KV cache, generation loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tornado_moe.engine.buffers import Activations, DeviceModel
from tornado_moe.engine.layer_graphs import SamplerConfig, embedding_graph, layer_graph, logits_graph
from tornado_moe.errors import DeviceError, InputError
from tornado_moe.graph.plan import ExecutionPlan
from tornado_moe.graph.task_graph import ImmutableTaskGraph
from tornado_moe.model.gguf_model import GGUFModel


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda: no CUDA GPU is visible to torch on this machine")
        from tornado_moe.kernels.ops import cuda_compiled

        if not cuda_compiled():
            raise DeviceError("--device cuda: the kernel library was built without CUDA (nvcc not found)")
    elif name != "cpu":
        raise DeviceError(f"unknown device {name!r} (choose auto, cpu or cuda)")
    return torch.device(name)


#: decode steps generate() launches at once by default (EngineOptions.steps_per_graph)
DEFAULT_STEPS_PER_GRAPH = 8
#: prompt tokens one prefill step processes by default (EngineOptions.prefill_chunk)
DEFAULT_PREFILL_CHUNK = 128
#: prefill plans (one per chunk length) an engine keeps built; the least recently used goes first
_PREFILL_PLANS_KEPT = 4


@dataclass
class EngineOptions:
    device: str = "auto"
    route: str = "torch"
    fuse_experts: bool = True
    cuda_graphs: bool = False
    # Q8_0 weights in the tiled layout on CUDA (tornado_moe.quant.tiled): bitwise the same results, faster.
    tile_weights: bool = True
    profiler: bool = False
    max_context: int | None = None  # default: min(model context, 4096)
    # Decode steps generate() launches at once: with cuda_graphs, one replay of a graph that holds them all,
    # so the device does not idle at a graph boundary between them (results/NOTES.md, v9). Tokens come back
    # once per such launch; past a stop token the extra steps are discarded.
    steps_per_graph: int = DEFAULT_STEPS_PER_GRAPH
    # Prompt tokens one prefill step runs through the model at once (every kernel takes a token count): the
    # same bits as feeding them one by one, with a launch per task for the whole chunk instead of per token.
    # 1 = token by token, through the decode plan.
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    progress: bool = False


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first generated token comes out of the prefill step; decode steps make the rest.
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def summary(self) -> str:
        return (f"prompt tokens: {self.prompt_tokens}, generated tokens: {self.generated_tokens}, "
                f"prefill: {self.prefill_tok_s:.1f} tok/s, decode: {self.decode_tok_s:.1f} tok/s")


class Engine:
    """One model on one device, decoding one sequence through the task graphs.

    A decode step feeds one token: the embedding graph, one graph per layer and the logits graph run as one
    execution plan, which writes the next token id and advances the device-side position. With
    ``cuda_graphs`` the whole step is captured once (after a first eager step) and replayed per token.
    A prompt goes through in chunks of up to ``prefill_chunk`` tokens, each one execution of a plan built
    for that many tokens over the same buffers and KV cache (run eagerly: it runs once per prompt).
    """

    def __init__(self, model: GGUFModel, options: EngineOptions | None = None) -> None:
        self.options = opts = options or EngineOptions()
        self.model = model
        self.config = cfg = model.config
        self.device = resolve_device(opts.device)
        if opts.cuda_graphs and self.device.type != "cuda":
            raise DeviceError("CUDA graphs need --device cuda")
        if opts.steps_per_graph < 1:
            raise InputError("steps per graph (--steps-per-graph) must be at least 1, got "
                             f"{opts.steps_per_graph}")
        if opts.prefill_chunk < 1:
            raise InputError(f"prefill chunk (--prefill-chunk) must be at least 1, got {opts.prefill_chunk}")
        self.max_context = min(opts.max_context or 4096, cfg.context_length)
        self.weights = DeviceModel(model, self.device, progress=opts.progress, tile=opts.tile_weights)
        # per-token buffers for a whole prefill chunk; a decode step uses their first row
        self.act = Activations(cfg, self.device, max_tokens=min(opts.prefill_chunk, self.max_context),
                               max_context=self.max_context)
        self.graphs = self._step_graphs(1)
        self.plan = ExecutionPlan(*self.graphs, device=self.device, route=opts.route)
        if opts.profiler:
            self.plan.with_profiler()
        self._prefill_plans: dict[int, ExecutionPlan] = {}
        self._plan_ran = False  # whether the decode plan ran eagerly (CUDA-graph capture waits for that)
        self._graph_enabled = False
        self.position = 0
        self._last_row = 0  # the buffers' row of the last token processed (a prefill step's last)

    def _step_graphs(self, n_tokens: int) -> list[ImmutableTaskGraph]:
        """The graphs of one step over ``n_tokens`` consecutive tokens: embedding, layers, logits."""
        w, act, opts = self.weights, self.act, self.options
        graphs = [embedding_graph(w, act, n_tokens)]
        graphs += [layer_graph(w, act, i, n_tokens, fuse_experts=opts.fuse_experts)
                   for i in range(self.config.n_layers)]
        graphs.append(logits_graph(w, act, n_tokens, opts.sampler, fuse_experts=opts.fuse_experts))
        return graphs

    # ---- steps -------------------------------------------------------------------------------------------
    @property
    def launches_per_token(self) -> int:
        return self.plan.launches_per_execution

    def reset(self) -> None:
        """Start a new sequence (the KV cache rows are simply overwritten)."""
        self.position = 0
        self.act.position.zero_()

    def _check_room(self, n: int) -> None:
        if self.position + n > self.max_context:
            raise InputError(f"sequence of {self.position + n} tokens exceeds the context of "
                             f"{self.max_context} tokens (model context {self.config.context_length})")

    def _execute(self, steps: int = 1) -> None:
        """``steps`` decode steps of the decode plan; with cuda_graphs, replays of its capture once it has run
        eagerly (so that capture never loads modules lazily)."""
        if self.options.cuda_graphs and not self._graph_enabled:
            if not self._plan_ran:
                self._run_decode_plan(1)
                steps -= 1
            self.plan.with_cuda_graph()
            self._graph_enabled = True
        if steps:
            self._run_decode_plan(steps)

    def _run_decode_plan(self, steps: int) -> None:
        self.plan.execute(steps)
        self.position += steps
        self._plan_ran = True
        self._last_row = 0

    def _prefill_plan(self, n_tokens: int) -> ExecutionPlan:
        """The plan of one step over ``n_tokens`` prompt tokens, built on first use (a few are kept)."""
        plan = self._prefill_plans.pop(n_tokens, None)
        if plan is None:
            if len(self._prefill_plans) >= _PREFILL_PLANS_KEPT:
                self._prefill_plans.pop(next(iter(self._prefill_plans))).close()
            plan = ExecutionPlan(*self._step_graphs(n_tokens), device=self.device, route=self.options.route)
        self._prefill_plans[n_tokens] = plan  # most recently used last
        return plan

    def _prefill(self, tokens: Sequence[int]) -> None:
        """Feeds ``tokens`` at the current position, ``prefill_chunk`` at a time; the last chunk's step
        chooses the next token. Bitwise the same as feeding them one by one: every kernel computes a (token,
        row) value the same way whatever the step's token count, and attention reads the cache rows a token's
        own step would (the chunk's earlier tokens' among them)."""
        self._check_tokens(tokens)  # all of them before the first chunk runs
        step = self.act.max_tokens
        for start in range(0, len(tokens), step):
            chunk = tokens[start:start + step]
            self._load_tokens(chunk)
            if len(chunk) == 1:
                self._execute()
            else:
                self._prefill_plan(len(chunk)).execute()
                self.position += len(chunk)
                self._last_row = len(chunk) - 1

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        """Room for ``tokens`` at the current position, and ids inside the vocabulary."""
        self._check_room(len(tokens))
        bad = [t for t in tokens if not 0 <= t < self.config.vocab]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab - 1})")

    def _load_tokens(self, tokens: Sequence[int]) -> None:
        """Writes checked tokens where the embedding task reads them."""
        if len(tokens) == 1:
            self.act.tokens[0] = tokens[0]
        else:
            self.act.tokens[:len(tokens)].copy_(torch.tensor(list(tokens), dtype=torch.int32))

    def feed(self, token: int) -> int:
        """Processes ``token`` at the current position and returns the chosen next token."""
        return self.prefill([token])

    def prefill(self, tokens: Sequence[int]) -> int:
        """Processes ``tokens`` from the current position (in chunks, :meth:`_prefill`) and returns the chosen
        next token: feed() of each token in turn, in fewer launches."""
        if not tokens:
            raise InputError("no tokens to prefill")
        self._prefill(tokens)
        return int(self.act.tokens[0].item())

    def decode_next(self) -> int:
        """Feeds back the token the previous step chose (it is already in the device buffer)."""
        self._check_room(1)
        self._execute()
        return int(self.act.tokens[0].item())

    def feed_traced(self, token: int, after_graph: Callable[[int, ImmutableTaskGraph], None]) -> int:
        """feed(), launched eagerly task by task, calling ``after_graph(index, graph)`` after each graph.

        For diagnostics (tornado-moe determinism hashes the residual stream after every layer graph): the
        same kernels in the same order as a plan execution, never a CUDA-graph replay.
        """
        self._check_tokens([token])
        self._load_tokens([token])
        for gi, graph in enumerate(self.plan.graphs):
            for ti in range(graph.launch_count):
                self.plan.execute_task(gi, ti)
            after_graph(gi, graph)
        self.position += 1
        self._last_row = 0
        return int(self.act.tokens[0].item())

    def last_logits(self) -> torch.Tensor:
        return self.act.logits[0]

    def hidden_state(self) -> torch.Tensor:
        """The residual stream after the last layer for the last token processed."""
        return self.act.x[self._last_row]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None,
                 on_logits: Callable[[torch.Tensor], None] | None = None
                 ) -> tuple[list[int], GenerationStats]:
        """Greedy or sampled continuation of ``prompt_ids`` (the sampler was fixed at construction).

        Decode steps are pipelined: each step reads its input token from the device buffer the previous step
        wrote, so the next steps are launched before the host reads this step's token back, and the device
        does not wait for the host's read, callbacks or next launch (on the H200 those took ~120 us of a
        1.47 ms step: results/NOTES.md, v4k). Steps go out ``steps_per_graph`` at a time (one CUDA-graph
        replay each; the last launch takes what is left of max_new_tokens); every step logs its token
        (Activations.token_log), which the host reads once per launch. Steps launched past a stop token are
        discarded (position and token buffer restored), so the engine's state is that of a plain
        token-by-token loop, but for last_logits(), which then holds the last discarded step's.
        ``on_logits`` needs each step's logits before the next step overwrites them: with it, steps run one
        at a time.
        """
        if not prompt_ids:
            raise InputError("the prompt is empty: give at least one token")
        self._check_room(len(prompt_ids) + max_new_tokens - 1)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        chunk = self.options.steps_per_graph
        reader = _TokenReader(self.act.token_log, chunk)
        sync()
        t0 = time.perf_counter()
        self._prefill(prompt_ids)
        first = self.position  # out[i] is the token logged for position first + i
        pending = reader.enqueue(first, 1)
        sync()
        stats.prefill_s = time.perf_counter() - t0
        out: list[int] = []
        launched = 1  # tokens whose steps are launched (the prompt's last step chose the first)
        t1 = time.perf_counter()
        while True:
            following = None
            if on_logits is None and launched < max_new_tokens:  # launched before `pending` is read back
                n = min(chunk, max_new_tokens - launched)
                following = self._launch_logged(reader, n)
                launched += n
            done = False
            for nxt in reader.read(pending):
                out.append(nxt)
                if on_logits is not None:
                    on_logits(self.last_logits())
                if on_token is not None:
                    on_token(nxt)
                if len(out) >= max_new_tokens or nxt in stop_ids:
                    done = True
                    break
            if done:
                self._rewind(first + len(out) - 1, out[-1])
                break
            if following is None:
                following = self._launch_logged(reader, 1)
                launched += 1
            pending = following
        sync()
        stats.decode_s = time.perf_counter() - t1
        stats.generated_tokens = len(out)
        return out, stats

    def _launch_logged(self, reader: _TokenReader, steps: int) -> int:
        """Launches ``steps`` decode steps and queues the read-back of the tokens they log (its slot)."""
        first = self.position + 1
        self._execute(steps)
        return reader.enqueue(first, steps)

    def _rewind(self, position: int, chosen: int) -> None:
        """Discards the steps launched past ``position`` (they ran ahead of a stop token or the token
        limit), so the state is that of a token-by-token loop that stopped there; their KV rows are
        overwritten later."""
        if self.position != position:
            self.position = position
            self.act.position.fill_(position)
            self.act.tokens[0] = chosen

    def close(self) -> None:
        for plan in self._prefill_plans.values():
            plan.close()
        self._prefill_plans.clear()
        self.plan.close()


class _TokenReader:
    """Reads the chosen tokens back without stalling the device's stream.

    Each enqueue() copies entries of the token log into its own pinned host slot behind the steps that wrote
    them and records an event, so that further steps can be queued before the host waits for these. Two slots
    suffice: at most one launch runs ahead of the tokens being read.
    """

    def __init__(self, token_log: torch.Tensor, max_steps: int) -> None:
        self._log = token_log
        self._cuda = token_log.device.type == "cuda"
        self._host = torch.zeros(2, max_steps, dtype=token_log.dtype, pin_memory=self._cuda)
        self._events = [torch.cuda.Event() for _ in range(2)] if self._cuda else []
        self._counts = [0, 0]
        self._next = 0

    def enqueue(self, first: int, n: int) -> int:
        """Slot of the tokens logged at positions first .. first + n - 1."""
        slot = self._next
        self._next ^= 1
        self._counts[slot] = n
        self._host[slot, :n].copy_(self._log[first : first + n], non_blocking=self._cuda)
        if self._cuda:
            self._events[slot].record()
        return slot

    def read(self, slot: int) -> list[int]:
        if self._cuda:
            self._events[slot].synchronize()
        return self._host[slot, : self._counts[slot]].tolist()
