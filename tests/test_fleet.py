"""Two `tokenflow serve` processes share one PostgreSQL store under load through SIGKILLs
and restarts (tests/fleet.py; benchmarks/store_fleet_kill.py runs 20 kills)."""

from __future__ import annotations

import pytest

from tests.fleet import listed_servers, soak
from tests.postgres import Cluster


@pytest.mark.slow  # servers killed and restarted, again and again
@pytest.mark.soak
def test_two_servers_write_one_history_through_kills_and_restarts(postgres: Cluster) -> None:
    db = postgres.create_database()
    report = soak(db, kills=2)
    assert "'box-a' already writes into" in report.refusal and "pid " in report.refusal
    assert "--server-name" in report.refusal
    assert report.unfinished == [], report.states  # every accepted request ended
    # none run again (or missing from the journal) after its client had its answer
    assert report.rerun_after_answer == [], {k: report.answered[k]
                                             for k in report.rerun_after_answer}
    assert len(report.answered) >= 6
    assert {"box-a", "box-b"} <= listed_servers(db)  # one listing, both servers
