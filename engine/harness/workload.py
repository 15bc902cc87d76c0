"""What requests arrive when: profiles, multi-turn conversations, trace replay, JSONL files."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import SamplingParams
from engine.errors import EngineError
from engine.harness.conversations import (
    MAX_ARRIVAL_S,
    MULTITURN,
    OPEN_LOOP_TURN_GAP_S,
    Conversation,
    json_object,
    load_conversations,
    multiturn_conversations,
)
from engine.harness.trace import SHIPPED_TRACES, TraceRow, load_trace, sample_trace, shipped_trace
from engine.stats import LengthStats

# Token ids 0..2 are special (pad/bos/eos) in the synthetic tokenizer; prompts avoid them.
FIRST_PROMPT_TOKEN_ID = 3

# Profiles' GPU lengths over 8: a CPU run takes tens of seconds, long documents still chunk.
CPU_LENGTH_SCALE = 1 / 8
GPU_LENGTH_SCALE = 1.0

INT64_LIMIT = 2**63

# A run keeps every request's prompt and timeline in memory, and draws the whole workload
# before its first step: past these it would fill the host's memory before refusing anything.
MAX_REQUESTS = 100_000
MAX_PROMPT_TOKENS = 100_000_000


class WorkloadError(EngineError):
    """A workload spec or request file cannot be used (trace files raise TraceError)."""


class UnknownWorkload(WorkloadError):
    """A spec that names no workload; `choices` are the ones build_workload knows."""

    def __init__(self, spec: str, choices: list[str]) -> None:
        super().__init__(f"unknown workload {spec!r}; choose one of {', '.join(choices)}")
        self.spec = spec
        self.choices = choices


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    tenant: str = "default"
    tag: str | None = None
    priority: int = 0
    # Profiles and traces fix the output length; the caller must then ignore EOS.
    ignore_eos: bool = False
    # A conversation's next turn, sent after request `follows` replies (engine.harness.driver).
    follows: str | None = None
    history_tokens: int = 0
    think_s: float = 0.0

    def sampling_params(self) -> SamplingParams:
        return _sampling_params(self.max_tokens, self.ignore_eos)


@functools.lru_cache(maxsize=1024, typed=True)
def _sampling_params(max_tokens: int, ignore_eos: bool) -> SamplingParams:
    """Validated once per pair: a workload's requests repeat a few, and a frozen
    SamplingParams holds only immutable values, so its requests share it."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)


@dataclass(frozen=True)
class Shape:
    """One kind of request in a profile, at GPU scale."""

    tag: str
    prompt_len: int
    output_len: int
    tenant: str


@dataclass(frozen=True)
class Profile:
    name: str
    main: Shape
    num_requests: int
    rate: float
    rare: Shape | None = None
    rare_share: float = 0.0


PROFILES: dict[str, Profile] = {
    "long-doc": Profile("long-doc", Shape("long-doc", 8000, 200, "default"),
                        num_requests=8, rate=0.5),
    "chat": Profile("chat", Shape("chat", 200, 800, "default"), num_requests=64, rate=8.0),
    "mixed": Profile("mixed", Shape("chat", 200, 800, "interactive"), num_requests=32,
                     rate=4.0, rare=Shape("long-doc", 8000, 200, "batch"), rare_share=0.125),
}
TRACE_DEFAULT_REQUESTS = 64

LENGTH_JITTER = 0.25


def default_length_scale(device: str) -> float:
    return CPU_LENGTH_SCALE if device == "cpu" else GPU_LENGTH_SCALE


