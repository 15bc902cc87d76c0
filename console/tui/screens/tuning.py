"""Tuning: a form over the live-tunable fields; bad values are refused inline, good ones applied.

All changed fields are applied together or not at all, and every applied change is stored
by the engine (config_changed events), so the table beside the form is the store's record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, DataTable, Input, Label, Static

from console.sources.base import Capability
from console.tui.collectors import ConfigApplied, ConfigChangesLoaded, ConfigRejected
from console.tui.screens.base import ConsoleScreen
from console.tui.state import ConsoleState
from console.tui.widgets.field import Field as NumberField
from console.tui.widgets.notice import unavailable
from engine.snapshot import Snapshot


@dataclass(frozen=True)
class Field:
    name: str  # the EngineConfig field
    label: str
    help: str


FIELDS: tuple[Field, ...] = (
    Field("max_num_batched_tokens", "Token budget", "tokens one step may spend"),
    Field("chunk_tile", "Chunk tile", "chunks round down to a multiple"),
    Field("max_prefill_chunks", "Chunk concurrency", "partial prefills per step"),
    Field("long_prefill_threshold", "Chunk cap", "per request per step; 0 = none"),
    Field("cache_high_watermark", "KV high watermark", "stop admitting above"),
    Field("cache_low_watermark", "KV low watermark", "admit again below"),
    Field("bandwidth_throttle_2", "BW throttle → 2", "5 s avg above: concurrency 2"),
    Field("bandwidth_throttle_1", "BW throttle → 1", "above: concurrency 1"),
    Field("bandwidth_pause", "BW pause", "above: new prefills paused"),
    Field("slow_query_threshold", "Slow query", "budget_score above is slow"),
)


def shown(value: Any) -> str:
    return "" if value is None else str(value)


class TuningScreen(ConsoleScreen):
    AUTO_FOCUS = "#input-max_num_batched_tokens"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "apply", "Apply"),
        Binding("ctrl+r", "revert", "Revert"),
    ]
    NEEDS: ClassVar[dict[str, Capability]] = {"apply": Capability.TUNE,
                                              "revert": Capability.TUNE}

    def __init__(self, state: ConsoleState) -> None:
        super().__init__(state)
        self._base: dict[str, Any] = {}  # the live values the form was last filled from

    def compose(self) -> ComposeResult:
        yield from self.compose_header()
        with Horizontal(id="tuning"):
            with VerticalScroll(id="tuning-form"):
                for field in FIELDS:
                    with Horizontal(classes="field"):
                        yield Label(field.label, classes="field-label")
                        yield NumberField(id=f"input-{field.name}", classes="field-input",
                                          type="number")
                        yield Static(field.help, id=f"note-{field.name}", classes="field-note")
                with Horizontal(id="tuning-buttons"):
                    yield Button("Apply  ctrl+s", id="apply", variant="primary")
                    yield Button("Revert ctrl+r", id="revert")
                    yield Button("Apply C*  c", id="apply-cstar")
            with Vertical(id="tuning-side"):
                yield Static(id="tuning-status")
                yield Static(id="tuning-refusal", classes="unavailable")
                yield DataTable(id="config-changes", cursor_type="row", zebra_stripes=True)
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self.border_title = "Tuning"
        self.query_one("#tuning-form").border_title = "Live configuration"
        changes = self.query_one("#config-changes", DataTable)
        changes.border_title = "Changes (stored)"
        for label in ("field", "old", "new", "by"):
            changes.add_column(label, key=label)

    def show_capabilities(self) -> None:
        """Without tuning the form shows the live values, read-only; without a stored history
        the changes table gives way to the reason."""
        super().show_capabilities()
        tune = self.state.refusal(Capability.TUNE)
        for box in self.query(".field-input"):
            box.disabled = tune is not None
        for button in self.query(Button):
            button.disabled = tune is not None
        history = self.state.refusal(Capability.CONFIG_HISTORY)
        self.query_one("#config-changes").display = history is None
        lines = [refusal for refusal in (tune, history) if refusal is not None]
        note = self.query_one("#tuning-refusal", Static)
        note.update(unavailable("\n".join(lines)))
        note.display = bool(lines)

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self._load_changes()

    def _load_changes(self) -> None:
        self.state.load_config_changes(self)  # without a history, show_capabilities said why

    def show_snapshot(self, snapshot: Snapshot) -> None:
        super().show_snapshot(snapshot)
        # Refill only the inputs the operator has not edited, so typing is never overwritten.
        for field in FIELDS:
            box = self.query_one(f"#input-{field.name}", Input)
            live = snapshot.config.get(field.name)
            if field.name not in self._base or box.value == shown(self._base[field.name]):
                box.value = shown(live)
            self._base[field.name] = live
        cstar = snapshot.recommended_chunk_size
        status = Text(f"recommended C* = {cstar if cstar is not None else '–'}", style="cyan")
        self.query_one("#tuning-status", Static).update(status)

    def edited(self) -> dict[str, str]:
        """The fields whose text differs from the live value, as typed."""
        out = {}
        for field in FIELDS:
            value = self.query_one(f"#input-{field.name}", Input).value.strip()
            if value != shown(self._base.get(field.name)):
                out[field.name] = value
        return out

    def action_apply(self) -> None:
        self._clear_errors()
        changes = self.edited()
        if not changes:
            self.notify("nothing changed", timeout=2)
            return
        self._refused(self.state.apply_config(self, changes))

    def action_apply_recommended(self) -> None:
        self._refused(self.state.apply_recommended(self))

    def _refused(self, refusal: str | None) -> None:
        if refusal is not None:
            self.notify(refusal, severity="warning")

    def action_revert(self) -> None:
        self._clear_errors()
        for field in FIELDS:
            self.query_one(f"#input-{field.name}", Input).value = shown(self._base.get(field.name))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        actions = {"apply": self.action_apply, "revert": self.action_revert,
                   "apply-cstar": self.action_apply_recommended}
        actions[event.button.id or ""]()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_apply()

    def on_config_applied(self, message: ConfigApplied) -> None:
        for name, value in message.config.items():
            if name in self._base:
                self._base[name] = value
                self.query_one(f"#input-{name}", Input).value = shown(value)
        self.notify("configuration applied", timeout=2)
        self._load_changes()

    def on_config_rejected(self, message: ConfigRejected) -> None:
        names = {field.name for field in FIELDS}
        if message.field in names:
            note = self.query_one(f"#note-{message.field}", Static)
            note.update(Text(message.message, style="bold red"))
            note.add_class("error")
            self.query_one(f"#input-{message.field}", Input).add_class("error")
        else:
            self.notify(message.message, severity="error")

    def _clear_errors(self) -> None:
        for field in FIELDS:
            self.query_one(f"#note-{field.name}", Static).update(field.help)
            self.query_one(f"#note-{field.name}", Static).remove_class("error")
            self.query_one(f"#input-{field.name}", Input).remove_class("error")

    def on_config_changes_loaded(self, message: ConfigChangesLoaded) -> None:
        table = self.query_one("#config-changes", DataTable)
        table.clear()
        for change in message.changes:
            table.add_row(change.field, shown(change.old), shown(change.new), change.source,
                          key=str(change.id))
