"""`tokenflow calibrate`: time real steps on this device and fit the step-time predictor.

Sweeps prefill chunks × context, decode batches × context and a few mixed steps on the
engine's own model runner, fits the predictor on three quarters of the shapes and reports
its error on the rest. Then it serves a short probe of mixed requests and fits what serving
costs beyond the sweep (engine.calibration.served), which the GPU twin charges. The run, its table
and the predictor go into the store; a table more than 10% off the last stored one for this
model and device is also stored as a drift event.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from console.cli.db import add_db_argument, add_server_name_argument, open_existing_store
from console.cli.engine_flags import (
    DEFAULT_MODEL,
    SLO_FLAGS,
    WATCHED_FLAGS,
    add_engine_flags,
    engine_config,
    engine_flags_given,
)
from console.cli.given_flags import given
from console.errors import UserError
from engine import Engine
from engine.budget.predictor import StepTimePredictor
from engine.calibration.calibrate import (
    CalibrationResult,
    calibrate,
    latest_for,
    save_result,
)
from engine.calibration.drift import drift_event
from engine.calibration.served import PROBE_REQUESTS, QUICK_PROBE_REQUESTS, measure_served
from engine.events import Drift
from engine.store import Database, StoreWriter, open_database
from engine.store.calibration import CalibrationRecord, calibration_history


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("calibrate", help="measure step times and fit the predictor",
                                   description=__doc__.splitlines()[0])
    # a sweep serves no users: no SLO to keep, no live percentiles, no logprobs asked for;
    # --model left unset unless given, so --history lists every model's runs by default
    add_engine_flags(parser, model_default=None, skip=SLO_FLAGS | WATCHED_FLAGS)
    parser.add_argument("--history", action="store_true",
                        help="list the stored calibrations, newest first (--model: of one "
                             "model), with the ids `--simulate calibration:ID` takes; measures "
                             "nothing")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller sweep with 3 timed runs per shape instead of 20, and a "
                        "smaller served probe (seconds on a CPU)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="show a progress bar on stderr (default: on)")
    add_db_argument(parser)
    add_server_name_argument(parser, "this host")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.history:
        return _history(args)
    config = engine_config(args, model=args.model or DEFAULT_MODEL)
    # a bad --db fails before the engine loads
    database = open_database(args.db, server=args.server_name)
    try:
        started = time.perf_counter()
        engine = Engine(config)
        phases = {"engine_start_s": time.perf_counter() - started}
        with _ProgressBar(args.progress is not False) as progress:
            result = calibrate(engine, quick=args.quick, progress=progress)
            phases["sweep_s"] = result.wall_s
            if progress is not None:
                progress(1.0, "serving a probe")
            # the probe's steps are priced by the new fit
            engine.apply_calibration(result.predictor)
            served_at = time.perf_counter()
            served = measure_served(
                engine, requests=QUICK_PROBE_REQUESTS if args.quick else PROBE_REQUESTS)
            phases["served_probe_s"] = time.perf_counter() - served_at
            result = dataclasses.replace(result, served=served)
        if result.contended:
            raise UserError(f"calibration not stored: it was measured while "
                            f"{result.load_words()}, so its step times are partly theirs; "
                            "run it again on a quiet host")
        with database.session() as session:
            previous = latest_for(session, engine)
            drift = (drift_event(StepTimePredictor.from_dict(previous.params), result)
                     if previous is not None else None)
            run_id = save_result(session, result, "tokenflow calibrate")
        if drift is not None:
            _store_event(database, engine, drift)
    finally:
        database.close()
    summary = {**result.to_dict(), "calibration_id": run_id, "db": database.location,
               "previous_id": previous.id if previous else None,
               "drift": drift.to_dict() if drift else None,
               "phases": {k: round(v, 3) for k, v in phases.items()}}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(result, summary)
    return 0


def _history(args: argparse.Namespace) -> int:
    """The stored runs, newest first: what `--simulate calibration:ID` and drift refer to."""
    measuring = engine_flags_given(args, but=("model",))
    measuring += given(args, ("server_name", "progress"), {"progress": "--[no-]progress"})
    if args.quick:
        measuring.append("--quick")
    if measuring:
        raise UserError(f"--history lists stored calibrations; {', '.join(measuring)} shape a "
                        "new one: drop them, or drop --history")
    database = open_existing_store(args.db)  # read-only: listing changes nothing
    try:
        with database.session() as session:
            records = calibration_history(session, model=args.model)
    finally:
        database.close()
    rows = [_history_row(r) for r in records]
    if args.json:
        print(json.dumps({"db": database.location, "calibrations": rows}, indent=2))
        return 0
    if not rows:
        of = f" of {args.model}" if args.model else ""
        print(f"no calibration{of} stored in {database.location}; run `tokenflow calibrate "
              f"--model {args.model or 'MODEL'}` to measure one")
        return 0
    print(f"{'id':>5}  {'measured (UTC)':16}  {'model':24}  {'device':12}  {'dtype':8}  "
          f"{'shapes':>6}  {'held-out':>8}  sweep")
    for row in rows:
        error = row["heldout_median_abs_error"]
        print(f"{row['id']:>5}  {row['measured']:16}  {_cell(row['model'], 24)}  "
              f"{_cell(row['device'], 12)}  {_cell(row['dtype'], 8)}  {row['shapes']:>6}  "
              f"{'-' if error is None else f'{error:.1%}':>8}  "
              f"{'quick' if row['quick'] else 'full'}{', reused' if row['reused'] else ''}")
    print(f"{len(rows)} stored in {database.location}; price a run on one with `tokenflow "
          "bench --simulate calibration:ID --model MODEL`")
    return 0


def _history_row(record: CalibrationRecord) -> dict[str, Any]:
    info = record.info
    error = info.get("heldout_median_abs_error")
    return {"id": record.id, "model": record.model, "device": record.device,
            "dtype": str(info.get("dtype", "?")),
            "measured": time.strftime("%Y-%m-%d %H:%M", time.gmtime(record.created_at)),
            "created_at": record.created_at, "shapes": info.get("points", len(record.table)),
            "heldout_median_abs_error": (error if isinstance(error, int | float)
                                         and math.isfinite(error) else None),
            "quick": bool(info.get("quick")), "reused": record.reused,
            "provenance": record.provenance_words()}


def _cell(text: str, width: int) -> str:
    """`text` in `width` columns, its end kept (a model directory's name is at its end)."""
    return text.ljust(width) if len(text) <= width else "…" + text[-(width - 1):]


class _ProgressBar:
    """A tqdm bar fed by the calibrator's (fraction, note) callback, or nothing."""

    def __init__(self, enabled: bool) -> None:
        self.bar = tqdm(total=100, file=sys.stderr, unit="%", leave=False,
                        bar_format="{desc} {bar} {percentage:3.0f}% {elapsed}<{remaining}",
                        ) if enabled else None

    def __enter__(self) -> Callable[[float, str], None] | None:
        return self.update if self.bar is not None else None

    def update(self, fraction: float, note: str) -> None:
        assert self.bar is not None
        self.bar.set_description_str(f"calibrating: {note}", refresh=False)
        self.bar.update(fraction * 100 - self.bar.n)

    def __exit__(self, *_: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _store_event(database: Database, engine: Engine, event: Drift) -> None:
    """Through the store writer, as a serving engine's drift events are stored."""
    writer = StoreWriter(database, engine.bus)
    engine.bus.publish(event)
    engine.bus.drain()
    writer.close()


def _print_summary(result: CalibrationResult, s: dict[str, Any]) -> None:
    p, kv = result.predictor, result.kv
    phases = s["phases"]
    print(f"{result.model} on {result.device} ({result.dtype}): {len(result.points)} shapes "
          f"in {result.wall_s:.1f} s, run #{s['calibration_id']} stored in {s['db']}")
    print(f"  engine start {phases['engine_start_s']:.1f} s, sweep {phases['sweep_s']:.1f} s, "
          f"served probe {phases['served_probe_s']:.1f} s")
    print(f"  held-out median |error| {result.heldout_median_abs_error:.1%} over "
          f"{len(result.heldout_errors)} shapes (max {max(result.heldout_errors, default=0):.1%})")
    print(f"  predictor: {p.constant_s * 1e3:.2f} ms/step (+{p.multi_token_s * 1e3:.2f} ms past "
          f"one token) + {p.per_token_s * 1e6:.1f} µs/token on max(tokens, {p.token_knee:.1f})"
          f" + {p.per_prefill_chunk_s * 1e3:.2f} ms/chunk + {p.per_decode_seq_s * 1e3:.3f} "
          f"ms/decode + {p.per_prefill_pair_s * 1e9:.2f} ns/prefill pair + "
          f"{p.per_decode_context_s * 1e9:.1f} ns/decode context token")
    print(f"  peaks measured: {result.peaks.flops / 1e9:.1f} GFLOP/s, "
          f"{result.peaks.bandwidth / 1e9:.1f} GB/s; KV pool {kv.blocks}/{kv.total_blocks} "
          f"blocks free = {kv.capacity_tokens} tokens")
    if result.served is not None:
        c = result.served
        print(f"  served: {c.step_s * 1e3:.2f} ms/step + {c.per_decode_s * 1e3:.3f} ms/decode + "
              f"{c.per_prefill_chunk_s * 1e3:.2f} ms/prefill chunk of host time beyond the "
              f"forward pass; steps with a prefill chunk ran {c.prefill_scale:.2f}x their "
              f"sweep price against decode steps ({c.steps} served steps)")
    if s["drift"]:
        print(f"  DRIFT vs run #{s['previous_id']}: {s['drift']['detail']}")
    print(f"  {'kind':8} {'chunk':>5} {'ctx':>5} {'dec':>4} {'dctx':>5} {'ms':>9} "
          f"{'pred ms':>9} {'err':>7} {'GFLOP/s':>8} {'GB/s':>6}")
    for point in result.points:
        q = point.probe
        chunk = f"{q.chunks}x{q.chunk}" if q.chunks > 1 and q.chunk else str(q.chunk)
        print(f"  {q.kind:8} {chunk:>5} {q.chunk_context:5} {q.decode_seqs:4} "
              f"{q.decode_context:5} {point.median_s * 1e3:9.2f} {point.predicted_s * 1e3:9.2f} "
              f"{point.relative_error:+7.1%} {point.achieved_flops / 1e9:8.2f} "
              f"{point.achieved_bandwidth / 1e9:6.2f}{'  held out' if point.held_out else ''}")