def build_workload(
    spec: str,
    *,
    vocab_size: int,
    max_model_len: int,
    num_requests: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    length_scale: float = CPU_LENGTH_SCALE,
    time_scale: float = 1.0,
    sample: str = "window",
    encode: Callable[[str], list[int]] | None = None,
) -> list[WorkloadRequest]:
    """Requests for `spec`: a profile, multiturn, conversations:PATH, conv, code or trace:PATH."""
    check_scale("length_scale", length_scale)
    check_scale("time_scale", time_scale)
    if rate is not None:
        _check_positive("rate", rate)
    check_count(num_requests)
    if vocab_size <= FIRST_PROMPT_TOKEN_ID:
        raise WorkloadError(f"vocab_size must exceed {FIRST_PROMPT_TOKEN_ID}, got {vocab_size}")
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len must be at least 2, got {max_model_len}")
    rng = random.Random(seed)
    if spec == "multiturn" or spec.startswith("conversations:"):
        if spec == "multiturn":
            # num_requests counts conversations here: each holds MULTITURN.turns requests
            conversations = multiturn_conversations(
                MULTITURN, num_conversations=num_requests, rate=rate,
                length_scale=length_scale, vocab_size=vocab_size,
                max_model_len=max_model_len, rng=rng)
        else:
            conversations = load_conversations(spec.split(":", 1)[1], encode)
        requests = conversation_requests(conversations, vocab_size=vocab_size,
                                         max_model_len=max_model_len, time_scale=time_scale,
                                         rng=rng)
        if not requests:
            shortest = min(len(c.system) + len(c.turns[0].user) + c.turns[0].max_tokens
                           for c in conversations)
            raise WorkloadError(
                f"no conversation's first turn fits the model's {max_model_len} tokens (the "
                f"shortest needs {shortest} with its reply): lower --length-scale, shorten "
                f"the conversations or raise --max-model-len")
        return within_span(requests)
    if spec in PROFILES:
        profile = PROFILES[spec]
        drafts = _profile_drafts(profile, num_requests or profile.num_requests,
                                 profile.rate if rate is None else rate, rng)
        label = profile.name
    elif spec in SHIPPED_TRACES or spec.startswith("trace:"):
        if spec in SHIPPED_TRACES:
            rows, label = load_trace(shipped_trace(spec)), spec
        else:
            rows, label = load_trace(spec[6:]), Path(spec[6:]).stem
        drafts = _trace_drafts(rows, num_requests or TRACE_DEFAULT_REQUESTS, rate, sample, label,
                               rng)
    else:
        raise UnknownWorkload(spec, [*PROFILES, "multiturn", "conversations:PATH",
                                     *SHIPPED_TRACES, "trace:PATH"])
    lengths = [_lengths(draft, length_scale, max_model_len) for draft in drafts]
    # every prompt's ids in one draw, as one rng.choices call a prompt would draw them
    ids = prompt_ids(rng, vocab_size, sum(prompt_len for prompt_len, _ in lengths))
    requests, start = [], 0
    for i, (draft, (prompt_len, output_len)) in enumerate(zip(drafts, lengths, strict=True)):
        requests.append(WorkloadRequest(
            f"{label}-{i:05d}", draft.arrival_s * time_scale,
            tuple(ids[start:start + prompt_len].tolist()), output_len, tenant=draft.tenant,
            tag=draft.tag, ignore_eos=True))
        start += prompt_len
    return within_span(requests)


@dataclass(frozen=True)
class _Draft:
    """A request before scaling: GPU-scale lengths and unscaled arrival."""

    arrival_s: float
    prompt_len: int
    output_len: int
    tenant: str
    tag: str


def _profile_drafts(profile: Profile, n: int, rate: float, rng: random.Random) -> list[_Draft]:
    # An exact count of rare requests, at random positions, so even a short run holds one.
    rare_count = min(n - 1, max(1, round(n * profile.rare_share))) if profile.rare else 0
    kinds = [profile.main] * (n - rare_count)
    if profile.rare:
        kinds += [profile.rare] * rare_count
    rng.shuffle(kinds)
    arrivals = _poisson_arrivals(n, rate, rng)
    return [
        _Draft(t, _jitter(shape.prompt_len, rng), _jitter(shape.output_len, rng), shape.tenant,
               shape.tag)
        for t, shape in zip(arrivals, kinds, strict=True)
    ]


def _poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    arrivals = [0.0]
    for _ in range(n - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(rate))
    return arrivals


