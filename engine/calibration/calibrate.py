"""The token-budget calibrator: time real steps on this device, fit the step-time predictor."""

from __future__ import annotations

import math
import random
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from sqlalchemy.orm import Session

from engine.batch import QUIET, Batch, HostMark, StepShape, lent
from engine.budget.cost_model import BudgetModel
from engine.budget.operations import OperationEfficiency, StepPrice, fit_step_price
from engine.budget.peaks import DevicePeaks
from engine.budget.predictor import FEATURES, StepTimePredictor
from engine.calibration.served import ServedCosts
from engine.config import SamplingParams
from engine.core.engine_core import EngineCore
from engine.core.request import Request, RequestState
from engine.errors import EngineError
from engine.events import CalibrationProgress
from engine.ops.telemetry import NvmlBandwidth, TelemetryError, cuda_uuid, nvml_available
from engine.store import (
    BudgetPoint,
    CalibrationRecord,
    calibration_history,
    save_calibration,
)

Progress = Callable[[float, str], None]  # fraction done in [0, 1], what is happening now
HELD_OUT_SEED = 0


@dataclass(frozen=True)
class Probe:
    """One step shape: `chunks` prefill chunks of `chunk` after `chunk_context`, and decodes."""

    chunk: int = 0
    chunk_context: int = 0
    decode_seqs: int = 0
    decode_context: int = 0
    # several chunks in one step tell the per-chunk cost apart from the per-step one
    chunks: int = 1

    @property
    def kind(self) -> str:
        if self.chunk and (self.decode_seqs or self.chunks > 1):
            return "mixed"
        return "prefill" if self.chunk else "decode"

    @property
    def longest(self) -> int:
        return max(self.chunk_context + self.chunk, self.decode_context + 1)

    @property
    def tokens(self) -> int:
        return self.chunk * self.chunks + self.decode_seqs

    @property
    def rows(self) -> int:
        return (self.chunks if self.chunk else 0) + self.decode_seqs


@dataclass(frozen=True)
class SweepPlan:
    prefill_chunks: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed: tuple[Probe, ...]
    warmup: int = 5
    repeats: int = 20
    # Time the last of a burst of like steps: served steps follow steps like them (cache state).
    burst: int = 4

    def probes(self) -> list[Probe]:
        return ([Probe(chunk=c, chunk_context=s)
                 for c in self.prefill_chunks for s in self.prefill_contexts]
                + [Probe(decode_seqs=b, decode_context=s)
                   for b in self.decode_batches for s in self.decode_contexts]
                + list(self.mixed))


# CPU shapes suit a 20M-parameter model; GPU ones reach where an 8B model turns compute bound.
PLANS: dict[tuple[str, bool], SweepPlan] = {
    # Seconds, not minutes: each shape once per pass, no burst; the served probe prices the
    # cache state a burst would have caught.
    ("cpu", True): SweepPlan(
        prefill_chunks=(16, 64, 128), prefill_contexts=(0, 512),
        decode_batches=(1, 8, 32), decode_contexts=(64, 512),
        mixed=(Probe(32, 0, 16, 128), Probe(128, 256, 8, 256), Probe(64, 0, 32, 512),
               Probe(16, 0, 4, 64, chunks=4)),
        warmup=1, repeats=3, burst=1),
    ("cpu", False): SweepPlan(
        prefill_chunks=(16, 32, 64, 128, 256, 384, 512), prefill_contexts=(0, 256, 1024, 2048),
        decode_batches=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 64),
        decode_contexts=(64, 256, 1024, 2048),
        mixed=(Probe(32, 0, 32, 128), Probe(64, 256, 8, 256), Probe(128, 0, 16, 512),
               Probe(128, 512, 4, 1024), Probe(256, 128, 8, 128), Probe(512, 0, 32, 256),
               Probe(384, 1024, 16, 1024), Probe(16, 0, 0, 0, chunks=4),
               Probe(32, 0, 4, 64, chunks=4), Probe(64, 256, 8, 128, chunks=2)),
        warmup=5, repeats=20),
    ("cuda", True): SweepPlan(
        prefill_chunks=(64, 256, 512, 1024, 2048), prefill_contexts=(0, 2048, 8192),
        decode_batches=(1, 16, 64, 256), decode_contexts=(256, 2048, 8192),
        mixed=(Probe(256, 0, 64, 1024), Probe(512, 2048, 32, 2048), Probe(1024, 0, 128, 512),
               Probe(2048, 4096, 16, 4096), Probe(128, 0, 256, 256),
               Probe(128, 0, 16, 1024, chunks=4)),
        warmup=5, repeats=10),
    ("cuda", False): SweepPlan(
        prefill_chunks=(64, 128, 256, 512, 1024, 2048, 4096, 8192),
        prefill_contexts=(0, 2048, 8192, 16384),
        decode_batches=(1, 4, 16, 32, 64, 128, 256), decode_contexts=(256, 1024, 4096, 16384),
        mixed=(Probe(256, 0, 64, 1024), Probe(512, 2048, 32, 2048), Probe(1024, 0, 128, 512),
               Probe(2048, 4096, 16, 4096), Probe(128, 0, 256, 256), Probe(4096, 0, 64, 4096),
               Probe(1024, 8192, 32, 8192), Probe(64, 0, 0, 0, chunks=8),
               Probe(128, 0, 16, 1024, chunks=4), Probe(512, 2048, 32, 2048, chunks=2)),
        warmup=5, repeats=20),
}

