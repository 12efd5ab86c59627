"""The decode engine against the float64 reference, and its bitwise promises.

Bounds: weights are dequantized exactly in both; the engine computes in float32 with fixed reduction orders,
so logits differ from the float64 reference only by float32 rounding, amplified a little through the layers:
relative error (max |diff| / max |ref|) under 2e-4 on the tiny model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import GPU, device_params

from tornado_moe.engine import Engine, EngineOptions, SamplerConfig
from tornado_moe.engine.buffers import Activations
from tornado_moe.engine.layer_graphs import layer_graph, logits_graph
from tornado_moe.errors import DeviceError, InputError
from tornado_moe.kernels.ops import KERNEL_ARGS
from tornado_moe.model.gguf_model import load_model
from tornado_moe.reference.model64 import ReferenceModel

PROMPT = [3, 17, 250, 9, 101, 44]


def _logits_trace(engine: Engine, tokens: list[int]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Feeds ``tokens`` one by one; returns next tokens, logits rows and final hidden state (float32)."""
    nxt, rows = [], []
    for t in tokens:
        nxt.append(engine.feed(t))
        rows.append(engine.last_logits().cpu().numpy().copy())
    return nxt, np.stack(rows), engine.hidden_state().cpu().numpy().copy()


def assert_same_trace(a: tuple, b: tuple) -> None:
    """Two _logits_trace results: the same next tokens, and bitwise the same logits and final hidden state."""
    assert a[0] == b[0]
    assert a[1].tobytes() == b[1].tobytes()
    assert a[2].tobytes() == b[2].tobytes()


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return load_model(tiny_model_path)


@pytest.mark.parametrize("device", device_params())
def test_tiny_logits_match_float64_reference(tiny, device: str) -> None:
    eng = Engine(tiny, EngineOptions(device=device))
    _, got, _ = _logits_trace(eng, PROMPT)
    ref_model = ReferenceModel(tiny)
    ref = ref_model.forward(PROMPT, ref_model.new_cache(64)).numpy()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-4, err


@pytest.mark.parametrize("device", device_params())
def test_fused_and_per_slot_are_bitwise_identical(tiny, device: str) -> None:
    fused = _logits_trace(Engine(tiny, EngineOptions(device=device, fuse_experts=True)), PROMPT)
    per_slot = _logits_trace(Engine(tiny, EngineOptions(device=device, fuse_experts=False)), PROMPT)
    assert_same_trace(fused, per_slot)


@pytest.mark.parametrize("device", device_params())
def test_run_to_run_bitwise_and_sampling_seeded(tiny, device: str) -> None:
    opts = EngineOptions(device=device, sampler=SamplerConfig(temperature=0.9, top_p=0.9, top_k=40, seed=7))
    a, _ = Engine(tiny, opts).generate(PROMPT, 12)
    b, _ = Engine(tiny, opts).generate(PROMPT, 12)
    assert a == b
    other = EngineOptions(device=device, sampler=SamplerConfig(temperature=0.9, top_p=0.9, top_k=40, seed=8))
    c, _ = Engine(tiny, other).generate(PROMPT, 12)
    assert c != a  # a different seed must be able to change the sample (12 tokens, vocab 512)


def _stepwise(engine: Engine, prompt: list[int], n: int, stop: set[int]) -> list[int]:
    """generate() written as the plain loop it must equal: one step at a time, each token read back."""
    out = [0]
    for t in prompt:
        out[0] = engine.feed(t)
    while len(out) < n and out[-1] not in stop:
        out.append(engine.decode_next())
    return out


def _pipelining_params() -> list:
    params = [pytest.param("cpu", False, id="cpu")]
    if GPU:
        params += [pytest.param("cuda", False, id="cuda-eager", marks=pytest.mark.gpu),
                   pytest.param("cuda", True, id="cuda-graphs", marks=pytest.mark.gpu)]
    return params


