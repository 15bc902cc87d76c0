"""`tokenflow chaos`: fault-injection scenarios with a pass/fail report (protection layer 7)."""

from __future__ import annotations

import argparse
import json

from engine.harness.chaos import SCENARIOS, ScenarioResult, run_chaos


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chaos", help="fault-injection scenarios with a pass/fail "
                                   "report", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="small workloads and short faults (seconds, for CI)")
    parser.add_argument("--json", action="store_true",
                        help='print {"passed", "lost", "scenarios": [...]} as JSON')
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS), metavar="NAME",
                        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    suite = run_chaos(args.scenario, quick=args.quick,
                      on_result=None if args.json else _print_result)
    if args.json:
        print(json.dumps(suite.to_dict(), indent=2))
    else:
        print(f"{'PASSED' if suite.passed else 'FAILED'}: {len(suite.scenarios)} scenario(s), "
              f"{suite.lost} request(s) lost")
    return 0 if suite.passed else 1


def _print_result(result: ScenarioResult) -> None:
    recovery = "-" if result.recovery_ms is None else f"{result.recovery_ms:.0f} ms"
    print(f"{'pass' if result.passed else 'FAIL'}  {result.name:<16} recovery {recovery:>9}  "
          f"lost {result.lost}  {result.detail}", flush=True)
