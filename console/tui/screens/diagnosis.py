"""Diagnosis: seed 003 §11 evaluated live — which symptoms are present, why, and how to check."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from console.tui.diagnosis import RULES, Finding, evaluate
from console.tui.screens.base import ConsoleScreen
from engine.snapshot import Snapshot


def finding_text(symptom: str, mechanism: str, check: str, finding: Finding | None) -> Text:
    text = Text()
    if finding is None:
        text.append("○ absent   ", style="green")
        text.append(symptom, style="dim")
        return text
    text.append("● PRESENT  ", style="bold red")
    text.append(symptom, style="bold")
    text.append("\n    mechanism  ", style="dim")
    text.append(mechanism)
    text.append("\n    check      ", style="dim")
    text.append(check, style="cyan")
    text.append("\n    condition  ", style="dim")
    text.append(finding.condition)
    text.append("\n    evidence   ", style="dim")
    text.append("  ".join(f"{name} {value}" for name, value in finding.figures.items()),
                style="yellow")
    return text


class DiagnosisScreen(ConsoleScreen):
    def compose(self) -> ComposeResult:
        yield from self.compose_header()
        with VerticalScroll(id="diagnosis"):
            yield Static(id="diagnosis-summary")
            for index in range(len(RULES)):
                yield Static(id=f"rule-{index}", classes="rule")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self.query_one("#diagnosis").border_title = "Diagnosis (seed 003 §11)"

    def show_snapshot(self, snapshot: Snapshot) -> None:
        super().show_snapshot(snapshot)
        findings = {f.key: f for f in evaluate(snapshot, self.state.history)}
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
