"""`tokenflow slow-queries list|show|export` and `tokenflow db upgrade|current`."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from console.cli.main import main
from engine.events import EventBus, SlowQuery
from engine.store import StoreWriter, head_revision, open_database

CONFIG = {"max_num_batched_tokens": 512, "chunk_tile": 16}


@pytest.fixture
def db_path(tmp_path: Path) -> str:
    """A store holding four slow queries from two tenants."""
    path = tmp_path / "store.db"
    database = open_database(path)
    bus = EventBus()
    writer = StoreWriter(database, bus)
    for rid, tenant, score, prompt, tag, cached in [
        ("r1", "acme", 1.6, 100, None, 0), ("r2", "acme", 3.2, 4000, "contract", 3072),
        ("r3", "beta", 2.1, 900, "email", 0), ("r4", "beta", 1.9, 50, None, 0),
    ]:
        bus.publish(SlowQuery(
            request_id=rid, tenant=tenant, budget_score=score, prompt_tokens=prompt,
            prefill_s=score * 0.01, budgeted_s=0.01, tag=tag, config=CONFIG, cached_tokens=cached,
            chunks=({"index": 0, "tokens": 64, "duration_s": 0.004, "predicted_s": 0.002},),
        ))
    bus.drain()
    assert writer.close()
    database.close()
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def listed_ids(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines()[1:]]


def test_list_sorts_and_filters(capsys: pytest.CaptureFixture[str], db_path: str) -> None:
    code, out, _ = run(capsys, "slow-queries", "list", "--db", db_path)
    assert code == 0 and out.splitlines()[0].split()[:8] == [
        "ID", "WHEN", "TENANT", "RULES", "N", "FELT", "CAUSE", "SCORE"]
    assert listed_ids(out) == ["2", "3", "4", "1"]  # highest budget_score first
    _, out, _ = run(capsys, "slow-queries", "list", "--db", db_path, "--sort", "prompt")
    assert listed_ids(out) == ["2", "3", "1", "4"]
    _, out, _ = run(capsys, "slow-queries", "list", "--db", db_path, "--tenant", "beta",
                    "--min-score", "2", "--limit", "5")
    assert listed_ids(out) == ["3"] and "email" in out
    _, out, _ = run(capsys, "slow-queries", "list", "--db", db_path, "--limit", "1")
    assert listed_ids(out) == ["2"]


def test_list_marks_resumed_requests_in_its_table_and_json(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A request resumed from the journal after a restart shows the output tokens it had
    (0: it stopped mid-prefill); one never resumed shows "-" and null."""
    path = tmp_path / "resumed.db"
    database = open_database(path)
    bus = EventBus()
    writer = StoreWriter(database, bus)
    for rid, score, resumed in [("fresh", 3.0, None), ("mid-prefill", 2.0, 0),
                                ("decoding", 1.5, 37)]:
        bus.publish(SlowQuery(request_id=rid, tenant="t", budget_score=score, prompt_tokens=64,
                              prefill_s=score * 0.01, budgeted_s=0.01, chunks=(),
                              config=CONFIG, resumed_tokens=resumed))
    bus.drain()
    assert writer.close()
    database.close()

    code, out, _ = run(capsys, "slow-queries", "list", "--db", str(path))
    header, *rows = (line.split() for line in out.splitlines())
    column = header.index("RESUMED") + 1  # WHEN is two words: a date and a time
    assert code == 0 and [(row[-1], row[column]) for row in rows] == [
        ("fresh", "-"), ("mid-prefill", "0"), ("decoding", "37")]

    code, out, err = run(capsys, "slow-queries", "list", "--db", str(path), "--json",
                         "--limit", "2")
    listed = json.loads(out)
    assert code == 0 and err == ""
    assert [(r["request_id"], r["resumed_tokens"]) for r in listed["slow_queries"]] == [
        ("fresh", None), ("mid-prefill", 0)]
    assert listed["next_after"] == listed["slow_queries"][-1]["id"]
    assert listed["quarantined"] == []
    _, out, _ = run(capsys, "slow-queries", "list", "--db", str(path), "--json",
                    "--after", str(listed["next_after"]))
    (last,) = json.loads(out)["slow_queries"]
    assert (last["request_id"], last["resumed_tokens"]) == ("decoding", 37)


