"""Workload flags shared by `run`, `bench` and the console: which requests arrive when."""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import TYPE_CHECKING

from console.errors import UserError
from console.sources.workloads import named_workload

if TYPE_CHECKING:  # the engine pulls in torch: kept off the console's launch path (--rate)
    from engine.core.engine_core import EngineCore
    from engine.harness.workload import WorkloadRequest


def add_workload_flags(parser: argparse.ArgumentParser, default: str = "mixed") -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default=default,
                       help="long-doc, chat, mixed, multiturn (conversations resending their "
                            "history), conversations:FILE (JSONL), conv, code (the Azure "
                            "traces), trace:FILE or traced:DB (the requests an attached vLLM "
                            "or SGLang fleet served, from the OTLP traces stored in DB)")
    group.add_argument("--num-requests", type=int, default=None,
                       help="requests to send (default: the profile's own count); for "
                            "multiturn, conversations")
    add_rate_flag(group)
    group.add_argument("--length-scale", type=float, default=None,
                       help="multiply prompt and output lengths (default 1/8 on CPU, 1 on GPU)")
    group.add_argument("--time-scale", type=float, default=1.0,
                       help="stretch (>1) or squeeze (<1) arrival times")
    group.add_argument("--workload-seed", type=int, default=0)


def add_fixed_length_flags(parser: argparse.ArgumentParser) -> None:
    """A fixed-length experiment as `vllm bench` runs one: a requests file, or N prompts of
    random tokens of one length each; either replaces --workload."""
    group = parser.add_argument_group("fixed-length experiment (instead of --workload)")
    group.add_argument("--requests", type=Path, default=None,
                       help="JSONL requests (id, prompt_token_ids or prompt, max_tokens, "
                            "optional arrival_s), as `tokenflow run --requests` takes")
    group.add_argument("--input-len", type=int, default=None, help="prompt tokens of each")
    group.add_argument("--output-len", type=int, default=None, help="output tokens of each")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="how many (default 1000, as vllm bench); all at t=0 unless --rate")


def add_rate_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--rate, for `run`, `bench` and the console (where the Tuning screen turns it live)."""
    parser.add_argument("--rate", type=float, default=None,
                        help="arrivals per second (Poisson for profiles; traces keep their "
                             "pattern, rescaled to this mean rate); inf sends all at once")


# vllm bench's default number of prompts
DEFAULT_NUM_PROMPTS = 1000


def workload_for(args: argparse.Namespace, engine: EngineCore) -> list[WorkloadRequest]:
    fixed = _fixed_length(args, engine)
    if fixed is not None:
        return fixed
    return named_workload(args.workload, engine, num_requests=args.num_requests,
                          rate=args.rate, seed=args.workload_seed,
                          length_scale=args.length_scale, time_scale=args.time_scale)


def _fixed_length(args: argparse.Namespace, engine: EngineCore) -> list[WorkloadRequest] | None:
    """The requests file's or the random fixed-length prompts' requests, if asked for."""
    from engine.harness.workload import WorkloadRequest, load_requests_jsonl

    path = getattr(args, "requests", None)
    lengths = [getattr(args, name, None) for name in ("input_len", "output_len", "num_prompts")]
    if path is None and all(v is None for v in lengths):
        return None
    if path is not None:
        if any(v is not None for v in lengths):
            raise UserError("--requests and --input-len/--output-len/--num-prompts are two "
                            "ways to give the requests; pick one")
        if not Path(path).exists():
            raise UserError(f"--requests {path}: no such file")
        return load_requests_jsonl(path, engine.tokenizer.encode)
    input_len, output_len, count = lengths
    if input_len is None or output_len is None:
        raise UserError("a fixed-length experiment needs both --input-len and --output-len")
    count = DEFAULT_NUM_PROMPTS if count is None else count
    if min(input_len, output_len, count) < 1:
        raise UserError("--input-len, --output-len and --num-prompts must be >= 1")
    if input_len + output_len > engine.max_model_len:
        raise UserError(f"--input-len + --output-len = {input_len + output_len} exceeds the "
                        f"model's length {engine.max_model_len}; shorten them")
    rng = random.Random(args.workload_seed)
    vocab = engine.model_config.vocab_size
    rate = args.rate
    arrival, requests = 0.0, []
    for n in range(count):
        if rate is not None and rate != float("inf") and n:
            arrival += rng.expovariate(rate)
        prompt = tuple(rng.randrange(vocab) for _ in range(input_len))
        requests.append(WorkloadRequest(f"fixed-{n}", arrival, prompt, output_len,
                                        ignore_eos=True))
    return requests
