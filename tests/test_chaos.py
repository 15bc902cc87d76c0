"""The chaos suite (protection layer 7): every scenario recovers within its bound, none loses
a request, and `tokenflow chaos --json` reports each recovery time."""

from __future__ import annotations

import json

import pytest

from console.cli.main import main
from engine.harness.chaos import QUICK, ChaosError, run_chaos

IN_PROCESS = ["kv_exhaustion", "bandwidth_spike", "slow_chunks", "locked_database"]


def test_in_process_scenarios_recover_without_loss(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chaos", "--quick", "--json", *(f"--scenario={n}" for n in IN_PROCESS)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["lost"] == 0
    assert [s["name"] for s in report["scenarios"]] == IN_PROCESS
    for scenario in report["scenarios"]:
        assert scenario["passed"] and scenario["lost"] == 0, scenario
        assert 0 <= scenario["recovery_ms"] <= QUICK.bound_s * 1000


@pytest.mark.slow
def test_sigkill_mid_chunk_resumes_without_loss() -> None:
    suite = run_chaos(["sigkill"], quick=True)
    (result,) = suite.scenarios
    assert result.passed and result.lost == 0, result.detail
    assert result.recovery_ms is not None


def test_unknown_scenario_is_refused() -> None:
    with pytest.raises(ChaosError, match="unknown scenario 'nope'"):
        run_chaos(["nope"], quick=True)
