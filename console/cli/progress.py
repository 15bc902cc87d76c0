"""Progress on stderr for `run` and `bench`: the start-up stages, then requests done, tok/s
and an ETA, so a headless run is never silent for the seconds a start or a run takes
(`--quiet` turns it off; stdout keeps only the summary)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from engine.batch import RequestOutput
from engine.events import CalibrationProgress, Event

REFRESH_S = 1.0  # how often the line is redrawn (at most)


def add_quiet_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (start-up stages, requests done, tok/s, ETA)")


class RunProgress:
    """Counts outputs as `drive` hands them over and redraws one line on stderr: in place on
    a terminal, a line per REFRESH_S otherwise (a log keeps each)."""

    def __init__(self, label: str, total: int, *, quiet: bool = False,
                 stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.tokens = 0
        self.started = time.monotonic()
        self._drawn = float("-inf")
        self._in_place = self.stream.isatty()
        self._open = False  # an in-place line is drawn and not ended

    def start(self, total: int) -> None:
        """The run proper begins (after the start-up stages): `total` requests to serve."""
        self.total = total
        self.started = time.monotonic()
        self.stage(f"serving {total} requests")

    def stage(self, text: str) -> None:
        """A start-up stage (loading, serving), on a line of its own."""
        self._show(f"{self.label}: {text}", force=True)
        self._end_line()

    def on_calibration(self, event: Event) -> None:
        """An engine-bus subscriber: the first calibration's progress."""
        if isinstance(event, CalibrationProgress):
            self._show(f"{self.label}: calibrating {event.fraction:.0%}: {event.note}",
                       force=event.fraction >= 1.0)
            if event.fraction >= 1.0:
                self._end_line()

    def on_output(self, output: RequestOutput) -> None:
        self.tokens += len(output.new_token_ids)
        self.done += output.finished
        if output.finished:
            self._show(self.line(time.monotonic()), force=self.done == self.total)

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.tokens / elapsed
        left = self.total - self.done
        eta = "–" if self.done == 0 else f"{elapsed / self.done * left:.0f} s"
        return (f"{self.label}: {self.done}/{self.total} requests · {rate:,.0f} tok/s · "
                f"ETA {eta}")

    def _show(self, text: str, *, force: bool) -> None:
        """Draw `text`: in place on a terminal, as a line otherwise; at most every REFRESH_S
        unless `force`d (a stage, the last request)."""
        now = time.monotonic()
        if self.quiet or (not force and now - self._drawn < REFRESH_S):
            return
        self._drawn = now
        if self._in_place:
            print(f"\r\x1b[K{text}", end="", file=self.stream, flush=True)
            self._open = True
        else:
            print(text, file=self.stream, flush=True)

    def _end_line(self) -> None:
        if self._open:
            print(file=self.stream, flush=True)
            self._open = False

    def close(self) -> None:
        """End the in-place line, so the summary starts on a line of its own."""
        self._end_line()
