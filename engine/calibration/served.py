"""What serving costs beyond the sweep's forward passes, measured by serving a short probe."""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import asdict, dataclass

import numpy as np

from engine.batch import StepShape
from engine.budget.predictor import nonnegative_relative_lstsq
from engine.config import SamplingParams
from engine.core.engine_core import EngineCore
from engine.errors import EngineError
from engine.events import ChunkComplete, Event, StepComplete

# The probe: prompts of cycling lengths, so many chunk sizes run beside a few decodes.
PROBE_PROMPTS = (24, 96, 200, 48, 320, 64, 160, 32, 256, 112, 40, 180)
PROBE_REQUESTS = 48
# `calibrate --quick`: every prompt length at least once, so every fitted cost has steps
QUICK_PROBE_REQUESTS = 16
PROBE_EVERY_STEPS = 3
PROBE_OUTPUT_TOKENS = 16
# A step this many MADs off the first fit lost its core (a collection, a process): dropped.
OUTLIER_MADS = 4.0
OUTLIER_FLOOR_S = 50e-6  # nor any closer than this: timer noise, not a lost core


@dataclass(frozen=True)
class ServedSample:
    """One served step: its shape in counts, its forward pass and its whole time."""

    prefill_chunks: int
    decode_seqs: int
    forward_s: float
    predicted_s: float
    step_s: float

    @property
    def host_s(self) -> float:
        return max(0.0, self.step_s - self.forward_s)


@dataclass(frozen=True)
class ServedCosts:
    """Host seconds per served step, plus the prefill steps' price ratio against decode steps'."""

    step_s: float
    per_decode_s: float
    per_prefill_chunk_s: float
    prefill_scale: float
    steps: int

    def host_seconds(self, shape: StepShape) -> float:
        return (self.step_s + self.per_decode_s * len(shape.decode_contexts)
                + self.per_prefill_chunk_s * len(shape.prefill))

    def forward_seconds(self, shape: StepShape, predicted_s: float) -> float:
        return predicted_s * self.prefill_scale if shape.prefill else predicted_s

    @classmethod
    def fit(cls, samples: list[ServedSample]) -> ServedCosts:
        if len(samples) < 3:
            raise EngineError(f"need at least 3 served steps to fit their costs, got "
                              f"{len(samples)}")
        x = np.asarray([(1.0, s.decode_seqs, s.prefill_chunks) for s in samples])
        y = np.asarray([max(s.host_s, 1e-6) for s in samples])
        coef = nonnegative_relative_lstsq(x, y)
        residual = np.abs(x @ coef - y)
        mad = float(np.median(np.abs(residual - np.median(residual))))
        keep = residual <= max(float(np.median(residual)) + OUTLIER_MADS * mad, OUTLIER_FLOOR_S)
        if keep.sum() >= 3 and not keep.all():
            coef = nonnegative_relative_lstsq(x[keep], y[keep])
        ratios = {kind: [s.forward_s / s.predicted_s for s in samples
                         if (s.prefill_chunks > 0) == kind and s.predicted_s > 0]
                  for kind in (True, False)}
        scale = (statistics.median(ratios[True]) / statistics.median(ratios[False])
                 if ratios[True] and ratios[False] else 1.0)
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), scale, int(keep.sum()))

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float | int]) -> ServedCosts:
        return cls(float(data["step_s"]), float(data["per_decode_s"]),
                   float(data["per_prefill_chunk_s"]), float(data["prefill_scale"]),
                   int(data["steps"]))


def measure_served(engine: EngineCore, seed: int = 0,
                   requests: int = PROBE_REQUESTS) -> ServedCosts:
    """Serve `requests` of the probe on an idle, calibrated `engine` that serves nothing else
    after, and fit."""
    if engine.has_unfinished():
        raise EngineError("the served probe needs an idle engine")
    if not engine.calibrated:
        raise EngineError("the served probe prices steps with the sweep's fit: apply it first")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    longest = engine.max_model_len - PROBE_OUTPUT_TOKENS
    pending = [[rng.randrange(vocab) for _ in range(min(n, longest))]
               for n in itertools.islice(itertools.cycle(PROBE_PROMPTS), requests)]
    params = SamplingParams(max_tokens=PROBE_OUTPUT_TOKENS, ignore_eos=True)
    heard: list[Event] = []
    unsubscribe = engine.bus.subscribe(heard.append)
    samples: list[ServedSample] = []
    try:
        step = 0
        while pending or engine.has_unfinished():
            if pending and step % PROBE_EVERY_STEPS == 0:
                engine.add_request(pending.pop(0), params, tenant="calibration")
            heard.clear()
            entered = engine.clock()
            engine.step()
            step_s = engine.clock() - entered
            step += 1
            done = [e for e in heard if isinstance(e, StepComplete)]
            if done:
                chunks = sum(isinstance(e, ChunkComplete) for e in heard)
                samples.append(ServedSample(chunks, done[0].decode_seqs, done[0].duration_s,
                                            done[0].predicted_s, step_s))
    finally:
        unsubscribe()
    return ServedCosts.fit(samples)
