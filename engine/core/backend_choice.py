"""The CPU backends an engine runs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from engine.batch import Batch, ModelRunnerOutput, NewRequest, ScheduledChunk, lent
from engine.config import SamplingParams
from engine.kernels.cpu_kernels import cache_dir
from engine.model.config import ModelConfig

log = logging.getLogger(__name__)

MARGIN = 0.03  # a less simple candidate must be this much faster (median) to be picked
MIN_ROUNDS, MAX_ROUNDS = 3, 9
BUDGET_S = 1.0  # per probe (decode, prefill): no new round starts past it once MIN_ROUNDS ran
# probe shapes: a full and a tail decode batch (overhead weighs most there); a chunk with history
DECODES, TAIL_DECODES, DECODE_CONTEXT = 32, 4, 256
PREFILL_CHUNK, PREFILL_HISTORY = 128, 384

PAGED, TORCH, KERNELS = "paged", "torch", "kernels"
K = TypeVar("K")


@dataclass(frozen=True)
class DecodePath:
    attention: str  # paged | torch
    dense: str  # kernels | torch
    graphs: bool

    @property
    def rank(self) -> int:
        return (self.attention == PAGED) + (self.dense == KERNELS) + self.graphs

    @property
    def name(self) -> str:
        return "/".join((self.attention, self.dense, "graphs" if self.graphs else "eager"))


@dataclass(frozen=True)
class Backends:
    """What a CPU engine runs: the decode path and prefill's attention."""

    decode: DecodePath
    prefill_attention: str  # paged | torch

    def describe(self) -> str:
        return f"decode {self.decode.name}, prefill {self.prefill_attention}"


TORCH_BACKENDS = Backends(DecodePath(TORCH, TORCH, False), TORCH)


@dataclass(frozen=True)
class Choice:
    """The backends picked, how (measured, cached or forced) and the medians behind it."""

    backends: Backends
    how: str  # measured | cached | forced
    decode_ms: dict[str, float]  # candidate name -> median step, ms
    prefill_ms: dict[str, float]
    seconds: float = 0.0  # spent choosing at this start

    def line(self) -> str:
        def figures(medians: Mapping[str, float]) -> str:
            return ", ".join(f"{name} {ms:.1f}" for name, ms in medians.items())

        how = f"measured in {self.seconds:.1f} s" if self.how == "measured" else self.how
        text = f"CPU backends ({how}): {self.backends.describe()}"
        timed = [f"{kind} ms: {figures(medians)}" for kind, medians in
                 (("decode (attention/dense/graphs)", self.decode_ms),
                  ("prefill", self.prefill_ms)) if medians]
        return text + (f" [{'; '.join(timed)}]" if timed else "")


@dataclass(frozen=True)
class Candidates:
    """The paths a start may pick from, after the flags have narrowed them."""

    decode: tuple[DecodePath, ...]
    prefill: tuple[str, ...]


def candidates(attention_backend: str, cpu_graphs: bool | None, kernels: bool,
               graphable: bool, prefill_fits: bool) -> Candidates:
    if attention_backend == TORCH or not kernels:
        return Candidates((TORCH_BACKENDS.decode,), (TORCH,))
    attentions = (PAGED,) if attention_backend == PAGED else (TORCH, PAGED)
    decode = [DecodePath(attention, dense, False) for attention in attentions
              for dense in (TORCH, KERNELS)
              if attention_backend != PAGED or dense == KERNELS]
    graphs = DecodePath(PAGED, KERNELS, True)
    if graphable and cpu_graphs is not False:
        decode = [graphs] if cpu_graphs else [*decode, graphs]
    prefill = (PAGED,) if attention_backend == PAGED and prefill_fits else (
        (TORCH, PAGED) if prefill_fits else (TORCH,))
    return Candidates(tuple(decode), prefill)


def pick(timings: Mapping[K, Sequence[float]], rank: Callable[[K], int],
            margin: float = MARGIN) -> K:
    """The simplest candidate within `margin` of the fastest median."""
    medians = {candidate: statistics.median(times) for candidate, times in timings.items()}
    best = min(medians.values())
    within = [candidate for candidate, median in medians.items()
              if median <= best * (1 + margin)]
    return min(within, key=lambda candidate: (rank(candidate), medians[candidate]))


def interleaved(candidates: Sequence[K], run: Callable[[K], float],
                   clock: Callable[[], float] = time.perf_counter,
                   budget_s: float = BUDGET_S) -> dict[K, list[float]]:
    """Each candidate's times from `run` (seconds)."""
    for candidate in candidates:
        run(candidate)
    times: dict[K, list[float]] = {candidate: [] for candidate in candidates}
    start = clock()
    for rounds in range(MAX_ROUNDS):
        if rounds >= MIN_ROUNDS and clock() - start > budget_s:
            break
        for candidate in candidates:
            times[candidate].append(run(candidate))
    return times