@pytest.mark.parametrize("steps", [1, 4], ids=["1-step", "4-step"])
@pytest.mark.parametrize(("device", "cuda_graphs"), _pipelining_params())
def test_pipelined_generate_is_the_stepwise_loop(tiny, device: str, cuda_graphs: bool, steps: int) -> None:
    """generate() launches steps (``steps`` at a time, one CUDA graph each) before reading the previous tokens
    back, and discards the steps launched past a stop token: tokens, positions and a continued conversation
    (a second generate() on the same sequence, as the chat loop does) must be those of the plain loop. With
    4 steps a launch, the stop token below falls inside a launch and the last launch is a partial one."""
    # sampled, so the tokens vary (greedy decoding of the random tiny model repeats one token)
    sampler = SamplerConfig(temperature=0.9, top_p=0.9, top_k=40, seed=7)
    opts = EngineOptions(device=device, cuda_graphs=cuda_graphs, sampler=sampler, steps_per_graph=steps)
    free, _ = Engine(tiny, opts).generate(PROMPT, 12)
    stop = {free[4]}  # a stop token the run meets, early: steps were launched ahead of it
    first = free.index(free[4]) + 1
    assert first >= 3 and free[first] != free[first - 1]
    piped, ref = Engine(tiny, opts), Engine(tiny, opts)
    a, _ = piped.generate(PROMPT, 12, stop_ids=sorted(stop))
    b = _stepwise(ref, PROMPT, 12, stop)
    assert a == b == free[:first]
    assert piped.position == ref.position == len(PROMPT) + len(a) - 1
    assert int(piped.act.position.item()) == int(ref.act.position.item()) == piped.position
    assert piped.decode_next() == ref.decode_next()  # feeds the chosen token from the device buffer
    turn = [5, 77]
    c, _ = piped.generate(turn, 6, stop_ids=sorted(stop))
    d = _stepwise(ref, turn, 6, stop)
    assert c == d and piped.position == ref.position
    piped.feed(c[-1])  # and the caches hold the same rows: the next step's logits are bitwise the same
    ref.feed(d[-1])
    assert piped.last_logits().cpu().numpy().tobytes() == ref.last_logits().cpu().numpy().tobytes()


def _sequence_state(engine: Engine) -> tuple:
    """Everything a step leaves for the next: positions, the chosen token, the last logits and hidden state,
    and every KV-cache row written (bytes)."""
    p = engine.position
    caches = b"".join(c[:p].cpu().numpy().tobytes() for c in (*engine.act.k_cache, *engine.act.v_cache))
    rows = (engine.last_logits(), engine.hidden_state())
    return (p, int(engine.act.position.item()), int(engine.act.tokens[0].item()),
            *(r.cpu().numpy().tobytes() for r in rows), caches)


LONG_PROMPT = [3, 17, 250, 9, 101, 44, 7, 311, 64, 2, 480]  # 11 tokens: chunks of 2 leave one, of 4 leave 3


@pytest.mark.parametrize("chunk", [2, 4, 128])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "per-slot"])
@pytest.mark.parametrize(("device", "cuda_graphs"), _pipelining_params())
def test_batched_prefill_is_token_by_token(tiny, device: str, cuda_graphs: bool, fuse: bool, sampled: bool,
                                           chunk: int) -> None:
    """A prompt run through in chunks of several tokens leaves bitwise the state of feeding its tokens one by
    one (the KV cache, the last logits and hidden state, the position and the chosen token, sampled ones
    included), at the start of a sequence and in the middle of one; decoding on gives the same tokens."""
    sampler = SamplerConfig(temperature=0.9, top_p=0.9, top_k=40, seed=7) if sampled else SamplerConfig()

    def engine(prefill_chunk: int) -> Engine:
        return Engine(tiny, EngineOptions(device=device, cuda_graphs=cuda_graphs, fuse_experts=fuse,
                                          sampler=sampler, prefill_chunk=prefill_chunk))

    batched, by_token = engine(chunk), engine(1)
    assert batched.act.max_tokens == chunk and by_token.act.max_tokens == 1
    for prompt in (LONG_PROMPT, [5, 77, 190]):  # the second continues the sequence
        first = batched.prefill(prompt)
        assert first == [by_token.feed(t) for t in prompt][-1]
        assert _sequence_state(batched) == _sequence_state(by_token)
        a = [batched.decode_next() for _ in range(4)]
        assert a == [by_token.decode_next() for _ in range(4)]
        assert _sequence_state(batched) == _sequence_state(by_token)


