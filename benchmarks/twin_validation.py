"""The GPU twin against real runs on this machine, in one command.

    PYTHONPATH=. .venv/bin/python benchmarks/twin_validation.py --out /tmp/twin
    PYTHONPATH=. .venv/bin/python benchmarks/twin_validation.py --out /tmp/twin --db D --reuse
    PYTHONPATH=. .venv/bin/python benchmarks/twin_validation.py --out /tmp/b --db D2 --reuse \
        --against /tmp/twin

Calibrates `--model` on this machine into `--db` (unless `--reuse`, which takes the stored
one), then runs `tokenflow bench --simulate this --against-real N` on the conversation trace
(64 requests) and on `mixed` (32), each at budgets 64, 256 and 512. Prints one markdown table,
each cell "the twin / the twin at the real runs' speeds", with misses in bold. Then it prints
how many figures were within tolerance for the twin, for the twin at the real runs' speeds,
and for each real run against the median of the others, in all and for each run on its own:
a run of the machine itself in the twin's place. The bench JSON of each workload is kept in
`--out`. Run it on a quiet machine: any run that shared its machine is named at the
end.

With `--against DIR` (the `--out` of an earlier pass) nothing runs for real: the twin of
`--db` is judged against the real runs DIR kept. Two predictors judged on the same real runs
differ by the predictors alone, not by how the machine drifted between their passes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from console.cli.bench import AGREEMENT, real_runs, real_within_each, sim_vs_real, within_counts

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
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="judge the twin against the real runs kept in DIR (an earlier "
                             "--out) instead of running new ones")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    db = args.db or args.out / "calibration.db"
    if not args.reuse:
        _tokenflow("calibrate", "--model", args.model, "--db", str(db))
    reports = {}
    for workload, requests in WORKLOADS:
        configs = [f"--config={name}:max_num_batched_tokens={budget}"
                   for name, budget in BUDGETS if name != "chunked"]
        reals = [] if args.against else ["--against-real", str(args.reals)]
        out = _tokenflow("bench", "--simulate", "this", *reals,
                         "--model", args.model, "--db", str(db), "--workload", workload,
                         "--num-requests", str(requests), *configs, "--compare",
                         ",".join(name for name, _ in BUDGETS), "--json", "--quiet")
        (args.out / f"{workload}.json").write_text(out)
        report = json.loads(out)
        if args.against:
            report = _judged_against(report, json.loads(
                (args.against / f"{workload}.json").read_text()))
        reports[f"{workload} {requests}"] = report
    _print(reports)
    return 0


def _tokenflow(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "console.cli.main", *argv],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tokenflow {' '.join(argv)} failed:\n{done.stderr}")
    return done.stdout


def _judged_against(twin: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """`twin` (a report of simulations alone) judged against `earlier`'s real runs, shaped as
    an --against-real report: its sim_vs_real, and the real runs for their host readings."""
    judged: dict[str, Any] = {"sim_vs_real": {}, "runs": {}}
    for name, _ in BUDGETS:
        reals = real_runs(earlier, name)
        if not reals:
            raise SystemExit(f"the earlier pass kept no real runs of {name}")
        judged["sim_vs_real"][name] = sim_vs_real(twin["runs"][name], reals)
        judged["runs"].update({f"{name}:real{i}": run for i, run in enumerate(reals)})
    return judged


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
        if judged:
            print(f"{WHO[who]}: {inside} of {judged} within tolerance")
    each = real_within_each(agreements)
    if each:
        print("each real run so judged: " + ", ".join(str(inside) for inside, _ in each)
              + f" of {each[0][1]} (the twin's test, passed by {sum(i == n for i, n in each)} "
              f"of {len(each)})")
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
