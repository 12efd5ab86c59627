"""The README's Python examples run as written (on the CPU; the default model is written into a temporary
cache folder)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_python_examples() -> None:
    blocks = python_blocks()
    assert len(blocks) == 2 and "Engine(" in blocks[0] and "TaskGraph(" in blocks[1]


@pytest.mark.parametrize("index", [0, 1], ids=["engine", "task-graph"])
def test_readme_python_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORNADO_MOE_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # device="auto": the CPU here
    scope: dict = {}
    exec(compile(python_blocks()[index], f"README.md example {index}", "exec"), scope)  # noqa: S102
    if index == 0:
        out = capsys.readouterr().out
        assert "prefill" in out and "decode" in out
    else:
        x, y = scope["x"], scope["y"]
        expected = x / torch.sqrt((x * x).mean(dim=1, keepdim=True) + 1e-6)
        assert torch.allclose(y, expected, rtol=1e-5, atol=1e-6)
