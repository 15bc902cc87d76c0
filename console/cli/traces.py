"""`tokenflow traces`: the request traces shipped in the package, which `--workload` replays."""

from __future__ import annotations

import argparse
import json

from engine.harness.trace import TRACE_LICENSE, TRACE_SOURCE, shipped_trace_summaries


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("traces", help="list the shipped request traces",
                                   description=__doc__)
    parser.add_argument("--json", action="store_true",
                        help='print {"traces": [...], "source", "license"} as JSON')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    summaries = shipped_trace_summaries()
    if args.json:
        print(json.dumps({"traces": [s.to_dict() for s in summaries], "source": TRACE_SOURCE,
                          "license": TRACE_LICENSE}, indent=2))
        return 0
    print(f"{'name':<6}{'requests':>9}{'duration':>10}{'req/s':>7}"
          f"{'prompt p50/p90/max':>21}{'output p50/p90/max':>21}  what")
    for s in summaries:
        p, o = s.prompt_tokens, s.output_tokens
        rate = "-" if s.rate_per_s is None else f"{s.rate_per_s:.2f}"
        print(f"{s.name:<6}{s.requests:>9}{s.duration_s / 60:>8.1f} m{rate:>7}"
              f"{f'{p.p50:.0f}/{p.p90:.0f}/{p.max}':>21}{f'{o.p50:.0f}/{o.p90:.0f}/{o.max}':>21}"
              f"  {s.what}")
    print(f"source: {TRACE_SOURCE}")
    print(f"license: {TRACE_LICENSE}; keep this attribution with any copy")
    print("replay one with --workload NAME (run, bench, tokenflow-console)")
    return 0