# The first calibration at start: seconds, not minutes, still covering every predictor feature
# (on a CPU the quick sweep already is).
FIRST_PLANS: dict[str, SweepPlan] = {
    "cpu": PLANS[("cpu", True)],
    "cuda": SweepPlan(
        prefill_chunks=(64, 512, 2048), prefill_contexts=(0, 4096),
        decode_batches=(1, 32, 256), decode_contexts=(256, 4096),
        mixed=(Probe(256, 0, 64, 1024), Probe(1024, 2048, 32, 2048), Probe(128, 0, 256, 256),
               Probe(128, 0, 16, 1024, chunks=4)),
        warmup=3, repeats=3),
}
FIRST_REASON = "first calibration at start"

# Fixed shapes two predictors are compared on for drift: prefill, decode and mixed terms.
REFERENCE_SHAPES = (
    StepShape(prefill=((32, 0),)), StepShape(prefill=((128, 0),)),
    StepShape(prefill=((256, 0),)), StepShape(prefill=((128, 1024),)),
    StepShape(decode_contexts=(257,)), StepShape(decode_contexts=(257,) * 8),
    StepShape(decode_contexts=(1025,) * 16),
    StepShape(prefill=((128, 0),), decode_contexts=(513,) * 8),
    StepShape(prefill=((64, 256),), decode_contexts=(129,) * 32),
)


def plan_for(device: torch.device, quick: bool) -> SweepPlan:
    return PLANS[(_kind(device), quick)]


def first_plan(device: torch.device) -> SweepPlan:
    return FIRST_PLANS[_kind(device)]


def _kind(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


@dataclass(frozen=True)
class KvProbe:
    """The KV pool allocated block by block until it refused one more."""

    blocks: int
    total_blocks: int
    block_size: int
    capacity_tokens: int
    capacity_bytes: int


@dataclass(frozen=True)
class CalibrationPoint:
    probe: Probe
    mean_s: float
    median_s: float
    min_s: float
    runs: int
    flops: float
    bytes_moved: float
    achieved_flops: float
    achieved_bandwidth: float
    flops_utilization: float
    bandwidth_utilization: float
    predicted_s: float
    held_out: bool
    nvml_memory_busy: float | None
    dram_active: float | None = None

    @property
    def relative_error(self) -> float:
        return self.predicted_s / self.median_s - 1

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.probe.kind, **asdict(self.probe),
                **{k: v for k, v in asdict(self).items() if k != "probe"},
                "relative_error": self.relative_error}