def _jitter(mean: int, rng: random.Random) -> int:
    return round(mean * rng.uniform(1 - LENGTH_JITTER, 1 + LENGTH_JITTER))


def _lengths(draft: _Draft, length_scale: float, max_model_len: int) -> tuple[int, int]:
    """A draft's prompt and output lengths, scaled, within the model's length."""
    # clipped before rounding: a scaled length may pass any integer a float can hold
    prompt_len = max(1, round(min(draft.prompt_len * length_scale, max_model_len - 1)))
    output_len = max(1, round(min(draft.output_len * length_scale, max_model_len - prompt_len)))
    return prompt_len, output_len


def prompt_ids(rng: random.Random, vocab_size: int, count: int) -> np.ndarray:
    """`rng.choices(range(FIRST_PROMPT_TOKEN_ID, vocab_size), k=count)`: the same ids, and
    `rng` left where that call leaves it. numpy draws them from `rng`'s own Mersenne Twister
    state, with the same doubles and the same floor(random() * n): a Python call a token was
    most of a simulated bench's start-up. An array, sliced a prompt at a time: a list of
    millions would be walked by every young collection while the workload is built."""
    check_prompt_tokens(count)
    version, state, gauss = rng.getstate()
    twister = np.random.RandomState()
    twister.set_state(("MT19937", np.array(state[:-1], dtype=np.uint32), state[-1]))
    ids = np.floor(twister.random_sample(count) * float(vocab_size - FIRST_PROMPT_TOKEN_ID))
    _, keys, position, _, _ = twister.get_state()
    rng.setstate((version, (*keys.tolist(), position), gauss))
    return ids.astype(np.int64) + FIRST_PROMPT_TOKEN_ID


def conversation_requests(conversations: Sequence[Conversation], *, vocab_size: int,
                          max_model_len: int, time_scale: float,
                          rng: random.Random) -> list[WorkloadRequest]:
    """Each turn as a request: history plus message, a placeholder reply until it is known."""
    requests = []
    for conversation in conversations:
        history: tuple[int, ...] = conversation.system
        previous: WorkloadRequest | None = None
        arrival = conversation.arrival_s * time_scale
        for index, turn in enumerate(conversation.turns):
            prompt = history + turn.user
            if len(prompt) + turn.max_tokens > max_model_len:
                break
            request = WorkloadRequest(
                f"{conversation.conversation_id}-t{index}", arrival, prompt, turn.max_tokens,
                tenant=conversation.tenant, tag="multiturn", ignore_eos=True,
                follows=previous.request_id if previous else None,
                history_tokens=len(history) if previous else 0,
                think_s=turn.think_s * time_scale)
            requests.append(request)
            reply = tuple(rng.choices(range(FIRST_PROMPT_TOKEN_ID, vocab_size),
                                      k=turn.max_tokens))
            history, previous = prompt + reply, request
            arrival += OPEN_LOOP_TURN_GAP_S * time_scale
    return sorted(requests, key=lambda r: r.arrival_s)


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise WorkloadError(f"{name} must be > 0, got {value}")


def check_scale(name: str, value: float) -> None:
    """A scale multiplies every length or arrival: infinity leaves none to send."""
    if not (value > 0 and math.isfinite(value)):
        raise WorkloadError(f"{name} must be a finite number > 0, got {value}")


def check_count(num_requests: int | None, name: str = "num_requests") -> None:
    if num_requests is not None and not 1 <= num_requests <= MAX_REQUESTS:
        raise WorkloadError(f"{name} must be in [1, {MAX_REQUESTS}], got {num_requests}:"
                            " a run keeps every request's prompt and timeline in memory; "
                            "split a larger one into runs")


def check_prompt_tokens(total: int) -> None:
    if total > MAX_PROMPT_TOKENS:
        raise WorkloadError(f"the workload's prompts total {total} tokens, past the "
                            f"{MAX_PROMPT_TOKENS} one run holds in memory: send fewer "
                            "requests, or shorter ones (--length-scale, --input-len)")


