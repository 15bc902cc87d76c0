"""A calibration says where it came from: measured when, on which host, device and store,
under what load; a copy keeps its origin, and one measured under load is not spread."""

from __future__ import annotations

from pathlib import Path

from engine.store import calibration_history, open_database, save_calibration
from engine.store.calibration import BudgetPoint

QUIET_LOAD = {"contended": False, "others_cpus": 0.05, "steal": 0.0, "own_cpus": 1.9,
              "measured": True}


def provenance(**load: object) -> dict[str, object]:
    return {"measured_at": 1796569200.0, "host": "box-a", "device": "cpu",
            "load": {**QUIET_LOAD, **load}}


def test_a_stored_calibration_names_its_store_and_a_copy_keeps_its_origin(
        tmp_path: Path) -> None:
    first, second = tmp_path / "first.db", tmp_path / "second.db"
    table = [BudgetPoint(16, 0, 0.01)]
    database = open_database(first)
    with database.session() as session:
        save_calibration(session, model="m", device="cpu", table=table, params={},
                         info={"provenance": provenance()}, reason="first calibration")
        (record,) = calibration_history(session, model="m", device="cpu")
    database.close()
    assert str(first) in record.info["provenance"]["store"] and not record.reused
    assert record.provenance_words() == (
        f"measured 2026-12-06 15:00 UTC on box-a (cpu) on a quiet host, stored in "
        f"{record.info['provenance']['store']}")
    copy = open_database(second)
    with copy.session() as session:
        save_calibration(session, model="m", device="cpu", table=table, params={},
                         info=record.info, reason=f"calibration 1 of {first}, reused")
        (copied,) = calibration_history(session, model="m", device="cpu")
    copy.close()
    assert copied.reused and copied.provenance_words() == record.provenance_words()
    busy = provenance(contended=True, others_cpus=1.6)
    assert "while other processes used 1.6 CPUs" in type(record)(
        1, 0.0, "m", "cpu", {"provenance": busy}, {}, []).provenance_words()
    assert type(record)(1, 0.0, "m", "cpu", {}, {}, []).provenance_words() == (
        "where it was measured is not recorded")