def test_prefill_plans_are_built_per_chunk_length_and_few_are_kept(tiny) -> None:
    eng = Engine(tiny, EngineOptions(device="cpu", prefill_chunk=4))
    ref = Engine(tiny, EngineOptions(device="cpu", prefill_chunk=1))
    for n in (2, 3, 4, 6, 7, 5, 3):  # chunk lengths 2, 3, 4, 4+2, 4+3, 4+1 (the decode plan), 3
        prompt = LONG_PROMPT[:n]
        assert eng.prefill(prompt) == ref.prefill(prompt)
        assert _sequence_state(eng) == _sequence_state(ref)
        eng.reset()
        ref.reset()
    # most recently used last; a single token takes the decode plan
    assert list(eng._prefill_plans) == [2, 4, 3]
    assert all(len(p.graphs) == tiny.config.n_layers + 2 for p in eng._prefill_plans.values())


def test_prefill_chunk_below_one_is_a_clear_error(tiny) -> None:
    with pytest.raises(InputError, match="--prefill-chunk"):
        Engine(tiny, EngineOptions(device="cpu", prefill_chunk=0))


def test_prefill_checks_every_token_before_running(tiny) -> None:
    eng = Engine(tiny, EngineOptions(device="cpu", max_context=8))
    with pytest.raises(InputError, match="outside the vocabulary"):
        eng.prefill([1, 2, tiny.config.vocab])
    with pytest.raises(InputError, match="exceeds the context of 8"):
        eng.prefill(list(range(9)))
    with pytest.raises(InputError, match="no tokens"):
        eng.prefill([])
    assert eng.position == 0


def test_declared_launch_counts(tiny) -> None:
    cfg = tiny.config
    fused = Engine(tiny, EngineOptions(device="cpu", fuse_experts=True))
    per_slot = Engine(tiny, EngineOptions(device="cpu", fuse_experts=False))

    experts = ("moe_gate_up", "experts_gate_up", "router_experts_gate_up", "router_experts_ffn",
               "moe_down_accumulate", "experts_down_accumulate")

    def routed(engine: Engine) -> list[str]:  # the expert launches that read the router's ids
        return [t.name for t in engine.graphs[1].tasks if t.kernel in experts
                and t.args[KERNEL_ARGS[t.kernel].index("ids")] is not None]

    # fused decode step: the router, the shared expert and every slot's gate-up and down in one launch (the
    # CPU counts its one call as one; on a GPU router_experts_ffn_launches decides, test_fused_kernels.py)
    assert routed(fused) == ["router_experts_ffn"]
    assert "router_topk" not in [t.name for t in fused.graphs[1].tasks]
    assert len(routed(per_slot)) == 2 * cfg.top_k
    per_layer_diff = per_slot.graphs[1].launch_count - fused.graphs[1].launch_count
    # + the router, the FFN norm's factors (the deferred shared gate-up's), the shared expert's two, - the
    # fused one
    assert per_layer_diff == 2 * cfg.top_k + 3
    assert per_slot.launches_per_token - fused.launches_per_token == cfg.n_layers * per_layer_diff
    # a step of several tokens keeps the two fused launches
    two = Activations(cfg, torch.device("cpu"), max_tokens=2, max_context=8)
    prefill = layer_graph(fused.weights, two, 0, 2)
    assert [t.name for t in prefill.tasks if t.kernel in experts] == ["router_experts_gate_up",
                                                                      "experts_down_accumulate"]
    # whose last layer's down also writes the output norm's factors (xw, x's sums of squares), so the output
    # head computes inv from them and no norm launch comes before it; the one-launch FFN (decode here) and the
    # per-slot tasks leave the norm's factors to output_norm, which the head then scales by
    def logits_tasks(n_tokens: int, fuse_experts: bool) -> list[str]:
        act = one if n_tokens == 1 else two
        graph = logits_graph(fused.weights, act, n_tokens, SamplerConfig(), fuse_experts=fuse_experts)
        return [t.name for t in graph.tasks]

    one = Activations(cfg, torch.device("cpu"), max_tokens=1, max_context=8)
    assert logits_tasks(2, True) == ["output", "argmax_advance"]
    with_norm = ["output_norm", "output", "argmax_advance"]
    assert logits_tasks(2, False) == logits_tasks(1, True) == with_norm


def test_context_overflow_is_a_clear_error(tiny) -> None:
    eng = Engine(tiny, EngineOptions(device="cpu", max_context=8))
    with pytest.raises(InputError, match="exceeds the context of 8"):
        eng.generate(PROMPT, 5)