def within_span(requests: list[WorkloadRequest]) -> list[WorkloadRequest]:
    """`requests`, if the last of them arrives by MAX_ARRIVAL_S, as a requests file's must."""
    last = max((r.arrival_s for r in requests), default=0.0)
    if last > MAX_ARRIVAL_S:
        raise WorkloadError(
            f"the last request would arrive at {last:.4g} s, past the {MAX_ARRIVAL_S:g} s (11.6 "
            f"days) a workload may span: raise --rate, lower --time-scale or send fewer requests")
    return requests


def _trace_drafts(rows: list[TraceRow], n: int, rate: float | None, mode: str, label: str,
                  rng: random.Random) -> list[_Draft]:
    chosen = sample_trace(rows, n, mode, rng)
    first = chosen[0].arrival_s
    offsets = [row.arrival_s - first for row in chosen]
    if rate is not None and math.isinf(rate):
        offsets = [0.0] * n
    elif rate is not None and offsets[-1] > 0:
        stretch = (n - 1) / rate / offsets[-1]
        offsets = [t * stretch for t in offsets]
    return [_Draft(t, row.context_tokens, row.generated_tokens, "default", label)
            for t, row in zip(offsets, chosen, strict=True)]


def steady_count(rate: float, duration_s: float, min_requests: int = 1) -> int:
    """The requests steady traffic at `rate`/s sends over `duration_s`, at least `min_requests`."""
    return max(min_requests, math.ceil(rate * duration_s))


def steady_traffic(sample: Sequence[WorkloadRequest], rate: float, duration_s: float,
                   min_requests: int = 1) -> list[WorkloadRequest]:
    """`sample` repeated at `rate`/s (gap pattern kept), long enough for a queue to build."""
    _check_positive("rate", rate)
    if not 0 <= duration_s <= MAX_ARRIVAL_S or not sample:
        raise WorkloadError(f"steady traffic needs a non-empty sample and duration_s in "
                            f"[0, {MAX_ARRIVAL_S:g}], got {duration_s}")
    ordered = sorted(sample, key=lambda w: w.arrival_s)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(ordered)]
    mean_gap = sum(gaps) / len(gaps) if gaps else 0.0
    gaps.append(mean_gap)
    scale = 1 / (rate * mean_gap) if mean_gap > 0 else None
    count = steady_count(rate, duration_s, min_requests)
    traffic: list[WorkloadRequest] = []
    arrival = 0.0
    for k in range(count):
        copy, index = divmod(k, len(ordered))
        request = ordered[index]
        request_id = request.request_id if copy == 0 else f"{request.request_id}-{copy}"
        traffic.append(dataclasses.replace(request, request_id=request_id, arrival_s=arrival))
        arrival += gaps[index] * scale if scale is not None else 1 / rate
    return traffic


def load_requests_jsonl(path: Path | str, tokenizer_encode: Callable[[str], list[int]], *,
                        vocab_size: int | None = None) -> list[WorkloadRequest]:
    """One JSON object per line (see docs/harness.md); any bad line fails the whole file, named."""
    return requests_from_lines(request_lines(path), tokenizer_encode, vocab_size=vocab_size)


def requests_from_lines(lines: Sequence[tuple[str, dict[str, Any]]],
                        tokenizer_encode: Callable[[str], list[int]], *,
                        vocab_size: int | None = None) -> list[WorkloadRequest]:
    """The requests of lines `request_lines` read (each checked, named by its line)."""
    requests: list[WorkloadRequest] = []
    seen: set[str] = set()
    for where, obj in lines:
        request = _parse_request(where, obj, tokenizer_encode, vocab_size)
        if request.request_id in seen:
            raise WorkloadError(f"{where}: field 'id': {request.request_id!r} repeats "
                                "an earlier line; ids must be unique")
        seen.add(request.request_id)
        requests.append(request)
    return sorted(requests, key=lambda r: r.arrival_s)