@dataclass(frozen=True)
class CalibrationResult:
    model: str
    device: str
    dtype: str
    created_at: float
    wall_s: float
    quick: bool
    peaks: DevicePeaks
    kv: KvProbe
    points: tuple[CalibrationPoint, ...]
    skipped: tuple[Probe, ...]
    predictor: StepTimePredictor
    # what serving cost beyond the sweep (engine.calibration.served), where a probe was served
    served: ServedCosts | None = None
    # the same steps fitted in the twin's per-operation form (engine.budget.operations)
    operations: OperationsFit | None = None
    # where and under what load it was measured: the busiest host reading of the sweep
    host: str = ""
    load: HostMark = QUIET

    @property
    def contended(self) -> bool:
        """Other processes took the CPUs while it ran: its step times are partly theirs."""
        return self.load.contended

    def load_words(self) -> str:
        return (f"other processes used {self.load.others_cpus:.1f} CPUs, steal "
                f"{self.load.steal:.0%}")

    def provenance(self) -> dict[str, Any]:
        """Measured when, on which host and device, under what load (the store is added
        where it is first saved)."""
        return {"measured_at": self.created_at, "host": self.host, "device": self.device,
                "load": {"contended": self.load.contended,
                         "others_cpus": round(self.load.others_cpus, 3),
                         "steal": round(self.load.steal, 4),
                         "own_cpus": round(self.load.own_cpus, 3),
                         "measured": self.load.measured}}

    @property
    def heldout_errors(self) -> tuple[float, ...]:
        return tuple(abs(p.relative_error) for p in self.points if p.held_out)

    @property
    def heldout_median_abs_error(self) -> float:
        errors = self.heldout_errors
        return statistics.median(errors) if errors else math.nan

    def to_dict(self) -> dict[str, Any]:
        errors = self.heldout_errors
        return {
            "model": self.model, "device": self.device, "dtype": self.dtype,
            "created_at": self.created_at, "wall_s": self.wall_s, "quick": self.quick,
            "heldout_median_abs_error": self.heldout_median_abs_error,
            "heldout_max_abs_error": max(errors) if errors else None,
            "heldout_points": len(errors), "points": len(self.points),
            "peaks": asdict(self.peaks), "kv": asdict(self.kv),
            "predictor": self.predictor.to_dict(),
            "operations": None if self.operations is None else self.operations.to_dict(),
            "served": None if self.served is None else self.served.to_dict(),
            "table": [p.to_dict() for p in self.points],
            "skipped": [asdict(p) for p in self.skipped],
            "provenance": self.provenance(),
        }


