"""The wheel works anywhere: built with `pip wheel --no-deps`, installed with `--target` into a
temporary folder and run from another temporary folder, far from this checkout, it migrates a
store, prints the roofline table, lists the shipped traces and replays one in a bench. The
installed copy's dependencies are this venv's, on PYTHONPATH's
heels; a fresh venv with dependencies from PyPI is the same check done by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from engine.store import head_revision

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# What the build reads. The build runs on a copy, so stale build/ output in the checkout never
# slips into the wheel and the checkout is left as it was.
SOURCES = ("pyproject.toml", "README.md", "engine", "console")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    # No build isolation: the venv's pinned setuptools builds it, with no download.
    _pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dist), str(source))
    (built,) = dist.glob("tokenflow-*.whl")
    return built


@pytest.fixture(scope="module")
def target(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    _pip("install", "--no-deps", "--no-compile", "--target", str(site), str(wheel))
    return site


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "-q", *args], capture_output=True,
                          text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert done.returncode == 0, done.stderr


def _tokenflow(target: Path, cwd: Path, *args: str) -> str:
    """`tokenflow ARGS` as the installed copy runs it, from `cwd`, with only it on the path."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-m", "console.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_wheel_carries_migrations_traces_styles_and_the_kernels(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"engine/store/migrations/env.py", "engine/store/migrations/script.py.mako",
            "engine/store/migrations/versions/0001_initial.py",
            "engine/harness/traces/azure_llm_2023_conv.csv",
            "engine/harness/traces/azure_llm_2023_code.csv",
            "engine/harness/traces/README.md", "engine/kernels/paged_attention.cpp",
            "engine/kernels/layer_ops.cpp", "engine/kernels/cpu_vectors.h",
            "engine/sim/published_gpu_cases.json",
            "engine/sim/published_gpu_requests.json"} <= names
    assert any(n.startswith("console/tui/") and n.endswith(".tcss") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/", "migrations/")) for n in names)


def test_the_installed_copy_is_the_one_that_runs(target: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import engine, console; "
                            "print(engine.__file__); print(console.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert all(Path(line).is_relative_to(target) for line in where.stdout.split())


def test_db_upgrade(target: Path, tmp_path: Path) -> None:
    out = _tokenflow(target, tmp_path, "db", "upgrade", "--db", str(tmp_path / "x.db"))
    assert f"schema at revision {head_revision()} (head)" in out  # every revision shipped


def test_roofline_json(target: Path, tmp_path: Path) -> None:
    report = json.loads(_tokenflow(target, tmp_path, "roofline", "--json"))
    assert report["rows"]


def test_traces(target: Path, tmp_path: Path) -> None:
    out = _tokenflow(target, tmp_path, "traces")
    assert "conv" in out and "code" in out and "CC-BY 4.0" in out


def test_a_simulated_bench_reports_its_nearest_published_cases(target: Path,
                                                               tmp_path: Path) -> None:
    report = json.loads(_tokenflow(
        target, tmp_path, "bench", "--model", "synthetic:8b", "--simulate", "h100",
        "--input-len", "128", "--output-len", "16", "--num-prompts", "8", "--compare",
        "chunked", "--json"))
    nearest = report["runs"]["chunked"]["trust"]["nearest"][0]
    assert nearest["source"] in ("argonne", "lambda") and isinstance(nearest["error"], float)


def test_bench_replays_a_shipped_trace(target: Path, tmp_path: Path) -> None:
    report = json.loads(_tokenflow(
        target, tmp_path, "bench", "--model", "synthetic:tiny", "--workload", "conv",
        "--num-requests", "8", "--compare", "chunked,unchunked", "--json"))
    assert report["workload"]["spec"] == "conv" and report["workload"]["requests"] == 8
    assert set(report["runs"]) == {"chunked", "unchunked"}
    assert all(run["finished"] == 8 for run in report["runs"].values())