def request_lines(path: Path | str) -> list[tuple[str, dict[str, Any]]]:
    """Each non-blank line as ("PATH:LINE", its object), checked; cheap: run before loading."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read request file {path} ({exc.strerror})") from None
    found = []
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WorkloadError(f"{path}:{number}: not valid UTF-8 (byte {exc.start + 1} of "
                                "the line); save the file as UTF-8") from None
        if line.strip():
            where = f"{path}:{number}"
            found.append((where, json_object(where, line, WorkloadError)))
    return found


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse_request(where: str, obj: dict[str, Any],
                   tokenizer_encode: Callable[[str], list[int]],
                   vocab_size: int | None) -> WorkloadRequest:
    def bad(field: str, need: str) -> WorkloadError:
        return WorkloadError(f"{where}: field {field!r}: {need}, got {obj.get(field)!r}")

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for name in ("id", "prompt", "tenant", "tag"):
        if isinstance(obj.get(name), str) and not _is_unicode(obj[name]):
            raise WorkloadError(f"{where}: field {name!r}: holds a lone surrogate escape "
                                "(\\ud800-\\udfff alone); text must be valid Unicode")
    request_id = obj.get("id")
    if not isinstance(request_id, str) or not request_id:
        raise bad("id", "must be a non-empty string")
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        raise WorkloadError(f"{where}: give exactly one of 'prompt' (text) or 'prompt_token_ids'")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise bad("prompt", "must be non-empty text")
        prompt = tuple(tokenizer_encode(obj["prompt"]))
    else:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids):
            raise bad("prompt_token_ids", "must be a non-empty list of non-negative integers")
        outside = next((t for t in ids if vocab_size is not None and t >= vocab_size), None)
        if outside is not None:
            shown = outside if outside < 10**12 else f"of {len(str(outside))} digits"
            raise WorkloadError(f"{where}: field 'prompt_token_ids': token id {shown} is "
                                f"outside the model's vocabulary (0 to {vocab_size - 1})")
        prompt = tuple(ids)
    if not is_int(obj.get("max_tokens")) or obj["max_tokens"] < 1:
        raise bad("max_tokens", "must be an integer >= 1")
    if not isinstance(obj.get("tenant", "default"), str):
        raise bad("tenant", "must be a string")
    if not isinstance(obj.get("tag", ""), str | None):
        raise bad("tag", "must be a string")
    priority = obj.get("priority", 0)
    if not is_int(priority) or not -INT64_LIMIT <= priority < INT64_LIMIT:
        raise bad("priority", "must be an integer in [-2^63, 2^63)")
    arrival = obj.get("arrival_s", 0.0)
    if (isinstance(arrival, bool) or not isinstance(arrival, int | float)
            or not 0 <= arrival <= MAX_ARRIVAL_S):
        raise bad("arrival_s", f"must be a number of seconds in [0, {MAX_ARRIVAL_S:g}]")
    if not isinstance(obj.get("ignore_eos", False), bool):
        raise bad("ignore_eos", "must be true or false")
    return WorkloadRequest(request_id, float(arrival), prompt, obj["max_tokens"],
                           tenant=obj.get("tenant", "default"), tag=obj.get("tag"),
                           priority=priority,
                           ignore_eos=obj.get("ignore_eos", False))


@dataclass(frozen=True)
class WorkloadStats:
    """What bench JSON reports under "workload"."""

    requests: int
    tenants: dict[str, int]
    prompt_tokens: LengthStats
    output_tokens: LengthStats
    duration_s: float
    rate_per_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def describe(requests: Sequence[WorkloadRequest]) -> WorkloadStats:
    if not requests:
        raise WorkloadError("cannot describe an empty workload")
    arrivals = [r.arrival_s for r in requests]
    duration = max(arrivals) - min(arrivals)
    return WorkloadStats(
        requests=len(requests),
        tenants=dict(sorted(Counter(r.tenant for r in requests).items())),
        prompt_tokens=LengthStats.of([len(r.prompt_token_ids) for r in requests]),
        output_tokens=LengthStats.of([r.max_tokens for r in requests]),
        duration_s=duration,
        rate_per_s=(len(requests) - 1) / duration if duration > 0 else None,
    )
