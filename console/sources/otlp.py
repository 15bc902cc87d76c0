"""The console's OTLP/HTTP trace receiver (`--otlp-listen HOST:PORT`): a TraceCollector
(engine.serve.otlp) behind a small HTTP server on its own thread, scoring each request
against the roofline of `--roofline-model` on `--gpu`."""

from __future__ import annotations

from dataclasses import dataclass

from console.errors import UserError
from console.sources.device_peak import lookup_peaks
from engine.budget.cost_model import BudgetModel
from engine.errors import EngineError
from engine.model.loader import model_config_for
from engine.serve.otlp import TraceCollector, create_otlp_app
from engine.serve.thread import ServerThread
from engine.store import Database

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


def roofline_model(shape: str | None, gpu: str | None) -> BudgetModel | None:
    """The budget model that predicts traced prefills, or None when the shape is not given."""
    if not shape:
        return None
    try:
        config = model_config_for(shape)
    except EngineError as exc:
        raise UserError(f"--roofline-model: {exc}") from exc
    peak = lookup_peaks(gpu, "http://127.0.0.1")
    if peak.peaks is None:
        raise UserError(f"--roofline-model needs the device's peaks: {peak.reason}")
    return BudgetModel(config, BYTES_PER_ELEMENT, peak.peaks)


def start_receiver(listen: str, *, shape: str | None = None, gpu: str | None = None,
                   database: Database | None = None) -> TraceReceiver:
    host, port = parse_listen(listen)
    collector = TraceCollector(roofline_model(shape, gpu), database)
    try:
        server = ServerThread(create_otlp_app(collector), host=host, port=port)
    except OSError as exc:
        raise UserError(f"--otlp-listen {listen}: {exc.strerror}; pick a free port") from exc
    return TraceReceiver(collector, server.start())
