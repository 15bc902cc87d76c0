"""The header line: the engine's state, token budget, chunk size, recommended C* and tokens/s,
and the source's name; or, while the source fails, what failed.

The state is the scheduler's mode, and beside it what the mode alone does not say: a backlog
of waiting requests, and KV usage above the high watermark. NORMAL is green only when neither
holds. A field the source does not export is left out, not shown as "?". When the line is
wider than the terminal, figures drop from the least useful up; the state and the source's
name stay.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rich.text import Text
from textual import events
from textual.widgets import Static

from console.tui.text import escaped, plain
from console.tui.widgets.plot import ms
from console.tui.widgets.redraw import update_changed
from engine.slo_targets import ServiceSLO
from engine.snapshot import Snapshot

BACKLOG_MIN = 16  # fewer waiting requests than this is a queue, not a backlog

MODE_STYLES = {
    "NORMAL": "bold green",
    "CACHE_PRESSURE_WAIT": "bold yellow",
    "BANDWIDTH_THROTTLE": "bold red",
}


def warnings(snapshot: Snapshot, slo: ServiceSLO) -> list[tuple[str, str]]:
    """What is wrong beside the mode, each with its style: a backlog (many waiting, or any
    waiting while the median first token is past its SLO; red once it is), a reused
    calibration, KV usage at or above the high watermark."""
    out: list[tuple[str, str]] = []
    waiting = snapshot.num_waiting
    ttft = snapshot.ttft_ms.p50
    late = ttft is not None and ttft > slo.ttft_ms
    if waiting >= max(BACKLOG_MIN, snapshot.num_running) or (waiting and late):
        note = f"BACKLOG {waiting} waiting"
        if late and ttft is not None:
            note += f", TTFT p50 {ms(ttft)} > SLO {ms(slo.ttft_ms)}"
        out.append((note, "bold red" if late else "bold yellow"))
    if snapshot.calibration_reused:  # until a calibration measured here replaces it
        out.append(("CALIBRATION REUSED", "bold yellow"))
    high = snapshot.config.get("cache_high_watermark")  # absent: not tokenflow's watermarks
    if high is not None and snapshot.kv_usage >= float(high):
        out.append((f"KV {snapshot.kv_usage:.0%} ≥ {float(high):.0%}", "bold yellow"))
    return out


def chunk_size(config: dict[str, object]) -> object | None:
    """The largest chunk one request gets in a step: the per-request cap, else the budget;
    None when the source exports neither."""
    return config.get("long_prefill_threshold") or config.get("max_num_batched_tokens")


def cstar_text(snapshot: Snapshot) -> tuple[str, str] | None:
    """C* as the header says it, with its style: how far the first calibration is, that it
    failed, the roofline's own value with the clamp named, or None when the source gives no
    C*."""
    if snapshot.calibration.startswith("calibrating"):
        shape = re.search(r"shape \d+/\d+", snapshot.calibration)  # the pass is the pane's
        return f"C* calibrating{f' ({shape[0]})' if shape else ''}", "dim cyan"
    if snapshot.calibration.startswith("uncalibrated"):
        return "C* uncalibrated", "yellow"
    cstar = snapshot.recommended_chunk_size
    if cstar is None:
        return None
    unclamped = snapshot.recommended_chunk_unclamped
    if unclamped is None or unclamped == cstar:
        return f"C* {cstar}", "cyan"
    bound = "tile" if unclamped < cstar else "budget"
    return f"C* {unclamped} (clamped to {bound} {cstar})", "cyan"


@dataclass(frozen=True)
class Part:
    text: str
    style: str = ""
    drop: int = 0  # 0: always shown; else dropped first when narrow, lowest first


def parts(snapshot: Snapshot, source_name: str, slo: ServiceSLO) -> list[Part]:
    config = snapshot.config
    out: list[Part] = []
    if snapshot.paused:
        out.append(Part(" PAUSED ", "bold reverse yellow"))
        out.append(Part(" "))
    wrong = warnings(snapshot, slo)
    style = MODE_STYLES.get(snapshot.mode, "bold")
    out.append(Part(escaped(snapshot.mode), "bold yellow" if wrong and "green" in style else style))
    for note, note_style in wrong:
        out.append(Part(f" · {note}", note_style))
    if snapshot.host_contended:  # the engine's timings include others' load (the Bandwidth
        out.append(Part(" · HOST BUSY", "bold yellow", drop=1))  # pane's host line: who)
    budget = config.get("max_num_batched_tokens")
    if budget is not None:
        out.append(Part(f"  budget {budget}", drop=4))
    chunk, tile = chunk_size(config), config.get("chunk_tile")
    if chunk is not None and tile is not None:
        out.append(Part(f"  chunk {chunk}/tile {tile}", drop=2))
    cstar = cstar_text(snapshot)
    if cstar is not None:
        out.append(Part(f"  {cstar[0]}", cstar[1], drop=3))
    out.append(Part(f"  {snapshot.tokens_per_s:,.0f} tok/s", "bold", drop=5))
    out.append(Part(f"  {escaped(source_name)}", "dim"))
    return out


def fitted(line: list[Part], width: int) -> Text:
    """The parts that fit in `width` columns, the droppable ones going lowest first."""
    kept = list(line)
    droppable = sorted((p for p in kept if p.drop), key=lambda p: p.drop)
    while droppable and sum(len(p.text) for p in kept) > width:
        kept.remove(droppable.pop(0))
    text = Text(no_wrap=True, overflow="ellipsis")
    for part in kept:
        text.append(part.text, style=part.style)
    return text


class EngineHeader(Static):
    DEFAULT_CSS = "EngineHeader { height: 1; background: $panel; padding: 0 1; }"

    def __init__(self) -> None:
        super().__init__()
        self._line: list[Part] = []

    def update_from(self, snapshot: Snapshot, source_name: str, slo: ServiceSLO) -> None:
        self._line = parts(snapshot, source_name, slo)
        self._show()

    def on_resize(self, event: events.Resize) -> None:
        self._show()

    def _show(self) -> None:
        if self._line:
            update_changed(self, fitted(self._line, self.content_size.width or 10_000))

    def show_failure(self, error: str, source_name: str) -> None:
        """Kept until a snapshot arrives again: a toast alone fades while the panes go stale."""
        self._line = []
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" SOURCE FAILED ", style="bold reverse red")
        text.append(plain(f" {error}", style="bold red"))
        text.append(plain(f"  {source_name}", style="dim"))
        self.update(text)
