"""`tokenflow traces` lists the traces shipped in the package, with their source and licence."""

from __future__ import annotations

import json

import pytest

from console.cli.main import main
from engine.harness.trace import SHIPPED_TRACES


def test_table_lists_each_trace_with_source_and_license(capsys: pytest.CaptureFixture[str]):
    assert main(["traces"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]
            if line.split() and line.split()[0] in SHIPPED_TRACES}
    assert rows["conv"][1] == "19366" and rows["code"][1] == "8819"
    assert "Splitwise" in out and "license: CC-BY 4.0" in out


def test_json_has_counts_durations_and_token_stats(capsys: pytest.CaptureFixture[str]):
    assert main(["traces", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["license"] == "CC-BY 4.0"
    by_name = {t["name"]: t for t in report["traces"]}
    assert set(by_name) == set(SHIPPED_TRACES)
    conv = by_name["conv"]
    assert conv["requests"] == 19366 and 50 * 60 < conv["duration_s"] < 60 * 60
    assert set(conv["prompt_tokens"]) == {"p50", "p90", "p99", "max", "mean", "total"}
    assert conv["output_tokens"]["max"] >= conv["output_tokens"]["p99"]
