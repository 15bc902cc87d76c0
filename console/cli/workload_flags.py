"""Workload flags shared by `run`, `bench` and the console: which requests arrive when."""

from __future__ import annotations

import argparse

from engine.core.engine import Engine
from engine.harness.workload import WorkloadRequest, build_workload, default_length_scale


def add_workload_flags(parser: argparse.ArgumentParser, default: str = "mixed") -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default=default,
                       help="long-doc, chat, mixed, multiturn (conversations resending their "
                            "history), conversations:FILE (JSONL), conv, code (the Azure "
                            "traces) or trace:FILE")
    group.add_argument("--num-requests", type=int, default=None,
                       help="requests to send (default: the profile's own count); for "
                            "multiturn, conversations")
    group.add_argument("--rate", type=float, default=None,
                       help="arrivals per second (Poisson for profiles; traces keep their "
                            "pattern, rescaled to this mean rate); inf sends all at once")
    group.add_argument("--length-scale", type=float, default=None,
                       help="multiply prompt and output lengths (default 1/8 on CPU, 1 on GPU)")
    group.add_argument("--time-scale", type=float, default=1.0,
                       help="stretch (>1) or squeeze (<1) arrival times")
    group.add_argument("--workload-seed", type=int, default=0)


def workload_for(args: argparse.Namespace, engine: Engine) -> list[WorkloadRequest]:
    scale = args.length_scale
    if scale is None:
        scale = default_length_scale(engine.runner.device.type)
    return build_workload(args.workload, vocab_size=engine.model_config.vocab_size,
                          max_model_len=engine.max_model_len, num_requests=args.num_requests,
                          rate=args.rate, seed=args.workload_seed, length_scale=scale,
                          time_scale=args.time_scale, encode=engine.tokenizer.encode)
