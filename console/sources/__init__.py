"""The console's sources. What attaches to servers over HTTP loads on first use: it pulls httpx,
prometheus_client and torch (seconds), which the embedded engine's UI process never needs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from console.sources.attach import open_http_source, split_kind
    from console.sources.fleet import FleetSource
    from console.sources.http import HttpSource
    from console.sources.sglang import SglangMetricsSource
    from console.sources.vllm import VllmMetricsSource

_HOMES = {"FleetSource": "fleet", "HttpSource": "http", "SglangMetricsSource": "sglang",
          "VllmMetricsSource": "vllm", "open_http_source": "attach", "split_kind": "attach"}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"console.sources.{home}"), name)


__all__ = ["FleetSource", "HttpSource", "SglangMetricsSource", "VllmMetricsSource",
           "open_http_source", "split_kind"]
