"""Files the user did not name: `run --output` never appends without --resume, never follows
a symlink and never names the store; each refusal comes before anything is written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from console.cli.main import main
from console.cli.run import _OutputSink
from console.errors import UserError
from engine.store import open_database

RUN = ["run", "--model", "synthetic:tiny", "--device", "cpu", "--workload", "mixed",
       "--num-requests", "2"]


def test_an_existing_output_is_refused_without_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output, db = tmp_path / "out.jsonl", tmp_path / "j.db"
    output.write_bytes(b'{"id": "mine"}\nmy notes, no newline')
    assert main([*RUN, "--output", str(output), "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "--resume" in err
    assert output.read_bytes() == b'{"id": "mine"}\nmy notes, no newline'
    assert not (tmp_path / "out.jsonl.torn").exists() and not db.exists()


def test_a_symlinked_output_is_never_followed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "precious.txt"
    target.write_bytes(b"keep me")
    link = tmp_path / "out.jsonl"
    link.symlink_to(target)
    for resume in ([], ["--resume"]):
        assert main([*RUN, "--output", str(link), "--db", str(tmp_path / "j.db"),
                     *resume]) == 2
        assert "is a symlink" in capsys.readouterr().err
    assert target.read_bytes() == b"keep me"
    # and should the link appear between the check and the open, O_NOFOLLOW refuses it
    with pytest.raises(UserError, match="cannot open --output"):
        _OutputSink(link, None, resume=True)
    assert target.read_bytes() == b"keep me"


def test_an_output_that_is_the_store_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "s.db"
    open_database(store).close()
    before = store.read_bytes()
    for named in (store, tmp_path / "." / "s.db", tmp_path / "s.db.lock"):
        assert main([*RUN, "--db", str(store), "--output", str(named), "--resume"]) == 2
        assert "is the store" in capsys.readouterr().err
    assert store.read_bytes() == before


def test_an_output_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="not a regular file"):
        _OutputSink(fifo, None, resume=True)
    with pytest.raises(UserError, match="cannot open --output"):  # exists: O_EXCL refuses
        _OutputSink(fifo, None)


def test_an_output_in_a_missing_directory_is_named_before_any_work(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from console.cli.main import main

    missing = tmp_path / "no" / "out.jsonl"
    assert main(["run", "--model", "synthetic:tiny", "--no-db", "--num-requests", "1",
                 "--output", str(missing)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"--output {missing}: no directory {tmp_path / 'no'}; create it first")
    assert main(["slow-queries", "--db", str(tmp_path / "s.db"), "export", "--format", "csv",
                 "--output", str(missing)]) == 2
    assert f"no directory {tmp_path / 'no'}" in capsys.readouterr().err