def test_list_of_an_empty_store(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    open_database(tmp_path / "new.db").close()
    code, out, _ = run(capsys, "slow-queries", "list", "--db", str(tmp_path / "new.db"))
    assert code == 0 and "no slow queries" in out


def test_show_one_and_a_missing_id(capsys: pytest.CaptureFixture[str], db_path: str) -> None:
    code, out, _ = run(capsys, "slow-queries", "show", "2", "--db", db_path)
    assert code == 0
    assert "request r2" in out and "tenant acme" in out and "tag contract" in out
    assert "budget_score 3.20" in out and "prefill 32.0 ms against a budget of 10.0 ms" in out
    assert "4.0 ms" in out and "duration_s=" not in out  # durations as people read them
    assert "\n4000 prompt tokens, 3072 (77%) found in the prefix cache, never prefilled\n" in out
    assert '"max_num_batched_tokens": 512' in out
    code, _, err = run(capsys, "slow-queries", "show", "99", "--db", db_path)
    assert code == 2 and "no slow query with id 99" in err


def test_export_csv_and_json(capsys: pytest.CaptureFixture[str], db_path: str,
                             tmp_path: Path) -> None:
    code, out, _ = run(capsys, "slow-queries", "export", "--format", "csv", "--db", db_path)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [row["request_id"] for row in rows] == ["r2", "r3", "r4", "r1"]
    assert json.loads(rows[0]["config"]) == CONFIG
    assert json.loads(rows[0]["chunks"])[0]["tokens"] == 64
    assert rows[0]["cached_tokens"] == "3072"

    target = tmp_path / "out.json"
    code, out, _ = run(capsys, "slow-queries", "export", "--format", "json", "--db", db_path,
                       "--tenant", "acme", "--output", str(target))
    records = json.loads(target.read_text())
    assert code == 0 and out == ""
    assert [(r["request_id"], r["budget_score"], r["tag"], r["cached_tokens"])
            for r in records] == [("r2", 3.2, "contract", 3072), ("r1", 1.6, None, 0)]

    code, _, err = run(capsys, "slow-queries", "export", "--format", "json", "--db", db_path,
                       "--output", str(tmp_path / "missing" / "out.json"))
    assert code == 2 and f"no directory {tmp_path / 'missing'}; create it first" in err


def test_bad_limit_and_bad_database(capsys: pytest.CaptureFixture[str], db_path: str,
                                    tmp_path: Path) -> None:
    code, _, err = run(capsys, "slow-queries", "list", "--db", db_path, "--limit", "0")
    assert code == 2 and "--limit" in err
    junk = tmp_path / "junk.db"
    junk.write_text("not a database")
    code, _, err = run(capsys, "slow-queries", "list", "--db", str(junk))
    assert code == 2 and str(junk) in err and "--db" in err
    assert junk.read_text() == "not a database"


def test_db_upgrade_and_current(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = str(tmp_path / "fresh.db")
    code, out, _ = run(capsys, "db", "upgrade", "--db", path)
    assert code == 0 and path in out and head_revision() in out
    code, out, _ = run(capsys, "db", "current", "--db", path)
    assert code == 0 and head_revision() in out and "up to date" in out


def test_db_may_come_before_or_after_the_action(capsys: pytest.CaptureFixture[str],
                                                db_path: str, tmp_path: Path) -> None:
    _, before, _ = run(capsys, "slow-queries", "--db", db_path, "list")
    _, after, _ = run(capsys, "slow-queries", "list", "--db", db_path)
    assert listed_ids(before) == listed_ids(after) == ["2", "3", "4", "1"]
    other = str(tmp_path / "other.db")
    _, out, _ = run(capsys, "slow-queries", "--db", other, "list", "--db", db_path)
    assert listed_ids(out) == ["2", "3", "4", "1"]  # the one nearer the action wins
    code, out, _ = run(capsys, "db", "--db", db_path, "current")
    assert code == 0 and out.startswith(f"{db_path}: schema at revision")


def test_a_reader_that_leaves_the_pipe_early_is_no_error(tmp_path: Path) -> None:
    path = tmp_path / "many.db"
    database = open_database(path)
    bus = EventBus()
    writer = StoreWriter(database, bus)
    for i in range(2000):  # ~180 KB of listing: more than a pipe holds once `head` has left
        bus.publish(SlowQuery(request_id=f"r{i}", tenant="t", budget_score=2.0,
                              prompt_tokens=10, prefill_s=0.02, budgeted_s=0.01, chunks=(),
                              config=CONFIG))
    bus.drain()
    assert writer.close()
    database.close()
    listed = subprocess.run(
        f"{sys.executable} -m console.cli.main slow-queries list --limit 2000 --db {path} "
        "| head -1; "
        "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
        text=True)
    assert listed.stdout.startswith("ID") and listed.stderr == ""
    assert listed.returncode == 141


@pytest.mark.parametrize("argv", [("slow-queries", "list"), ("slow-queries", "show", "1"),
                                  ("slow-queries", "export", "--format", "csv"),
                                  ("db", "current")])
def test_reading_a_store_that_is_not_there_is_refused_and_creates_nothing(
        argv: tuple[str, ...], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    typo = tmp_path / "no-such-dir" / "tokenflw.db"
    code, out, err = run(capsys, *argv, "--db", str(typo))
    assert code == 2 and out == ""
    assert f"{typo}: no such store; check the path" in err
    assert not typo.parent.exists()


# --- bounds, the store never overwritten, safe output -------------------------------------


@pytest.mark.parametrize("argv", [("list", "--limit", "9223372036854775808"),
                                  ("export", "--format", "csv", "--limit", str(2**70)),
                                  ("show", "9223372036854775808"),
                                  ("list", "--min-score", "nan")])
def test_out_of_range_numbers_are_one_line(argv: tuple[str, ...], db_path: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "slow-queries", *argv, "--db", db_path)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm", ".lock"])
def test_export_never_writes_over_the_store(suffix: str, db_path: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    before = Path(db_path).read_bytes()
    target = tmp_path / ".." / tmp_path.name / f"store.db{suffix}"  # another spelling of it
    code, _, err = run(capsys, "slow-queries", "export", "--format", "json", "--db", db_path,
                       "--output", str(target))
    assert code == 2 and "is the store" in err and "choose another --output" in err
    assert Path(db_path).read_bytes() == before


def test_export_output_follows_no_symlink_and_overwrites_only_when_asked(
        db_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    link = tmp_path / "link.json"
    link.symlink_to(precious)
    export = ("slow-queries", "export", "--format", "json", "--db", db_path, "--output")
    code, _, err = run(capsys, *export, str(link))
    assert code == 2 and "is a symlink" in err
    code, _, err = run(capsys, *export, str(link), "--overwrite")
    assert code == 2 and "is a symlink" in err and precious.read_text() == "keep me"
    code, _, err = run(capsys, *export, str(precious))
    assert code == 2 and "exists" in err and "--overwrite" in err
    assert precious.read_text() == "keep me"
    code, _, _ = run(capsys, *export, str(precious), "--overwrite")
    assert code == 0 and isinstance(json.loads(precious.read_text()), list)
    code, _, err = run(capsys, "slow-queries", "export", "--format", "json", "--db", db_path,
                       "--overwrite")
    assert code == 2 and "add --output FILE" in err


def _store_with(path: Path, **fields: str) -> str:
    database = open_database(path)
    bus = EventBus()
    writer = StoreWriter(database, bus)
    bus.publish(SlowQuery(**{"request_id": "r", "tenant": "t", "budget_score": 2.0,
                             "prompt_tokens": 4, "prefill_s": 0.02, "budgeted_s": 0.01,
                             "chunks": (), "config": {}, **fields}))
    bus.drain()
    assert writer.close()
    database.close()
    return str(path)


def test_csv_export_defuses_formulas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = _store_with(tmp_path / "f.db", request_id='=HYPERLINK("http://x","y")', tenant="@t",
                     tag="-2+3")
    code, out, _ = run(capsys, "slow-queries", "export", "--format", "csv", "--db", db)
    (row,) = list(csv.DictReader(io.StringIO(out)))
    assert code == 0
    assert (row["request_id"], row["tenant"], row["tag"]) == (
        '\'=HYPERLINK("http://x","y")', "'@t", "'-2+3")
    assert row["budget_score"] == "2.0"  # numbers stay numbers


def test_ids_are_printed_terminal_safe(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    db = _store_with(tmp_path / "t.db", request_id="evil\x1b]0;pwned\x07\x1b[2J",
                     tenant="t\u202eenant")
    for argv in (("list",), ("show", "1")):
        code, out, _ = run(capsys, "slow-queries", *argv, "--db", db)
        assert code == 0 and "\x1b" not in out and "\u202e" not in out
        assert "evil\\x1b]0;pwned\\x07\\x1b[2J" in out and "t\\u202eenant" in out
