"""Whole models through the engine: float64 reference agreement and the route/fusion bitwise promises.

Covers the architectures the layer builder supports: qwen2moe (tiny synth), llama dense and llama with
Mixtral-style experts (small GGUFs written here), and the embedded default model (real text). Bounds: both
sides dequantize weights exactly; the engine accumulates in float32, so logits stay within 5e-4 relative
(max |diff| / max |ref|) of the float64 reference after 30 layers of the default model, 2e-4 on small ones.
"""

from __future__ import annotations

import pytest
from _gguf_fixtures import llama_spec, qwen2moe_spec, write_gguf_file
from conftest import GPU, device_params
from engine_checks import assert_reference_and_variants_agree, rel_err_vs_reference, trace

from tornado_moe.engine import Engine, EngineOptions
from tornado_moe.model.gguf_model import GGUFModel, load_model
from tornado_moe.model.tokenizer import Tokenizer

IDS = [5, 17, 42, 3, 60, 11]


@pytest.fixture(scope="module")
def default_model(default_model_file) -> GGUFModel:
    return load_model(default_model_file)


@pytest.mark.parametrize("experts", [0, 4], ids=["llama-dense", "llama-mixtral"])
def test_llama_layers_match_the_reference(tmp_path, experts: int) -> None:
    keys, tensors = llama_spec(n_exp=experts, top_k=2 if experts else 0, ffn=64, tied=False)
    model = load_model(write_gguf_file(tmp_path / "llama.gguf", "llama", keys, tensors))
    assert rel_err_vs_reference(model, IDS) < 2e-4


@pytest.mark.parametrize("experts", [0, 4], ids=["llama-dense", "llama-mixtral"])
def test_llama_batched_prefill_is_token_by_token(tmp_path, experts: int) -> None:
    """The other layer shapes (a dense FFN, experts without a shared one, interleaved RoPE, no qkv bias): the
    prompt in one step gives bitwise the tokens and logits of feeding it token by token."""
    keys, tensors = llama_spec(n_exp=experts, top_k=2 if experts else 0, ffn=64, tied=False)
    model = load_model(write_gguf_file(tmp_path / "llama.gguf", "llama", keys, tensors))
    by_token, batched = (trace(Engine(model, EngineOptions(device="cpu", prefill_chunk=n)), IDS, 4)
                         for n in (1, 4))
    assert by_token == batched


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q5_0", "Q5_1",
                                   "IQ4_NL"])
def test_k_quant_models_match_the_reference_and_keep_every_promise(tmp_path, device: str, qtype: str) -> None:
    """The tiny qwen2moe in llama.cpp's K and IQ4 types (expert down rows of 128 values in the type's
    fallback, as llama.cpp stores them: the shared and routed downs then differ in format and run as two
    launches): logits within float32 rounding of the float64 reference; fused == per-slot and the prompt in
    one step == token by token, bit for bit."""
    from tornado_moe.synth.random_model import PRESETS, write_random_model

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_random_model(path, PRESETS["tiny"].with_overrides(qtype=qtype), seed=3, progress=False)
    assert_reference_and_variants_agree(load_model(path), device, IDS)


@pytest.mark.parametrize("device", device_params())
def test_a_q4_k_m_style_mix_of_formats(tmp_path, device: str) -> None:
    """Formats mixed per tensor as llama.cpp's Q4_K_M leaves a Qwen1.5-MoE: Q4_K matrices, Q6_K for attn_v in
    one layer, the shared down and the output, the expert downs (rows of 128 values) in Q5_0. The layer graphs
    then take the unfused qkv (q, k, v in two formats) and two down launches."""
    from tornado_moe.quant.formats import QuantType

    keys, tensors = qwen2moe_spec(hidden=256, n_heads=4, n_kv=2, vocab=96, n_exp=4, top_k=2, expert_ffn=128,
                                  shared_ffn=256)
    six = {"blk.0.attn_v.weight", "blk.0.ffn_down_shexp.weight", "blk.1.ffn_down_shexp.weight",
           "output.weight"}
    for name, value in list(tensors.items()):
        if value.ndim < 2 or name.endswith("ffn_gate_inp.weight"):
            continue
        qt = QuantType.Q6_K if name in six else QuantType.Q5_0 if "ffn_down_exps" in name else QuantType.Q4_K
        tensors[name] = (value, qt)
    model = load_model(write_gguf_file(tmp_path / "q4km.gguf", "qwen2moe", keys, tensors))
    kinds = ("attn_q", "attn_v", "ffn_down_exps", "ffn_down_shexp")
    assert {model.layer(0)[n].qtype.name for n in kinds} == {"Q4_K", "Q6_K", "Q5_0"}
    assert_reference_and_variants_agree(model, device, IDS)


@pytest.mark.parametrize("device", device_params())
def test_long_batched_prompts_twice_on_one_engine(tiny_model_path, device: str) -> None:
    """A 300-token prompt in steps of 128 (attention past 128 positions merges through its scratch, which the
    decode plan shares), then decode steps, twice on one engine: the token-by-token prompt's tokens both
    times, with CUDA graphs where there is a GPU."""
    model = load_model(tiny_model_path)
    prompt = [(7 * i + 3) % 512 for i in range(300)]
    graphs = device == "cuda"
    by_token = Engine(model, EngineOptions(device=device, prefill_chunk=1, cuda_graphs=graphs))
    want, _ = by_token.generate(prompt, 6)
    eng = Engine(model, EngineOptions(device=device, prefill_chunk=128, cuda_graphs=graphs))
    for _ in range(2):
        eng.reset()
        assert eng.generate(prompt, 6)[0] == want


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("preset,expect", [("tiny-qwen3moe", ("qwen3moe", 128, "head", True, 0)),
                                           ("tiny-olmoe", ("olmoe", 64, "full", False, 0))])
