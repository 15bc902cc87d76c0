"""The "Chunk queue" pane: chunks waiting, and how far each prefilling request has got."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from console.tui.widgets.gauge import gauge
from console.tui.widgets.notice import unavailable
from engine.snapshot import RequestView, Snapshot

PREFILLING = ("PREFILL_CHUNKING",)


class ChunkQueue(Widget):
    DEFAULT_CSS = "ChunkQueue { height: 1fr; }"

    def __init__(self) -> None:
        super().__init__(id="chunk-queue")
        self.border_title = "Chunk queue"
        self._length = 0
        self._prefilling: tuple[RequestView, ...] = ()
        self._refusal: str | None = None

    def update_from(self, snapshot: Snapshot, refusal: str | None = None) -> None:
        """`refusal`: why this source has no chunk queue to show, if it has none."""
        self._length = snapshot.chunk_queue_length
        self._prefilling = tuple(r for r in snapshot.requests if r.state in PREFILLING)
        self._refusal = refusal
        self.refresh()

    def render(self) -> Text:
        if self._refusal is not None:
            return unavailable(self._refusal)
        width, height = self.size.width, self.size.height
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f"{self._length}", style="bold cyan")
        text.append(f" chunks queued · {len(self._prefilling)} prefilling")
        rows = max(height - 1, 0)
        overflow = len(self._prefilling) > rows
        shown = self._prefilling[: rows - 1 if overflow else rows]
        bar_width = max(width - 26, 4)
        for r in shown:
            done = r.prefilled_tokens / max(r.prompt_tokens, 1)
            text.append(f"\n{r.id[:8]:<8} ")
            text.append_text(gauge(done, bar_width, style="cyan"))
            text.append(f" {r.chunks_done:>3}/{r.chunks_total:<3} {done:>4.0%}")
        if overflow and rows > 0:
            text.append(f"\n… {len(self._prefilling) - len(shown)} more", style="dim")
        return text
