"""Attaching the console to servers over HTTP: tokenflow serve, vLLM, SGLang, or a fleet of any
mix of them, told apart by their /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import httpx

from console.errors import UserError
from console.sources.base import Source, SourceError
from console.sources.fleet import AsyncSource, FleetSource
from console.sources.http import HttpSource
from console.sources.remote import Remote, bearer
from console.sources.scraped import MAX_METRICS_BYTES, ScrapedSource
from console.sources.sglang import SglangMetricsSource
from console.sources.vllm import VllmMetricsSource

if TYPE_CHECKING:
    from engine.serve.otlp import TraceCollector

KINDS = ("tokenflow", "vllm", "sglang")
SCHEMES = ("http", "https")


def split_kind(target: str) -> tuple[str | None, str]:
    """("vllm", "http://h:8000") for "vllm+http://h:8000"; (None, url) for a bare URL."""
    scheme, sep, rest = target.partition("://")
    kind, plus, transport = scheme.partition("+")
    if not sep or (transport if plus else kind) not in SCHEMES:
        raise UserError(f"--attach {target!r}: give a URL like http://HOST:PORT, optionally "
                        f"prefixed with its kind ({', '.join(k + '+' for k in KINDS)})")
    if not plus:
        return None, target
    if kind not in KINDS:
        raise UserError(f"--attach {target!r}: unknown kind {kind!r}; use one of "
                        f"{', '.join(KINDS)}")
    return kind, f"{transport}://{rest}"


def detect_kind(url: str, *, token: str | None = None,
                timer: Callable[[], float] = time.monotonic,
                transport: httpx.BaseTransport | None = None) -> str:
    """What serves `url`, from the prefix of its /metrics names; the scrape has a total
    deadline and a size cap, so a server that trickles cannot hold the console's start."""
    remote = Remote(url, headers=bearer(token), timer=timer, transport=transport,
                    max_bytes=MAX_METRICS_BYTES)
    try:
        text = remote.request("GET", "/metrics").text
    except SourceError as exc:
        raise UserError(f"cannot reach {url} to tell what it serves ({remote.last_error}); "
                        f"prefix it with its kind: {', '.join(k + '+' + url for k in KINDS)}"
                        ) from exc
    finally:
        remote.close()
    for kind, prefix in (("vllm", "\nvllm:"), ("sglang", "\nsglang:"),
                         ("tokenflow", "\ntokenflow_"), ("tokenflow", "\ntokenflow:")):
        if prefix in f"\n{text}":
            return kind
    raise UserError(f"{url}/metrics has no tokenflow_, vllm: or sglang: metrics; prefix the "
                    "URL with its kind if it is one of them")


def open_member(target: str, *, gpu: str | None = None, token: str | None = None,
                traces: TraceCollector | None = None) -> AsyncSource:
    """The source for one target; `token` goes to this server only."""
    kind, url = split_kind(target)
    kind = kind or detect_kind(url, token=token)
    if kind == "vllm":
        return VllmMetricsSource(url, gpu=gpu, traces=traces, token=token)
    if kind == "sglang":
        return SglangMetricsSource(url, gpu=gpu, traces=traces, token=token)
    return HttpSource(url, token=token)


def open_http_source(attach: list[str], attach_vllm: str | None = None,
                     attach_sglang: str | None = None, *, gpu: str | None = None,
                     traces: TraceCollector | None = None,
                     tokens: Mapping[str, str] | None = None) -> Source:
    """One source for `--attach URL...`, `--attach-vllm URL` and `--attach-sglang URL`;
    several open as a fleet. `tokens` maps a target, as given, to the bearer token sent to
    that server and no other."""
    tokens = tokens or {}
    targets = list(attach)
    if attach_vllm:
        targets.append(f"vllm+{attach_vllm}")
    if attach_sglang:
        targets.append(f"sglang+{attach_sglang}")
    members = [open_member(target, gpu=gpu, token=tokens.get(target), traces=traces)
               for target in targets]
    scraped = [m for m in members if isinstance(m, ScrapedSource)]
    if len(scraped) > 1:  # each traced server names itself with OTEL_SERVICE_NAME=<its URL>
        for member in scraped:
            member.trace_source = member.remote.url
    return members[0] if len(members) == 1 else FleetSource(members)
