"""HttpSource: the console attached to a running `tokenflow serve`.

It reads the same snapshots an embedded console does (GET /v1/stats) and tunes through
PATCH /v1/admin/config with the admin token given for this server alone (`--attach URL
--token-env NAME`): a token is never sent to a server it was not given for. The server publishes
its slow queries; calibrations, drift and config history stay in the server's own store, so
this source declares it cannot read them (and cannot recalibrate: that runs beside the engine).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from console.sources.base import TRACED_DRIFT_WHY, Capabilities, Capability, SourceError
from console.sources.checked import checked_slow_query, checked_snapshot, store_note
from console.sources.remote import Remote, RemoteBacked, bearer, error_message
from engine.config import ConfigError
from engine.serve.auth import TOKEN_ENV
from engine.snapshot import Snapshot
from engine.store import SlowQueryRecord

MAX_SLOW_QUERIES = 5000  # the server's own cap on one listing


class HttpSource(RemoteBacked):
    label = "attach"

    def __init__(self, url: str, *, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.remote = Remote(url, headers=bearer(token), clock=clock, transport=transport)
        self.store_note = ""  # the server's store, when it is not fine (checked.store_note)
        there = f"on the machine serving {self.remote.url}"
        self.capabilities = Capabilities.lacking({
            Capability.CALIBRATE: f"calibration runs next to the engine: run `tokenflow "
                                  f"calibrate` {there}",
            Capability.DRIFT: f"calibration runs and drift events stay in the server's own "
                              f"store: run `tokenflow calibrate` {there}",
            Capability.CONFIG_HISTORY: "the server keeps its configuration history in its own "
                                       "store, which HTTP does not publish",
            Capability.TRAFFIC: "a server's traffic comes from its clients, not the console",
            Capability.TRACED_DRIFT: TRACED_DRIFT_WHY,
            Capability.STORED_METRICS: "the server's request journal stays in its own store, "
                                       "which HTTP does not publish: charts hold what the "
                                       "console has seen",
        })

    def snapshot(self) -> Snapshot:
        return self._snapshot(self._call("GET", "/v1/stats"))

    async def snapshot_async(self) -> Snapshot:
        response = await self.remote.arequest("GET", "/v1/stats")
        return self._snapshot(self._checked(response, "/v1/stats"))

    def _snapshot(self, response: httpx.Response) -> Snapshot:
        """The answer's snapshot; an unusable answer marks the server failing (backing off)."""
        try:
            data = response.json()
            snapshot = checked_snapshot(data, "/v1/stats")
            self.store_note = store_note(data.get("store"), "/v1/stats")
            return snapshot
        except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser
            raise self.remote.failed(f"/v1/stats is not a JSON snapshot "
                                     f"({type(exc).__name__})") from None
        except SourceError as exc:
            raise self.remote.failed(str(exc)) from None

    def update_config(self, **changes: Any) -> dict[str, Any]:
        response = self.remote.request("PATCH", "/v1/admin/config", json=changes)
        if response.status_code == 422:
            error = response.json()["error"]
            raise ConfigError(error.get("param") or "configuration", error["message"])
        return self._checked(response, "/v1/admin/config").json()["config"]

    def pause(self) -> None:
        self._call("POST", "/v1/admin/pause")

    def resume(self) -> None:
        self._call("POST", "/v1/admin/resume")

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]:
        limit = max(1, min(limit, MAX_SLOW_QUERIES))
        response = self._call("GET", "/v1/slow_queries", params={"limit": limit})
        where = f"{self.remote.url}/v1/slow_queries"
        try:
            records = response.json()["data"]
        except (ValueError, RecursionError, TypeError, KeyError) as exc:  # not our shape
            raise SourceError(f"{where} answered what the console cannot read "
                              f"({type(exc).__name__})") from None
        if not isinstance(records, list):
            raise SourceError(f"{where} answered what the console cannot read (data is not "
                              "a list)")
        return [checked_slow_query(record, where) for record in records]

    def slow_query(self, query_id: int) -> SlowQueryRecord:
        for record in self.slow_queries(MAX_SLOW_QUERIES):
            if record.id == query_id:
                return record
        raise SourceError(f"{self.remote.url} has no slow query with id {query_id}")

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self._checked(self.remote.request(method, path, **kwargs), path)

    def _checked(self, response: httpx.Response, path: str) -> httpx.Response:
        if response.status_code < 400:
            return response
        hint = ""
        if response.status_code == 401:
            hint = (f"; give the server's admin token: --attach {self.remote.url} --token-env "
                    f"{TOKEN_ENV}")
        raise SourceError(f"{self.remote.url}{path}: HTTP {response.status_code} "
                          f"{error_message(response)}{hint}")
