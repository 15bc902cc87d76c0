"""The "Requests" pane: one keyed row per request, its budget_score coloured at 1.0 (on
budget) and at the slow-query threshold. Running requests come first, the worst
budget_score at the top: what needs a look is what is in view. A request resumed from the
journal after a restart is marked ↻ with the output tokens it had (`/resumed` finds them
where the column has dropped)."""

from __future__ import annotations

from rich.text import Text

from console.tui.settings import setting
from console.tui.text import plain
from console.tui.widgets.gauge import level_style
from console.tui.widgets.keyed_table import Column, KeyedTable, TableRow
from engine.snapshot import RequestView, Snapshot

COLUMNS = (
    Column("id", "id", 14),
    Column("tenant", "tenant", 8, drop=3),
    Column("state", "state", 16),
    Column("prompt", "prompt", 7, drop=2),
    Column("cached", "cached", 6, drop=4),
    Column("chunks", "chunks", 7),
    Column("generated", "gen", 5, drop=1),
    Column("ttft", "TTFT ms", 8),
    Column("score", "budget_score", 14),
    Column("resumed", "resumed", 7, drop=5),
)
SCORE_COLUMN = 8
# Running first, then waiting, then done: the order of the budget_score column's sort.
STATE_RANK = {"PREFILL_CHUNKING": 2, "DECODING": 2, "PREEMPTED": 2, "WAITING": 1}

STATE_STYLES = {
    "WAITING": "bright_black",
    "PREFILL_CHUNKING": "cyan",
    "DECODING": "green",
    "PREEMPTED": "yellow",
    "FINISHED": "dim",
    "FAILED": "bold red",
    "REJECTED": "red",
}


def budget_text(score: float | None, slow_threshold: float) -> Text:
    if score is None:
        return Text("–", style="dim")
    return Text(f"{score:.2f}", style=level_style(score, 1.0, slow_threshold))


def resumed_text(resumed_tokens: int | None) -> Text:
    """↻ and the output tokens a resumed request had; a dash for one never resumed."""
    if resumed_tokens is None:
        return Text("–")
    return Text(f"↻ {resumed_tokens}", style="yellow")


def request_row(r: RequestView, slow_threshold: float) -> TableRow:
    ttft = "–" if r.ttft_ms is None else f"{r.ttft_ms:.0f}"
    cached = f"{r.cached_share:.0%}" if r.cached_tokens else "–"
    state = plain(r.state, style=STATE_STYLES.get(r.state, ""))
    if r.kind != "generate":  # a chat completion, or a prompt scored without generating
        state.append(f" {r.kind}", style="magenta")
    return TableRow(
        key=r.id,
        cells=(r.id, r.tenant, state,
               str(r.prompt_tokens), cached, f"{r.chunks_done}/{r.chunks_total}",
               str(r.generated_tokens), ttft, budget_text(r.budget_score, slow_threshold),
               resumed_text(r.resumed_tokens)),
        sort_values=(r.arrival_s, r.tenant, r.state, r.prompt_tokens, r.cached_share,
                     r.chunks_done / max(r.chunks_total, 1), r.generated_tokens, r.ttft_ms,
                     (STATE_RANK.get(r.state, 0),
                      -1.0 if r.budget_score is None else r.budget_score), r.resumed_tokens),
        haystack=f"{r.id} {r.tenant} {r.state} {r.kind}"
                 f"{'' if r.resumed_tokens is None else ' resumed'}".lower(),
    )


NO_REQUEST = "no request yet: the engine has not admitted any"


class RequestsTable(KeyedTable):
    def __init__(self) -> None:
        super().__init__(COLUMNS, id="requests", sort_index=SCORE_COLUMN, reverse=True,
                         empty=NO_REQUEST)
        self.border_title = "Requests"

    def update_from(self, snapshot: Snapshot) -> None:
        threshold = setting(snapshot.config, "slow_query_threshold")
        self.sync([request_row(r, threshold) for r in snapshot.requests])
        counted = snapshot.num_running + snapshot.num_waiting
        self.say_when_empty(NO_REQUEST if not counted else (
            f"{snapshot.num_running} running and {snapshot.num_waiting} waiting, but this "
            "source lists no request one by one"))
        subtitle = f"{snapshot.num_running} running · {snapshot.num_waiting} waiting"
        if snapshot.score_estimate:  # traced scores are measured against an estimate
            subtitle += f" · budget_score vs {snapshot.score_estimate} estimate"
        # every "–" says why
        if snapshot.calibration.startswith(("calibrating", "uncalibrated")):
            subtitle = f"budget_score {snapshot.calibration} · {subtitle}"
        elif snapshot.score_note:
            subtitle = f"{snapshot.score_note} · {subtitle}"
        self.border_subtitle = plain(subtitle)  # a source's words, never markup
