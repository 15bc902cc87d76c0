"""The one script to run when a session is lent a GPU: checks every CUDA path and measures.

1. Exactness on CUDA: a tiny synthetic model's greedy tokens, generated with chunked prefill
   under several budgets, equal the CPU engine's (fp32 on both).
2. Attention backend: flash-attn if importable (varlen + block table), else torch SDPA; both
   report which one ran.
3. Timing: a quick calibration sweep on CUDA events; its held-out error.
4. Telemetry: NVML's memory-busy share and, on Hopper and later, GPM's DRAM-active, sampled
   during the sweep, beside the bytes/s the budget model estimates.
5. Roofline: benchmarks/step_micro.py on the GPU: measured peaks and one prefill chunk / one
   decode step as MFU / MBU, on synthetic:1b in bf16.
6. Ride-along: step_micro's step curve on the GPU, D decodes beside a P-token chunk. Issues 3
   and 9's latency targets need a chunk to ride along a decode step nearly free (ride_along
   near 0 below C*); on the 2-core CPU it measured 0.6-1.0.
7. Compiled (issue 18): the torch.compile'd engine on CUDA, whose steps of up to
   CUDA_GRAPH_MAX_TOKENS tokens replay as CUDA graphs: greedy tokens equal the CPU engine's
   (fp32), then decode steps at several D and a prefill chunk, eager against compiled, on
   `--model` in bf16, with the compile time.
8. Targets (only with --checks naming it; minutes): issue 3's and issue 9's `tokenflow bench`
   comparisons on CUDA, each as bench's JSON: mixed chunked/unchunked, the conversation trace
   chunked/hf, and capacity at the TPOT SLO, auto/unchunked.

Prints one JSON object; exits 0 with {"cuda": false} where there is no GPU, so it is safe
anywhere. Never part of CI.

Here, once: `./scripts/gpu_prepare` (the wheels the GPU image lacks, into .gpu/).
There, with the device tool's `run`, carry [".gpu"]:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .gpu/wheels/*.whl && PYTHONPATH=/tmp/site:. \
        python3 benchmarks/gpu_check.py [--model synthetic:1b] [--checks all]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from step_micro import (  # run from benchmarks/, as the usage line says
    _decodes,
    _engine,
    _request,
    _timed,
    measure,
    step_curve,
)

from engine import Engine, EngineConfig, SamplingParams
from engine.core.request import RequestState
from engine.harness.calibrate import calibrate
from engine.kernels.attention import flash_available
from engine.model.transformer import CUDA_GRAPH_MAX_TOKENS
from engine.ops.telemetry import NvmlBandwidth, TelemetryError, nvml_available

PROMPTS = [[3 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((1, 17, 64, 200))]


def exactness() -> dict[str, Any]:
    """Greedy tokens on CUDA under several budgets against the CPU engine's."""
    params = SamplingParams(max_tokens=12)
    reference = Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                    dtype="float32")).generate(PROMPTS, params)
    by_budget = {}
    for budget in (16, 64, 4096):
        engine = Engine(EngineConfig(model="synthetic:tiny", device="cuda", dtype="float32",
                                     max_num_batched_tokens=budget, chunk_tile=16))
        by_budget[budget] = engine.generate(PROMPTS, params) == reference
    return {"greedy_equal_to_cpu": by_budget, "ok": all(by_budget.values())}


def compiled(model: str) -> dict[str, Any]:
    """The compiled path with CUDA graphs: exact against the CPU, then eager vs compiled."""
    params = SamplingParams(max_tokens=12)
    reference = Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                    dtype="float32")).generate(PROMPTS, params)
    exact = {}
    for budget in (16, 4096):  # graphed decode steps beside compiled prefill steps
        engine = Engine(EngineConfig(model="synthetic:tiny", device="cuda", dtype="float32",
                                     max_num_batched_tokens=budget, compile=True))
        exact[budget] = engine.generate(PROMPTS, params) == reference
    engines = {"eager": _engine(model, "cuda", "bfloat16"),
               "compiled": _engine(model, "cuda", "bfloat16", compile=True)}
    timings: dict[str, dict[str, float]] = {}
    for name, engine in engines.items():
        running = _decodes(engine, 64, 512)
        prefill = _request(engine, "prefill", 1024, RequestState.PREFILL_CHUNKING)
        timings[name] = {f"decode_{d}_ms": _timed(engine, running[:d], 3, 20) * 1e3
                         for d in (1, 8, 32, CUDA_GRAPH_MAX_TOKENS)}
        timings[name]["prefill_1024_ms"] = _timed(
            engine, [prefill.chunk(0, 1024)], 2, 10) * 1e3
    return {"greedy_equal_to_cpu": exact, "ok": all(exact.values()),
            "compile_s": engines["compiled"].runner.compile_s, "model": model, **timings}


