"""The console's OTLP/HTTP trace receiver (`--otlp-listen HOST:PORT`): a TraceCollector
(engine.serve.otlp) behind a small HTTP server on its own thread, scoring each request
against the calibration stored for `--roofline-model` on `--gpu`, else against its roofline.

Exporters must send the receiver's bearer token (console.cli.otlp_flags) unless the receiver
was started without one (--otlp-insecure)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from console.errors import UserError
from console.sources.device_peak import lookup_peaks, preset_for_device
from engine.budget.cost_model import BudgetModel
from engine.budget.peaks import DevicePeaks
from engine.budget.predictor import StepTimePredictor
from engine.errors import EngineError
from engine.model.loader import model_config_for
from engine.serve.hosts import LOOPBACK_HOSTS
from engine.serve.otlp import SLOW_THRESHOLD, PrefillEstimate, TraceCollector, create_otlp_app
from engine.serve.thread import ServerThread
from engine.store import (
    CalibrationRecord,
    Database,
    calibration_history,
    default_db_path,
    open_database,
)

# Scores assume 16-bit weights, activations and KV, what vLLM and SGLang serve by default.
BYTES_PER_ELEMENT = 2


@dataclass
class TraceReceiver:
    collector: TraceCollector
    server: ServerThread

    @property
    def url(self) -> str:
        return f"{self.server.url}/v1/traces"

    def close(self) -> None:
        self.server.stop()


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserError(f"--otlp-listen {listen!r}: give HOST:PORT, e.g. 127.0.0.1:4318")
    return host, int(port)


def prefill_estimate(shape: str | None, gpu: str | None,
                     database: Database | None = None) -> PrefillEstimate | None:
    """What traced prefills are scored against: the newest calibration stored for this model
    on this GPU (`tokenflow calibrate` run there, e.g. on a lent H200), else the roofline of
    the model's shape on the GPU's peaks; None when the shape is not given."""
    if not shape:
        return None
    try:
        config = model_config_for(shape)
    except EngineError as exc:
        raise UserError(f"--roofline-model: {exc}") from exc
    peak = lookup_peaks(gpu, "http://127.0.0.1")
    if peak.peaks is None:
        raise UserError(f"--roofline-model needs the device's peaks: {peak.reason}")
    record = None if database is None else stored_calibration(database, shape, peak.peaks)
    if record is not None:
        predictor = StepTimePredictor.from_dict(record.params)
        return PrefillEstimate(predictor.predict, f"calibration {record.id}",
                               f"{record.model} on {record.device} "
                               f"({calibrated_device(record)}), {predictor.points} steps")
    model = BudgetModel(config, BYTES_PER_ELEMENT, peak.peaks)
    return PrefillEstimate(model.predict, "roofline", f"{shape} on {peak.reason}")


def stored_calibration(database: Database, shape: str,
                       peaks: DevicePeaks) -> CalibrationRecord | None:
    """The newest calibration of the model `shape` names, measured on the device `peaks`
    stand for: this CPU for measured CPU peaks, else a GPU of the same datasheet."""
    with database.session() as session:
        history = calibration_history(session)
    for record in history:
        if not same_model(record.model, shape):
            continue
        if peaks.name == "cpu":
            if record.device == "cpu":
                return record
        elif preset_for_device(calibrated_device(record)) == peaks:
            return record
    return None


def calibrated_device(record: CalibrationRecord) -> str:
    """The device name the run measured on ("NVIDIA H200"), as its peaks recorded it."""
    return str(record.info.get("peaks", {}).get("name", record.device))


def same_model(stored: str, given: str) -> bool:
    """A preset by name; a model directory by where it is, however the path was written."""
    if stored == given:
        return True
    stored_path, given_path = Path(stored), Path(given)
    return stored_path.is_dir() and given_path.is_dir() and stored_path.resolve() == \
        given_path.resolve()


def trace_store(db: str | None) -> str:
    """The store the console's receiver writes traces to, and its twin reads them back from:
    `db` (--db), else the user's store."""
    return str(db or default_db_path())


def open_trace_store(db: str | None) -> Database:
    return open_database(trace_store(db))


def start_receiver(listen: str, *, token: str | None, shape: str | None = None,
                   gpu: str | None = None, database: Database | None = None,
                   slow_threshold: float = SLOW_THRESHOLD,
                   allow_hosts: Iterable[str] = ()) -> TraceReceiver:
    """The receiver on `listen`; `token` None takes traces from anyone (--otlp-insecure).
    Requests must name a loopback host, the listen host or one of `allow_hosts` in Host."""
    host, port = parse_listen(listen)
    collector = TraceCollector(prefill_estimate(shape, gpu, database), database,
                               slow_threshold=slow_threshold)
    app = create_otlp_app(collector, token=token,
                          allowed_hosts=[*LOOPBACK_HOSTS, host, *allow_hosts])
    try:
        server = ServerThread(app, host=host, port=port)
    except OSError as exc:
        raise UserError(f"--otlp-listen {listen}: {exc.strerror}; pick a free port") from exc
    return TraceReceiver(collector, server.start())
