"""How far to trust a simulated run: the published cases nearest its shape, and their errors.

A run is placed by its GPU, precision, model size, tensor parallelism, batch (the mean
number of sequences decoding a step) and prompt and output lengths; a case by the same. The
distance is a sum of log ratios (a factor of e in one dimension counts 1; another GPU or
precision counts as a factor of e), so the cases nearest a run are those measured on the
most similar work. The band is the largest |error| the twin showed on the nearest cases, and
never less than its median |error| on the held-out cases (the nearest are mostly fitted on,
so their own errors flatter it); a run farther than FAR from every case gets none, and so
does a run on a GPU or at a weight precision no case was measured on (B200, the PCIe
boards, float32 weights, ...): it is placed, but its profile's shares were never judged
there.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.harness.driver import RunResult
from engine.harness.workload import WorkloadRequest
from engine.model.config import ModelConfig
from engine.sim.published import PUBLISHED_CASES

FAR = 2.5  # past this, no case is near: a factor of 12 in one dimension, or e.g. 3 and 3 and 2
NEAREST = 3
# Lengths weigh half: the twin prices a context's tokens the same whichever length they make.
WEIGHTS = {"params": 1.0, "tp": 1.0, "batch": 1.0, "input": 0.5, "output": 0.5}


@dataclass(frozen=True)
class RunShape:
    """What a run (or a published case) is, for the distance between them."""

    gpu: str
    dtype: str
    params: float
    tp: int
    batch: float
    input: float
    output: float

    def distance(self, other: RunShape) -> float:
        d = sum(weight * abs(math.log(max(getattr(self, name), 1e-9)
                                      / max(getattr(other, name), 1e-9)))
                for name, weight in WEIGHTS.items())
        return d + (self.gpu != other.gpu) + (_precision(self.dtype) != _precision(other.dtype))


@dataclass(frozen=True)
class NearCase:
    id: str
    source: str
    conditions: str
    distance: float
    error: float


@dataclass(frozen=True)
class Trust:
    """The nearest published cases of a run and the band their errors give."""

    nearest: tuple[NearCase, ...]
    # the largest |error| among the nearest, at least the held-out median; None when far or
    # when the cases' errors do not speak for this run
    band: float | None
    # why the cases' errors do not speak for a run near them (it priced with other factors)
    no_band: str | None = None

    @property
    def far(self) -> bool:
        return self.band is None and self.no_band is None

    def to_dict(self) -> dict[str, Any]:
        return {"nearest": [asdict(n) for n in self.nearest], "band": self.band,
                "far": self.far, "far_distance": FAR, "no_band": self.no_band}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trust:
        return cls(tuple(NearCase(**n) for n in data["nearest"]), data["band"],
                   data.get("no_band"))

    def line(self) -> str:
        if not self.nearest:
            return "no published case priced: no band, do not trust its absolute figures"
        first = self.nearest[0]
        where = f"{first.id} ({first.source}, distance {first.distance:.2f})"
        if self.no_band is not None:
            return (f"nearest published case {where}: the shipped profile's twin "
                    f"{first.error:+.0%} there; no band: {self.no_band}")
        if self.far:
            return (f"far from every published case (nearest {where}, twin {first.error:+.0%} "
                    "there): no band, do not trust its absolute figures")
        return (f"nearest published case {where}: twin {first.error:+.0%}; band "
                f"±{self.band:.0%} (the largest |error| of the {len(self.nearest)} nearest, "
                "at least the held-out cases' median)")

    def brief(self) -> str:
        """`line()` for a pane's one line: the band first, the nearest case after."""
        if not self.nearest:
            return "no published case priced: no band"
        first = self.nearest[0]
        if self.no_band is not None:
            return f"no band: {self.no_band}"
        if self.far:
            return f"far from every published case (nearest {first.id}): no band"
        return f"band ±{self.band:.0%} · nearest {first.id}: twin {first.error:+.0%}"


def _precision(dtype: str) -> str:
    return "16-bit" if dtype in ("bfloat16", "float16") else dtype