def roofline(model: str) -> dict[str, Any]:
    """step_micro's shapes on the GPU in bf16, timed with CUDA events."""
    return {"gpu": torch.cuda.get_device_name(0),
            **measure(model, device="cuda", dtype="bfloat16", repeats=20)}


def ride_along(model: str) -> list[dict[str, Any]]:
    return step_curve(model, device="cuda", dtype="bfloat16", decodes=(0, 8, 32, 128),
                      prefills=(0, 64, 256, 512, 1024, 2048), context=1024, repeats=20)


# issue 3 (mixed), issue 9 (conversation trace against hf; capacity at the TPOT SLO)
TARGET_BENCHES = {
    "mixed": ["--workload", "mixed", "--compare", "chunked,unchunked"],
    "conv": ["--workload", "conv", "--compare", "chunked,hf"],
    "capacity": ["--workload", "conv", "--compare", "auto,unchunked", "--capacity"],
}


def targets(model: str, device: str = "cuda", dtype: str = "bfloat16") -> dict[str, Any]:
    """`tokenflow bench --json` for each of TARGET_BENCHES. Only bench's own front door is
    imported: the others need packages (Textual, uvicorn) that the GPU image lacks."""
    from console.cli import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    db = Path(tempfile.mkdtemp()) / "bench.db"  # no calibration stored: roofline predictions
    reports = {}
    for name, flags in TARGET_BENCHES.items():
        args = parser.parse_args(["bench", "--model", model, "--device", device, "--dtype",
                                  dtype, "--db", str(db), "--json", *flags])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            args.func(args)
        reports[name] = json.loads(printed.getvalue())
    return reports


def calibration(model: str) -> dict[str, Any]:
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16",
                                 max_model_len=4096))
    started = time.perf_counter()
    result = calibrate(engine, quick=True)
    busy = [p.nvml_memory_busy for p in result.points if p.nvml_memory_busy is not None]
    dram = [p.dram_active for p in result.points if p.dram_active is not None]
    estimated = [p.bandwidth_utilization for p in result.points]
    return {
        "wall_s": time.perf_counter() - started,
        "heldout_median_abs_error": result.heldout_median_abs_error,
        "points": len(result.points),
        "median_estimated_bandwidth_utilization": statistics.median(estimated),
        "median_nvml_memory_busy": statistics.median(busy) if busy else None,
        "median_dram_active": statistics.median(dram) if dram else None,
    }


def telemetry() -> dict[str, Any]:
    if not nvml_available():
        return {"nvml": False}
    monitor = NvmlBandwidth(interval_s=0.1, torch_device="cuda:0")
    try:
        monitor.start()
    except TelemetryError as exc:
        return {"nvml": False, "error": str(exc)}
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # keep the memory busy across a few samples
        x = x * 1.0001
    torch.cuda.synchronize()
    sample = monitor.latest()
    monitor.stop()
    return {"nvml": True, "latest": None if sample is None else sample.__dict__,
            "reading": monitor.reading().util_5s}


CHECKS = ("exactness", "compiled", "telemetry", "roofline", "ride_along", "calibration",
          "targets")
DEFAULT_CHECKS = CHECKS[:-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:1b")
    parser.add_argument("--checks", default=",".join(DEFAULT_CHECKS),
                        help=f"comma-separated, or 'all': {', '.join(CHECKS)} "
                             f"(default: all but targets)")
    args = parser.parse_args()
    chosen = CHECKS if args.checks == "all" else tuple(args.checks.split(","))
    unknown = set(chosen) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "flash_attn": False}))
        return 0
    runs = {"exactness": exactness, "compiled": lambda: compiled(args.model),
            "telemetry": telemetry,
            "roofline": lambda: roofline(args.model),
            "ride_along": lambda: ride_along(args.model),
            "calibration": lambda: calibration(args.model),
            "targets": lambda: targets(args.model)}
    report: dict[str, Any] = {"cuda": True, "torch": torch.__version__,
                              "flash_attn": flash_available(torch.device("cuda"))}
    for name in chosen:
        try:
            report[name] = runs[name]()
        except Exception as exc:  # report every check, even after one fails
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(report, indent=2, default=str))
    exact = all(report.get(check, {"ok": True}).get("ok") for check in ("exactness", "compiled"))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
