"""`tokenflow-console`: the Textual console on an embedded, recorded or remote engine.

This entry module stays light on purpose: it checks the flags and launches the embedded
engine's process first, so that the child's start-up (torch, the model) runs while this
process imports Textual, instead of after it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the problem, not a usage dump (see --help for that)."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenflow-console", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="synthetic:<preset> or a Hugging Face model directory "
                        "(default: synthetic:small on CPU, a bigger preset on CUDA)")
    parser.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument("--workload", default="mixed",
                        help="mixed, chat, long-doc or trace:FILE (default: mixed)")
    parser.add_argument("--db", type=Path, help="SQLite store (default: the user data dir)")
    parser.add_argument("--attach", action="append", metavar="URL", default=[],
                        help="watch a running `tokenflow serve` instead (repeatable)")
    parser.add_argument("--attach-vllm", metavar="URL", help="watch a vLLM server's /metrics")
    parser.add_argument("--replay", type=Path, metavar="FILE",
                        help="review a session recorded with --record")
    parser.add_argument("--speed", type=float, default=1.0,
                        help="replay speed (default 1.0; 0 steps one snapshot per refresh)")
    parser.add_argument("--record", type=Path, metavar="FILE",
                        help="write every snapshot and the store's records to FILE (JSONL)")
    parser.add_argument("--simulate", metavar="TARGET",
                        help="run the GPU twin: a100, h100, h200, l40s, b200, this or "
                             "calibration:ID; no weights, step times predicted")
    parser.add_argument("--tp", type=int, default=1,
                        help="with --simulate GPU: tensor-parallel GPUs (default 1)")
    parser.add_argument("--sim-speed", type=float, default=1.0, metavar="X",
                        help="with --simulate: simulated seconds per wall-clock second "
                             "(default 1.0)")
    return parser


def conflict(args: argparse.Namespace) -> str | None:
    """Why the flags cannot go together, or None: exactly one source, and engine flags only
    for the embedded engine."""
    chosen = [flag for flag, value in (("--replay", args.replay), ("--attach", args.attach),
                                       ("--attach-vllm", args.attach_vllm)) if value]
    if len(chosen) > 1:
        return f"{' and '.join(chosen)} cannot be combined; pick one source"
    engine_flags = [flag for flag, value in (("--model", args.model), ("--device", args.device),
                                             ("--db", args.db), ("--simulate", args.simulate))
                    if value]
    if (args.tp != 1 or args.sim_speed != 1.0) and not args.simulate:
        return "--tp and --sim-speed apply to a simulated engine; add --simulate"
    if not args.sim_speed > 0:
        return f"--sim-speed must be > 0, got {args.sim_speed}"
    if chosen and engine_flags:
        return (f"{', '.join(engine_flags)} configure the embedded engine; "
                f"drop them with {chosen[0]}")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = conflict(args)
    if problem is not None:
        print(f"tokenflow-console: {problem}", file=sys.stderr)
        return 2
    engine = None
    if not (args.replay or args.attach or args.attach_vllm):
        from console.sources.process import ProcessSource
        from engine.sim.executor import Simulation

        simulate = None if args.simulate is None else Simulation(args.simulate, args.tp,
                                                                 args.sim_speed)
        engine = ProcessSource.launch(model=args.model, device=args.device,
                                      workload=args.workload, db=args.db, simulate=simulate)
    from console.tui.app import run  # Textual and the screens: seconds, overlapping the child's

    return run(args, engine)


if __name__ == "__main__":
    sys.exit(main())