def case_shapes(path: Path = PUBLISHED_CASES) -> list[tuple[RunShape, dict[str, Any]]]:
    """Every case with a stored twin error, as a shape beside its record. A served case's
    batch is the number its twin run kept decoding (`placed_batch`), as a run's is: its
    requests arrive at once and wait for KV, so their count is not how many decode."""
    data = json.loads(Path(path).read_text())
    params = {name: ModelConfig(**{k: v for k, v in m.items() if k != "source"}).num_params(
        include_embeddings=False) for name, m in data["models"].items()}
    shapes = []
    for c in data["cases"]:
        if "twin_error" not in c:
            continue
        shapes.append((RunShape(c["gpu"], "bfloat16" if c["dtype"] == "float16" else c["dtype"],
                                params[c["model"]], c["tp"], c.get("placed_batch",
                                                                   c.get("batch", 1)),
                                max(c.get("input", 0), c.get("tokens", 0), 1),
                                max(c.get("output", 1), 1)), c))
    return shapes


class PublishedCases:
    """The published cases with a stored error, read once and asked for any number of runs
    (a live simulated engine asks at every snapshot)."""

    def __init__(self, path: Path = PUBLISHED_CASES) -> None:
        self.shapes = case_shapes(path)
        held = sorted(abs(c["twin_error"]) for _, c in self.shapes if c.get("held_back"))
        self.floor = held[len(held) // 2] if held else 0.0
        self.gpus = frozenset(shape.gpu for shape, _ in self.shapes)
        self.precisions = frozenset(_precision(shape.dtype) for shape, _ in self.shapes)

    def trust(self, run: RunShape, no_band: str | None = None) -> Trust:
        """The cases nearest `run` and their band; `no_band` says why there is none for a
        run priced on other factors than the ones the cases' errors were measured with."""
        ranked = sorted(((run.distance(shape), c) for shape, c in self.shapes),
                        key=lambda pair: pair[0])[:NEAREST]
        nearest = tuple(NearCase(c["id"], c["source"], c["conditions"], round(d, 3),
                                 c["twin_error"]) for d, c in ranked)
        far = not ranked or ranked[0][0] > FAR
        if no_band is None and not far and run.gpu not in self.gpus:
            # its profile's shares are another board's: no case has judged them on this one
            no_band = (f"no published case was measured on {run.gpu}; its nearest are "
                       "another GPU's")
        elif no_band is None and not far and _precision(run.dtype) not in self.precisions:
            no_band = (f"no published case was measured with {run.dtype} weights; its "
                       "nearest are another precision's")
        if no_band is not None:
            return Trust(nearest, None, no_band)
        return Trust(nearest, None if far else max(self.floor, *(abs(n.error) for n in nearest)))


def trust(run: RunShape, path: Path = PUBLISHED_CASES, no_band: str | None = None) -> Trust:
    """One run's trust (PublishedCases.trust), the cases read for it."""
    return PublishedCases(path).trust(run, no_band)


def shape(gpu: str, dtype: str, model: ModelConfig, tp: int, batch: float, prompt: float,
          output: float) -> RunShape:
    """A simulated run's shape from its mean batch and mean lengths (at least 1 each)."""
    return RunShape(gpu.lower(), dtype, model.num_params(include_embeddings=False), tp,
                    max(batch, 1.0), max(prompt, 1.0), max(output, 1.0))


@dataclass
class DecodingBatch:
    """The mean number of sequences decoding over a run's time, step by step (1 before any
    step took time): a finished run's steps, or a live engine's as they complete."""

    decoding_s: float = 0.0  # sequences decoding x seconds, summed over steps
    busy_s: float = 0.0

    def add(self, decode_seqs: int, duration_s: float) -> None:
        if duration_s > 0:
            self.decoding_s += decode_seqs * duration_s
            self.busy_s += duration_s

    @property
    def mean(self) -> float:
        return self.decoding_s / self.busy_s if self.busy_s else 1.0


def decoding_batch(result: RunResult) -> float:
    """The mean number of sequences decoding over a finished run's time."""
    batch = DecodingBatch()
    for step in result.steps:
        batch.add(step.decode_seqs, step.duration_s)
    return batch.mean


def run_shape(gpu: str, dtype: str, model: ModelConfig, tp: int, result: RunResult,
              workload: list[WorkloadRequest]) -> RunShape:
    """A simulated run's shape: its batch is the mean number decoding over its time."""
    n = max(len(workload), 1)
    return shape(gpu, dtype, model, tp, decoding_batch(result),
                 sum(len(w.prompt_token_ids) for w in workload) / n,
                 sum(w.max_tokens for w in workload) / n)
