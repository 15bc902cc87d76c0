"""Engine output throughput with the console running against headless `tokenflow run`.

Every run builds the same engine and the same workload (all requests at t=0, so the figure is
compute-bound, not arrival-bound). Headless drives it with engine.harness.driver.drive, as
`tokenflow run` does. The console run is `tokenflow-console`'s own set-up (the engine and its
store in a child process) while the Textual app (headless terminal, 120×40) polls and redraws every
pane. The loop run plays the workload on the engine's background thread with no app: what the
console would cost if it shared the engine's process. Prints one JSON object.

    .venv/bin/python benchmarks/console_throughput.py [--model synthetic:small] [--requests 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from pathlib import Path

from console.sources.process import ProcessSource
from console.tui.app import TokenflowApp
from engine import Engine, RequestOutput
from engine.calibration.calibrate import calibrate, save_result
from engine.config import EngineConfig
from engine.harness.driver import drive
from engine.harness.workload import WorkloadRequest, build_workload, default_length_scale
from engine.serve.loop import EngineLoop
from engine.store import open_database


def workload(engine: Engine, spec: str, requests: int) -> list[WorkloadRequest]:
    return build_workload(spec, vocab_size=engine.model_config.vocab_size,
                          max_model_len=engine.max_model_len, num_requests=requests,
                          rate=float("inf"), seed=0,
                          length_scale=default_length_scale(engine.runner.device.type))


def headless(config: EngineConfig, spec: str, requests: int) -> float:
    engine = Engine(config)
    return float(drive(engine, workload(engine, spec, requests)).summary()["output_tok_s"])


def loop_only(config: EngineConfig, spec: str, requests: int) -> float:
    engine = Engine(config)
    items = workload(engine, spec, requests)
    finished = threading.Event()
    loop = EngineLoop(engine).start()
    start = time.monotonic()
    remaining = len(items)

    def count(output: RequestOutput) -> None:
        nonlocal remaining
        if output.finished:
            remaining -= 1
            if remaining == 0:
                finished.set()

    for item in items:
        loop.submit(list(item.prompt_token_ids), item.sampling_params(), tenant=item.tenant,
                    request_id=item.request_id, tag=item.tag, on_output=count)
    finished.wait()
    elapsed = time.monotonic() - start
    loop.stop()
    return engine.metrics.generation_tokens_total / elapsed


def calibrate_into(db: Path, config: EngineConfig) -> None:
    """Store a calibration first, as a console that has run before has one: on an empty
    database the console's drift monitor would recalibrate mid-run, which is not what this
    benchmark measures."""
    database = open_database(db)
    try:
        result = calibrate(Engine(config), quick=True)
        with database.session() as session:
            save_result(session, result, "benchmark set-up")
    finally:
        database.close()


async def with_console(config: EngineConfig, spec: str, requests: int, db: Path) -> float:
    """The console as `tokenflow-console` runs it: the engine in its child process."""
    source = ProcessSource.start(model=config.model, device=config.device, workload=spec,
                                 db=db, num_requests=requests, rate=float("inf"),
                                 repeat=False)
    start = time.monotonic()  # the child has just started playing the workload
    app = TokenflowApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        snapshot = source.snapshot()
        while snapshot.requests_finished_total < requests:
            await pilot.pause(0.1)
            snapshot = source.snapshot()
        elapsed = time.monotonic() - start
    return snapshot.generation_tokens_total / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternate the two runs this many times; the best of each counts")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device=args.device)
    plain: list[float] = []
    loop: list[float] = []
    console: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.db"
        calibrate_into(db, config)
        for _ in range(args.repeats):
            plain.append(headless(config, args.workload, args.requests))
            loop.append(loop_only(config, args.workload, args.requests))
            console.append(asyncio.run(with_console(config, args.workload, args.requests, db)))
    result = {
        "model": args.model, "device": args.device, "workload": args.workload,
        "requests": args.requests, "headless_output_tok_s": max(plain),
        "loop_output_tok_s": max(loop), "console_output_tok_s": max(console),
        "ratio": max(console) / max(plain), "ratio_vs_loop": max(console) / max(loop),
        "runs": {"headless": plain, "loop": loop, "console": console},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
