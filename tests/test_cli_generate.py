"""``tornado-moe generate`` and the llama-tornado launcher, run in-process (fast) and once as subprocesses.

What the CLI prints is checked against the engine driven directly (the tokens a CLI run prints must be the
engine's tokens; a chat turn that reuses the KV cache must answer exactly as a fresh engine fed the whole
conversation), and every bad input must end as ONE stderr line ``tornado-moe generate: error: ...``, exit
status 2 and no traceback.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _gguf_fixtures import qwen2moe_spec, write_gguf_file

from tornado_moe.cli.main import main
from tornado_moe.engine import Engine, EngineOptions, SamplerConfig
from tornado_moe.model.gguf_model import load_model
from tornado_moe.model.tokenizer import CHATML_TEMPLATE, Tokenizer
from tornado_moe.quant.formats import QuantType

REPO = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^prompt tokens: (\d+), generated tokens: (\d+), prefill: [\d.]+ tok/s, "
                     r"decode: [\d.]+ tok/s$")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(err: str, cmd: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"tornado-moe {cmd}: error: "), lines[0]
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def summary(err: str) -> tuple[int, int]:
    last = err.strip().splitlines()[-1]
    m = SUMMARY.match(last)
    assert m, f"last stderr line is not the summary: {last!r}"
    return int(m.group(1)), int(m.group(2))


# ---- a tiny model WITH a tokenizer (byte-level BPE, ChatML template), written here -----------------------

def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable-character table (the standard byte-level BPE alphabet), spelled out."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens = _byte_chars() + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * 258 + [3, 3, 3]
    keys, tensors = qwen2moe_spec(vocab=len(tokens), hidden=64, seed=5, weight_type=QuantType.Q8_0)
    keys.update({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t", "h e"],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    })
    return write_gguf_file(tmp_path_factory.mktemp("text") / "text.gguf", "qwen2moe", keys, tensors)


PROMPT_IDS = [5, 17, 300, 42]


# ---- token-id model --------------------------------------------------------------------------------------

def test_generate_prints_the_engines_tokens_and_a_summary(tiny_model_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_path), "--device", "cpu",
                           "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "-n", "7")
    assert rc == 0, err
    expected, _ = Engine(load_model(tiny_model_path), EngineOptions(device="cpu")).generate(PROMPT_IDS, 7)
    assert [int(t) for t in out.split()] == expected
    assert summary(err) == (len(PROMPT_IDS), 7)


def test_sampled_output_depends_only_on_the_seed(tiny_model_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--model", str(tiny_model_path), "--device", "cpu", "--prompt-ids", "1 2 3",
            "-n", "10", "--temperature", "0.9", "--top-k", "50", "--top-p", "0.9"]
    a = run_cli(capsys, *args, "--seed", "11")[1]
    b = run_cli(capsys, *args, "--seed", "11")[1]
    sampler = SamplerConfig(temperature=0.9, top_p=0.9, top_k=50, seed=11)
    expected, _ = Engine(load_model(tiny_model_path), EngineOptions(device="cpu", sampler=sampler)).generate(
        [1, 2, 3], 10)
    assert a == b and [int(t) for t in a.split()] == expected


def test_no_stream_echo_and_per_slot(tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--model", str(tiny_model_path), "--device", "cpu", "--prompt-ids", "9,8,7",
            "-n", "5"]
    streamed = run_cli(capsys, *base)[1]
    rc, whole, _ = run_cli(capsys, *base, "--no-stream", "--per-slot")
    assert rc == 0 and whole == streamed  # per-slot experts are bitwise identical to fused ones
    rc, echoed, _ = run_cli(capsys, *base, "--echo")
    assert rc == 0 and echoed.startswith("9 8 7") and echoed.split()[3:] == streamed.split()


def test_max_tokens_is_clamped_to_the_context(tiny_model_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_path), "--device", "cpu",
                           "--prompt-ids", "1,2,3", "-n", "50", "--max-context", "8")
    assert rc == 0, err
    assert len(out.split()) == 6  # 8 positions: 3 prompt tokens, then 6 outputs (the last is never fed)
    assert "reduced to 6" in err and summary(err) == (3, 6)


def test_profiler_table_and_dump(tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                 ) -> None:
    rc, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_path), "--device", "cpu",
                         "--prompt-ids", "1,2", "-n", "3", "--profiler", "--profiler-dump-dir",
                         str(tmp_path / "prof"), "--verbose-init")
    assert rc == 0, err
    assert "init: load" in err and "warm-up step" in err and "launches per token" in err
    assert "init: tensor formats: Q8_0 " in err and "F32 " in err
    assert "router_experts_ffn" in err
    summary(err)
    (dump,) = (tmp_path / "prof").glob("*.json")
    report = json.loads(dump.read_text())
    for key in ("command", "date", "git_commit", "device", "gpu_name", "model", "variant", "stats",
                "profiler"):
        assert key in report
    declared = report["launches_per_token_declared"]
    assert declared == Engine(load_model(tiny_model_path), EngineOptions(device="cpu")).launches_per_token
    # the one-token steps: warm-up + 2 decode steps, every task once per step (the prompt is one 2-token
    # step of a plan of its own) ...
    assert report["profiler"]["kernel_count"] == 3 * declared
    assert all(t["launches"] == 3 for t in report["profiler"]["tasks"])
    # ... and the 2 prompt steps too when the prompt goes token by token
    rc, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_path), "--device", "cpu",
                         "--prompt-ids", "1,2", "-n", "3", "--prefill-chunk", "1", "--profiler-dump-dir",
                         str(tmp_path / "prof1.json"))
    assert rc == 0, err
    report = json.loads((tmp_path / "prof1.json").read_text())
    assert report["profiler"]["kernel_count"] == 4 * declared
    assert report["variant"] == "fused/eager/torch/per-token-prefill"


# ---- text model ------------------------------------------------------------------------------------------

def test_text_prompt_and_instruct_echo(text_model: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "generate", "--model", str(text_model), "--device", "cpu", "--prompt",
                           "the hat", "-n", "6", "--echo")
    assert rc == 0, err
    assert out.startswith("the hat")
    (tmp_path / "prompt.txt").write_text("the hat\n")  # the same prompt from a file, its last newline dropped
    rc, from_file, err = run_cli(capsys, "generate", "--model", str(text_model), "--device", "cpu", "-f",
                                 str(tmp_path / "prompt.txt"), "-n", "6", "--echo")
    assert rc == 0, err
    assert from_file == out
    model = load_model(text_model)
    tok = Tokenizer.from_metadata(model.metadata)
    ids = tok.encode("the hat")
    expected, _ = Engine(model, EngineOptions(device="cpu")).generate(ids, 6, stop_ids=sorted(tok.eos_ids))
    assert out == "the hat" + tok.decode(expected, skip_special=True) + "\n"

    rc, out, err = run_cli(capsys, "generate", "--model", str(text_model), "--device", "cpu", "--instruct",
                           "-sp", "Be brief.", "--prompt", "hi", "-n", "3", "--echo", "--no-stream")
    assert rc == 0, err
    assert out.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                          "<|im_start|>assistant\n")


def test_sentencepiece_vocabulary_prompts_in_text(spm_vocab: tuple[dict, object], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A model with a SentencePiece vocabulary (as Mixtral's GGUFs have): the prompt text becomes BOS and
    sentencepiece's own ids, the answer is the engine's tokens as text, stopping at </s>."""
    metadata, sp = spm_vocab
    keys, tensors = qwen2moe_spec(vocab=len(metadata["tokenizer.ggml.tokens"]), seed=3)
    keys.update(metadata)
    path = write_gguf_file(tmp_path / "spm.gguf", "qwen2moe", keys, tensors)
    rc, out, err = run_cli(capsys, "generate", "--model", str(path), "--device", "cpu", "--prompt",
                           "the capital of France", "-n", "8")
    assert rc == 0, err
    ids = [1, *sp.encode("the capital of France")]
    assert summary(err)[0] == len(ids)
    expected, _ = Engine(load_model(path), EngineOptions(device="cpu")).generate(ids, 8, stop_ids=[2])
    assert out == Tokenizer.from_metadata(metadata).decode(expected, skip_special=True) + "\n"


