"""The GPU twin against real runs on this machine, as issue 21 asks, in one command.

    PYTHONPATH=. .venv/bin/python benchmarks/twin_validation.py --out /tmp/twin
    PYTHONPATH=. .venv/bin/python benchmarks/twin_validation.py --out /tmp/twin --db D --reuse

Calibrates `--model` on this machine into `--db` (unless `--reuse`, which takes the stored
one), then runs `tokenflow bench --simulate this --against-real N` on the conversation trace
(64 requests) and on `mixed` (32), each at budgets 64, 256 and 512. Prints one markdown table,
each cell "the twin / the twin at the real runs' speeds", with misses in bold. Then it prints
how many figures were within tolerance for the twin, for the twin at the real runs' speeds,
and for each real run against the median of the others. The bench JSON of each workload is
kept in `--out`. Run it on a quiet machine: any run that shared its machine is named at the
end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from console.cli.bench import AGREEMENT, within_counts

WORKLOADS = (("conv", 64), ("mixed", 32))
BUDGETS = (("b64", 64), ("chunked", 256), ("b512", 512))
WHO = {"twin": "the twin", "at_real_speed": "the twin at the real runs' speeds",
       "real": "a real run against the median of the others"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for each bench JSON")
    parser.add_argument("--db", type=Path, help="the store to calibrate into (default in --out)")
    parser.add_argument("--reuse", action="store_true",
                        help="take the calibration already stored in --db")
    parser.add_argument("--model", default="synthetic:small")
    parser.add_argument("--reals", type=int, default=5, help="real runs per configuration")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    db = args.db or args.out / "calibration.db"
    if not args.reuse:
        _tokenflow("calibrate", "--model", args.model, "--db", str(db))
    reports = {}
    for workload, requests in WORKLOADS:
        configs = [f"--config={name}:max_num_batched_tokens={budget}"
                   for name, budget in BUDGETS if name != "chunked"]
        out = _tokenflow("bench", "--simulate", "this", "--against-real", str(args.reals),
                         "--model", args.model, "--db", str(db), "--workload", workload,
                         "--num-requests", str(requests), *configs, "--compare",
                         ",".join(name for name, _ in BUDGETS), "--json", "--quiet")
        (args.out / f"{workload}.json").write_text(out)
        reports[f"{workload} {requests}"] = json.loads(out)
    _print(reports)
    return 0


def _tokenflow(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "console.cli.main", *argv],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tokenflow {' '.join(argv)} failed:\n{done.stderr}")
    return done.stdout


def _print(reports: dict[str, dict[str, Any]]) -> None:
    fields = [field if q is None else f"{field}_{q}" for field, q, _ in AGREEMENT]
    print("| run | " + " | ".join(fields) + " |")
    print("| --- " * (len(fields) + 1) + "|")
    agreements = []
    for workload, report in reports.items():
        for name, budget in BUDGETS:
            agreement = report["sim_vs_real"][name]
            agreements.append(agreement)
            cells = [" / ".join(_cell(judged) for judged in
                                (figure, figure.get("at_real_speed")) if judged is not None)
                     for figure in (agreement[f] for f in fields)]
            print(f"| {workload}, budget {budget} | " + " | ".join(cells) + " |")
    for who, (inside, judged) in within_counts(agreements).items():
        print(f"{WHO[who]}: {inside} of {judged} within tolerance")
    busy = [f"{workload} {name}" for workload, report in reports.items()
            for name, run in report["runs"].items() if not run["host"]["quiet"]]
    if busy:
        print("shared its machine (rerun on a quiet one): " + ", ".join(busy))


def _cell(judged: dict[str, Any]) -> str:
    error = judged["error"]
    text = "-" if error is None else f"{error:+.0%}"
    return f"**{text}**" if judged["within"] is False else text


if __name__ == "__main__":
    sys.exit(main())
