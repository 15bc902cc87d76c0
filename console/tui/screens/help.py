"""Help: every command with its key, drawn from the same table as the bindings and palette;
a command this source cannot do is shown dimmed, with the reason."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from console.tui.keymap import COMMANDS
from console.tui.state import ConsoleState
from engine.budget.plan import BUDGET_SCORE_DEFINITION

SCREEN_KEYS = (
    ("Tables", "/ filter · o next sort column · O reverse · click a header to sort · "
               "the arrow marks the sorted column"),
    ("Live", "enter on a request: its timeline (slow queries) or its figures"),
    ("Tuning", "ctrl+s apply · ctrl+r revert · enter in a field applies · "
               "esc leaves the field, then 1–5 switch screens; F1–F5 switch while typing"),
    ("Slow queries", "enter detail · e export CSV · E export JSON · r reload"),
    ("Drift", "r recalibrate"),
    ("Fleet", "enter opens a server · s simulates the traffic the fleet served (its stored "
              "traces) on a GPU's twin at a token budget"),
    ("Anywhere", "? and q work even in a field · ctrl+p command palette · "
                 "esc closes a dialog"),
)
# What a newcomer meets on the screens, in the words the screens use.
GLOSSARY = (
    ("budget_score", BUDGET_SCORE_DEFINITION),
    ("calibrating", "budget_score and C* before the first calibration of this model on this "
                    "device: no verdicts until the step-time model is fitted"),
    ("C*", "the recommended chunk size: the balance chunk at which a step's compute time "
           "equals its memory time (the roofline), for the decode load D (sequences) and S "
           "(context) averaged over 20 s; smaller wastes the weights read, larger slows the "
           "decodes. c sets the token budget to it"),
    ("tile", "chunks are cut to a multiple of it (chunk_tile), so kernels run full tiles"),
    ("token budget", "max_num_batched_tokens: the tokens one step may spend, decodes first"),
    ("chunk", "the slice of a prompt prefilled in one step"),
    ("NORMAL", "mode: requests are admitted and prefilled as the budget allows"),
    ("CACHE_PRESSURE_WAIT", "mode: KV-cache use is above the high watermark; nothing new is "
                            "admitted until it falls below the low watermark"),
    ("BANDWIDTH_THROTTLE", "mode: memory bandwidth (5 s average) is above a throttle level; "
                           "prefill concurrency drops to 2, then 1, then new prefills pause"),
    ("Requests", "one row per request: running first, the worst budget_score on top"),
    ("Chunk queue", "prefills waiting for or taking chunks, and the chunk each gets"),
    ("Cache pressure", "KV-cache use against the watermarks, and fragmentation"),
    ("Bandwidth", "memory bandwidth as a share of the device's peak, and throttle levels"),
    ("Latency", "TTFT (time to first token) and TPOT (time per output token) over the window"),
    ("ITL", "inter-token latency: the gap between two tokens of one request"),
    ("Slow query", "a request whose budget_score went above slow_query_threshold and whose "
                   "prefill overran its plan by slow_query_min_overrun_ms or more; stored "
                   "with its timeline and cause"),
    ("Drift", "how far measured steps run from the calibrated prediction; persistent drift "
              "recalibrates"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss", "Close")]

    def __init__(self, state: ConsoleState) -> None:
        super().__init__()
        self.state = state

    def compose(self) -> ComposeResult:
        keys = Table(show_header=False, box=None, padding=(0, 2))
        for command in COMMANDS:
            refusal = None if command.needs is None else self.state.refusal(command.needs)
            keys.add_row(command.key_display or command.key.replace(",", " "), command.title,
                         command.help if refusal is None else refusal,
                         style=None if refusal is None else "dim")
        screens = Table(show_header=False, box=None, padding=(0, 2))
        for name, text in SCREEN_KEYS:
            screens.add_row(name, text)
        glossary = Table(show_header=False, box=None, padding=(0, 2))
        glossary.add_column(style="bold", no_wrap=True)
        glossary.add_column()
        for term, meaning in GLOSSARY:
            glossary.add_row(term, meaning)
        with VerticalScroll(id="help"):
            yield Static(keys)
            yield Static(screens)
            yield Static("[b]Glossary[/b]")
            yield Static(glossary)

    def on_mount(self) -> None:
        self.query_one("#help").border_title = "tokenflow console · keys and glossary"
        self.query_one("#help").border_subtitle = "esc or ? closes · scroll for more"
