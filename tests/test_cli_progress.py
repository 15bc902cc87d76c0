"""`run` and `bench` progress on stderr: start-up stages, requests done, tok/s and an ETA;
--quiet says nothing."""

from __future__ import annotations

import io

import pytest

from console.cli.main import main
from console.cli.progress import RunProgress
from engine.batch import RequestOutput


def output(rid: str, tokens: int, finished: bool) -> RequestOutput:
    ids = tuple(range(tokens))
    return RequestOutput(request_id=rid, new_token_ids=ids, finished=finished,
                         finish_reason="length" if finished else None,
                         state="FINISHED" if finished else "DECODING")


def test_progress_counts_requests_and_tokens() -> None:
    stream = io.StringIO()
    progress = RunProgress("tokenflow run", 0, stream=stream)
    progress.stage("loading synthetic:tiny")
    progress.start(2)
    progress.on_output(output("a", 3, finished=False))
    progress.on_output(output("a", 1, finished=True))
    progress.on_output(output("b", 4, finished=True))  # the last: always drawn
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[:2] == ["tokenflow run: loading synthetic:tiny",
                         "tokenflow run: serving 2 requests"]
    assert lines[-1].startswith("tokenflow run: 2/2 requests · ") and "ETA 0 s" in lines[-1]
    assert progress.tokens == 8 and "tok/s" in lines[-1]


def test_quiet_progress_writes_nothing() -> None:
    stream = io.StringIO()
    progress = RunProgress("tokenflow bench", 1, quiet=True, stream=stream)
    progress.stage("loading")
    progress.on_output(output("a", 1, finished=True))
    progress.close()
    assert stream.getvalue() == ""


def test_run_says_where_it_is_on_stderr_unless_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["run", "--model", "synthetic:tiny", "--workload", "chat", "--num-requests", "2",
             "--no-db", "--json"]
    assert main(flags) == 0
    err = capsys.readouterr().err
    assert "tokenflow run: loading synthetic:tiny" in err and "2/2 requests" in err
    assert main([*flags, "--quiet"]) == 0
    assert "tokenflow run" not in capsys.readouterr().err
