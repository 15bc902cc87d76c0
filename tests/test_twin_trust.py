"""How far a simulated run may be trusted: the published cases nearest it, and their errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.sim.trust import FAR, RunShape, trust


def _cases(tmp_path: Path) -> Path:
    models = {"m8": {"vocab_size": 1000, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}}
    cases = [
        {"id": "near", "source": "s", "gpu": "h100", "model": "m8", "tp": 1, "dtype": "float16",
         "batch": 64, "input": 1000, "output": 200, "conditions": "c", "twin_error": -0.08},
        {"id": "second", "source": "s", "gpu": "h100", "model": "m8", "tp": 1,
         "dtype": "bfloat16", "batch": 16, "input": 1000, "output": 200, "conditions": "c",
         "twin_error": 0.12},
        {"id": "other-gpu", "source": "t", "gpu": "a100", "model": "m8", "tp": 4,
         "dtype": "bfloat16", "batch": 1, "input": 128, "output": 128, "conditions": "c",
         "twin_error": -0.30},
        {"id": "held", "source": "u", "gpu": "l40s", "model": "m8", "tp": 2,
         "dtype": "fp8", "batch": 500, "input": 32000, "output": 4, "conditions": "c",
         "held_back": True, "twin_error": 0.40},
        {"id": "held2", "source": "u", "gpu": "l40s", "model": "m8", "tp": 2,
         "dtype": "fp8", "batch": 500, "input": 16000, "output": 4, "conditions": "c",
         "held_back": True, "twin_error": -0.20},
        {"id": "unpriced", "source": "t", "gpu": "h100", "model": "m8", "tp": 1,
         "dtype": "bfloat16", "batch": 64, "input": 1000, "output": 200, "conditions": "c"},
    ]
    path = tmp_path / "cases.json"
    path.write_text(json.dumps({"models": models, "cases": cases}))
    return path


def test_a_run_near_published_cases_reports_the_nearest_and_their_worst_error(
        tmp_path: Path) -> None:
    params = 6.98e9
    run = RunShape("h100", "bfloat16", params, 1, 60.0, 1100, 180)
    judged = trust(run, _cases(tmp_path))
    assert [n.id for n in judged.nearest] == ["near", "second", "other-gpu"]
    assert judged.nearest[0].error == -0.08 and not judged.far
    assert judged.band == 0.40  # the held-out median (of 0.20 and 0.40: the upper) is the floor
    assert "near (s, distance" in judged.line() and "±40%" in judged.line()


def test_the_band_is_the_worst_of_the_nearest_when_above_the_held_out_median(
        tmp_path: Path) -> None:
    path = _cases(tmp_path)
    data = json.loads(path.read_text())
    data["cases"][2]["twin_error"] = -0.55
    path.write_text(json.dumps(data))
    judged = trust(RunShape("h100", "bfloat16", 6.98e9, 1, 60.0, 1100, 180), path)
    assert judged.band == 0.55


def test_a_shape_far_from_every_case_says_so_and_gets_no_band(tmp_path: Path) -> None:
    run = RunShape("b200", "fp8", 400e9, 8, 500.0, 30000, 4)
    judged = trust(run, _cases(tmp_path))
    assert judged.far and judged.band is None and judged.nearest[0].distance > FAR
    assert judged.line().startswith("far from every published case")
    assert judged.to_dict()["far"] is True


def test_a_simulated_bench_imports_no_torch_no_model_code_and_no_store() -> None:
    code = ("import sys, console.cli.bench, engine.sim.fleet, engine.sim.trust; "
            "print(sorted(m for m in sys.modules if m in ('torch', 'sqlalchemy', 'matplotlib') or "
            "m.startswith(('engine.kernels', 'engine.model.transformer', "
            "'engine.core.model_runner'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent).stdout
    assert out.strip() == "[]"
