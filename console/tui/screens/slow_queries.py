"""Slow queries from the store: a sortable, filterable list, a per-chunk detail view, export."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from console.sources.base import Capability, export_slow_queries
from console.tui.collectors import SlowQueriesLoaded
from console.tui.screens.base import ConsoleScreen
from console.tui.settings import DEFAULTS, setting
from console.tui.state import ConsoleState
from console.tui.text import escaped, plain
from console.tui.widgets.keyed_table import Column, KeyedTable, TableRow, middle_cut
from console.tui.widgets.notice import unavailable
from console.tui.widgets.redraw import update_changed
from console.tui.widgets.requests_table import budget_text
from engine.ops.timeline import timeline_lines
from engine.stats import human_duration

if TYPE_CHECKING:  # annotations only: the store pulls SQLAlchemy and Alembic (~1 s)
    from console.sources.base import SlowQueryRecord

COLUMNS = (
    Column("id", "id", 6),
    Column("time", "stored", 8, drop=2),
    Column("request", "request", 14),
    Column("tenant", "tenant", 8, drop=3),
    Column("score", "budget_score", 12),
    Column("prompt", "prompt", 7, drop=1),
    Column("prefill", "prefill ms", 10),
    Column("budgeted", "budget ms", 10),
    Column("chunks", "chunks", 6),
    Column("server", "server", 14, drop=4),  # every server sharing the store; `/` filters
)
RELOAD_S = 5.0


def clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def slow_row(r: SlowQueryRecord) -> TableRow:
    threshold = setting(r.config, "slow_query_threshold")
    return TableRow(
        key=str(r.id),
        cells=(str(r.id), clock(r.created_at), middle_cut(r.request_id, 14), r.tenant,
               budget_text(r.budget_score, threshold), str(r.prompt_tokens),
               f"{r.prefill_s * 1e3:.1f}", f"{r.budgeted_s * 1e3:.1f}", str(len(r.chunks)),
               plain(middle_cut(r.server or "–", 14))),
        # an SLO breach stored with no calibrated plan has no score: it sorts last
        sort_values=(r.id, r.created_at, r.request_id, r.tenant,
                     -1.0 if r.budget_score is None else r.budget_score,
                     r.prompt_tokens, r.prefill_s, r.budgeted_s, len(r.chunks), r.server),
        haystack=f"{r.request_id} {r.tenant} {r.tag or ''} {r.server}".lower(),
    )


class SlowQueriesScreen(ConsoleScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("e", "export('csv')", "Export CSV"),
        Binding("E", "export('json')", "Export JSON"),
        Binding("r", "reload", "Reload"),
    ]
    NEEDS: ClassVar[dict[str, Capability]] = {"export": Capability.SLOW_QUERIES,
                                              "reload": Capability.SLOW_QUERIES}

    def __init__(self, state: ConsoleState) -> None:
        super().__init__(state)
        self.records: dict[str, SlowQueryRecord] = {}

    def compose(self) -> ComposeResult:
        yield from self.compose_header()
        yield Static(id="slow-queries-unavailable", classes="unavailable")
        yield KeyedTable(COLUMNS, id="slow-queries",
                         empty="no slow query stored yet: a request is one when its "
                               "budget_score passes the slow-query threshold")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self.query_one(KeyedTable).border_title = "Slow queries"
        self.set_interval(RELOAD_S, self.action_reload)

    def show_capabilities(self) -> None:
        super().show_capabilities()
        refusal = self.state.refusal(Capability.SLOW_QUERIES)
        note = self.query_one("#slow-queries-unavailable", Static)
        update_changed(note, unavailable(refusal or ""))  # an update lays the screen out
        note.display = refusal is not None
        self.query_one(KeyedTable).display = refusal is None

    def on_screen_resume(self) -> None:  # Textual runs ConsoleScreen's handler too
        self.action_reload()

    def action_reload(self) -> None:
        if self.is_current:
            self.state.load_slow_queries(self)  # a source without them says so on screen

    def on_slow_queries_loaded(self, message: SlowQueriesLoaded) -> None:
        self.records = {str(r.id): r for r in message.records}
        table = self.query_one(KeyedTable)
        table.sync([slow_row(r) for r in message.records])
        table.border_subtitle = f"{len(message.records)} stored · enter for detail"

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        record = self.records.get(str(event.row_key.value))
        if record is not None:
            self.app.push_screen(SlowQueryDetail(record))

    def action_export(self, fmt: str) -> None:
        table = self.query_one(KeyedTable)
        keys = [str(k.value) for k in table.table.rows]  # what is shown: filtered, in order
        records = [self.records[k] for k in keys if k in self.records]
        path = Path.cwd() / f"slow_queries_{time.strftime('%Y%m%d_%H%M%S')}.{fmt}"
        try:
            path.write_text(export_slow_queries(records, fmt), encoding="utf-8")
        except OSError as exc:
            self.notify(f"export failed: {exc.strerror} ({path})", severity="error")
            return
        self.notify(f"exported {len(records)} slow queries to {path}")


def config_text(config: Mapping[str, Any]) -> Text:
    """`name=value` pairs flowing over the width, every value readable at 80 columns (a
    name/value table cut them); those off EngineConfig's default first, in yellow."""
    def changed(name: str) -> bool:
        return name in DEFAULTS and DEFAULTS[name] != config[name]

    text = Text()
    for name in sorted(config, key=lambda name: (not changed(name), name)):
        if text:
            text.append("  ")
        text.append(f"{name}=", style="dim")
        text.append(plain(config[name], "bold yellow" if changed(name) else ""))
    return text


