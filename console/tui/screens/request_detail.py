"""Enter on a Live row: the request's timeline when the engine kept one (a slow query's
record, the same view as the Slow queries screen's detail), else what the snapshot says."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from console.tui.text import plain
from engine.snapshot import RequestView, prompt_words

NO_TIMELINE = ("no timeline: the engine keeps one for slow queries only "
               "(budget_score above the threshold)")


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f} ms"


class RequestDetail(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss", "Close")]

    def __init__(self, view: RequestView, note: str = NO_TIMELINE) -> None:
        super().__init__()
        self.view = view
        self.note = note

    def compose(self) -> ComposeResult:
        r = self.view
        fields = Table(show_header=False, box=None, padding=(0, 2))
        for name, value in (
                ("state", f"{r.state}{f'  ({r.reason})' if r.reason else ''}"),
                ("tenant", r.tenant),
                ("prompt", f"{prompt_words(r.prompt_tokens, r.cached_tokens, r.resumed_tokens)}; "
                           f"{r.prefilled_tokens} prefilled"),
                ("chunks", f"{r.chunks_done} of {r.chunks_total}"),
                ("generated", f"{r.generated_tokens} tokens"),
                ("TTFT", ms(r.ttft_ms)),
                ("TPOT", ms(r.tpot_ms)),
                ("budget_score", "–" if r.budget_score is None else f"{r.budget_score:.2f}")):
            fields.add_row(name, plain(value))  # a str cell would be parsed as markup
        with Vertical(id="detail"):
            yield Static(fields)
            yield Static(plain(self.note), classes="dim")
            yield Static("esc closes", classes="dim")

    def on_mount(self) -> None:
        self.query_one("#detail").border_title = plain(f"Request {self.view.id}")
