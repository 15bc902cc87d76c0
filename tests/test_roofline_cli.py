"""`tokenflow roofline` prints the seed-003 table by default and rejects bad flags with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from console.cli.main import main
from engine.model.config import preset


def _json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    assert main(["roofline", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_table_is_the_seed_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roofline"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if len(line.split()) == 6 and line.split()[0] in {"128", "486", "2048", "4096"}}
    assert rows["128"][1:] == ["24.2", "memory", "24.2", "773.8", "32"]
    assert rows["486"][1:] == ["24.2", "balanced", "24.2", "217.6", "9"]
    assert rows["2048"][1:] == ["97.1", "compute", "97.1", "194.1", "2"]
    assert rows["4096"][1:] == ["192.6", "compute", "192.6", "192.6", "1"]
    assert "R = F/W = 150.0" in out
    assert "486.1 tokens" in out
    assert "S_cap = 40,960 tokens" in out and "B_max = 20 sequences" in out


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys)
    assert report["balance_chunk"] == pytest.approx(486.14, abs=0.01)
    assert report["machine_balance"] == 150
    assert [row["chunk"] for row in report["rows"]] == [128, 486, 2048, 4096]
    assert set(report["rows"][0]) == {"chunk", "tau_ms", "bound", "tpot_ms", "ttft_ms", "rounds"}
    assert [round(row["ttft_ms"]) for row in report["rows"]] == [774, 218, 194, 193]
    assert report["kv_capacity_tokens"] == 40960
    assert report["max_concurrency"] == 20
    assert report["inputs"]["params"] == 7e9
    assert report["budget_segments"][0]["governing"] == "compute"


def test_flags_change_the_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys, "--decode-seqs", "8", "--chunks", "234", "--prompt", "8000")
    assert report["balance_chunk"] == pytest.approx(234, abs=1)
    assert report["rows"][0]["rounds"] == 35
    gpu = _json(capsys, "--gpu", "H100")
    assert gpu["inputs"]["flops"] == 989e12 and gpu["inputs"]["bandwidth"] == 3.35e12
    explicit = _json(capsys, "--gpu", "h100", "--flops", "500e12")
    assert explicit["inputs"]["flops"] == 500e12
    quant = _json(capsys, "--weight-bits", "4", "--chunks", "128")
    assert quant["inputs"]["weight_bytes"] == 3.5e9
    assert quant["rows"][0]["tau_ms"] == pytest.approx(24.18 - 5.25, abs=0.01)
    hits = _json(capsys, "--hit-rate", "0.5", "--chunks", "486")
    assert hits["rows"][0]["rounds"] == 5


def test_model_presets_and_directories(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    synthetic = _json(capsys, "--model", "synthetic:7b")
    assert synthetic["inputs"]["params"] == preset("7b").num_params(include_embeddings=False)
    assert synthetic["inputs"]["kv_bytes_per_token"] == 524288
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }))
    directory = _json(capsys, "--model", str(tmp_path))
    assert directory["inputs"]["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 2
    # Gemma 3: 22 of 26 layers windowed (512 tokens); their KV reads stop at the window
    gemma = _json(capsys, "--model", "synthetic:gemma3-1b", "--context", "8192")
    assert gemma["inputs"]["sliding_window"] == 512
    assert gemma["inputs"]["windowed_share"] == pytest.approx(22 / 26)
    inputs = gemma["inputs"]
    read = (4 / 26) * 8192 + (22 / 26) * 512
    assert gemma["balance_chunk"] == pytest.approx(
        inputs["flops"] / inputs["bandwidth"]
        * (inputs["weight_bytes"] + 32 * read * inputs["kv_bytes_per_token"])
        / (2 * inputs["params"]) - 32)


@pytest.mark.parametrize(("flags", "message"), [
    (["--bandwidth", "0"], "--bandwidth"),
    (["--flops=-3e12"], "--flops"),
    (["--params", "0"], "--params"),
    (["--gpu", "tpu9"], "unknown GPU"),
    (["--chunks", "128,abc"], "--chunks"),
    (["--chunks", "0"], "--chunks"),
    (["--decode-seqs", "-1"], "--decode-seqs"),
    (["--context", "0"], "--context"),
    (["--hit-rate", "1.5"], "--hit-rate"),
    (["--kv-gib", "0"], "--kv-gib"),
    # finite and bounded: 1e300 GiB made a pool of more tokens than an integer holds
    (["--kv-gib", "1e300"], "--kv-gib: must be in (0, 1048576] GiB"),
    (["--kv-gib", "inf"], "--kv-gib"),
    (["--step-ms", "nan"], "--step-ms: must be in (0, 60000] ms"),
    (["--step-ms", "1e300"], "--step-ms"),
    (["--weight-bits", "0"], "--weight-bits"),
    (["--model", "synthetic:huge"], "unknown synthetic preset"),
    (["--model", "/nonexistent/model"], "config.json"),
])
def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str], flags: list[str],
                          message: str) -> None:
    assert main(["roofline", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_decodes_beyond_b_max_are_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roofline", "--kv-gib", "1"]) == 0  # B_max = 1 sequence, D = 32
    out = capsys.readouterr().out
    assert "kv_capacity                   0" in out
    assert "warning: D = 32 decodes exceed B_max = 1 sequences at S = 2048" in out
    assert "read 0 tokens" in out and "raise --kv-gib" in out
    assert _json(capsys, "--kv-gib", "1")["warnings"]
    assert [w for w in _json(capsys)["warnings"] if "B_max = 20" in w]  # the seed: D 32
    assert _json(capsys, "--decode-seqs", "8")["warnings"] == []
