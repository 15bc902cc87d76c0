"""What serving costs beyond the sweep's forward passes, measured by serving a short workload.

The sweep times each shape's forward pass on its own. A served step pays more: the engine's
own work around the pass (scheduling, booking, events, guards), 0.2-0.25 ms a step plus about
0.5 ms a prefill chunk on the project's 2-core EPYC VM, 5-10% of a decode step there; and a
step with a prefill chunk served between decodes may run slower or faster against its sweep
price than a decode step does. `measure_served` serves requests of mixed lengths on an idle
engine and fits both, so that the GPU twin (engine.sim) charges them as the real engine pays
them.
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import asdict, dataclass

import numpy as np

from engine.batch import StepShape
from engine.budget.predictor import nonnegative_relative_lstsq
from engine.config import SamplingParams
from engine.core.engine import Engine
from engine.errors import EngineError
from engine.events import ChunkComplete, Event, StepComplete

# The probe: one prompt arrives every PROBE_EVERY_STEPS steps, its length cycling through
# PROBE_PROMPTS (tokens), so that prefill chunks of many sizes run beside a few decodes, as
# they do in service; enough of them (PROBE_REQUESTS) that the prefill steps' median is stable.
PROBE_PROMPTS = (24, 96, 200, 48, 320, 64, 160, 32, 256, 112, 40, 180)
PROBE_REQUESTS = 48
PROBE_EVERY_STEPS = 3
PROBE_OUTPUT_TOKENS = 16
# A served step's host time this many median absolute deviations off the first fit lost its
# core to something else (a collection, another process): dropped before the final fit.
OUTLIER_MADS = 4.0
OUTLIER_FLOOR_S = 50e-6  # nor any closer than this: timer noise, not a lost core


@dataclass(frozen=True)
class ServedSample:
    """One served step: its shape in counts, its forward pass and its whole time."""

    prefill_chunks: int
    decode_seqs: int
    forward_s: float
    predicted_s: float  # the sweep's price of the forward pass
    step_s: float  # engine.step() from entry to return

    @property
    def host_s(self) -> float:
        return max(0.0, self.step_s - self.forward_s)


@dataclass(frozen=True)
class ServedCosts:
    """Host seconds per served step = step_s + per_decode_s × decodes + per_prefill_chunk_s
    × chunks; a step with a prefill chunk runs `prefill_scale` times its sweep price
    against a decode step's (a ratio of ratios: the machine's speed since the sweep cancels)."""

    step_s: float
    per_decode_s: float
    per_prefill_chunk_s: float
    prefill_scale: float
    steps: int  # served steps the fit used

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


def measure_served(engine: Engine, seed: int = 0) -> ServedCosts:
    """Serve the probe's requests on `engine`, which must be idle and calibrated (its steps'
    predictions are the sweep's prices), and fit what serving them cost beyond the sweep.
    The requests are served for real: run it on an engine that serves nothing else after
    (`tokenflow calibrate`'s), as they count in its metrics and prefix cache."""
    if engine.has_unfinished():
        raise EngineError("the served probe needs an idle engine")
    if not engine.calibrated:
        raise EngineError("the served probe prices steps with the sweep's fit: apply it first")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    longest = engine.max_model_len - PROBE_OUTPUT_TOKENS
    pending = [[rng.randrange(vocab) for _ in range(min(n, longest))]
               for n in itertools.islice(itertools.cycle(PROBE_PROMPTS), PROBE_REQUESTS)]
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