class Calibration:
    """One sweep over `plan` on `engine`, a unit per `advance()`, timed passes interleaved."""

    def __init__(self, engine: EngineCore, plan: SweepPlan, *, quick: bool = False,
                 progress: Progress | None = None) -> None:
        if plan.warmup < 0 or plan.repeats < 1 or plan.burst < 1:
            raise EngineError(f"a sweep needs warmup >= 0, repeats >= 1 and burst >= 1, got "
                              f"{plan.warmup}, {plan.repeats} and {plan.burst}")
        self.engine = engine
        self.plan = plan
        self.quick = quick
        self.progress = progress
        self.probes = plan.probes()
        self._held_out = _held_out(self.probes)
        self._steps: dict[Probe, ProbeStep] = {}
        self._times: dict[Probe, list[float]] = {}
        self._busy: dict[Probe, list[float]] = {}
        self._dram: dict[Probe, list[float]] = {}
        self._skipped: list[Probe] = []
        self._kv: KvProbe | None = None
        self._units: Iterator[None] = self._run_units()
        self._started = time.perf_counter()
        self._done = False
        self._nvml = _start_nvml(engine.runner.device)
        self._load = engine.host.mark(engine.clock())  # the busiest reading while it runs

    @property
    def total_units(self) -> int:
        return 1 + len(self.probes) * (1 + self.plan.repeats)

    def advance(self) -> bool:
        """Run the next unit; True once the sweep is complete."""
        if not self._done:
            self._done = next(self._units, True) is True
            mark = self.engine.host.mark(self.engine.clock())
            if (mark.contended, mark.others_cpus) > (self._load.contended,
                                                      self._load.others_cpus):
                self._load = mark
        return self._done

    def finish(self) -> CalibrationResult:
        while not self.advance():
            pass
        if self._nvml is not None:
            self._nvml.stop()
            self._nvml = None
        engine = self.engine
        timed = {probe: (step.batch.shape(), self._times[probe])
                 for probe, step in self._steps.items() if self._times[probe]}
        fit = [(shape, times) for probe, (shape, times) in timed.items()
               if not self._held_out[probe]]
        if len(fit) < len(FEATURES):
            blocks = engine.blocks
            raise EngineError(f"only {len(fit)} of the sweep's shapes fit this engine's KV pool "
                              f"({blocks.num_blocks} blocks of {blocks.block_size} tokens) and "
                              f"max_model_len, and the fit needs {len(FEATURES)}: lower "
                              "--block-size, or raise --kv-cache-bytes or --max-model-len")
        model = engine.model_config
        predictor = StepTimePredictor.fit(
            [shape for shape, _ in fit], [statistics.median(t) for _, t in fit],
            source=f"{'quick ' if self.quick else ''}sweep of {len(timed)} shapes",
            sliding_window=model.sliding_window if model.windowed_layers else None,
            windowed_share=model.windowed_share)
        peaks, budget = engine.peaks, engine.budget
        points = []
        for probe, (shape, times) in timed.items():
            median = statistics.median(times)
            flops, moved = budget.flops(shape), budget.bytes_moved(shape)
            busy, dram = self._busy[probe], self._dram[probe]
            points.append(CalibrationPoint(
                probe=probe, mean_s=statistics.fmean(times), median_s=median, min_s=min(times),
                runs=len(times), flops=flops, bytes_moved=moved, achieved_flops=flops / median,
                achieved_bandwidth=moved / median,
                flops_utilization=flops / median / peaks.flops,
                bandwidth_utilization=moved / median / peaks.bandwidth,
                predicted_s=predictor.predict(shape), held_out=self._held_out[probe],
                nvml_memory_busy=statistics.median(busy) if busy else None,
                dram_active=statistics.median(dram) if dram else None))
        assert self._kv is not None
        operations = fit_operations(budget, peaks, fit, [
            (shape, statistics.median(times)) for probe, (shape, times) in timed.items()
            if self._held_out[probe]])
        return CalibrationResult(
            model=engine.config.model, device=device_key(engine.runner.device),
            dtype=str(engine.runner.dtype).removeprefix("torch."), created_at=time.time(),
            wall_s=time.perf_counter() - self._started, quick=self.quick, peaks=peaks,
            kv=self._kv, points=tuple(points), skipped=tuple(self._skipped),
            predictor=predictor, operations=operations, host=socket.gethostname(),
            load=self._load)

    def _run_units(self) -> Iterator[None]:
        done = 0
        self._report(done, "probing KV capacity")
        self._kv = self._probe_kv()
        done += 1
        yield
        vocab = self.engine.model_config.vocab_size
        shapes = len(self.probes)
        for index, probe in enumerate(self.probes, 1):
            self._report(done, f"warm-up, shape {index}/{shapes}: {_describe(probe)}")
            config = self.engine.config
            # past the step the KV pool was sized to leave room for, a probe could run the
            # device out of memory: the engine never runs such a step
            if (probe.longest > self.engine.max_model_len
                    or probe.tokens > config.budget_ceiling()
                    or probe.rows > config.max_num_seqs):
                self._skipped.append(probe)
            else:
                step = _probe_step(probe, vocab)
                if self._run(step, self.plan.warmup) is None:
                    self._skipped.append(probe)
                else:
                    self._steps[probe] = step
                    self._times[probe], self._busy[probe], self._dram[probe] = [], [], []
            done += 1 + (0 if probe in self._steps else self.plan.repeats)
            yield
        for repeat in range(self.plan.repeats):
            timed = len(self._steps)
            for index, (probe, step) in enumerate(self._steps.items(), 1):
                self._report(done, f"pass {repeat + 1}/{self.plan.repeats}, shape "
                             f"{index}/{timed}: {_describe(probe)}")
                seconds = self._run(step, self.plan.burst)
                if seconds is not None:  # None: serving took the blocks since the warm-up
                    self._times[probe].append(seconds)
                    latest = self._nvml.latest() if self._nvml is not None else None
                    if latest is not None:
                        self._busy[probe].append(latest.memory_busy)
                        if latest.dram_active is not None:
                            self._dram[probe].append(latest.dram_active)
                done += 1
                yield
        self._report(done, "fitting")

    def _report(self, done: int, note: str) -> None:
        if self.progress is not None:
            self.progress(done / self.total_units, note)

    def _probe_kv(self) -> KvProbe:
        blocks, runner = self.engine.blocks, self.engine.runner
        # what one request could be granted now: allocate() refuses past the free count, and
        # granting it a block at a time took minutes on a small model's pool of millions
        granted = blocks.num_free
        block_bytes = (self.engine.model_config.kv_bytes_per_token(runner.bytes_per_element)
                       * blocks.block_size)
        capacity = granted * blocks.block_size
        return KvProbe(blocks=granted, total_blocks=blocks.num_blocks,
                       block_size=blocks.block_size, capacity_tokens=capacity,
                       capacity_bytes=granted * block_bytes)

    def _run(self, step: ProbeStep, runs: int) -> float | None:
        """Seconds of the last of `runs` runs of `step`; None if the free KV cannot hold it."""
        requests, blocks, runner = step.requests, self.engine.blocks, self.engine.runner
        for index, request in enumerate(requests):
            if blocks.allocate(request, request.num_tokens) is None:
                for placed in requests[:index]:
                    blocks.release(placed)
                blocks.take_newly_allocated()
                return None
        try:
            runner.zero_blocks(blocks.take_newly_allocated())
            seconds = math.nan
            # lent before the timed runs: a served step's decodes bring no new request
            with lent(runner.run, [r.entering() for r in requests]):
                for _ in range(runs):
                    seconds = timed_step(self.engine, step.batch)
            return seconds
        finally:
            for request in requests:
                blocks.release(request)


