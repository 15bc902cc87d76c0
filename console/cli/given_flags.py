"""Which of a command's flags the command line gave: the ones a parser leaves at None unless
given, so a flag given for nothing it tunes can be refused by name rather than dropped."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping


def given(args: argparse.Namespace, dests: Iterable[str],
          spelled: Mapping[str, str] | None = None) -> list[str]:
    """The flags of `dests` set on the command line, as the user writes them (`--dest-name`,
    or `spelled[dest]` where that differs, e.g. "--[no-]compile")."""
    spelled = spelled or {}
    return [spelled.get(dest, "--" + dest.replace("_", "-")) for dest in dests
            if getattr(args, dest, None) is not None]
