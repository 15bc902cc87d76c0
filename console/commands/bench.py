"""`tokenflow bench`: one workload under several configurations in one process.

Built-in configurations: `chunked` (the default token budget), `unchunked` (a budget as large
as the longest prompt plus a decode per running request, prompts never split). More with
`--config NAME:field=value,...`. Every run replays the same requests at the same times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Any

import torch

from console.commands.engine_flags import add_engine_flags, engine_config
from console.commands.workload_flags import add_workload_flags, workload_for
from console.errors import UserError
from engine.config import EngineConfig
from engine.driver import drive
from engine.engine import Engine
from engine.workload import WorkloadRequest, describe


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="compare configurations on one workload",
                                   description=__doc__)
    add_engine_flags(parser)
    add_workload_flags(parser)
    parser.add_argument("--compare", default="chunked,unchunked",
                        help="comma-separated configuration names (default chunked,unchunked)")
    parser.add_argument("--config", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="define a named configuration, e.g. small:max_num_batched_tokens=128")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.set_defaults(func=bench)


def bench(args: argparse.Namespace) -> int:
    base = engine_config(args)
    names = [n.strip() for n in args.compare.split(",") if n.strip()]
    custom = dict(_parse_config(spec) for spec in args.config)
    probe = Engine(base)
    workload = workload_for(args, probe)
    longest = max(len(w.prompt_token_ids) for w in workload)
    configs = {name: _named_config(name, base, custom, longest, probe.max_model_len)
               for name in names}
    report: dict[str, Any] = {
        "workload": {"spec": args.workload, **describe(workload).to_dict()},
        "machine": _machine(probe),
        "runs": {},
    }
    del probe
    for name, config in configs.items():
        report["runs"][name] = run_one(config, workload)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


def run_one(config: EngineConfig, workload: list[WorkloadRequest]) -> dict[str, Any]:
    engine = Engine(config)
    result = drive(engine, workload)
    return {"config": config.live_values(), **result.summary()}


def _named_config(name: str, base: EngineConfig, custom: dict[str, dict[str, str]],
                  longest: int, max_model_len: int) -> EngineConfig:
    if name in custom:
        return base.replace(**custom[name])
    if name == "chunked":
        return base
    if name == "unchunked":
        budget = max(base.max_num_batched_tokens, min(longest, max_model_len) + base.max_num_seqs)
        return base.replace(max_num_batched_tokens=budget, chunked_prefill=False)
    known = ", ".join(["chunked", "unchunked", *custom])
    raise UserError(f"unknown configuration {name!r}; known: {known} "
                    f"(define more with --config NAME:field=value)")


def _parse_config(spec: str) -> tuple[str, dict[str, str]]:
    name, sep, body = spec.partition(":")
    if not sep or not name:
        raise UserError(f"--config {spec!r}: expected NAME:field=value,...")
    fields: dict[str, str] = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--config {spec!r}: {item!r} is not field=value")
        fields[key.strip()] = value.strip()
    EngineConfig().replace(**fields)  # ConfigError names a bad field now, before any run
    return name, fields


def _machine(engine: Engine) -> dict[str, Any]:
    peaks = engine.peaks
    return {
        "device": str(engine.runner.device),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "model": engine.config.model,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "peak_flops": peaks.flops,
        "peak_bandwidth": peaks.bandwidth,
        "peaks_source": peaks.source,
        **({"gpu": torch.cuda.get_device_name(engine.runner.device)}
           if engine.runner.device.type == "cuda" else {}),
    }


def _print_table(report: dict[str, Any]) -> None:
    runs = report["runs"]
    header = (f"{'config':<14}{'out tok/s':>10}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'TPOT p50':>10}{'TPOT p99':>10}{'ITL max':>9}{'preempt':>9}{'slow':>6}")
    print(f"workload {report['workload']['spec']}: {report['workload']['requests']} requests "
          f"on {report['machine']['model']} ({report['machine']['device']})")
    print(header)
    for name, r in runs.items():
        print(f"{name:<14}{r['output_tok_s']:>10.1f}{r['throughput_tok_s']:>9.1f}"
              f"{_f(r['ttft_ms']['p50']):>10}{_f(r['ttft_ms']['p99']):>10}"
              f"{_f(r['tpot_ms']['p50']):>10}{_f(r['tpot_ms']['p99']):>10}"
              f"{_f(r['itl_ms']['max']):>9}{r['preemptions']:>9}{r['slow_queries']:>6}")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"

