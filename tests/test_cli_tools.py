"""``tornado-moe determinism``, ``profile`` and ``bench``: exit codes, JSON schemas, error lines.

The determinism checker must be able to fail: with ``--vary-seed`` its two sampled runs really differ, and
the step it reports must be the first index where the token lists differ, computed here from two engines
driven directly. Digests are recomputed here from the engine's own tokens and logits rows. Profile launch
counts must equal what the task graphs declare (per-slot: 2 * top_k routed launches per layer; fused: 2),
and its byte counts must match the GGUF tensors' sizes (routed experts: top_k / n_experts of the stack).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import GPU

from tornado_moe.cli.main import SUBCOMMANDS, main
from tornado_moe.engine import Engine, EngineOptions, SamplerConfig
from tornado_moe.model.gguf_model import load_model

PROMPT = "3,1,4,1,5,9"
PROMPT_IDS = [3, 1, 4, 1, 5, 9]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_error_line(err: str, cmd: str, *fragments: str) -> None:
    """One error line, the last one on stderr (progress lines may precede it), and no traceback."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith(f"tornado-moe {cmd}: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    for f in fragments:
        assert f in errors[0], (f, errors[0])


def check_run_info(report: dict) -> None:
    for key, typ in (("command", str), ("date", str), ("git_commit", str), ("device", str), ("gpu_name", str),
                     ("model", str), ("torch_version", str)):
        assert isinstance(report[key], typ), key
    assert report["command"].startswith("tornado-moe ")
    assert report["date"].endswith("Z") and len(report["date"]) == 20
    assert report["git_commit"] == "unknown" or len(report["git_commit"]) == 40


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path):
    return load_model(tiny_model_path)


# ---- determinism ----------------------------------------------------------------------------------------

GREEDY = SamplerConfig()


def _engine_trace(model, n: int, sampler: SamplerConfig = GREEDY, **opts) -> tuple[list[int], str]:
    h = hashlib.sha256()
    tokens, _ = Engine(model, EngineOptions(device="cpu", sampler=sampler, **opts)).generate(
        PROMPT_IDS, n, on_logits=lambda row: h.update(row.cpu().numpy().astype("<f4").tobytes()))
    return tokens, h.hexdigest()