@dataclass(frozen=True)
class OperationsFit:
    """Per-operation efficiency factors fitted on a sweep against measured peaks, with errors."""

    efficiency: OperationEfficiency
    heldout_errors: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        errors = [abs(e) for e in self.heldout_errors]
        return {"form": "operations", "efficiency": self.efficiency.to_dict(),
                "heldout_median_abs_error": statistics.median(errors) if errors else None,
                "heldout_max_abs_error": max(errors) if errors else None}


def fit_operations(model: BudgetModel, peaks: DevicePeaks,
                   fit: list[tuple[StepShape, list[float]]],
                   held_out: list[tuple[StepShape, float]]) -> OperationsFit:
    """The per-operation form fitted on each `fit` shape's median time, judged on `held_out`."""
    efficiency = fit_step_price(model, peaks, [(shape, statistics.median(times))
                                               for shape, times in fit])
    price = StepPrice(model, peaks, efficiency)
    return OperationsFit(efficiency, tuple(price.predict(shape) / seconds - 1
                                           for shape, seconds in held_out))


def calibrate(engine: EngineCore, *, quick: bool = False, plan: SweepPlan | None = None,
              progress: Progress | None = None) -> CalibrationResult:
    """Run a whole sweep (the device's plan unless `plan` is given) and fit."""
    plan = plan or plan_for(engine.runner.device, quick)
    return Calibration(engine, plan, quick=quick, progress=progress).finish()


def compare(old: StepTimePredictor, new: StepTimePredictor) -> float:
    """The median over REFERENCE_SHAPES of new/old − 1 (uniformly 20% slower: +0.20)."""
    ratios = [new.predict(s) / old.predict(s) for s in REFERENCE_SHAPES if old.predict(s) > 0]
    if not ratios:
        raise EngineError("the stored predictor predicts zero time for every reference shape; "
                          "recalibrate with `tokenflow calibrate`")
    return statistics.median(ratios) - 1


def first_calibration(engine: EngineCore, session: Session | None = None) -> CalibrationResult:
    """The quick sweep at start (FIRST_PLANS), applied, stored in `session` if given."""
    def progress(fraction: float, note: str) -> None:
        engine.bus.publish(CalibrationProgress(fraction=fraction, note=note,
                                               reason=FIRST_REASON))
        engine.bus.drain()

    result = calibrate(engine, quick=True, plan=first_plan(engine.runner.device),
                       progress=progress)
    engine.apply_calibration(result.predictor)
    if session is not None:  # its provenance names its load: no other store reuses it if busy
        save_result(session, result, FIRST_REASON)
    busy = f"; measured while {result.load_words()}" if result.contended else ""
    progress(1.0, f"calibrated in {result.wall_s:.1f} s: held-out step error "
             f"{result.heldout_median_abs_error:.0%}{busy}")
    return result


