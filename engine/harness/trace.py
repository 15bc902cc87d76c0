"""Request traces: the two Azure traces shipped as package data, and any CSV of the same shape."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.stats import LengthStats

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SAMPLE_MODES = ("window", "stratified")
TRACE_SOURCE = ("Azure LLM inference trace 2023 (Azure Public Dataset, "
                "AzureLLMInferenceDataset2023; Patel et al., Splitwise, ISCA 2024)")
TRACE_LICENSE = "CC-BY 4.0"


@dataclass(frozen=True)
class ShippedTrace:
    name: str
    file: str
    what: str


SHIPPED_TRACES = {
    "conv": ShippedTrace("conv", "azure_llm_2023_conv.csv", "a conversation (chat) service"),
    "code": ShippedTrace("code", "azure_llm_2023_code.csv", "a code-completion service"),
}


class TraceError(EngineError):
    """A trace file cannot be read or sampled; the message names the file and the fix."""


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float
    context_tokens: int
    generated_tokens: int


def shipped_trace(name: str) -> Traversable:
    """The package-data file of the shipped trace `name` ("conv" or "code")."""
    if name not in SHIPPED_TRACES:
        raise TraceError(f"no shipped trace {name!r}; choose one of {', '.join(SHIPPED_TRACES)}")
    return resources.files("engine.harness").joinpath("traces", SHIPPED_TRACES[name].file)


def load_trace(path: Path | str | Traversable) -> list[TraceRow]:
    """Rows of an Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    if isinstance(path, str):
        path = Path(path)
    expected = ", ".join(TRACE_COLUMNS)
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise TraceError(
                    f"{path}: missing column(s) {', '.join(missing)}; a trace needs {expected}"
                )
            parsed = [(_parse_row(path, reader.line_num, row)) for row in reader]
    except OSError as exc:
        raise TraceError(
            f"cannot read trace {path} ({exc.strerror}); give a CSV with columns {expected}"
        ) from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not valid UTF-8; save the trace as UTF-8") from None
    if not parsed:
        raise TraceError(f"{path}: no rows; a trace needs {expected} and at least one row")
    zoned = [ts.utcoffset() is not None for ts, _, _ in parsed]
    if any(zoned) and not all(zoned):
        raise TraceError(
            f"{path}: line {zoned.index(True) + 2} gives TIMESTAMP a UTC offset and line "
            f"{zoned.index(False) + 2} does not; give every row one, or none")
    parsed.sort(key=lambda row: row[0])
    start = parsed[0][0]
    return [TraceRow((ts - start).total_seconds(), ctx, gen) for ts, ctx, gen in parsed]


def _parse_row(path: object, line: int, row: dict[str, str]) -> tuple[datetime, int, int]:
    try:
        parsed = (datetime.fromisoformat(row["TIMESTAMP"]), int(row["ContextTokens"]),
                  int(row["GeneratedTokens"]))
    except (TypeError, ValueError):
        parsed = None
    if parsed is None or parsed[1] < 1 or parsed[2] < 1:
        raise TraceError(
            f"{path}:{line}: bad row {row}; expected TIMESTAMP like '2023-11-16 18:17:03.97996' "
            "and integer ContextTokens, GeneratedTokens >= 1")
    return parsed


def sample_trace(rows: Sequence[TraceRow], n: int, mode: str,
                 rng: random.Random) -> list[TraceRow]:
    """n rows in time order: a window keeps the bursts, strata the length mix and daily shape."""
    if n > len(rows):
        raise TraceError(f"asked for {n} requests but the trace has only {len(rows)} rows")
    if mode == "window":
        start = rng.randrange(len(rows) - n + 1)
        return list(rows[start : start + n])
    if mode == "stratified":
        bounds = [len(rows) * i // n for i in range(n + 1)]
        return [rows[rng.randrange(lo, hi)] for lo, hi in itertools.pairwise(bounds)]
    raise TraceError(f"unknown sample mode {mode!r}; choose one of {', '.join(SAMPLE_MODES)}")


@dataclass(frozen=True)
class TraceSummary:
    """One shipped trace as `tokenflow traces` lists it."""

    name: str
    file: str
    what: str
    requests: int
    duration_s: float
    rate_per_s: float | None
    prompt_tokens: LengthStats
    output_tokens: LengthStats
    source: str = TRACE_SOURCE
    license: str = TRACE_LICENSE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def shipped_trace_summaries() -> list[TraceSummary]:
    summaries = []
    for trace in SHIPPED_TRACES.values():
        rows = load_trace(shipped_trace(trace.name))
        duration = rows[-1].arrival_s
        summaries.append(TraceSummary(
            name=trace.name, file=trace.file, what=trace.what, requests=len(rows),
            duration_s=duration,
            # n arrivals span n - 1 gaps, as workload.describe counts a rate
            rate_per_s=(len(rows) - 1) / duration if duration > 0 else None,
            prompt_tokens=LengthStats.of(r.context_tokens for r in rows),
            output_tokens=LengthStats.of(r.generated_tokens for r in rows)))
    return summaries
