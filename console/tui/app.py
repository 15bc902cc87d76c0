"""`tokenflow-console`: the Textual console on an embedded, recorded or remote engine."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from textual import events
from textual.app import App, SystemCommand
from textual.await_complete import AwaitComplete
from textual.binding import BindingType
from textual.logging import TextualHandler
from textual.screen import ModalScreen, Screen
from textual.widgets import Input

from console.errors import UserError
from console.sources.base import Source, SourceError
from console.sources.fleet import FleetSource
from console.sources.process import ProcessSource
from console.sources.replay import ReplaySource, SessionRecorder
from console.tui.collectors import (
    ConfigApplied,
    ConfigRejected,
    SnapshotCollector,
    SnapshotPolled,
    SourceFailed,
)
from console.tui.keymap import COMMANDS, bindings, command_for, own_keys
from console.tui.screens.base import ConsoleScreen
from console.tui.screens.diagnosis import DiagnosisScreen
from console.tui.screens.drift import DriftScreen
from console.tui.screens.fleet import FleetScreen
from console.tui.screens.help import HelpScreen
from console.tui.screens.live import LiveScreen
from console.tui.screens.slow_queries import SlowQueriesScreen
from console.tui.screens.splash import (
    EngineStarted,
    EngineStarting,
    SplashScreen,
)
from console.tui.screens.tuning import TuningScreen
from console.tui.state import ConsoleState, TracedTraffic, TwinRun
from console.tui.text import escaped
from console.tui.widgets.field import keystroke
from engine.errors import EngineError
from engine.slo_targets import ServiceSLO
from engine.snapshot import Snapshot

if TYPE_CHECKING:
    from engine.serve.otlp import TraceCollector

POLL_INTERVAL_S = 0.4  # panes refresh at 2.5 Hz
HOLD_BOUND_S = 1.0  # the longest a screen switch holds frames back
SCREENS: dict[str, type[ConsoleScreen]] = {  # the modes; keymap's show('NAME') switches
    "live": LiveScreen,
    "tuning": TuningScreen,
    "slow_queries": SlowQueriesScreen,
    "drift": DriftScreen,
    "diagnosis": DiagnosisScreen,
    "fleet": FleetScreen,
}


class TokenflowApp(App[None]):
    CSS_PATH = "tokenflow.tcss"
    TITLE = "tokenflow"
    BINDINGS: ClassVar[list[BindingType]] = bindings()
    DEFAULT_MODE = "live"

    def __init__(self, source: Source, *, interval: float = POLL_INTERVAL_S,
                 recorder: SessionRecorder | None = None, starting: bool = False,
                 slo: ServiceSLO | None = None, traced: TracedTraffic | None = None) -> None:
        """`starting`: `source` is a ProcessSource whose engine is still starting; a splash
        shows its stages until it is ready, and the polls begin then. `slo`: the latency
        targets figures are coloured against (a chat service's by default). `traced`: the fleet's
        traced requests, which the fleet view replays on a GPU's twin."""
        super().__init__()
        self.state = ConsoleState(source, slo=slo or ServiceSLO(), traced=traced)
        self._mode_screens: dict[str, ConsoleScreen] = {}  # each mode's screen, once made
        for mode in SCREENS:
            self.add_mode(mode, functools.partial(self._make_screen, mode))
        self._switching = False  # inside switch_mode: Textual's hold on the screen is skipped
        self.recorder = recorder
        self.collector = SnapshotCollector(self, source, interval, recorder)
        self.starting = starting
        self.startup_error: str | None = None  # why the engine did not start, for the shell

    def _make_screen(self, mode: str) -> ConsoleScreen:
        screen = self._mode_screens[mode] = SCREENS[mode](self.state)  # handed the state
        return screen

    @property
    def source(self) -> Source:
        return self.state.source

    @property
    def latest(self) -> Snapshot | None:
        return self.state.latest

    def on_mount(self) -> None:
        if not self.starting:
            self.collector.start()
            return
        self.push_screen(SplashScreen(self.source.name))
        self.run_worker(self._wait_ready, thread=True, name="engine start", exit_on_error=False)

    def _wait_ready(self) -> None:
        source = self.source
        assert isinstance(source, ProcessSource)
        try:
            source.wait_ready(lambda fraction, what: self.post_message(
                EngineStarting(fraction, what)))
        except (UserError, EngineError, SourceError) as exc:
            self.post_message(EngineStarted(str(exc)))
            return
        self.post_message(EngineStarted(None, source.orphans, source.quarantined))

    def on_engine_starting(self, message: EngineStarting) -> None:
        if isinstance(self.screen, SplashScreen):
            self.screen.show_stage(message.fraction, message.what)

    def on_engine_started(self, message: EngineStarted) -> None:
        if message.error is not None:
            self.startup_error = message.error
            self.exit(return_code=2)
            return
        self.starting = False
        if isinstance(self.screen, SplashScreen):
            self.pop_screen()
        self.collector.start()
        if message.quarantined:
            shown = ", ".join(message.quarantined[:3]) + (" …" if len(message.quarantined) > 3
                                                         else "")
            self.notify(escaped(f"{len(message.quarantined)} request(s) quarantined, not run: "
                                f"{shown}. They killed the runs that resumed them; `tokenflow "
                                "db release-quarantine ID` runs one again"),
                        title="quarantine", severity="warning", timeout=30, markup=False)
        if message.orphans:
            self.notify(f"closed {len(message.orphans)} request(s) the last session left "
                        "unfinished, as aborted (the journal keeps them)", title="journal",
                        timeout=10)

    def on_unmount(self) -> None:
        if not self.starting:
            self.collector.stop()
        if self.recorder is not None:
            self.recorder.finish(self.source)
        self.source.close()

    async def on_event(self, event: events.Event) -> None:
        """A key for the focused field is applied here, as it arrives, so keystrokes land in
        the order they were sent, and a command key after them sees their effect."""
        if isinstance(event, events.Key) and not event.is_forwarded:
            self.collector.hurry()  # the operator is here: figures at the full rate again
            if isinstance(self.focused, Input) and await keystroke(self.focused, event):
                return
        await super().on_event(event)

    def on_snapshot_polled(self, message: SnapshotPolled) -> None:
        before = self.state.latest
        if message.snapshot.engine_restarts > (0 if before is None else before.engine_restarts):
            self.notify(f"restart {message.snapshot.engine_restarts} after "
                        f"{message.snapshot.engine_fault}", title="engine restarted",
                        severity="warning", markup=False)
        self.state.record(message.snapshot)
        screen = self._shown_console_screen()
        if screen is not None:
            screen.show_snapshot(message.snapshot)

    def on_source_failed(self, message: SourceFailed) -> None:
        if message.error != self.state.failure:  # one toast per distinct failure, not per poll
            self.state.failure = message.error
            self.notify(escaped(message.error), title="source", severity="error",
                        markup=False)
            screen = self._shown_console_screen()
            if screen is not None:
                screen.show_failure(message.error)

    def _shown_console_screen(self) -> ConsoleScreen | None:
        """The console screen being shown, once composed: the top one, or the one a dialog
        sits over (the panes behind the resume notice show the engine, not nothing). At
        shutdown the app stops running before it prunes each screen's children, so a late
        poll must not redraw."""
        if not (self.is_running and self.screen_stack):
            return None
        stack = self.screen_stack
        screen = stack[-2] if isinstance(stack[-1], ModalScreen) and len(stack) > 1 else stack[-1]
        if isinstance(screen, ConsoleScreen) and screen.is_mounted:
            return screen
        return None

    def on_config_applied(self, message: ConfigApplied) -> None:
        self.notify(message.note, timeout=4)

    def on_config_rejected(self, message: ConfigRejected) -> None:
        self.notify(escaped(f"{message.field}: {message.message}" if message.field
                            else message.message), severity="error", markup=False)

    def action_show(self, mode: str) -> None:
        self.switch_mode(mode)

    def switch_mode(self, mode: str) -> AwaitComplete:
        """The screen a key asks for is drawn whole, once, as soon as it has resumed: its
        figures are set before the switch, and frames are held until its resume is handled
        (Textual holds them a fixed 50 ms instead, and then draws the screen again)."""
        if mode == self.current_mode:
            return super().switch_mode(mode)
        if isinstance(self.screen, ConsoleScreen):
            self.screen.leave()
        target = self._mode_screens.get(mode)
        if target is not None and target.is_mounted:
            target.switched_to = True
            if self.state.latest is not None:
                target.show_snapshot(self.state.latest)
        hold = self.batch_update()
        hold.__enter__()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                hold.__exit__(None, None, None)
                self.screen.refresh()

        self._switching = True
        try:
            switched = super().switch_mode(mode)
        except BaseException:
            release()
            raise
        finally:
            self._switching = False
        self.screen.call_later(release)  # queued behind the ScreenResume the switch posted
        self.set_timer(HOLD_BOUND_S, release)  # a bound, should that screen be torn down
        return switched

    def delay_update(self, delay: float = 0.05) -> None:
        if not self._switching:  # switch_mode holds frames itself
            super().delay_update(delay)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss()
        else:
            self.push_screen(HelpScreen(self.state))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A command the source cannot do is off (its key still says why:
        ConsoleScreen.on_key). A key the focused field takes never gets here (Field)."""
        if action != "command":
            return True
        key = str(parameters[0])
        if key in own_keys(self.screen):
            return False  # the screen's own binding runs instead (Textual tries it next)
        need = command_for(key).needs
        return need is None or need in self.state.capabilities

    async def action_command(self, key: str) -> None:
        await self.run_action(command_for(key).action)

    def action_toggle_pause(self) -> None:
        refusal = self.state.toggle_pause(self)
        if refusal is not None:
            self.notify(escaped(refusal), severity="warning", markup=False)

    def action_next_server(self) -> None:
        """Fleet view: each attached server is a tab; this moves to the next one."""
        if not isinstance(self.source, FleetSource):
            self.notify("one source only: pass several --attach URLs for a fleet",
                        severity="warning")
            return
        self.select_server((self.source.selected + 1) % len(self.source.members))

    def select_server(self, index: int) -> None:
        """Show fleet member `index` from now on: its history started afresh, and the keys
        and panes following what it can do."""
        fleet = self.source
        assert isinstance(fleet, FleetSource)
        fleet.select(index)
        self.state.forget_history()
        self.refresh_bindings()
        shown = self._shown_console_screen()
        if shown is not None:
            shown.show_capabilities()
        self.notify(escaped(fleet.name), title="fleet", timeout=2, markup=False)

    def on_fleet_screen_server_chosen(self, message: FleetScreen.ServerChosen) -> None:
        self.select_server(message.index)
        self.switch_mode("live")

    def action_apply_recommended(self) -> None:
        # The Tuning screen hears the result itself, to refresh its form and its changes.
        target = self.screen if isinstance(self.screen, TuningScreen) else self
        refusal = self.state.apply_recommended(target)
        if refusal is not None:
            self.notify(escaped(refusal), severity="warning", markup=False)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for command in COMMANDS:
            if command.needs is None or command.needs in self.state.capabilities:
                yield SystemCommand(command.title, command.help,
                                    functools.partial(self.run_action, command.action))


def open_source(args: argparse.Namespace, engine: ProcessSource | None) -> Source:
    """The source the flags chose (console.cli.console checked they agree): replay, attach, or the
    embedded engine launched already (the app shows its start-up)."""
    if args.replay:
        return ReplaySource(args.replay, speed=1.0 if args.speed is None else args.speed)
    if args.attach or args.attach_vllm or args.attach_sglang:
        from console.sources import open_http_source

        return open_http_source(args.attach, args.attach_vllm, args.attach_sglang,
                                gpu=args.gpu, traces=open_traces(args),
                                tokens=args.attach_tokens)
    assert engine is not None, "console.cli.console launches the embedded engine"
    return engine


def open_traces(args: argparse.Namespace) -> TraceCollector | None:
    """The OTLP receiver of --otlp-listen, writing to --db (default: the user's store)."""
    if not args.otlp_listen:
        return None
    from console.sources.otlp import open_trace_store, start_receiver

    receiver = start_receiver(args.otlp_listen, token=args.otlp_token, shape=args.roofline_model,
                              gpu=args.gpu, database=open_trace_store(args.db))
    return receiver.collector


def traced_traffic(args: argparse.Namespace, simulate: TwinRun) -> TracedTraffic | None:
    """What --otlp-listen stores (in --db, else the user's store), replayed by `simulate`."""
    if not args.otlp_listen:
        return None
    from console.sources.otlp import trace_store

    return TracedTraffic(trace_store(args.db), simulate)


def run(args: argparse.Namespace, engine: ProcessSource | None, simulate: TwinRun) -> int:
    """The console on `args`' source (`engine`, once launched, for the embedded one);
    `simulate` is the shell's twin run for the fleet view's traced traffic."""
    try:
        source = open_source(args, engine)
        recorder = SessionRecorder(args.record) if args.record else None
    except (UserError, EngineError) as exc:
        print(f"tokenflow-console: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"tokenflow-console: cannot write {args.record}: {exc.strerror}", file=sys.stderr)
        return 2
    # Engine warnings (e.g. chunks off their prediction) go to Textual's log, not the screen.
    logging.basicConfig(level=logging.WARNING, handlers=[TextualHandler()], force=True)
    app = TokenflowApp(source, recorder=recorder, starting=engine is not None,
                       slo=ServiceSLO(args.slo_ttft_ms, args.slo_itl_ms),
                       traced=traced_traffic(args, simulate))
    app.run()
    if app.startup_error is not None:
        print(f"tokenflow-console: {app.startup_error}", file=sys.stderr)
        return 2
    return 0