def test_determinism_identical_runs_and_fused_vs_per_slot(tiny_model_path: Path, tiny, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "det.json"
    rc, out, err = run_cli(capsys, "determinism", "--model", str(tiny_model_path), "--device", "cpu",
                           "--runs", "2", "-n", "6", "--prompt-ids", PROMPT, "--compare", "fused,per-slot",
                           "--json", str(out_json))
    assert rc == 0, err
    assert "identical" in out
    report = json.loads(out_json.read_text())
    check_run_info(report)
    assert report["identical"] is True and report["divergence"] is None and report["mismatches"] == []
    assert report["variants"] == ["fused/eager/torch", "per-slot/eager/torch"]
    assert [(r["variant"], r["run"]) for r in report["runs"]] == [
        ("fused/eager/torch", 0), ("fused/eager/torch", 1), ("per-slot/eager/torch", 0),
        ("per-slot/eager/torch", 1)]
    tokens, logits_sha = _engine_trace(tiny, 6)
    tokens_sha = hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()
    for r in report["runs"]:
        assert set(r) >= {"variant", "run", "tokens_sha256", "logits_sha256", "n_tokens"}
        assert isinstance(r["run"], int) and isinstance(r["n_tokens"], int)
        assert r["n_tokens"] == 6 and r["tokens"] == tokens
        assert r["tokens_sha256"] == tokens_sha and r["logits_sha256"] == logits_sha


def test_determinism_batched_vs_per_token_prefill(tiny_model_path: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The prefill pair is an axis like the others: sampled runs of both agree bit for bit."""
    out_json = tmp_path / "det.json"
    rc, out, err = run_cli(capsys, "determinism", "--model", str(tiny_model_path), "--device", "cpu",
                           "--runs", "2", "-n", "6", "--prompt-ids", PROMPT, "--temperature", "0.8",
                           "--compare", "batched-prefill,per-token-prefill", "--json", str(out_json))
    assert rc == 0, err
    report = json.loads(out_json.read_text())
    assert report["identical"] is True
    assert report["variants"] == ["fused/eager/torch", "fused/eager/torch/per-token-prefill"]


def test_determinism_reports_the_first_diverging_step(tiny_model_path: Path, tiny, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """--vary-seed: run i samples with seed + i. Prefer a seed whose two runs agree for a few steps first."""
    n = 8

    def sampler(seed: int) -> SamplerConfig:
        return SamplerConfig(temperature=0.7, top_p=0.9, top_k=4, seed=seed)

    chosen = None
    for seed in range(40):
        a, _ = _engine_trace(tiny, n, sampler(seed))
        b, _ = _engine_trace(tiny, n, sampler(seed + 1))
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if diff is not None and (chosen is None or diff > chosen[1]):
            chosen = (seed, diff)
        if chosen is not None and chosen[1] >= 2:
            break
    assert chosen is not None, "no seed pair gives different samples: the sampler ignores its seed"
    seed, first_diff = chosen
    out_json = tmp_path / "det.json"
    rc, out, err = run_cli(capsys, "determinism", "--model", str(tiny_model_path), "--device", "cpu",
                           "--runs", "2", "-n", str(n), "--prompt-ids", PROMPT, "--temperature", "0.7",
                           "--top-p", "0.9", "--top-k", "4", "--seed", str(seed), "--vary-seed",
                           "--json", str(out_json))
    assert rc == 1, err
    assert "DIFFERENT" in out
    report = json.loads(out_json.read_text())
    assert report["identical"] is False
    d = report["divergence"]
    assert set(d) >= {"variants", "step", "layer"}
    assert d["step"] == first_diff and report["mismatches"][0]["step"] == first_diff
    assert d["kind"] == "tokens" and d["graph"] == "sampler" and d["layer"] is None
    assert [r["seed"] for r in report["runs"]] == [seed, seed + 1]


def test_determinism_catches_a_pipelined_run_that_differs(tiny_model_path: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run is repeated pipelined (no logits reader): a fault injected into that run's KV cache alone must
    make the command fail and name the pipelined run."""
    original = Engine.generate

    def faulty(self: Engine, *args: object, **kw: object) -> object:
        result = original(self, *args, **kw)
        if kw.get("on_logits") is None:
            self.act.k_cache[0][0, 0] += 1.0
        return result

    monkeypatch.setattr(Engine, "generate", faulty)
    js = tmp_path / "d.json"
    rc, out, _ = run_cli(capsys, "determinism", "--model", str(tiny_model_path), "--device", "cpu", "--runs",
                         "1", "-n", "4", "--prompt-ids", PROMPT, "--json", str(js))
    assert rc == 1
    assert "run pipelined differs from its stepwise run" in out
    report = json.loads(js.read_text())
    assert [m["kind"] for m in report["mismatches"]] == ["pipelined"] and report["divergence"] is None
    run = report["runs"][0]
    assert run["pipelined_tokens_sha256"] == run["tokens_sha256"]
    assert run["pipelined_state_sha256"] != run["state_sha256"]


@pytest.mark.parametrize("case", ["missing", "garbage", "text_prompt", "graphs_on_cpu", "bad_variant",
                                  "too_long"])
def test_determinism_bad_input(case: str, tiny_model_path: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "g.gguf"
    garbage.write_bytes(b"\0" * 1000)
    tiny = str(tiny_model_path)
    argv, frags = {
        "missing": (["--model", str(tmp_path / "none.gguf")], ["none.gguf"]),
        "garbage": (["--model", str(garbage)], ["g.gguf"]),
        "text_prompt": (["--model", tiny, "--prompt", "hello"], ["no tokenizer"]),
        "graphs_on_cpu": (["--model", tiny, "--compare", "graphs,eager"], ["graphs", "cuda"]),
        "bad_variant": (["--model", tiny, "--compare", "fused,turbo"], ["turbo"]),
        "too_long": (["--model", tiny, "--prompt-ids", ",".join(["2"] * 20), "--max-context", "16"],
                     ["16"]),
    }[case]
    rc, _, err = run_cli(capsys, "determinism", "--device", "cpu", "--runs", "1", "-n", "2", *argv)
    assert rc == 2
    assert_error_line(err, "determinism", *frags)


@pytest.mark.java
def test_determinism_torch_vs_java_route(tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tornado_moe.routes.java_route")
    rc, out, err = run_cli(capsys, "determinism", "--model", str(tiny_model_path), "--device", "cpu",
                           "--runs", "1", "-n", "4", "--prompt-ids", PROMPT, "--compare", "torch,java")
    assert rc == 0, err + out


# ---- profile --------------------------------------------------------------------------------------------

def test_profile_launch_counts_bytes_json_and_png(tiny_model_path: Path, tiny, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    js, png = tmp_path / "p.json", tmp_path / "p.png"
    rc, out, err = run_cli(capsys, "profile", "--model", str(tiny_model_path), "--device", "cpu", "-n", "3",
                           "--prompt-ids", "1,2", "--variants", "fused,per-slot", "--repeats", "2",
                           "--json", str(js), "--png", str(png))
    assert rc == 0, err
    assert "router_experts_ffn" in out and "routed_expert_gate_up" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(js.read_text())
    check_run_info(report)
    assert report["copy_bandwidth_gb_s"] > 0
    cfg = tiny.config
    k, E = cfg.top_k, cfg.n_experts
    def nbytes(name: str) -> int:
        return tiny.tensor(f"blk.0.{name}.weight").nbytes

    gate_up = nbytes("ffn_gate_exps") + nbytes("ffn_up_exps")
    down = nbytes("ffn_down_exps")
    sh_gate_up = nbytes("ffn_gate_shexp") + nbytes("ffn_up_shexp")
    sh_gate = nbytes("ffn_gate_inp_shexp")  # read by the shared down, or by the fused router that computes it
    sh_down = nbytes("ffn_down_shexp")
    # the fused attention input reads q, k, v, their F32 biases and the F32 norm weight
    qkv_bytes = sum(nbytes(f"attn_{n}") for n in "qkv") + 4 * cfg.hidden
    qkv_bytes += 4 * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    by_variant = {v["variant"]: v for v in report["variants"]}
    assert set(by_variant) == {"fused/eager/torch", "per-slot/eager/torch"}
    for name, fused in (("fused/eager/torch", True), ("per-slot/eager/torch", False)):
        v = by_variant[name]
        engine = Engine(tiny, EngineOptions(device="cpu", fuse_experts=fused))
        assert v["launches_per_token_declared"] == engine.launches_per_token
        assert v["launches_per_token_measured"] == engine.launches_per_token
        assert v["launch_counts_agree"] is True and v["launch_mismatches"] == []
        assert v["steps"] == 2 + 3 - 1
        routed = 1 if fused else 2 * k
        assert v["routed_launches_per_layer_declared"] == routed
        layers = [g for g in v["graphs"] if g["graph"].startswith("layer")]
        assert len(layers) == cfg.n_layers
        for g, eg in zip(layers, engine.graphs[1:-1], strict=True):
            assert g["launches_declared"] == g["launches_measured"] == eg.launch_count
            assert g["routed_launches_declared"] == routed
        tasks = {(t["graph"], t["task"]): t for t in v["tasks"]}
        assert all(t["launches_measured"] == 1 for t in v["tasks"])
        assert all(isinstance(t["time_us"], float) and t["time_us"] > 0 for t in v["tasks"])
        assert tasks[("layer0", "attn_qkv")]["weight_bytes"] == qkv_bytes
        if fused:  # the router, the shared expert and every slot's gate-up and down: one launch
            router = nbytes("ffn_gate_inp") + 4 * cfg.hidden  # F32 router rows and the F32 ffn_norm
            assert tasks[("layer0", "router_experts_ffn")]["weight_bytes"] == pytest.approx(
                router + sh_gate + sh_gate_up + gate_up * k / E + sh_down + down * k / E)
        else:
            assert tasks[("layer0", "shared_expert_gate_up")]["weight_bytes"] == sh_gate_up
            for s in range(k):
                assert tasks[("layer0", f"routed_expert_gate_up_{s}")]["weight_bytes"] == pytest.approx(
                    gate_up / E)
        assert all(r["chain_gb_s"] is None and r["chain_fraction_of_copy_bandwidth"] is None
                   for r in v["tasks"] + v["by_kind"])  # chain times are the GPU trace's
        kinds = {b["kind"] for b in v["by_kind"]}
        assert ("router_experts_ffn" in kinds) == fused
        assert ("routed_expert_gate_up" in kinds) != fused
        target = v["bandwidth_target"]  # the defaults: 70% from 10 MB a launch, above every tiny launch
        assert target["fraction"] == 0.7 and target["min_bytes_per_launch"] == 10e6
        assert target["judged"] is False and target["kinds"] == [] and target["all_meet"] is None
    assert "not judged" not in out and "against 70% of copy by chain time: none" in out


@pytest.mark.parametrize("argv,frags", [
    (["--variants", "graphs"], ["graphs", "cuda"]), (["--variants", "fused,bogus"], ["bogus"]),
    (["--check-bandwidth"], ["--check-bandwidth", "CUDA"]),
])
def test_profile_bad_input(argv: list[str], frags: list[str], tiny_model_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "profile", "--model", str(tiny_model_path), "--device", "cpu", *argv)
    assert rc == 2
    assert_error_line(err, "profile", *frags)


@pytest.mark.parametrize("argv,frags", [
    (["--bandwidth-target", "101"], ["--bandwidth-target", "percentage", "101"]),
    (["--bandwidth-target", "nan"], ["--bandwidth-target", "percentage", "nan"]),
    (["--large-mb", "-1"], ["--large-mb", ">= 0"]), (["--large-mb", "inf"], ["--large-mb", "finite"]),
    (["--large-mb", "ten"], ["--large-mb", "'ten'"]),
])
def test_profile_refuses_bad_targets(argv: list[str], frags: list[str], tiny_model_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as bad:  # argparse refuses them before anything loads
        run_cli(capsys, "profile", "--model", str(tiny_model_path), "--device", "cpu", *argv)
    err = capsys.readouterr().err
    assert bad.value.code == 2 and all(f in err for f in frags), err


def _kind(kind: str, launches: float, mb_per_launch: float, chain_fraction: float | None) -> dict:
    return {"kind": kind, "launches": launches, "bytes": launches * mb_per_launch * 1e6,
            "chain_fraction_of_copy_bandwidth": chain_fraction}


def test_bandwidth_targets_judge_large_launches_by_chain_rate() -> None:
    from tornado_moe.tools.profile import _format_targets, bandwidth_targets, below_bandwidth_target

    # Qwen1.5-MoE-like kinds: the output projection reads 107 MB a token, but 4.5 MB a launch
    by_kind = [_kind("attn_qkv", 24, 13.4, 0.617), _kind("attn_output", 24, 4.48, 0.10),
               _kind("router_experts_gate_up", 24, 49.6, 0.70), _kind("output", 1, 331.2, 0.89),
               _kind("hidden", 24, 12.0, None), _kind("none", 0, 0.0, None)]
    graphs = {"variant": "fused/graphs/torch", "cuda_graphs": True, "chain_us_per_token": 1000.0,
              "by_kind": by_kind}
    t = bandwidth_targets(graphs, 0.7, 10e6)
    assert [(r["kind"], r["meets"]) for r in t["kinds"]] == [
        ("attn_qkv", False), ("router_experts_gate_up", True), ("output", True), ("hidden", None)]
    assert t["kinds"][0]["bytes_per_launch"] == pytest.approx(13.4e6) and t["judged"] is True
    assert t["all_meet"] is False
    assert bandwidth_targets(graphs, 0.6, 10e6)["all_meet"] is True
    lower = bandwidth_targets(graphs, 0.7, 4e6)["kinds"]
    assert [r["kind"] for r in lower][:2] == ["attn_qkv", "attn_output"]
    line = _format_targets(t)
    assert "against 70% of copy" in line and "attn_qkv 13.4 MB 61.7% BELOW" in line
    assert "router_experts_gate_up 49.6 MB 70.0% meets" in line and "hidden 12.0 MB -% no chain time" in line
    eager = {**graphs, "variant": "fused/eager/torch", "cuda_graphs": False}
    e = bandwidth_targets(eager, 0.7, 10e6)  # eager chains wait on the host: listed, not judged
    assert e["judged"] is False and e["all_meet"] is None and all(r["meets"] is None for r in e["kinds"])
    assert "not judged" in _format_targets(e)
    report = {"variants": [{**graphs, "bandwidth_target": t}, {**eager, "bandwidth_target": e}]}
    assert below_bandwidth_target(report) == ["fused/graphs/torch: attn_qkv"]


# ---- bench ----------------------------------------------------------------------------------------------

BENCH_VARIANT_KEYS = {"variant": str, "decode_tok_s_median": float, "decode_tok_s_runs": list,
                      "prefill_tok_s_median": float, "launches_per_token": int, "decode_tok_s_min": float,
                      "decode_tok_s_max": float, "decode_tok_s_stdev": float, "fuse_experts": bool,
                      "cuda_graphs": bool, "route": str, "steps_per_graph": int, "prefill_chunk": int,
                      "decode_bytes_per_token": float, "decode_floor_us_per_token": float,
                      "decode_fraction_of_floor": float}


def bench_report(capsys: pytest.CaptureFixture[str], model: Path, tmp_path: Path, *argv: str
                 ) -> tuple[dict, str]:
    """``tornado-moe bench`` on the CPU with ``argv``: its JSON report and stdout (the run must succeed)."""
    js = tmp_path / "b.json"
    rc, out, err = run_cli(capsys, "bench", "--model", str(model), "--device", "cpu", *argv, "--json",
                           str(js))
    assert rc == 0, err
    return json.loads(js.read_text()), out


def test_bench_json_schema(tiny_model_path: Path, tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                           ) -> None:
    report, out = bench_report(capsys, tiny_model_path, tmp_path, "-n", "4", "--prompt-tokens", "5",
                               "--repeats", "2", "--compare", "fused,per-slot")
    check_run_info(report)
    assert (report["repeats"], report["warmup"]) == (2, 1)
    assert (report["prompt_tokens"], report["max_tokens"]) == (5, 4)
    assert report["tokens_identical_across_variants"] is True
    assert [v["variant"] for v in report["variants"]] == ["fused/eager/torch", "per-slot/eager/torch"]
    for v in report["variants"]:
        for key, typ in BENCH_VARIANT_KEYS.items():
            assert isinstance(v[key], typ), (key, v[key])
        assert len(v["decode_tok_s_runs"]) == 2 and all(x > 0 for x in v["decode_tok_s_runs"])
        assert v["decode_tok_s_min"] <= v["decode_tok_s_median"] <= v["decode_tok_s_max"]
        engine = Engine(tiny, EngineOptions(device="cpu", fuse_experts=v["fuse_experts"]))
        assert v["launches_per_token"] == engine.launches_per_token
        # the floor: the step's bytes at the run's copy bandwidth, and the median decode against it
        assert v["decode_floor_us_per_token"] == pytest.approx(
            v["decode_bytes_per_token"] / (report["copy_bandwidth_gb_s"] * 1e3))
        assert v["decode_fraction_of_floor"] == pytest.approx(
            v["decode_floor_us_per_token"] * v["decode_tok_s_median"] / 1e6)
    assert "decode tok/s" in out and "% floor" in out
    # the step's bytes are profile's: the same plan and byte model, attention's KV rows aside (bench: the mean
    # decode position 5 + 4 / 2; profile, the prompt fed token by token: (steps + 1) / 2 over its 8 steps)
    js = tmp_path / "p.json"
    rc, _, err = run_cli(capsys, "profile", "--model", str(tiny_model_path), "--device", "cpu", "-n", "4",
                         "--prompt-tokens", "5", "--variants", "fused,per-slot", "--repeats", "1", "--json",
                         str(js))
    assert rc == 0, err
    cfg = tiny.config
    kv_row = 2 * 4 * cfg.n_kv_heads * cfg.head_dim  # a K and a V row, float32
    for b, p in zip(report["variants"], json.loads(js.read_text())["variants"], strict=True):
        assert b["variant"] == p["variant"]
        assert b["decode_bytes_per_token"] - p["bytes_per_token"] == pytest.approx(
            cfg.n_layers * kv_row * (7 - 4.5))


def test_bench_compares_batched_and_per_token_prefill(tiny_model_path: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from tornado_moe.cli.common import PREFILL_CHUNK_HELP_DEFAULT
    from tornado_moe.engine.engine import DEFAULT_PREFILL_CHUNK

    assert PREFILL_CHUNK_HELP_DEFAULT == DEFAULT_PREFILL_CHUNK
    report, _ = bench_report(capsys, tiny_model_path, tmp_path, "-n", "3", "--prompt-tokens", "9",
                             "--repeats", "1", "--compare", "per-token-prefill,batched-prefill")
    assert [(v["variant"], v["prefill_chunk"]) for v in report["variants"]] == [
        ("fused/eager/torch", DEFAULT_PREFILL_CHUNK), ("fused/eager/torch/per-token-prefill", 1)]
    assert report["tokens_identical_across_variants"] is True
    assert all(v["prefill_tok_s_median"] > 0 for v in report["variants"])


def test_bench_steps_per_graph_list_runs_each_count(tiny_model_path: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``--steps-per-graph 1,3`` runs the variant once per count, named by it, with the same tokens; the help
    texts state the engine's default."""
    from tornado_moe.cli.common import STEPS_PER_GRAPH_HELP_DEFAULT
    from tornado_moe.engine.engine import DEFAULT_STEPS_PER_GRAPH

    assert STEPS_PER_GRAPH_HELP_DEFAULT == DEFAULT_STEPS_PER_GRAPH
    report, _ = bench_report(capsys, tiny_model_path, tmp_path, "-n", "7", "--prompt-tokens", "3",
                             "--repeats", "1", "--steps-per-graph", "1,3")
    assert [(v["variant"], v["steps_per_graph"]) for v in report["variants"]] == [
        ("fused/eager/torch/1-step", 1), ("fused/eager/torch/3-step", 3)]
    assert report["tokens_identical_across_variants"] is True
    with pytest.raises(SystemExit) as bad:  # argparse refuses it before anything loads
        run_cli(capsys, "bench", "--model", str(tiny_model_path), "--device", "cpu", "--steps-per-graph",
                "2,0")
    err = capsys.readouterr().err
    assert bad.value.code == 2 and "--steps-per-graph" in err and "positive integer" in err


def test_bench_preset_is_written_to_the_cache_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORNADO_MOE_CACHE", str(tmp_path / "cache"))
    args = ["bench", "--preset", "tiny", "--device", "cpu", "-n", "2", "--repeats", "1", "--warmup", "0"]
    rc, _, err = run_cli(capsys, *args)
    assert rc == 0, err
    (cached,) = (tmp_path / "cache").glob("*tiny*.gguf")
    stamp = cached.stat().st_mtime_ns
    assert run_cli(capsys, *args)[0] == 0
    assert cached.stat().st_mtime_ns == stamp


def test_bench_needs_two_tokens(tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "bench", "--model", str(tiny_model_path), "--device", "cpu", "-n", "1")
    assert rc == 2
    assert_error_line(err, "bench", "-n")


# ---- the command itself ---------------------------------------------------------------------------------

def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    top = capsys.readouterr().out
    for cmd in SUBCOMMANDS:
        assert cmd in top
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: tornado-moe {cmd}")
    assert {"generate", "determinism", "profile", "bench", "synth"} <= set(SUBCOMMANDS)


def test_run_info_is_shared_by_every_report(tmp_path: Path) -> None:
    from tornado_moe.tools.run_info import run_info

    info = run_info(["bench", "--json", "a b.json"], "cpu", model=tmp_path / "m.gguf", extra=1)
    assert info["command"] == "tornado-moe bench --json 'a b.json'"
    assert info["gpu_name"] == "cpu" and info["device"] == "cpu" and info["extra"] == 1
    assert info["torch_version"] == torch.__version__


def test_chain_times_split_the_span_by_latest_end() -> None:
    from tornado_moe.tools.profile import chain_times

    # b overlaps a (starts before a ends: PDL), c starts after an idle gap, d ends inside c
    spans = [(0.0, 10.0), (4.0, 15.0), (20.0, 30.0), (21.0, 25.0)]
    assert chain_times(spans) == [10.0, 5.0, 15.0, 0.0]
    assert sum(chain_times(spans)) == 30.0
    assert chain_times([]) == []


def test_step_gaps_measure_idle_time_between_whole_steps() -> None:
    from tornado_moe.tools.profile import step_gaps

    # steps of 2 kernels: step 1 starts 5 after step 0's latest end (its first kernel ended last), step 2
    # starts while step 1 drains (0), a partial step at the end is ignored
    spans = [(0.0, 10.0), (2.0, 8.0), (15.0, 20.0), (21.0, 30.0), (29.0, 35.0), (36.0, 40.0), (50.0, 60.0)]
    assert step_gaps(spans, 2) == [5.0, 0.0]
    assert step_gaps(spans[:2], 2) == [] and step_gaps([], 3) == []


# ---- GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_gpu_profile_torch_profiler_counts_agree_eager_and_graphs(tiny_model_path: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "p.json"
    # every kind judged (from 0 MB a launch) against 0%: --check-bandwidth passes unless a verdict is wrong
    rc, out, err = run_cli(capsys, "profile", "--model", str(tiny_model_path), "--device", "cuda", "-n", "4",
                           "--variants", "fused,per-slot,eager,graphs", "--json", str(js), "--large-mb", "0",
                           "--bandwidth-target", "0", "--check-bandwidth")
    assert rc == 0, out + err
    report = json.loads(js.read_text())
    assert report["gpu_name"] == torch.cuda.get_device_name()
    for v in report["variants"]:
        assert v["launch_counter"].startswith("torch.profiler")
        assert v["kernels_per_traced_step"] == [v["launches_per_token_declared"]] * 3
        assert v["launch_counts_agree"] is True
        assert all(t["kernel_time_us"] and t["kernel_time_us"] > 0 for t in v["tasks"])
        # chain times: one per task, none negative, adding up to the traced steps' span (the traced steps run
        # under torch.profiler, slower on the host than the untraced step_wall_us: no bound against it)
        chains = [t["chain_us"] for t in v["tasks"]]
        assert all(c is not None and c >= 0 for c in chains)
        assert sum(chains) == pytest.approx(v["chain_us_per_token"])
        assert v["chain_us_per_token"] >= max(chains) > 0
        for row in v["tasks"] + v["by_kind"]:  # % chain: the bytes over the chain time, where it is positive
            if row["chain_us"] > 0:
                assert row["chain_gb_s"] == pytest.approx(row["bytes"] / (row["chain_us"] * 1e3))
                assert row["chain_fraction_of_copy_bandwidth"] == pytest.approx(
                    row["chain_gb_s"] / report["copy_bandwidth_gb_s"])
            else:
                assert row["chain_gb_s"] is None and row["chain_fraction_of_copy_bandwidth"] is None
        target = v["bandwidth_target"]
        assert target["judged"] is v["cuda_graphs"] and len(target["kinds"]) == len(v["by_kind"])
        for r, k in zip(target["kinds"], v["by_kind"], strict=True):
            timed = v["cuda_graphs"] and k["chain_fraction_of_copy_bandwidth"] is not None
            assert r["meets"] is (True if timed else None)
        gap = v["step_gap_us"]  # -n 4: 3 decode steps, 2 boundaries
        assert gap["decode_steps"] == 3 and 0 <= gap["median_us"] <= gap["max_us"]
        assert gap["copy_us_per_step"] > 0  # the token read back after each step
        # the period between step starts holds a step's span and the gap after it; the steps of one graph
        # chain under PDL, so the next step's first kernel may start before this step's last one ends and a
        # span may pass the period by that overlap, at most the last kernel's time (argmax_advance's: 44.7
        # against 42.5 us on the tiny model, 1,402.3 against 1,397.9 on the full one, H100, 2026-12-07)
        last = v["tasks"][-1]
        overlap = last["kernel_time_us"] / last["launches_measured"]
        assert 0 < gap["span_median_us"] <= gap["period_median_us"] + overlap


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_gpu_determinism_and_bench_across_graphs(tiny_model_path: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "determinism", "--model", str(tiny_model_path), "--device", "cuda",
                           "--runs", "2", "-n", "8", "--compare", "fused,per-slot,eager,graphs")
    assert rc == 0, out + err
    js = tmp_path / "b.json"
    rc, out, err = run_cli(capsys, "bench", "--model", str(tiny_model_path), "--device", "cuda", "-n", "8",
                           "--repeats", "2", "--compare", "eager,graphs", "--json", str(js))
    assert rc == 0, err
    report = json.loads(js.read_text())
    assert report["tokens_identical_across_variants"] is True
    assert {v["variant"] for v in report["variants"]} == {"fused/eager/torch", "fused/graphs/torch"}