class SlowQueryDetail(ModalScreen[None]):
    """One slow query: its per-chunk timings and the configuration it ran under."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss", "Close")]

    def __init__(self, record: SlowQueryRecord) -> None:
        super().__init__()
        self.record = record

    def compose(self) -> ComposeResult:
        r = self.record
        with Vertical(id="detail"):
            yield Static(Text.assemble(
                plain(f"request {r.request_id}", "bold"), plain(f"  tenant {r.tenant}  "),
                budget_text(r.budget_score, setting(r.config, "slow_query_threshold")),
                f"  prefill {human_duration(r.prefill_s)} of "
                f"{human_duration(r.budgeted_s)} budgeted  ",
                plain(f"tag {r.tag or '–'}  server {r.server or '–'}")))
            if r.verdict:  # records stored before revision 0003 have none
                # its lines (what the user felt, then the budget_score), each escaped alone
                lines = Text("\n        ").join(plain(line, "bold yellow")
                                                for line in r.verdict.split("\n"))
                yield Static(Text.assemble(("verdict ", "dim"), lines), id="detail-verdict")
            # the words `tokenflow slow-queries show` prints: cached tokens and a resume, once
            yield Static(plain(r.prompt_words()), id="detail-prompt")
            if r.timeline:  # the lines `tokenflow slow-queries show` prints
                yield Static(Text("\n".join(map(escaped, timeline_lines(r.timeline)))),
                             id="detail-timeline")
            yield DataTable(id="detail-chunks", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="detail-config"):
                yield Static(config_text(r.config), id="detail-config-values")
            yield Static("esc closes", classes="dim")

    def on_mount(self) -> None:
        self.query_one("#detail").border_title = f"Slow query {self.record.id}"
        chunks = self.query_one("#detail-chunks", DataTable)
        chunks.border_title = "Chunks"
        chunks.add_columns("#", "start", "tokens", "decodes", "took", "predicted", "× own")
        for chunk in self.record.chunks:
            duration = float(chunk.get("duration_s", 0.0))
            predicted = float(chunk.get("predicted_s", 0.0))
            ratio = f"{duration / predicted:.1f}×" if predicted > 0 else "–"
            chunks.add_row(str(chunk.get("index", "")), str(chunk.get("start", "")),
                           str(chunk.get("tokens", "")), str(chunk.get("decodes", "–")),
                           human_duration(duration), human_duration(predicted), ratio)
        config = self.query_one("#detail-config", VerticalScroll)
        config.border_title = "Configuration at the time"
        config.border_subtitle = "yellow: not the default"
