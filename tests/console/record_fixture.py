"""Re-record tests/console/data/session.jsonl from a real embedded engine (tiny model, CPU).

    .venv/bin/python -m tests.console.record_fixture

The live part is real: the mixed workload on synthetic:tiny, its first calibration at start,
snapshots every 0.1 s (latency percentiles, ITL among them), a token budget change and a
slow-query threshold low enough that slow queries are stored. Two more calibration runs and
one drift event are written into the store the ordinary way (save_calibration, a Drift event
on the bus), so the drift screen has a history to draw.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from console.sources.embedded import EmbeddedSource
from console.sources.replay import SessionRecorder
from engine.config import EngineConfig
from engine.events import Drift
from engine.store import BudgetPoint, save_calibration

OUT = Path(__file__).parent / "data" / "session.jsonl"
SNAPSHOTS = 40
INTERVAL_S = 0.1


def record(out: Path = OUT) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(dtype="float32", max_num_batched_tokens=128,
                              slow_query_threshold=1.2)
        source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="mixed",
                                      db=Path(tmp) / "fixture.db", config=config)
        out.unlink(missing_ok=True)  # regenerated: a recorder writes a new file only
        recorder = SessionRecorder(out)
        engine = source.loop.engine
        with source.database.session() as session:
            for run, scale in enumerate((1.0, 1.3)):
                table = [BudgetPoint(tokens, 0, tokens * 2e-5 * scale) for tokens in (16, 64, 256)]
                save_calibration(session, model=engine.config.model,
                                 device=str(engine.runner.device), table=table,
                                 params={"run": run})
        engine.bus.publish(Drift(deviation=0.3, detail="prefill 30% slower than the stored table"))
        for i in range(SNAPSHOTS):
            if i == SNAPSHOTS // 2:
                source.update_config(max_num_batched_tokens=256)
            recorder.snapshot(source.snapshot())
            time.sleep(INTERVAL_S)
        source.loop.pause()
        source.writer.flush(10.0)
        recorder.finish(source)
        source.close()


if __name__ == "__main__":
    record()
    print(f"wrote {OUT}")
