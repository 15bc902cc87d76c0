"""Diagnosis: the symptom table evaluated live — which symptoms are present, why, and how to
check. Each finding's lines hang under its first words, so a wrapped line never starts at the
pane's edge (80 columns)."""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from console.tui.diagnosis import RULES, Finding, evaluate
from console.tui.screens.base import ConsoleScreen
from engine.snapshot import Snapshot


def finding_text(symptom: str, mechanism: str, check: str,
                 finding: Finding | None) -> RenderableType:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column()
    if finding is None:
        grid.add_row(Text("○ absent", style="green"), Text(symptom, style="dim"))
        return grid
    grid.add_row(Text("● PRESENT", style="bold red"), Text(symptom, style="bold"))
    details = Table.grid(padding=(0, 2))
    details.add_column(no_wrap=True, style="dim")
    details.add_column()
    details.add_row("mechanism", mechanism)
    details.add_row("check", Text(check, style="cyan"))
    details.add_row("condition", finding.condition)
    details.add_row("evidence", Text("  ".join(f"{name} {value}"
                                              for name, value in finding.figures.items()),
                                     style="yellow"))
    grid.add_row("", details)
    return grid


class DiagnosisScreen(ConsoleScreen):
    def compose(self) -> ComposeResult:
        yield from self.compose_header()
        with VerticalScroll(id="diagnosis"):
            yield Static(id="diagnosis-summary")
            for index in range(len(RULES)):
                yield Static(id=f"rule-{index}", classes="rule")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self.query_one("#diagnosis").border_title = "Diagnosis: symptoms, causes, checks"

    def show_snapshot(self, snapshot: Snapshot) -> None:
        super().show_snapshot(snapshot)
        findings = {f.key: f for f in evaluate(snapshot, self.state.history, self.state.slo)}
        if snapshot.paused:  # no symptom explains a queue the operator is holding
            summary = Text(f"paused by the operator: {snapshot.num_waiting} waiting, "
                           f"{snapshot.num_running} held mid-request; nothing runs until it "
                           "is resumed", style="bold yellow")
        else:
            summary = Text(f"{len(findings)} of {len(RULES)} symptoms present now",
                           style="bold red" if findings else "bold green")
        self.query_one("#diagnosis-summary", Static).update(summary)
        # Present symptoms first, each keeps the seed's order within its group.
        ordered = sorted(RULES, key=lambda rule: rule.key not in findings)
        for index, rule in enumerate(ordered):
            widget = self.query_one(f"#rule-{index}", Static)
            widget.update(finding_text(rule.worded(snapshot), rule.mechanism, rule.check,
                                       findings.get(rule.key)))
            widget.set_class(rule.key in findings, "present")
