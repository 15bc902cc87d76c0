"""The fleet table: one keyed row per attached server, worst first."""

from __future__ import annotations

import time

from rich.text import Text

from console.sources.fleet import FleetRow
from console.tui.text import plain
from console.tui.widgets.keyed_table import Column, KeyedTable, TableRow

# Narrowing, the model goes first (one fleet mostly serves one), then the KV share, ITL, the
# slow-query rate and tok/s; health, the server, its queue and TTFT (what users feel) stay.
COLUMNS = (
    Column("server", "#", 3),
    Column("health", "health", 16),
    Column("url", "server", 24),
    Column("model", "model", 18, drop=5),
    Column("running", "run", 5),
    Column("waiting", "wait", 5),
    Column("kv", "KV %", 6, drop=4),
    Column("tok_s", "tok/s", 8, drop=1),
    Column("ttft", "TTFT p99", 9),
    Column("itl", "ITL p99", 8, drop=3),
    Column("slow", "slow/min", 8, drop=2),
)
HEALTH_STYLES = {"up": "green", "paused": "bold yellow", "down": "bold red",
                 "starting": "yellow", "degraded": "bold yellow"}


def _number(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def health_text(row: FleetRow) -> Text:
    if row.health == "degraded":  # "store unreachable 12 s, 340 events held"
        return plain(row.error, HEALTH_STYLES["degraded"])
    if row.health != "down":
        return Text(row.health, style=HEALTH_STYLES[row.health])
    seen = ("never seen" if row.last_seen is None
            else "seen " + time.strftime("%H:%M:%S", time.localtime(row.last_seen)))
    return Text(f"down · {seen}", style=HEALTH_STYLES["down"])


def fleet_row(row: FleetRow, rank: int) -> TableRow:
    key = str(row.index + 1)
    return TableRow(
        key=key,
        cells=(key, health_text(row), row.name, row.model or "–", str(row.running),
               str(row.waiting), _number(None if row.kv_usage is None else row.kv_usage * 100,
                                         ".0f"),
               _number(row.tokens_per_s, ".0f"), _number(row.ttft_p99_ms, ".0f"),
               _number(row.itl_p99_ms, ".0f"), f"{row.slow_per_min:.1f}"),
        # The first column sorts by rank: worst first, as FleetSource.rows() ordered them.
        sort_values=(rank, row.health, row.name, row.model, row.running, row.waiting,
                     row.kv_usage, row.tokens_per_s, row.ttft_p99_ms, row.itl_p99_ms,
                     row.slow_per_min),
        haystack=f"{row.name} {row.model} {row.health}".lower(),
    )


class FleetTable(KeyedTable):
    def __init__(self) -> None:
        super().__init__(COLUMNS, id="fleet", empty="no server has answered yet")
        self.border_title = "Fleet"

    def update_from(self, rows: list[FleetRow]) -> None:
        self.sync([fleet_row(row, rank) for rank, row in enumerate(rows)])
        down = sum(row.health == "down" for row in rows)
        self.border_subtitle = (f"{len(rows)} servers · {down} down · worst first · "
                                "TTFT/ITL ms over each server's window · enter opens")
