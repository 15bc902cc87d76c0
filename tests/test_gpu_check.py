"""benchmarks/gpu_check.py, the script a lent GPU runs first: one JSON line per check as it
ends, to stdout and $OUT/gpu_check.jsonl, each with a threshold and pass; exit 1 on any
failure; --dry-run runs every check's CPU path."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as `python benchmarks/gpu_check.py` runs
    return importlib.import_module("gpu_check")


def _main(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", *args])
    return gpu_check.main()


def _lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_each_line_is_written_as_its_check_ends_and_a_failure_exits_1(
        gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A run stopped at its time limit keeps every line it finished: the second check finds
    the first's line already in the file. A check that raises fails alone; the rest run."""
    out = tmp_path / "gpu_check.jsonl"
    seen: list[list[str]] = []

    def first(s: Any) -> dict[str, Any]:
        return {"figure": 1.0, "threshold": 2.0, "pass": True}

    def second(s: Any) -> dict[str, Any]:
        seen.append([json.loads(line)["check"] for line in out.read_text().splitlines()])
        raise RuntimeError("out of memory")

    monkeypatch.setitem(gpu_check.CHECKS, "first", first)
    monkeypatch.setitem(gpu_check.CHECKS, "second", second)
    monkeypatch.setitem(gpu_check.CHECKS, "third", first)
    code = _main(gpu_check, monkeypatch, "--checks", "first,second,third", "--out",
                 str(tmp_path))
    assert code == 1
    assert seen == [["setup", "first"]]
    printed = _lines(capsys.readouterr().out)
    assert printed == [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["check"] for line in printed] == ["setup", "first", "second", "third"]
    assert printed[2]["pass"] is False and printed[2]["error"] == "RuntimeError: out of memory"
    assert all("seconds" in line for line in printed[1:])


def test_out_defaults_to_the_device_tools_out_folder(
        gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setitem(gpu_check.CHECKS, "first", lambda s: {"threshold": 0, "pass": True})
    assert _main(gpu_check, monkeypatch, "--checks", "first") == 0
    assert [json.loads(line)["check"] for line in
            (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()] == ["setup", "first"]


def test_an_unknown_check_is_refused_naming_the_known_ones(
        gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _main(gpu_check, monkeypatch, "--checks", "exactnes")
    assert "unknown checks ['exactnes']; known: exactness" in capsys.readouterr().err


def test_the_checks_close_their_engines(gpu_check: ModuleType) -> None:
    """Each engine a check makes is closed by _free, so no NVML sampler thread outlives it."""
    setting = gpu_check.Setting("cpu", True, "synthetic:tiny", "synthetic:tiny")
    engine = gpu_check._engine(setting)
    closed: list[bool] = []
    engine.close = lambda: closed.append(True)  # type: ignore[method-assign]
    gpu_check._free()
    assert closed == [True] and not gpu_check._OPEN


@pytest.mark.slow  # every check's CPU path: about a minute on two cores
def test_the_dry_run_passes_every_check_with_a_threshold(
        gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(gpu_check, monkeypatch, "--checks", "all", "--out", str(tmp_path)) == 0
    lines = _lines(capsys.readouterr().out)
    assert [line["check"] for line in lines] == ["setup", *gpu_check.ALL]
    assert all(line["pass"] is True and "threshold" in line for line in lines[1:])


def test_gpu_prepare_carries_the_versions_this_tree_runs() -> None:
    """The GPU machine is offline: scripts/gpu_prepare downloads, for the tree to carry, the
    very versions installed here (pyproject's pins and their locked dependencies)."""
    script = (BENCHMARKS.parent / "scripts" / "gpu_prepare").read_text()
    pins = dict(re.findall(r"\b([a-z][a-z0-9-]*)==([0-9][0-9.]*)", script))
    assert len(pins) >= 10
    assert {name: importlib.metadata.version(name) for name in pins} == pins