def test_tiny_qk_norm_synth_models(tmp_path, device: str, preset: str, expect: tuple) -> None:
    """The synth presets of the qwen3moe layout (heads of 128 over hidden 256, per-head q/k norms, no shared
    expert, renormalised top-k) and of the olmoe layout (q and k each normalised as a whole, no shared expert,
    top-k not renormalised, the routed width only under feed_forward_length) run as the reference does."""
    from tornado_moe.synth.random_model import PRESETS, write_random_model

    model = load_model(write_random_model(tmp_path / "m.gguf", PRESETS[preset], progress=False))
    c = model.config
    assert (c.arch, c.head_dim, c.qk_norm, c.normalize_topk, c.shared_ffn) == expect
    assert_reference_and_variants_agree(model, device, IDS)


def test_default_model_matches_the_reference(default_model: GGUFModel) -> None:
    tokens = Tokenizer.from_metadata(default_model.metadata).encode("The capital of France is")
    assert rel_err_vs_reference(default_model, tokens) < 5e-4


def test_default_model_generates_paris(default_model: GGUFModel) -> None:
    tok = Tokenizer.from_metadata(default_model.metadata)
    prompt = tok.encode("The capital of France is")
    out, logits = trace(Engine(default_model, EngineOptions(device="cpu")), prompt, 3)
    assert tok.decode(out).startswith(" Paris")
    # the prompt went through in one step; token by token gives the same bits
    by_token = Engine(default_model, EngineOptions(device="cpu", prefill_chunk=1))
    assert trace(by_token, prompt, 3) == (out, logits)


ROUTE_CASES = [
    pytest.param("tiny", "cpu", id="tiny-cpu"),
    pytest.param("default", "cpu", id="default-cpu"),
    pytest.param("tiny-q5_k", "cpu", id="tiny-q5_k-cpu"),  # K types and their fallback, mixed per tensor
    pytest.param("tiny-olmoe", "cpu", id="tiny-olmoe-cpu"),  # q/k norm tasks, the unfused qkv path
    pytest.param("tiny", "cuda", id="tiny-cuda", marks=pytest.mark.gpu),
    pytest.param("tiny-q5_k", "cuda", id="tiny-q5_k-cuda", marks=pytest.mark.gpu),
    pytest.param("tiny-olmoe", "cuda", id="tiny-olmoe-cuda", marks=pytest.mark.gpu),
]


@pytest.mark.java
@pytest.mark.parametrize("which,device", ROUTE_CASES)
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "per-slot"])
def test_java_and_torch_routes_are_bitwise_identical(which, device, fuse, tiny_model_path, tmp_path,
                                                     request: pytest.FixtureRequest) -> None:
    if device == "cuda" and not GPU:
        pytest.skip("needs a CUDA GPU")
    if which == "tiny":
        path = tiny_model_path
    elif which in ("tiny-q5_k", "tiny-olmoe"):
        from tornado_moe.synth.random_model import PRESETS, write_random_model

        spec = PRESETS["tiny"].with_overrides(qtype="Q5_K") if which == "tiny-q5_k" else PRESETS[which]
        path = write_random_model(tmp_path / f"{which}.gguf", spec, progress=False)
    else:  # the default model only where a case uses it: its source package need not exist on a GPU machine
        path = request.getfixturevalue("default_model_file")
    model = load_model(path)
    n_new = 4 if which == "default" else 10
    graphs = device == "cuda"
    runs = {}
    for route in ("torch", "java"):
        opts = EngineOptions(device=device, route=route, fuse_experts=fuse, cuda_graphs=graphs,
                             profiler=not graphs)
        eng = Engine(model, opts)
        runs[route] = (trace(eng, [504, 3575, 282, 4649, 314] if which == "default" else IDS, n_new),
                       eng.plan.profiler_result().launches_by_graph() if not graphs else None)
    assert runs["torch"][0] == runs["java"][0]
    if not graphs:
        # Launch counts per layer graph, as each route's own profiler counted them, are the same.
        assert runs["torch"][1] == runs["java"][1]
        per_layer = {g: n for g, n in runs["torch"][1].items() if g.startswith("layer")}
        assert len(set(per_layer.values())) == 1


@pytest.mark.parametrize("device", device_params())
def test_profiler_counts_one_launch_per_task(tiny_model_path, device: str) -> None:
    model = load_model(tiny_model_path)
    eng = Engine(model, EngineOptions(device=device, profiler=True, prefill_chunk=1))
    eng.generate(IDS[:2], 3)  # the prompt token by token: every step one of the profiled plan
    prof = eng.plan.profiler_result()
    steps = 2 + 3 - 1
    assert prof.kernel_count == steps * eng.launches_per_token
    assert all(r.launches == steps for r in prof.rows)