def test_chat_template_by_name_or_file(spm_vocab: tuple[dict, object], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """--chat-template replaces the file's template (here the file has none) by a built-in name or a Jinja
    file, and implies --instruct; the template's <s> is the BOS, not a second one."""
    metadata, sp = spm_vocab
    keys, tensors = qwen2moe_spec(vocab=len(metadata["tokenizer.ggml.tokens"]), seed=3)
    keys.update(metadata)
    path = write_gguf_file(tmp_path / "spm.gguf", "qwen2moe", keys, tensors)
    base = ["generate", "--model", str(path), "--device", "cpu", "--prompt", "hi", "-n", "2", "--no-stream"]
    rc, out, err = run_cli(capsys, *base, "--chat-template", "mistral", "--echo")
    assert rc == 0, err
    assert out.startswith("<s> [INST] hi [/INST]")  # echo decodes the ids: the space the prefix gave
    assert summary(err)[0] == 1 + len(sp.encode("[INST] hi [/INST]"))
    (tmp_path / "t.jinja").write_text("{{ bos_token }}Q: {{ messages[-1]['content'] }} A:")
    rc, out, err = run_cli(capsys, *base, "--chat-template", str(tmp_path / "t.jinja"), "--echo")
    assert rc == 0, err
    assert out.startswith("<s> Q: hi A:")
    rc, _, err = run_cli(capsys, *base, "--chat-template", "vicuna")
    assert rc == 2
    assert_one_error_line(err, "generate", "--chat-template vicuna", "chatml, llama2, mistral")


def test_interactive_chat_reuses_the_cache_and_answers_like_a_fresh_engine(
        text_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat\n\nhello there\n/exit\nnever read\n"))
    rc, out, err = run_cli(capsys, "generate", "--model", str(text_model), "--device", "cpu", "-i",
                           "-sp", "You are a test.", "-n", "5")
    assert rc == 0, err
    # Independent transcript: each turn from a fresh engine fed the whole conversation.
    model = load_model(text_model)
    tok = Tokenizer.from_metadata(model.metadata)
    stop = sorted(tok.eos_ids)
    msgs = [{"role": "system", "content": "You are a test."}]
    prompts, replies = [], []
    for user in ("the cat", "hello there"):
        msgs.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
        reply, _ = Engine(model, EngineOptions(device="cpu")).generate(ids, 5, stop_ids=stop)
        prompts.append(ids)
        replies.append(reply)
        msgs.append({"role": "assistant", "content": tok.decode(reply, skip_special=True)})
    texts = [m["content"] for m in msgs if m["role"] == "assistant"]
    # The empty line only re-prompts; /exit ends the loop before the last line is read.
    assert out == f"> {texts[0]}\n> > {texts[1]}\n> "
    # Turn 2 feeds only what extends the cached tokens (turn 1's prompt and reply), when it does extend them.
    cached = prompts[0] + replies[0][:-1]
    extends = prompts[1][:len(cached)] == cached
    fed = len(prompts[0]) + len(prompts[1]) - (len(cached) if extends else 0)
    assert summary(err) == (fed, len(replies[0]) + len(replies[1]))


# ---- errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [
    "missing", "garbage", "directory", "too_long", "text_on_ids_model", "graphs_on_cpu", "interactive_ids",
    "prompt_and_ids", "file_and_prompt", "missing_file", "bad_ids", "id_out_of_vocab", "temperature", "top_p",
])
def test_bad_input_is_one_error_line(case: str, tiny_model_path: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    tiny = str(tiny_model_path)
    argv, fragments = {
        "missing": (["--model", str(tmp_path / "nope.gguf"), "--prompt-ids", "1"], ["nope.gguf"]),
        "garbage": (["--model", str(garbage), "--prompt-ids", "1"], ["garbage.gguf", "GGUF"]),
        "directory": (["--model", str(tmp_path), "--prompt-ids", "1"], [str(tmp_path)]),
        "too_long": (["--model", tiny, "--prompt-ids", ",".join(["1"] * 20), "--max-context", "16"],
                     ["20 tokens", "16"]),
        "text_on_ids_model": (["--model", tiny, "--prompt", "hello"], ["no tokenizer", "--prompt-ids"]),
        "graphs_on_cpu": (["--model", tiny, "--prompt-ids", "1", "--cuda-graphs", "--device", "cpu"],
                          ["--cuda-graphs"]),
        "interactive_ids": (["--model", tiny, "--prompt-ids", "1", "-i"], ["--interactive", "--prompt-ids"]),
        "prompt_and_ids": (["--model", tiny, "--prompt-ids", "1", "--prompt", "x"], ["--prompt"]),
        "file_and_prompt": (["--model", tiny, "--file", str(tmp_path / "p.txt"), "--prompt", "x"],
                            ["--prompt and --file"]),
        "missing_file": (["--model", tiny, "--file", str(tmp_path / "none.txt")],
                         ["none.txt", "cannot read"]),
        "bad_ids": (["--model", tiny, "--prompt-ids", "1,x"], ["'x'"]),
        "id_out_of_vocab": (["--model", tiny, "--prompt-ids", "1,512"], ["512"]),
        "temperature": (["--model", tiny, "--prompt-ids", "1", "--temperature", "-1"], ["--temperature"]),
        "top_p": (["--model", tiny, "--prompt-ids", "1", "--top-p", "0"], ["--top-p"]),
    }[case]
    rc, out, err = run_cli(capsys, "generate", "--device", "cpu", *argv)
    assert rc == 2
    assert_one_error_line(err, "generate", *fragments)


def test_an_unsupported_tokenizer_still_generates_from_token_ids(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A file whose tokenizer is not supported (a WordPiece vocabulary, say) runs from --prompt-ids: one line
    says why the answer comes as token ids, generation stops at the file's end-of-sequence id; text prompts
    end in one error line."""
    keys, tensors = qwen2moe_spec(seed=7)
    prompt = [5, 17, 30, 42]
    greedy, _ = Engine(load_model(write_gguf_file(tmp_path / "plain.gguf", "qwen2moe", keys, tensors)),
                       EngineOptions(device="cpu")).generate(prompt, 6)
    eos = greedy[3]  # the file's end of sequence: the fourth greedy token
    keys.update({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": [f"t{i}" for i in range(80)],
                 "tokenizer.ggml.eos_token_id": eos})
    spm = write_gguf_file(tmp_path / "spm.gguf", "qwen2moe", keys, tensors)
    rc, out, err = run_cli(capsys, "generate", "--model", str(spm), "--device", "cpu",
                           "--prompt-ids", ",".join(map(str, prompt)), "-n", "6")
    assert rc == 0, err
    assert [int(t) for t in out.split()] == greedy[:greedy.index(eos) + 1]
    assert "tokenizer model 'bert' is not supported" in err and "printed as token ids" in err
    assert "--prompt-ids" not in err.split("printed as token ids")[0]
    rc, _, err = run_cli(capsys, "generate", "--model", str(spm), "--device", "cpu", "--prompt", "hello")
    assert rc == 2
    assert_one_error_line(err, "generate", "'bert' is not supported", "--prompt-ids")


def test_text_only_flags_on_an_ids_model_name_the_flag(tiny_model_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_path), "--device", "cpu", "--instruct")
    assert rc == 2
    assert_one_error_line(err, "generate", "no tokenizer")


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--prompt", "--prompt-ids", "--system-prompt", "--max-tokens", "--temperature",
                 "--top-p", "--top-k", "--seed", "--stream", "--no-stream", "--echo", "--interactive",
                 "--instruct", "--device", "--route", "--cuda-graphs", "--per-slot", "--profiler",
                 "--profiler-dump-dir", "--verbose-init", "--max-context"):
        assert flag in out, flag


# ---- subprocesses: the console entry point and the llama-tornado launcher --------------------------------

def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def test_console_entry_point(tiny_model_path: Path) -> None:
    """The installed ``tornado-moe`` script when present, else the same ``main`` pyproject points it to."""
    tomllib = pytest.importorskip("tomllib")
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["tornado-moe"]
    assert target == "tornado_moe.cli.main:main"
    script = Path(sys.executable).parent / "tornado-moe"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "tornado_moe.cli.main"]
    ok = subprocess.run([*cmd, "generate", "--model", str(tiny_model_path), "--device", "cpu",
                         "--prompt-ids", "1,2,3", "-n", "3"],
                        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert len(ok.stdout.split()) == 3 and SUMMARY.match(ok.stderr.strip().splitlines()[-1])
    bad = subprocess.run([*cmd, "generate", "--model", "/nonexistent/m.gguf", "--prompt-ids", "1"],
                         capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    assert bad.returncode == 2
    assert_one_error_line(bad.stderr, "generate", "/nonexistent/m.gguf")


def test_llama_tornado_translates_its_flags(text_model: Path) -> None:
    launcher = [sys.executable, str(REPO / "scripts" / "llama-tornado")]
    help_text = subprocess.run([*launcher, "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ("--model", "--prompt", "--system-prompt", "--temperature", "--top-p", "--seed",
                 "--max-tokens", "--stream", "--echo", "--interactive", "--instruct", "--gpu", "--profiler",
                 "--profiler-dump-dir", "--verbose-init", "--route", "--cuda-graphs", "--steps-per-graph",
                 "--prefill-chunk", "--per-slot"):
        assert flag in help_text, flag
    shown = subprocess.run([*launcher, "--model", "m.gguf", "--gpu", "-n", "9", "--stream", "false", "--echo",
                            "true", "--instruct", "-sp", "sys", "--prompt", "hi", "--steps-per-graph", "4",
                            "--prefill-chunk", "32", "--show-command"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    words = shown.stdout.split()
    assert words[:4] == [sys.executable, "-m", "tornado_moe.cli.main", "generate"]
    for pair in (("--device", "cuda"), ("--max-tokens", "9"), ("--model", "m.gguf"),
                 ("--system-prompt", "sys"), ("--steps-per-graph", "4"), ("--prefill-chunk", "32")):
        assert words[words.index(pair[0]) + 1] == pair[1]
    assert {"--no-stream", "--echo", "--instruct"} <= set(words)

    run = subprocess.run([*launcher, "--model", str(text_model), "--prompt", "the", "-n", "4", "--echo",
                          "true", "--stream", "false"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("the") and SUMMARY.match(run.stderr.strip().splitlines()[-1])
