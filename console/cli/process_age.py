"""How long this process has lived: a command's own figures can then count its start-up,
the interpreter's and the imports' included."""

from __future__ import annotations

import os
from pathlib import Path


def process_age_s() -> float | None:
    """Seconds since this process started (Linux); None where /proc does not say."""
    try:
        # fields after the command name's ')': state is field 3, starttime field 22
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
