"""The header line: the engine's state, token budget, chunk size, recommended C* and tokens/s;
or, while the source fails, what failed.

The state is the scheduler's mode, and beside it what the mode alone does not say: a backlog
of waiting requests, and KV usage above the high watermark. NORMAL is green only when neither
holds."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from console.tui.text import plain
from console.tui.widgets.latency import LatencySLO
from console.tui.widgets.plot import ms
from engine.snapshot import Snapshot

BACKLOG_MIN = 16  # fewer waiting requests than this is a queue, not a backlog

MODE_STYLES = {
    "NORMAL": "bold green",
    "CACHE_PRESSURE_WAIT": "bold yellow",
    "BANDWIDTH_THROTTLE": "bold red",
}


def warnings(snapshot: Snapshot) -> list[tuple[str, str]]:
    """What is wrong beside the mode, each with its style: a backlog (red once the median
    first token is past twice its SLO), KV usage at or above the high watermark."""
    out: list[tuple[str, str]] = []
    waiting = snapshot.num_waiting
    if waiting >= max(BACKLOG_MIN, snapshot.num_running):
        slo = LatencySLO.of(snapshot)
        ttft = snapshot.ttft_ms.p50
        late = slo is not None and ttft is not None and ttft > 2 * slo.ttft_ms
        note = f"BACKLOG {waiting} waiting" + (f", TTFT p50 {ms(ttft)}" if late and ttft else "")
        out.append((note, "bold red" if late else "bold yellow"))
    high = snapshot.config.get("cache_high_watermark")  # absent: not tokenflow's watermarks
    if high is not None and snapshot.kv_usage >= float(high):
        out.append((f"KV {snapshot.kv_usage:.0%} ≥ {float(high):.0%}", "bold yellow"))
    return out


def chunk_size(config: dict[str, object]) -> object:
    """The largest chunk one request gets in a step: the per-request cap, else the budget."""
    return config.get("long_prefill_threshold") or config.get("max_num_batched_tokens", "?")


class EngineHeader(Static):
    DEFAULT_CSS = "EngineHeader { height: 1; background: $panel; padding: 0 1; }"

    def update_from(self, snapshot: Snapshot, source_name: str) -> None:
        config = snapshot.config
        cstar = snapshot.recommended_chunk_size
        text = Text(no_wrap=True, overflow="ellipsis")
        if snapshot.paused:
            text.append(" PAUSED ", style="bold reverse yellow")
            text.append(" ")
        wrong = warnings(snapshot)
        style = MODE_STYLES.get(snapshot.mode, "bold")
        text.append(plain(snapshot.mode,
                          style="bold yellow" if wrong and "green" in style else style))
        for note, note_style in wrong:
            text.append(" · ")
            text.append(note, style=note_style)
        text.append(f"  budget {config.get('max_num_batched_tokens', '?')}")
        text.append(f"  chunk {chunk_size(config)}/tile {config.get('chunk_tile', '?')}")
        if snapshot.calibration == "calibrating":
            text.append("  C* calibrating", style="dim cyan")
        else:
            text.append(f"  C* {cstar if cstar is not None else '–'}", style="cyan")
        text.append(f"  {snapshot.tokens_per_s:,.0f} tok/s", style="bold")
        text.append(plain(f"  {source_name}", style="dim"))
        self.update(text)

    def show_failure(self, error: str, source_name: str) -> None:
        """Kept until a snapshot arrives again: a toast alone fades while the panes go stale."""
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" SOURCE FAILED ", style="bold reverse red")
        text.append(plain(f" {error}", style="bold red"))
        text.append(plain(f"  {source_name}", style="dim"))
        self.update(text)
