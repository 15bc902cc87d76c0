"""Tuning: change the engine live and see the effect.

Above, what the change is for: ITL, TTFT, the queue, the chunk size and throughput over the
engine's window. On the left a form over the live-tunable fields and the traffic's arrival
rate: each field is range-checked as it is typed, with the reason beside it, and edits not
yet applied are highlighted. On the right the same figures over time, each applied change
marked. Below, the stored changes, each with the 30 s before it and the 30 s after.

All changed fields are applied together or not at all, and every applied change is stored
by the engine (config_changed events), so the changes table is the store's record.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.widgets import Button, Input, Label, Static

from console.sources.base import Capability, stated_rate
from console.tui.change_effect import AROUND_S, Around, Load
from console.tui.collectors import (
    RATE_FIELD,
    ConfigApplied,
    ConfigChangesLoaded,
    ConfigRejected,
    RateSet,
    StoredMetricsLoaded,
)
from console.tui.screens.base import ConsoleScreen
from console.tui.state import ConsoleState
from console.tui.text import escaped, plain
from console.tui.time_range import (
    BUCKETS,
    MEMORY,
    RANGES,
    RELOAD_S,
    TimeRange,
    on_engine_clock,
    points,
)
from console.tui.tuning_form import BY_NAME, FIELDS, Field, shown
from console.tui.widgets.field import Field as NumberField
from console.tui.widgets.field import start_edit
from console.tui.widgets.header import chunk_size
from console.tui.widgets.keyed_table import Column, KeyedTable, TableRow
from console.tui.widgets.latency import append_latency, slo_style, window
from console.tui.widgets.notice import unavailable
from console.tui.widgets.plot import Line, Plot, Series, keyed_marks, ms, number, per_s
from console.tui.widgets.redraw import update_changed
from engine.events import wall_offset
from engine.ops.metrics import RATE_WINDOW_S
from engine.snapshot import Snapshot

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: kept off the launch path
    from console.sources.base import ConfigChangeRecord, StoredMetrics

NARROW_COLUMNS = 110  # below this the charts stack into one column of sparklines
STALE_SNAPSHOTS = 3  # snapshots an applied value waits for one that shows it
SPAN = f"{AROUND_S:.0f}s"
# The change's time is the key column; a field is named as the form labels it. As the table
# narrows, who changed it goes first, then the arrivals (the subtitle names an unequal load),
# the old value, and throughput, so TTFT before and after stay beside the new value.
CHANGE_COLUMNS = (
    Column("at", "at", 8),
    Column("field", "field"),
    Column("old", "old", drop=3),
    Column("new", "new"),
    Column("by", "by", drop=5),
    Column("ttft-before", f"TTFT p99 -{SPAN}"),
    Column("ttft-after", f"+{SPAN}"),
    Column("tps-before", f"tok/s -{SPAN}", drop=2),
    Column("tps-after", f"+{SPAN}", drop=2),
    Column("load", "arrivals", drop=4),
)


def change_row(change: ConfigChangeRecord, ttft: Around, throughput: Around,
               load: Load) -> TableRow:
    """A stored change with its TTFT p99 and tok/s before and after it, and the arrivals."""
    rate_change = change.field == RATE_FIELD
    moved = load.comparable is False and not rate_change
    field = BY_NAME.get(change.field)
    return TableRow(
        key=str(change.id),
        cells=(datetime.fromtimestamp(change.created_at).strftime("%H:%M:%S"),
               change.field if field is None else field.label, shown(change.old),
               shown(change.new), change.source, *ttft.cells(ms), *throughput.cells(number),
               Text(load.cell(rate_change), style="yellow" if moved else "dim")),
        sort_values=(change.created_at, change.field, None, None, change.source,
                     ttft.before, ttft.after, throughput.before, throughput.after,
                     load.after),
        haystack=f"{change.field} {'' if field is None else field.label} "
                 f"{change.source}".lower())


class TuningScreen(ConsoleScreen):
    """One rule for the form's focus: a screen key always acts unless a field is being
    edited. Entering the screen edits nothing; Enter or Tab starts an edit with the field's
    value selected (typing replaces it); Apply (Enter, ctrl+s) ends it, Escape drops the
    field's unapplied text, ctrl+r and leaving the screen drop every unapplied edit."""

    AUTO_FOCUS = ""
    # priority: each acts in the order it was sent, before the keys typed after it
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "apply", "Apply", priority=True),
        Binding("ctrl+r", "revert", "Revert", priority=True),
        Binding("enter", "enter", "Edit", show=False, priority=True),
        Binding("tab", "next_field(1)", "Next field", show=False, priority=True),
        Binding("shift+tab", "next_field(-1)", "Previous field", show=False, priority=True),
        Binding("escape", "leave_input", "Leave the field", show=False, priority=True),
        Binding("t", "time_range", "Range"),
    ]
    NEEDS: ClassVar[dict[str, Capability]] = {"apply": Capability.TUNE,
                                              "revert": Capability.TUNE}

    def __init__(self, state: ConsoleState) -> None:
        super().__init__(state)
        self._base: dict[str, Any] = {}  # the live values the form was last filled from
        # applied values no snapshot has shown yet, with the snapshots they may still wait:
        # one taken before the change may still be on its way and must not put the old value
        # back; a change made elsewhere meanwhile shows after STALE_SNAPSHOTS
        self._applied: dict[str, tuple[Any, int]] = {}
        self._range: TimeRange = MEMORY
        self._stored: StoredMetrics | None = None  # the store's figures for a longer range
        self._stored_at: float | None = None  # the engine time they were asked for
        self._changes: dict[int, ConfigChangeRecord] = {}  # the stored changes shown, by id

    def compose(self) -> ComposeResult:
        yield from self.compose_header()
        yield Static(id="tuning-live")
        with Horizontal(id="tuning"):
            with VerticalScroll(id="tuning-form"):
                for field in FIELDS:
                    with Horizontal(classes="field"):
                        yield Label(field.label, classes="field-label")
                        yield NumberField(id=f"input-{field.name}", classes="field-input",
                                          type="number")
                        yield Static(field.help, id=f"note-{field.name}", classes="field-note")
                with Horizontal(id="tuning-buttons"):
                    yield Button("Apply ^s", id="apply", variant="primary")
                    yield Button("Revert ^r", id="revert")
                    yield Button("C* c", id="apply-cstar")
                yield Static(id="tuning-refusal", classes="unavailable")
            with Grid(id="tuning-charts"):
                yield Plot(unit=ms, id="tune-ttft", mark_keys=False)
                yield Plot(unit=ms, id="tune-tbt", mark_keys=False)
                yield Plot(unit=number, id="tune-queue", mark_keys=False)
                yield Plot(unit=per_s, id="tune-rates", mark_keys=False)
                yield Plot(unit=number, id="tune-cstar", mark_keys=False)
                yield Plot(unit=per_s, id="tune-throughput", mark_keys=False)
        yield KeyedTable(CHANGE_COLUMNS, id="config-changes", reverse=True,
                         empty="no change stored yet")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self.border_title = "Tuning"
        self.query_one("#tuning-form").border_title = "Live configuration"
        self._show_editing()
        self._title_charts()
        self.query_one("#config-changes").border_title = "Changes (stored)"

    def on_resize(self, event: events.Resize) -> None:
        self.set_class(event.size.width < NARROW_COLUMNS, "narrow")

    def show_capabilities(self) -> None:
        """Without tuning the form shows the live values, read-only; without a stored history
        the changes table gives way to the reason; without traffic of its own, no rate."""
        super().show_capabilities()
        tune = self.state.refusal(Capability.TUNE)
        for box in self.query(".field-input"):
            box.disabled = tune is not None
        self.query_one("#tuning-buttons").display = tune is None  # read-only: no Apply
        traffic = self.state.refusal(Capability.TRAFFIC)
        self.query_one(f"#input-{RATE_FIELD}", Input).parent.display = traffic is None
        history = self.state.refusal(Capability.CONFIG_HISTORY)
        self.query_one("#config-changes").display = history is None
        lines = [refusal for refusal in (tune, history) if refusal is not None]
        note = self.query_one("#tuning-refusal", Static)
        update_changed(note, unavailable("\n".join(lines)))  # an update lays the screen out
        note.display = bool(lines)

    def on_screen_resume(self) -> None:  # Textual runs ConsoleScreen's handler too
        self._load_changes()

    def _load_changes(self) -> None:
        self.state.load_config_changes(self)  # without a history, show_capabilities said why

    # --- the live picture -------------------------------------------------------------------
    def show_snapshot(self, snapshot: Snapshot) -> None:
        super().show_snapshot(snapshot)
        live = {field.name: snapshot.config.get(field.name) for field in FIELDS}
        rate = snapshot.workload_rate  # three figures: the form shows 3.2, not 3.2016
        live[RATE_FIELD] = None if rate is None else stated_rate(rate)
        # Refill only the inputs the operator has not edited, so typing is never overwritten.
        for field in FIELDS:
            box = self.query_one(f"#input-{field.name}", Input)
            fresh = shown(live[field.name])
            if field.name in self._applied:
                value, left = self._applied.pop(field.name)
                if fresh != shown(value) and left > 1:
                    self._applied[field.name] = (value, left - 1)
                    continue  # a snapshot from before the change: the applied value stands
            if box.value != fresh and (field.name not in self._base
                                       or box.value == shown(self._base[field.name])):
                box.value = fresh
                if box is self.focused:
                    box.select_all()  # still untouched: typing still replaces it
            self._base[field.name] = live[field.name]
        self._mark_edits()
        update_changed(self.query_one("#tuning-live", Static), self._live_line(snapshot))
        self._show_charts(snapshot)

    def _live_line(self, snapshot: Snapshot) -> Text:
        slo = self.state.slo
        text = Text(no_wrap=False, overflow="fold")
        text.append(f"over {window(snapshot):.0f} s: ", style="dim")
        text.append("ITL p99 ")
        tbt = snapshot.itl_ms.p99
        text.append("–" if tbt is None else ms(tbt), style=slo_style(tbt, slo.itl_ms))
        text.append(" · ")
        append_latency(text, "TTFT p50/p99", snapshot.ttft_ms, slo.ttft_ms)
        text.append(" · queue ")
        text.append(f"{snapshot.num_waiting}", style="bold")
        text.append(f" waiting, {snapshot.chunk_queue_length} chunks · chunk ")
        text.append(f"{chunk_size(snapshot.config) or '–'}", style="bold")
        text.append(" · ")  # C* stands in the header, and over time in its chart
        text.append(f"{snapshot.tokens_per_s:,.0f} tok/s", style="bold")
        text.append(f" over {snapshot.window_s or RATE_WINDOW_S:.0f} s", style="dim")
        return text

    def _offset(self) -> float:
        """Wall-clock minus the engine's clock, as the newest snapshot says."""
        latest = self.state.latest
        return (latest.wall_offset if latest is not None and latest.wall_offset is not None
                else wall_offset())

    def action_time_range(self) -> None:
        """`t`: the next time range; beyond the in-memory minutes the store fills the past."""
        at = RANGES.index(self._range)
        wanted = RANGES[(at + 1) % len(RANGES)]
        refusal = self.state.refusal(Capability.STORED_METRICS)
        if wanted is not MEMORY and refusal is not None:
            self.notify(escaped(refusal), severity="warning", markup=False)
            wanted = MEMORY
        self._range, self._stored, self._stored_at = wanted, None, None
        self._title_charts()
        if self.state.latest is not None:
            self._show_charts(self.state.latest)

    def _title_charts(self) -> None:
        self.query_one("#tuning-charts").border_title = (
            f"Effect · {self._range.label} (t)")

    def _load_stored(self, now: float) -> None:
        """Ask the store for the range's figures, at most every RELOAD_S."""
        if self._range is MEMORY or (self._stored_at is not None
                                     and now - self._stored_at < RELOAD_S):
            return
        self._stored_at = now
        start = self._range.start(now, self.state.session_start or now)
        if now > start:
            offset = self._offset()
            self.state.load_stored_metrics(self, start + offset, now + offset, BUCKETS)

    def on_stored_metrics_loaded(self, message: StoredMetricsLoaded) -> None:
        if message.change is not None:
            self._show_stored_around(message.change, message.metrics)
            return
        self._stored = message.metrics
        if self.state.latest is not None:
            self._show_charts(self.state.latest)

    def _show_charts(self, snapshot: Snapshot) -> None:
        history, slo = self.state.history, self.state.slo
        now = history.newest_ts
        if now is None:
            return
        self._load_stored(now)
        stored, offset = self._stored, self._offset()
        marks, events = history.change_times, tuple(history.events)
        start = history.oldest_ts
        if self._range is not MEMORY:
            start = self._range.start(now, self.state.session_start or now)
        if stored is not None:
            marks = (*on_engine_clock(stored.changes, offset), *marks)
            events = (*on_engine_clock((*stored.drift, *stored.restarts, *stored.pauses,
                                        *stored.starts), offset), *events)

        def series(label: str, name: str) -> Series:
            return Series.of(label, points(history, name, stored, offset))

        def plot(name: str, shown: tuple[Series, ...], lines: tuple[Line, ...] = ()) -> None:
            self.query_one(f"#{name}", Plot).show(shown, lines, marks, now, start, events)

        plot("tune-ttft", (series("TTFT p50", "ttft_p50"), series("p99", "ttft_p99")),
             (Line(slo.ttft_ms, f"SLO {ms(slo.ttft_ms)}", "red"),))
        plot("tune-tbt", (series("ITL p99", "itl_p99"),),
             (Line(slo.itl_ms, f"SLO {ms(slo.itl_ms)}", "red"),))
        plot("tune-queue", (series("waiting", "num_waiting"),
                            series("chunks", "chunk_queue_length")))
        plot("tune-rates", (series("arrived/s", "arrival_rate"),
                            series("finished/s", "finish_rate")))
        budget = snapshot.config.get("max_num_batched_tokens")
        plot("tune-cstar", (series("C*", "cstar"),),
             () if budget is None else (Line(float(budget), f"budget {budget}"),))
        plot("tune-throughput", (series("prompt+output tok/s", "tokens_per_s"),))
        self.call_after_refresh(self._key_marks)  # once laid out: a chart's size decides

    def _key_marks(self) -> None:
        """Six charts a third of the width each have no room to name the marks: their frame
        names those they draw."""
        charts = self.query_one("#tuning-charts")
        charts.border_subtitle = keyed_marks(charts.query(Plot).results(Plot))

    # --- the form ---------------------------------------------------------------------------
    def edited(self) -> dict[str, str]:
        """The fields whose text differs from the live value, as typed."""
        out = {}
        for field in FIELDS:
            box = self.query_one(f"#input-{field.name}", Input)
            value = box.value.strip()
            if box.parent is not None and box.parent.display and value != shown(
                    self._base.get(field.name)):
                out[field.name] = value
        return out

    def _mark_edits(self) -> None:
        edits = self.edited()
        for field in FIELDS:
            self.query_one(f"#input-{field.name}", Input).set_class(field.name in edits,
                                                                    "edited")

    def on_input_changed(self, event: Input.Changed) -> None:
        """Range-check as the operator types, the reason beside the field."""
        name = (event.input.id or "").removeprefix("input-")
        field = BY_NAME.get(name)
        if field is None:
            return
        text = event.value.strip()
        problem = field.check(text) if text != shown(self._base.get(name)) else None
        self._show_note(field, problem)
        self._mark_edits()

    def _show_note(self, field: Field, problem: str | None) -> None:
        note = self.query_one(f"#note-{field.name}", Static)
        box = self.query_one(f"#input-{field.name}", Input)
        update_changed(note, plain(problem, style="bold red") if problem else field.help)
        note.set_class(problem is not None, "error")
        box.set_class(problem is not None, "error")

    def action_apply(self) -> None:
        """Apply every edited field together; this ends the edit, applied or refused."""
        self.end_edit()
        changes = self.edited()
        if not changes:
            self.notify("unchanged: no field differs from the live value", timeout=2)
            return
        problems = {name: BY_NAME[name].check(text) for name, text in changes.items()}
        for name, problem in problems.items():
            self._show_note(BY_NAME[name], problem)
        if any(problems.values()):
            self.notify("not applied: fix the fields marked in red", severity="warning")
            return
        rate = changes.pop(RATE_FIELD, None)
        if rate is not None:
            self._refused(self.state.set_arrival_rate(self, float(rate)))
        if changes:
            self._refused(self.state.apply_config(self, changes))

    def _fields(self) -> list[Input]:
        """The inputs the source lets one edit, in the form's order."""
        return [box for box in self.query(".field-input").results(Input)
                if box.focusable and box.parent is not None and box.parent.display]

    def _filtering(self) -> bool:
        """Whether the focused input is the changes table's filter, not a field."""
        return isinstance(self.focused, Input) and not self.focused.has_class("field-input")

    async def action_enter(self) -> None:
        """Enter applies while a field is edited, closes the changes' filter box, presses a
        focused button, and otherwise starts an edit in the first field."""
        if self._filtering():
            assert isinstance(self.focused, Input)
            await self.focused.action_submit()
        elif isinstance(self.focused, Input):
            self.action_apply()
        elif isinstance(self.focused, Button):
            self.focused.press()
        else:
            self.action_next_field(1)

    def action_next_field(self, step: int) -> None:
        """Tab: edit the next field (the first, when none is edited); shift+Tab the one
        before. Other edits stay, to be applied together."""
        boxes = self._fields()
        if not boxes:
            return
        at = boxes.index(self.focused) if self.focused in boxes else (-1 if step > 0 else 0)
        start_edit(self, boxes[(at + step) % len(boxes)])
        self._show_editing()

    def action_leave_input(self) -> None:
        """Escape ends the edit and drops the field's unapplied text (in the changes' filter
        box, it clears the filter)."""
        if self._filtering():
            self.query_one("#config-changes", KeyedTable).action_clear_filter()
            return
        box = self.focused
        if isinstance(box, Input):
            self._restore(box)
        self.end_edit()

    def on_screen_suspend(self) -> None:
        """A dialog over the form (help, a question) only pauses the edit."""

    def leave(self) -> None:
        """Leaving the screen drops every unapplied edit: coming back, the form shows the
        live values and no stray key typed before can block an Apply."""
        self.action_revert()

    def end_edit(self) -> None:
        super().end_edit()
        self._show_editing()

    def _show_editing(self) -> None:
        """Say on the form's frame whether a field is being edited, and what keys do."""
        box = self.focused
        name = (box.id or "").removeprefix("input-") if isinstance(box, Input) else ""
        field = BY_NAME.get(name)
        self.query_one("#tuning-form").border_subtitle = (
            f"editing {field.label}: typing replaces · Enter applies · Esc cancels"
            if field is not None else "Enter or Tab: edit")

    def _restore(self, box: Input) -> None:
        name = (box.id or "").removeprefix("input-")
        if name in BY_NAME:
            box.value = shown(self._base.get(name))
            self._show_note(BY_NAME[name], None)

    def action_apply_recommended(self) -> None:
        self._refused(self.state.apply_recommended(self))

    def _refused(self, refusal: str | None) -> None:
        if refusal is not None:
            self.notify(escaped(refusal), severity="warning", markup=False)

    def action_revert(self) -> None:
        """Drop every unapplied edit: the form shows the live values again."""
        self.end_edit()
        for box in self.query(".field-input").results(Input):
            self._restore(box)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        actions = {"apply": self.action_apply, "revert": self.action_revert,
                   "apply-cstar": self.action_apply_recommended}
        actions[event.button.id or ""]()

    def _take(self, name: str, value: Any) -> None:
        """`name` is live at `value` now: the form shows it, unedited."""
        self._base[name] = value
        self._applied[name] = (value, STALE_SNAPSHOTS)
        self.query_one(f"#input-{name}", Input).value = shown(value)
        self._show_note(BY_NAME[name], None)

    def on_config_applied(self, message: ConfigApplied) -> None:
        message.stop()  # said here, not again by the app
        for name, value in message.config.items():
            if name in self._base:
                self._take(name, value)
        self._mark_edits()
        self.notify(message.note, timeout=4)
        self._load_changes()

    def on_rate_set(self, message: RateSet) -> None:
        self._take(RATE_FIELD, stated_rate(message.rate))
        self._mark_edits()
        self.notify(f"arrival rate {stated_rate(message.rate):g}/s", timeout=2)
        self._load_changes()  # the rate's change is stored like any setting's

    def on_config_rejected(self, message: ConfigRejected) -> None:
        message.stop()  # shown beside its field, not again by the app
        field = BY_NAME.get(message.field)
        if field is not None:
            self._show_note(field, message.message)
        else:
            self.notify(escaped(message.message), severity="error", markup=False)

    def on_config_changes_loaded(self, message: ConfigChangesLoaded) -> None:
        table = self.query_one("#config-changes", KeyedTable)
        history = self.state.history
        # the store stamps wall-clock time, snapshots the engine's monotonic clock: the newest
        # snapshot says how they relate where it was taken (a recording, a remote engine)
        offset = self._offset()
        unequal: tuple[str, Load] | None = None  # the newest change whose load moved
        stored = self.state.refusal(Capability.STORED_METRICS) is None
        rows = []
        for change in message.changes:
            at = change.created_at - offset
            ttft = Around.of(history, at, "ttft_p99")
            throughput = Around.of(history, at, "tokens_per_s")
            # the measured arrivals, whatever moved them: a stored rate change or the traffic
            load = Load.around(history, at)
            if load.comparable is False and change.field != RATE_FIELD and unequal is None:
                unequal = (BY_NAME[change.field].label if change.field in BY_NAME
                           else change.field, load)
            rows.append(change_row(change, ttft, throughput, load))
            done = history.newest_ts is not None and history.newest_ts >= at + AROUND_S
            if stored and done and {ttft.before, ttft.after, throughput.before,
                                    throughput.after} == {None}:  # older than memory holds
                self.state.load_stored_metrics(self, change.created_at - AROUND_S,
                                               change.created_at + AROUND_S, 2, change.id)
        self._changes = {change.id: change for change in message.changes}
        table.sync(rows)
        table.border_subtitle = (
            f"{unequal[0]}: {unequal[1].sentence()}" if unequal is not None else "")

    def _show_stored_around(self, change: int, metrics: StoredMetrics) -> None:
        """A change older than the console's memory: its before and after from the store
        (TTFT p99 of the requests whose first token came in each half, tokens/s of those
        that finished in it)."""
        table = self.query_one("#config-changes", KeyedTable)
        record = self._changes.get(change)
        if record is None or str(change) not in table.rows or len(metrics.buckets) != 2:
            return
        before, after = metrics.buckets
        row = change_row(record, Around(before.ttft_p99_ms, after.ttft_p99_ms),
                         Around(before.tokens_per_s, after.tokens_per_s),
                         Load(before.arrivals_per_s, after.arrivals_per_s))
        table.sync([row if key == row.key else kept for key, kept in table.rows.items()])