def test_token_outside_vocabulary_is_rejected(tiny) -> None:
    with pytest.raises(InputError, match="outside the vocabulary"):
        Engine(tiny, EngineOptions(device="cpu")).feed(tiny.config.vocab)


def test_steps_per_graph_below_one_is_a_clear_error(tiny) -> None:
    with pytest.raises(InputError, match="--steps-per-graph"):
        Engine(tiny, EngineOptions(device="cpu", steps_per_graph=0))


@pytest.mark.skipif(GPU, reason="checks the error raised on a machine without a GPU")
def test_cuda_without_gpu_is_a_clear_error(tiny) -> None:
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        Engine(tiny, EngineOptions(device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "per-slot"])
def test_cuda_graph_replay_is_bitwise_eager(tiny, fuse: bool) -> None:
    eager = Engine(tiny, EngineOptions(device="cuda", fuse_experts=fuse))
    graphs = Engine(tiny, EngineOptions(device="cuda", fuse_experts=fuse, cuda_graphs=True))
    rows_e, rows_g = [], []
    ta, _ = eager.generate(PROMPT, 20, on_logits=lambda r: rows_e.append(r.cpu().numpy().copy()))
    tb, _ = graphs.generate(PROMPT, 20, on_logits=lambda r: rows_g.append(r.cpu().numpy().copy()))
    assert graphs._graph_enabled
    assert ta == tb
    assert np.stack(rows_e).tobytes() == np.stack(rows_g).tobytes()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_ffn_one_launch_setting_keeps_the_deferred_graphs(tiny) -> None:
    """With the shared expert's FFN norm deferred (attn_output's factors), the persistent FFN launch, which
    takes h alone, does not apply: choosing it (set_ffn_one_launch) leaves the tiny model's decode graphs
    their 5 launches a layer and their tokens and logits, bit for bit (the persistent launch itself is
    bitwise its two launches: test_fused_kernels)."""
    from tornado_moe import kernels as K

    def run(one_launch: bool) -> tuple[list[int], bytes, int]:
        K.set_ffn_one_launch(one_launch)
        try:
            eng = Engine(tiny, EngineOptions(device="cuda", cuda_graphs=True))
        finally:
            K.set_ffn_one_launch(None)
        rows: list[np.ndarray] = []
        toks, _ = eng.generate(PROMPT, 12, on_logits=lambda r: rows.append(r.cpu().numpy().copy()))
        return toks, np.stack(rows).tobytes(), eng.graphs[1].launch_count

    toks, logits, launches = run(False)  # explicit: the environment may change the default
    toks1, logits1, launches1 = run(True)
    assert toks1 == toks and logits1 == logits
    assert launches1 == launches


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "per-slot"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("route", ["torch", "java"])
def test_profiler_counts_agree_with_declared_launches(tiny, fuse: bool, cuda_graphs: bool, route: str
                                                      ) -> None:
    """torch.profiler sees every kernel of the process, JNI launches included: an independent counter."""
    from torch.profiler import ProfilerActivity, profile

    eng = Engine(tiny, EngineOptions(device="cuda", route=route, fuse_experts=fuse, cuda_graphs=cuda_graphs))
    eng.feed(PROMPT[0])  # eager first step (and graph capture on the next one)
    eng.decode_next()
    torch.cuda.synchronize()
    steps = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.decode_next()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    assert len(kernels) == steps * eng.launches_per_token


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_tiled_weights_are_bitwise_the_gguf_layout(tiny, cuda_graphs: bool) -> None:
    """The tiny model's Q8_0 matrices (rows of 128 and 256 values) are all tiled on CUDA; same bits."""
    from tornado_moe.quant.tiled import Q8_0_TILED

    tiled = Engine(tiny, EngineOptions(device="cuda", cuda_graphs=cuda_graphs))
    gguf_layout = Engine(tiny, EngineOptions(device="cuda", cuda_graphs=cuda_graphs, tile_weights=False))
    q8 = [k for k, w in gguf_layout.weights.layers[0].items() if w is not None and w.qtype == 8]
    assert len(q8) >= 7  # attention q, k, v, o and the expert matrices
    assert all(tiled.weights.layers[0][k].qtype == Q8_0_TILED for k in q8)
    assert (tiled.weights.output.qtype, gguf_layout.weights.output.qtype) == (Q8_0_TILED, 8)
    assert_same_trace(_logits_trace(tiled, PROMPT), _logits_trace(gguf_layout, PROMPT))
