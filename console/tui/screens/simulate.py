"""The fleet view's "simulate this traffic on …": the requests the attached fleet served (its
OTLP traces in the console's store) replayed on the GPU twin of a GPU the operator names, at
a token budget they give; the result is TTFT, TPOT and throughput, labelled SIMULATED."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from console.errors import UserError
from console.tui.state import TracedTraffic
from engine.errors import EngineError

DEFAULT_GPU = "h100"
DEFAULT_BUDGET = 2048  # vLLM's GPU server takes 2,048-8,192
DEFAULT_MODEL = "synthetic:8b"


def gpu_names() -> tuple[str, ...]:
    """The twin's GPUs. Its profiles pull in torch, so they load when this dialog opens, not
    with the console (whose launch competes with the engine process for the cores)."""
    from engine.sim.profiles import PROFILES

    return tuple(PROFILES)


class TrafficSimulated(Message):
    """The worker's answer: the run's report, or why there is none."""

    def __init__(self, report: dict[str, Any] | None, error: str | None = None) -> None:
        super().__init__()
        self.report = report
        self.error = error


def result_lines(gpu: str, budget: int, report: dict[str, Any]) -> str:
    """The run's figures, and how far to trust them (the published case nearest it), as
    `bench --simulate` prints them."""
    from engine.sim.trust import Trust  # loaded with the run that needs it

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    return (f"SIMULATED on {gpu} at a token budget of {budget}: {report['finished']} requests\n"
            f"TTFT p50 {ms(report['ttft_ms']['p50'])}   p99 {ms(report['ttft_ms']['p99'])}\n"
            f"TPOT p50 {ms(report['tpot_ms']['p50'])}   p99 {ms(report['tpot_ms']['p99'])}\n"
            f"throughput {report['output_tok_s']:.0f} output tok/s "
            f"({report['throughput_tok_s']:.0f} tok/s in all)\n"
            f"trust: {Trust.from_dict(report['trust']).line()}")


class SimulateTraffic(ModalScreen[None]):
    """Asks a GPU, a token budget and a model shape; enter runs the twin in a worker."""

    DEFAULT_CSS = """
    SimulateTraffic { align: center middle; }
    SimulateTraffic > Vertical { width: 80; height: auto; padding: 1 2;
                                 background: $surface; border: thick $accent; }
    SimulateTraffic Static { height: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss", "Close")]

    def __init__(self, traced: TracedTraffic) -> None:
        super().__init__()
        self.traced = traced

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Simulate this traffic (the requests the fleet served, from the "
                         f"traces in {self.traced.store}) on:", markup=False)
            yield Static("GPU: " + ", ".join(gpu_names()), classes="dim", markup=False)
            yield Input(DEFAULT_GPU, id="simulate-gpu", placeholder="GPU")
            yield Static("token budget (max_num_batched_tokens)", classes="dim", markup=False)
            yield Input(str(DEFAULT_BUDGET), id="simulate-budget", type="integer")
            yield Static("model (a directory with its config.json, or synthetic:NAME)",
                         classes="dim", markup=False)
            yield Input(DEFAULT_MODEL, id="simulate-model")
            yield Static("context length (max_model_len; empty: the model's own)",
                         classes="dim", markup=False)
            yield Input("", id="simulate-context", type="integer")
            yield Static("enter runs · esc closes", id="simulate-result", markup=False)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        gpu = self.query_one("#simulate-gpu", Input).value.strip().lower()
        budget_text = self.query_one("#simulate-budget", Input).value.strip()
        model = self.query_one("#simulate-model", Input).value.strip() or DEFAULT_MODEL
        result = self.query_one("#simulate-result", Static)
        if gpu not in gpu_names():
            result.update(f"unknown GPU {gpu!r}; choose one of {', '.join(gpu_names())}")
            return
        if not budget_text.isdigit() or int(budget_text) < 1:
            result.update("the token budget is a whole number of tokens, at least 1")
            return
        context_text = self.query_one("#simulate-context", Input).value.strip()
        if context_text and (not context_text.isdigit() or int(context_text) < 1):
            result.update("the context length is a whole number of tokens, at least 1, or "
                          "empty for the model's own")
            return
        budget = int(budget_text)
        context = int(context_text) if context_text else None
        result.update(f"simulating on {gpu} at a budget of {budget} …")
        self.gpu, self.budget = gpu, budget
        self.run_worker(lambda: self._simulate(gpu, budget, model, context), thread=True,
                        name="simulate traffic", exit_on_error=False)

    def _simulate(self, gpu: str, budget: int, model: str, context: int | None) -> None:
        try:
            report = self.traced.simulate(self.traced.store, gpu, budget, model, context)
        except (UserError, EngineError, SystemExit) as exc:
            self.post_message(TrafficSimulated(None, str(exc)))
            return
        self.post_message(TrafficSimulated(report))

    def on_traffic_simulated(self, message: TrafficSimulated) -> None:
        result = self.query_one("#simulate-result", Static)
        if message.report is None:
            result.update(f"not simulated: {message.error}")
        else:
            result.update(result_lines(self.gpu, self.budget, message.report))