def save_result(session: Session, result: CalibrationResult, reason: str) -> int:
    """Store the run, why it ran, its prefill table and its predictor; returns its id."""
    table = [BudgetPoint(p.probe.chunk, p.probe.chunk_context, p.median_s)
             for p in result.points if p.probe.kind == "prefill"]
    info = {k: v for k, v in result.to_dict().items() if k not in ("model", "device")}
    return save_calibration(session, model=result.model, device=result.device, table=table,
                            params=result.predictor.to_dict(), info=info, reason=reason)


def device_key(device: torch.device) -> str:
    """The device a stored calibration is looked up by: the GPU's model on CUDA, else the device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def latest_for(session: Session, engine: EngineCore) -> CalibrationRecord | None:
    """The newest stored calibration of this engine's model, device and dtype."""
    return latest_stored(session, model=engine.config.model,
                         device=device_key(engine.runner.device),
                         dtype=str(engine.runner.dtype).removeprefix("torch."))


def latest_stored(session: Session, *, model: str, device: str,
                  dtype: str) -> CalibrationRecord | None:
    history = calibration_history(session, model=model, device=device)
    return next((r for r in history if r.info.get("dtype") == dtype), None)


def apply_latest(engine: EngineCore, session: Session) -> CalibrationRecord | None:
    record = latest_for(session, engine)
    if record is not None:
        engine.apply_calibration(StepTimePredictor.from_dict(record.params))
    return record


_GREEDY = SamplingParams()


def _dummy_request(num_tokens: int, state: RequestState, vocab: int = 1,
                   request_id: str = "calibration") -> Request:
    request = Request(id=request_id, prompt_token_ids=[i % vocab for i in range(num_tokens)],
                      params=_GREEDY, arrival=0.0)
    request.set_state(state, "calibration probe")
    return request


@dataclass(frozen=True)
class ProbeStep:
    """A probe's requests (each holds KV blocks while it runs) and the batch that steps them."""

    requests: list[Request]
    batch: Batch


def _probe_step(probe: Probe, vocab: int) -> ProbeStep:
    requests, batch = [], Batch()
    for _ in range(probe.chunks if probe.chunk else 0):
        request = _dummy_request(probe.chunk_context + probe.chunk, RequestState.PREFILL_CHUNKING,
                                 vocab, f"calibration-{len(requests)}")
        requests.append(request)
        batch.prefills.append(request.chunk(probe.chunk_context, probe.chunk))
    for _ in range(probe.decode_seqs):
        request = _dummy_request(probe.decode_context + 1, RequestState.DECODING, vocab,
                                 f"calibration-{len(requests)}")
        requests.append(request)
        batch.decodes.append(request.chunk(probe.decode_context, 1))
    return ProbeStep(requests, batch)


def timed_step(engine: EngineCore, batch: Batch) -> float:
    """One forward pass plus sampling, timed as the engine times a step (CUDA events on a GPU)."""
    runner = engine.runner
    if runner.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.run(batch)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = engine.clock()  # a simulated engine's clock: the twin calibrates on its own steps
    runner.run(batch)
    return engine.clock() - start_s


def _start_nvml(device: torch.device) -> NvmlBandwidth | None:
    if device.type != "cuda" or not nvml_available():
        return None
    monitor = NvmlBandwidth(uuid=cuda_uuid(str(device)), interval_s=0.1)
    try:
        monitor.start()
    except TelemetryError:
        return None
    return monitor


def _held_out(probes: list[Probe]) -> dict[Probe, bool]:
    """A seeded quarter of each kind's probes, never its first or last (inside the fit range)."""
    rng = random.Random(HELD_OUT_SEED)
    held = dict.fromkeys(probes, False)
    for kind in ("prefill", "decode", "mixed"):
        same = [p for p in probes if p.kind == kind]
        interior = same[1:-1]
        for probe in rng.sample(interior, min(len(interior), math.ceil(len(same) / 4))):
            held[probe] = True
    return held


def _describe(probe: Probe) -> str:
    parts = []
    if probe.chunk:
        many = f"{probe.chunks} chunks" if probe.chunks > 1 else "chunk"
        parts.append(f"{many} {probe.chunk} after {probe.chunk_context}")
    if probe.decode_seqs:
        parts.append(f"{probe.decode_seqs} decodes at {probe.decode_context}")
    return " + ".join(parts)
