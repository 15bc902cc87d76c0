"""The header line: scheduler mode, token budget, chunk size, recommended C* and tokens/s;
or, while the source fails, what failed."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from engine.snapshot import Snapshot

MODE_STYLES = {
    "NORMAL": "bold green",
    "CACHE_PRESSURE_WAIT": "bold yellow",
    "BANDWIDTH_THROTTLE": "bold red",
}


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
        text.append(snapshot.mode, style=MODE_STYLES.get(snapshot.mode, "bold"))
        text.append(f"  budget {config.get('max_num_batched_tokens', '?')}")
        text.append(f"  chunk {chunk_size(config)}/tile {config.get('chunk_tile', '?')}")
        if snapshot.calibration == "calibrating":
            text.append("  C* calibrating", style="dim cyan")
        else:
            text.append(f"  C* {cstar if cstar is not None else '–'}", style="cyan")
        text.append(f"  {snapshot.tokens_per_s:,.0f} tok/s", style="bold")
        text.append(f"  {source_name}", style="dim")
        self.update(text)

    def show_failure(self, error: str, source_name: str) -> None:
        """Kept until a snapshot arrives again: a toast alone fades while the panes go stale."""
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" SOURCE FAILED ", style="bold reverse red")
        text.append(f" {error}", style="bold red")
        text.append(f"  {source_name}", style="dim")
        self.update(text)
