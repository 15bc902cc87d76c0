"""The "Chunk queue" pane: chunks waiting, and how far each prefilling request has got.

Servers that only publish metrics (vLLM, SGLang) have no chunk queue to show; there the pane
shows tokens per engine step over the window instead, against the step budget when known.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from console.tui.text import escaped
from console.tui.widgets.gauge import gauge
from console.tui.widgets.keyed_table import middle_cut
from console.tui.widgets.notice import unavailable
from engine.snapshot import Percentiles, RequestView, Snapshot

PREFILLING = ("PREFILL_CHUNKING",)
SCRAPED_MODES = ("vLLM", "SGLang")  # read-only views of other engines' /metrics
ID_WIDTH = 10  # ids differ at the end (long-doc-00017): cut in the middle, never the tail


class ChunkQueue(Widget):
    DEFAULT_CSS = "ChunkQueue { height: 1fr; }"

    def __init__(self) -> None:
        super().__init__(id="chunk-queue")
        self.border_title = "Chunk queue"
        self._length = 0
        self._prefilling: tuple[RequestView, ...] = ()
        self._scraped: Snapshot | None = None
        self._refusal: str | None = None

    def update_from(self, snapshot: Snapshot, refusal: str | None = None) -> None:
        """`refusal`: why this source has no chunk queue to show, if it has none."""
        shown = (self._length, self._prefilling, self._scraped, self._refusal)
        self._length = snapshot.chunk_queue_length
        self._prefilling = tuple(r for r in snapshot.requests if r.state in PREFILLING)
        self._scraped = snapshot if snapshot.mode in SCRAPED_MODES else None
        self.border_title = "Tokens per step" if self._scraped else "Chunk queue"
        self._refusal = refusal
        if (self._length, self._prefilling, self._scraped, self._refusal) != shown:
            self.refresh()  # an idle engine's empty queue is not drawn again

    def render(self) -> Text:
        if self._scraped is not None:  # another engine's steps stand in for the chunk queue
            return self._render_steps(self._scraped)
        if self._refusal is not None:
            return unavailable(self._refusal)
        width, height = self.size.width, self.size.height
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f"{self._length}", style="bold cyan")
        text.append(f" chunks queued · {len(self._prefilling)} prefilling")
        rows = max(height - 1, 0)
        overflow = len(self._prefilling) > rows
        shown = self._prefilling[: rows - 1 if overflow else rows]
        bar_width = max(width - (ID_WIDTH + 18), 4)
        for r in shown:
            done = r.prefilled_tokens / max(r.prompt_tokens, 1)
            text.append(f"\n{middle_cut(escaped(r.id), ID_WIDTH):<{ID_WIDTH}} ")
            text.append_text(gauge(done, bar_width, style="cyan"))
            text.append(f" {r.chunks_done:>3}/{r.chunks_total:<3} {done:>4.0%}")
        if overflow and rows > 0:
            text.append(f"\n… {len(self._prefilling) - len(shown)} more", style="dim")
        return text

    def _render_steps(self, snapshot: Snapshot) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        steps = snapshot.step_tokens
        if steps == Percentiles():
            why = (f"gathering a window ({snapshot.mode} counters are cumulative)"
                   if snapshot.mode == "vLLM" else
                   f"{snapshot.mode} exports no tokens per step")
            text.append(why, style="dim")
            return text
        text.append(f"over {snapshot.window_s:.0f} s: ")
        for name, value in (("p50", steps.p50), ("p90", steps.p90), ("p99", steps.p99)):
            text.append(f"{name} ")
            text.append(f"{value or 0:.0f} ", style="bold cyan")
        if snapshot.mode == "vLLM":  # vLLM 0.32 counts a chunked prompt whole, at its end
            text.append("\nas vLLM counts them: a chunked prompt in its last step", style="dim")
        budget = snapshot.token_budget
        if not budget:
            text.append(f"\nbudget: {snapshot.mode} does not export it (--max-num-batched-tokens)",
                        style="dim")
            return text
        width = max(self.size.width - 14, 4)
        for name, value in (("p50", steps.p50), ("p99", steps.p99)):
            share = (value or 0.0) / budget
            text.append(f"\n{name} ")
            text.append_text(gauge(share, width, style="cyan"))
            text.append(f" {share:>4.0%}")
        return text