def cache_key(kernel_key: str, shapes: Mapping[str, object], found: Candidates) -> str:
    """What a cached choice is keyed by: kernel build, torch, shapes, threads, candidates."""
    text = json.dumps({"kernels": kernel_key, "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "shapes": shapes,
                       "candidates": dataclasses.asdict(found)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path(key: str, kind: str = "backends") -> Path:
    return cache_dir() / f"{kind}-{key}.json"


def read_cached(path: Path) -> dict | None:
    """A cached choice's JSON; None where there is none (a damaged one is logged, then
    measured again)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"not an object: {type(data).__name__}")
        return data
    except (OSError, ValueError) as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("ignoring the cached choice %s: %s", path, exc)
        return None


def write_cached(path: Path, data: Mapping[str, object]) -> None:
    """Write `data` to `path` atomically (a concurrent start reads all or nothing)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as out:
            json.dump(data, out)
        os.replace(partial, path)
    except OSError as exc:  # a read-only cache costs the next start a measurement, no more
        log.warning("cannot cache the choice in %s: %s", path, exc)


def load_cached(key: str) -> Choice | None:
    data = read_cached(cache_path(key))
    if data is None:
        return None
    try:
        backends = Backends(DecodePath(**data["decode"]), data["prefill_attention"])
        return Choice(backends, "cached", data["decode_ms"], data["prefill_ms"])
    except (KeyError, TypeError) as exc:
        log.warning("ignoring the cached backend choice %s: %s", cache_path(key), exc)
        return None


def store(key: str, choice: Choice) -> None:
    write_cached(cache_path(key), {
        "decode": dataclasses.asdict(choice.backends.decode),
        "prefill_attention": choice.backends.prefill_attention,
        "decode_ms": choice.decode_ms, "prefill_ms": choice.prefill_ms})


def medians_ms(timings: Mapping[K, Sequence[float]], name: Callable[[K], str],
                  ) -> dict[str, float]:
    return {name(candidate): round(statistics.median(times) * 1e3, 3)
            for candidate, times in timings.items()}


class Runner(Protocol):
    """What the probe needs of engine.core.model_runner.ModelRunner."""

    block_size: int
    num_blocks: int
    max_model_len: int
    model_config: ModelConfig

    def apply(self, backends: Backends) -> None: ...
    def run(self, batch: Batch) -> ModelRunnerOutput: ...
    def forward(self, chunks: list[ScheduledChunk]) -> object: ...
    def zero_blocks(self, blocks: list[int]) -> None: ...


def scratch(request_id: str, block_size: int, tokens: list[int], first_block: int, start: int,
            count: int) -> tuple[NewRequest, ScheduledChunk]:
    """A lent request's `count` tokens from `start`, on blocks from `first_block` on."""
    blocks = tuple(range(first_block, first_block + -(-len(tokens) // block_size)))
    return (NewRequest(request_id, tokens, (), SamplingParams(max_tokens=1), blocks),
            ScheduledChunk.of(request_id, start, count, (), count == 1 and start > 0,
                              start + count == len(tokens)))


class StepProbe:
    """Times a runner's decode steps and prefill chunks on each candidate path."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        bs, limit = runner.block_size, runner.max_model_len
        capacity = runner.num_blocks * bs  # a small pool shrinks the probe, never overflows
        context = max(1, min(DECODE_CONTEXT, limit - 1, capacity - 1))
        decodes = max(1, min(DECODES, runner.num_blocks // -(-(context + 1) // bs)))
        history = min(PREFILL_HISTORY, limit // 2, capacity // 2)
        chunk = max(1, min(PREFILL_CHUNK, limit - history, capacity - history))
        tail = min(TAIL_DECODES, decodes)
        self.shapes = {"decodes": [decodes, tail], "decode_context": context,
                       "prefill_chunk": chunk, "prefill_history": history}
        vocab = runner.model_config.vocab_size
        tokens = [(7 * i + 1) % vocab for i in range(max(context + 1, history + chunk))]
        per_decode = -(-(context + 1) // bs)
        scratches = [scratch(f"probe-decode-{i}", bs, tokens[:context + 1], i * per_decode,
                             context, 1) for i in range(decodes)]
        scratches.append(scratch("probe-prefill", bs, tokens[:history + chunk], 0, history,
                                 chunk))
        self.lent = [new for new, _ in scratches]
        batch = [chunk for _, chunk in scratches[:decodes]]
        self.decode_steps = [batch, batch[:tail]]
        self.prefill_step = [scratches[-1][1]]
        self.blocks = max(decodes * -(-(context + 1) // bs), -(-(history + chunk) // bs))

    def _time(self, backends: Backends, steps: list[list[ScheduledChunk]]) -> float:
        self.runner.apply(backends)
        start = time.perf_counter()
        for step in steps:
            self.runner.forward(step)
        return time.perf_counter() - start

    def choose(self, found: Candidates) -> Choice:
        """Time every candidate the flags leave and pick as `pick` does."""
        started = time.perf_counter()
        decode = {found.decode[0]: [0.0]}
        prefill = {found.prefill[0]: [0.0]}
        with lent(self.runner.run, self.lent):
            if len(found.decode) > 1:
                decode = interleaved(found.decode, lambda path: self._time(
                    Backends(path, TORCH), self.decode_steps))
            chosen = pick(decode, lambda path: path.rank)
            if len(found.prefill) > 1:
                prefill = interleaved(found.prefill, lambda attention: self._time(
                    Backends(chosen, attention), [self.prefill_step]))
        attention = pick(prefill, lambda attention: attention == PAGED)
        self.runner.zero_blocks(list(range(self.blocks)))
        return Choice(Backends(chosen, attention), "measured",
                      medians_ms(decode, lambda path: path.name) if len(decode) > 1 else {},
                      medians_ms(prefill, str) if len(prefill) > 1 else {},
                      seconds=time.perf_counter() - started)
