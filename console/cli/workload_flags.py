"""Workload flags shared by `run`, `bench` and the console: which requests arrive when."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from console.cli.given_flags import given
from console.errors import UserError
from console.sources.workloads import named_workload

if TYPE_CHECKING:  # the engine pulls in torch: kept off the console's launch path (--rate)
    from engine.core.engine_core import EngineCore
    from engine.harness.workload import WorkloadRequest


# what --workload names when it is not given
DEFAULT_WORKLOAD = "mixed"


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default=None,
                       help="long-doc, chat, mixed (the default), multiturn (conversations "
                            "resending their history), conversations:FILE (JSONL), conv, code "
                            "(the Azure traces), trace:FILE or traced:DB (the requests an "
                            "attached vLLM or SGLang fleet served, from the OTLP traces "
                            "stored in DB)")
    group.add_argument("--num-requests", type=int, default=None,
                       help="requests to send (default: the profile's own count); for "
                            "multiturn, conversations")
    add_rate_flag(group)
    group.add_argument("--length-scale", type=float, default=None,
                       help="multiply prompt and output lengths (default 1/8 on CPU, 1 on GPU)")
    group.add_argument("--time-scale", type=float, default=None,
                       help="stretch (>1) or squeeze (<1) arrival times (default 1)")
    group.add_argument("--workload-seed", type=int, default=None,
                       help="seed of the requests drawn: lengths, tokens and arrivals "
                            "(default 0)")


def add_fixed_length_flags(parser: argparse.ArgumentParser) -> None:
    """A fixed-length experiment as `vllm bench` runs one: a requests file, or N prompts of
    random tokens of one length each; either replaces --workload."""
    group = parser.add_argument_group("fixed-length experiment (instead of --workload)")
    group.add_argument("--requests", type=Path, default=None,
                       help="JSONL requests (id, prompt_token_ids or prompt, max_tokens, "
                            "optional arrival_s), as `tokenflow run --requests` takes; --rate "
                            "paces a file without arrival_s")
    group.add_argument("--input-len", type=int, default=None, help="prompt tokens of each")
    group.add_argument("--output-len", type=int, default=None, help="output tokens of each")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="how many (default 1000, as vllm bench); all at t=0 unless --rate")


def add_rate_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--rate, for `run`, `bench` and the console (where the Tuning screen turns it live)."""
    parser.add_argument("--rate", type=arrival_rate, default=None,
                        help="arrivals per second (Poisson for profiles and fixed-length "
                             "requests; traces keep their pattern, rescaled to this mean "
                             "rate); inf sends all at once")


def arrival_rate(text: str) -> float:
    """--rate's value: arrivals per second, > 0, or inf."""
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise argparse.ArgumentTypeError(
            f"arrivals per second must be a number > 0, or inf to send all at once; got {text!r}")
    return rate


# vllm bench's default number of prompts
DEFAULT_NUM_PROMPTS = 1000


# flags that shape a named workload, and have nothing to shape where requests are given
_NAMED_ONLY = ("workload", "num_requests", "length_scale", "time_scale")


def workload_name(args: argparse.Namespace) -> str:
    return DEFAULT_WORKLOAD if args.workload is None else args.workload


def _seed(args: argparse.Namespace) -> int:
    return 0 if args.workload_seed is None else args.workload_seed


def workload_for(args: argparse.Namespace, engine: EngineCore) -> list[WorkloadRequest]:
    fixed = _fixed_length(args, engine)
    if fixed is not None:
        return fixed
    return named_workload(workload_name(args), engine, num_requests=args.num_requests,
                          rate=args.rate, seed=_seed(args),
                          length_scale=args.length_scale,
                          time_scale=1.0 if args.time_scale is None else args.time_scale)


def refuse_named_only(args: argparse.Namespace, source: str) -> None:
    """A UserError if a flag that shapes a named workload came with `source`'s requests."""
    named = given(args, _NAMED_ONLY)
    if named:
        raise UserError(f"{', '.join(named)} shape{'s' if len(named) == 1 else ''} a named "
                        f"workload, and {source} gives the requests itself; drop "
                        f"{'it' if len(named) == 1 else 'them'}")


def check_requests_file_flags(args: argparse.Namespace,
                              lines: list[tuple[str, dict[str, Any]]] | None) -> None:
    """A UserError for a flag a requests file leaves nothing to do (its lines, where read)."""
    refuse_named_only(args, "--requests")
    if args.rate is None and args.workload_seed is not None:
        raise UserError("--workload-seed draws a requests file's arrivals only with --rate; "
                        "add --rate, or drop --workload-seed")
    timed = next((where for where, obj in lines or () if "arrival_s" in obj), None)
    if args.rate is not None and timed is not None:
        raise UserError(f"--rate paces a requests file, but {timed} sets its own arrival_s; "
                        "drop --rate, or the file's arrival_s fields")


def requests_file_workload(args: argparse.Namespace, lines: list[tuple[str, dict[str, Any]]],
                           encode: Callable[[str], list[int]],
                           vocab_size: int) -> list[WorkloadRequest]:
    """A requests file's requests: at their `arrival_s`, or paced at --rate in file order."""
    from engine.harness.workload import requests_from_lines, within_span

    check_requests_file_flags(args, lines)
    requests = requests_from_lines(lines, encode, vocab_size=vocab_size)
    if args.rate is None:
        return requests
    rng = random.Random(_seed(args))
    arrivals = itertools.accumulate(_gap(n, args.rate, rng) for n in range(len(requests)))
    return within_span([dataclasses.replace(r, arrival_s=t)
                        for r, t in zip(requests, arrivals, strict=True)])


def _gap(n: int, rate: float | None, rng: random.Random) -> float:
    """The wait before request n's arrival: Poisson at `rate`/s; none before the first, or
    at no rate or inf (all at once)."""
    return rng.expovariate(rate) if n and rate is not None and not math.isinf(rate) else 0.0


def _fixed_length(args: argparse.Namespace, engine: EngineCore) -> list[WorkloadRequest] | None:
    """The requests file's or the random fixed-length prompts' requests, if asked for."""
    from engine.harness.workload import (
        WorkloadRequest,
        check_count,
        check_prompt_tokens,
        request_lines,
        within_span,
    )

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
        return requests_file_workload(args, request_lines(path), engine.tokenizer.encode,
                                      engine.model_config.vocab_size)
    refuse_named_only(args, "--input-len/--output-len/--num-prompts")
    input_len, output_len, count = lengths
    if input_len is None or output_len is None:
        raise UserError("a fixed-length experiment needs both --input-len and --output-len")
    count = DEFAULT_NUM_PROMPTS if count is None else count
    if min(input_len, output_len, count) < 1:
        raise UserError("--input-len, --output-len and --num-prompts must be >= 1")
    check_count(count, "--num-prompts")
    check_prompt_tokens(count * input_len)
    if input_len + output_len > engine.max_model_len:
        raise UserError(f"--input-len + --output-len = {input_len + output_len} exceeds the "
                        f"model's length {engine.max_model_len}; shorten them")
    rng = random.Random(_seed(args))
    vocab = engine.model_config.vocab_size
    arrival, requests = 0.0, []
    for n in range(count):
        arrival += _gap(n, args.rate, rng)
        prompt = tuple(rng.randrange(vocab) for _ in range(input_len))
        requests.append(WorkloadRequest(f"fixed-{n}", arrival, prompt, output_len,
                                        ignore_eos=True))
    return within_span(requests)
