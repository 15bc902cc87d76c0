"""Sources that attach the console to servers over HTTP: tokenflow serve, vLLM, or a fleet."""

from __future__ import annotations

from console.sources.base import Source
from console.sources.fleet import FleetSource
from console.sources.http import HttpSource
from console.sources.vllm import VllmMetricsSource


def open_http_source(attach: list[str], attach_vllm: str | None = None) -> Source:
    """One source for `--attach URL...` and `--attach-vllm URL`; several open as a fleet."""
    members: list[Source] = [HttpSource(url) for url in attach]
    if attach_vllm:
        members.append(VllmMetricsSource(attach_vllm))
    return members[0] if len(members) == 1 else FleetSource(members)


__all__ = ["FleetSource", "HttpSource", "VllmMetricsSource", "open_http_source"]
