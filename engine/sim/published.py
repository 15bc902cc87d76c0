"""Published GPU measurements as test cases for the twin's step prices."""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.batch import StepShape
from engine.budget.operations import OperationEfficiency
from engine.model.config import ModelConfig
from engine.sim.profiles import profile
from engine.sim.target import Deployment

KINDS = ("ttft", "decode", "static_throughput", "layer")


@dataclass(frozen=True)
class PublishedCase:
    id: str
    source: str
    gpu: str
    model: ModelConfig
    tp: int
    dtype: str
    kv_cache_dtype: str
    kind: str
    measured: float
    unit: str
    held_back: bool
    conditions: str
    input: int = 0
    output: int = 0
    batch: int = 1
    tokens: int = 0

    def deployment(self, efficiency: OperationEfficiency) -> Deployment:
        gpu = dataclasses.replace(profile(self.gpu), efficiency=efficiency)
        return Deployment(self.model, gpu, self.tp, self.dtype, self.kv_cache_dtype)

    def predicted(self, efficiency: OperationEfficiency) -> float:
        """The twin's figure for this case, in the case's unit."""
        price = self.deployment(efficiency).step_price()
        if self.kind == "ttft":
            return price.predict(StepShape(prefill=((self.input, 0),))) * 1e3
        if self.kind == "layer":
            ops = price.operations(StepShape(prefill=((self.tokens, 0),)))
            return ((ops["gemm"] + ops["elementwise"]) / self.model.num_layers
                    + efficiency.layer_s) * 1e3
        decode_s = sum(price.predict(StepShape(decode_contexts=(context,) * self.batch))
                       for context in range(self.input, self.input + self.output - 1))
        if self.kind == "decode":
            step_s = decode_s / (self.output - 1)
            return 1 / step_s if self.unit == "tok/s" else step_s * 1e3
        prefill_s = price.predict(StepShape(prefill=((self.input, 0),) * self.batch))
        return self.batch * self.output / (prefill_s + decode_s)

    def error(self, efficiency: OperationEfficiency) -> float:
        """predicted / measured − 1, on the case's own figure."""
        return self.predicted(efficiency) / self.measured - 1


def load_cases(path: Path) -> list[PublishedCase]:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    models = {name: ModelConfig(**{k: v for k, v in m.items() if k != "source"})
              for name, m in data["models"].items()}
    cases = []
    for c in data["cases"]:
        if c["source"] not in data["sources"] or c["kind"] not in KINDS:
            raise ValueError(f"case {c['id']}: unknown source or kind")
        cases.append(PublishedCase(
            id=c["id"], source=c["source"], gpu=c["gpu"], model=models[c["model"]],
            tp=c["tp"], dtype="bfloat16" if c["dtype"] == "float16" else c["dtype"],
            kv_cache_dtype=c.get("kv_cache_dtype", "auto"), kind=c["kind"],
            measured=float(c["measured"]), unit=c["unit"], held_back=c["held_back"],
            conditions=c["conditions"], input=c.get("input", 0), output=c.get("output", 0),
            batch=c.get("batch", 1), tokens=c.get("tokens", 0)))
    return cases


@dataclass(frozen=True)
class Agreement:
    """Absolute relative errors of a set of cases."""

    errors: dict[str, float]

    @property
    def median_abs(self) -> float:
        return statistics.median(abs(e) for e in self.errors.values())

    @property
    def worst_abs(self) -> float:
        return max(abs(e) for e in self.errors.values())


def agreement(cases: list[PublishedCase], efficiency: OperationEfficiency) -> Agreement:
    return Agreement({c.id: c.error(efficiency) for c in cases})
