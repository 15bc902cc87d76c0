"""What calling the CPU kernels through their torch operators (tokenflow::NAME) costs a decode
step, against calling the operators' Python kernels directly: generations alternate between
the two in one process, and each reports its median step in process CPU time. Prints JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/operator_overhead.py [--no-cpu-graphs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

_kernels: dict[str, Callable[..., None]] = {}
_register = torch.library.Library.impl


def _noting(self: torch.library.Library, name: str, fn: Callable[..., None],
            *args: Any, **kwargs: Any) -> Any:
    _kernels[name] = fn
    return _register(self, name, fn, *args, **kwargs)


torch.library.Library.impl = _noting  # before the kernels register their operators

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402


def _generation(engine: Engine) -> float:
    """Median step (ms) of 8 requests of 32 prompt tokens and 40 output tokens."""
    for i in range(8):
        engine.add_request([(7 * i + j) % 250 + 3 for j in range(32)],
                           SamplingParams(max_tokens=40, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        start = time.process_time()
        engine.step()
        times.append(time.process_time() - start)
    return statistics.median(times[5:]) * 1e3  # past the prefills


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:small")
    parser.add_argument("--no-cpu-graphs", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, device="cpu", dtype="float32",
                                 attention_backend="paged", cpu_graphs=not args.no_cpu_graphs,
                                 kv_cache_bytes=1 << 28, cpu_threads=1))
    operators = {name: getattr(cpu_kernels, f"_{name}") for name in _kernels}
    ways = {"operator": operators, "direct": _kernels}
    _generation(engine)
    steps: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, calls in ways.items():
            for name, call in calls.items():
                setattr(cpu_kernels, f"_{name}", call)
            steps[way].append(_generation(engine))
    print(json.dumps({way: {"median_step_ms": round(statistics.median(ms), 2),
                            "steps_ms": [round(m, 2) for m in ms]}
                      for way, ms in steps.items()}))


if __name__ == "__main__":
    main()
