"""`tokenflow-console`: the Textual console on an embedded, recorded or remote engine."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Iterable
from typing import ClassVar

from textual.app import App, SystemCommand
from textual.binding import BindingType
from textual.logging import TextualHandler
from textual.screen import Screen

from console.errors import UserError
from console.sources.base import Source
from console.sources.fleet import FleetSource
from console.sources.process import ProcessSource
from console.sources.replay import ReplaySource, SessionRecorder
from console.tui.collectors import (
    ConfigApplied,
    ConfigRejected,
    SnapshotCollector,
    SnapshotPolled,
    SourceFailed,
    apply_config_in_worker,
)
from console.tui.history import MetricHistory
from console.tui.keymap import COMMANDS, bindings
from console.tui.screens.base import ConsoleScreen
from console.tui.screens.diagnosis import DiagnosisScreen
from console.tui.screens.drift import DriftScreen
from console.tui.screens.help import HelpScreen
from console.tui.screens.live import LiveScreen
from console.tui.screens.slow_queries import SlowQueriesScreen
from console.tui.screens.tuning import TuningScreen
from engine.errors import EngineError

POLL_INTERVAL_S = 0.4  # panes refresh at 2.5 Hz


class TokenflowApp(App[None]):
    CSS_PATH = "tokenflow.tcss"
    TITLE = "tokenflow"
    BINDINGS: ClassVar[list[BindingType]] = bindings()
    MODES: ClassVar[dict[str, type[Screen]]] = {
        "live": LiveScreen,
        "tuning": TuningScreen,
        "slow_queries": SlowQueriesScreen,
        "drift": DriftScreen,
        "diagnosis": DiagnosisScreen,
    }
    DEFAULT_MODE = "live"

    def __init__(self, source: Source, *, interval: float = POLL_INTERVAL_S,
                 recorder: SessionRecorder | None = None) -> None:
        super().__init__()
        self.source = source
        self.history = MetricHistory()
        self.latest = None
        self.recorder = recorder
        self.collector = SnapshotCollector(self, source, interval, recorder)
        self.failure = ""  # the source's latest error, until a snapshot arrives again

    def on_mount(self) -> None:
        self.collector.start()

    def on_unmount(self) -> None:
        self.collector.stop()
        if self.recorder is not None:
            self.recorder.finish(self.source)
        self.source.close()

    def on_snapshot_polled(self, message: SnapshotPolled) -> None:
        self.history.record(message.snapshot)
        self.latest = message.snapshot
        self.failure = ""
        screen = self._shown_console_screen()
        if screen is not None:
            screen.show_snapshot(message.snapshot)

    def on_source_failed(self, message: SourceFailed) -> None:
        if message.error != self.failure:  # one toast per distinct failure, not one per poll
            self.failure = message.error
            self.notify(message.error, title="source", severity="error")
            screen = self._shown_console_screen()
            if screen is not None:
                screen.show_failure(message.error)

    def _shown_console_screen(self) -> ConsoleScreen | None:
        """The console screen being shown, once composed. At shutdown the app stops running
        before it prunes each screen's children, so a late poll must not redraw."""
        if (self.is_running and self.screen_stack and isinstance(self.screen, ConsoleScreen)
                and self.screen.is_mounted):
            return self.screen
        return None

    def on_config_applied(self, message: ConfigApplied) -> None:
        self.notify("configuration applied", timeout=2)

    def on_config_rejected(self, message: ConfigRejected) -> None:
        self.notify(f"{message.field}: {message.message}" if message.field else message.message,
                    severity="error")

    def action_show(self, mode: str) -> None:
        self.switch_mode(mode)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_toggle_pause(self) -> None:
        paused = self.latest is not None and self.latest.paused
        command = self.source.resume if paused else self.source.pause
        self.run_worker(command, thread=True, group="pause", exit_on_error=False)
        self.notify("resuming" if paused else "pausing", timeout=1.5)

    def action_next_server(self) -> None:
        """Fleet view: each attached server is a tab; this moves to the next one."""
        if not isinstance(self.source, FleetSource):
            self.notify("one source only: pass several --attach URLs for a fleet",
                        severity="warning")
            return
        fleet = self.source
        fleet.select((fleet.selected + 1) % len(fleet.members))
        self.history.clear()
        self.notify(fleet.name, title="fleet", timeout=2)

    def action_apply_recommended(self) -> None:
        # C* as a token budget, rounded by the engine's own policy (engine.budget.auto)
        budget = None if self.latest is None else self.latest.recommended_token_budget
        if budget is None:
            self.notify("no recommended C* yet: it needs a calibrated budget model",
                        severity="warning")
            return
        target = self.screen if isinstance(self.screen, TuningScreen) else self
        apply_config_in_worker(target, self, self.source, {"max_num_batched_tokens": budget})

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for command in COMMANDS:
            yield SystemCommand(command.title, command.help,
                                functools.partial(self.run_action, command.action))


def open_source(args: argparse.Namespace, engine: ProcessSource | None) -> Source:
    """The source the flags chose (console.cli.console checked they agree): replay, attach, or the
    embedded engine launched already, once it is ready."""
    if args.replay:
        return ReplaySource(args.replay, speed=args.speed)
    if args.attach or args.attach_vllm:
        from console.sources import open_http_source

        return open_http_source(args.attach, args.attach_vllm)
    assert engine is not None, "console.cli.console launches the embedded engine"
    engine.wait_ready()
    return engine


def run(args: argparse.Namespace, engine: ProcessSource | None) -> int:
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
    TokenflowApp(source, recorder=recorder).run()
    return 0
