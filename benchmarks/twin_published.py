"""The GPU twin against published GPU measurements: prints each case's error, the fitted
cases apart from the held-back ones.

    python benchmarks/twin_published.py          # the shipped factors (engine.sim.profiles)
    python benchmarks/twin_published.py --fit    # refit the factors on the fitted cases

The cases, their sources and conditions are in benchmarks/published_gpu_cases.json; the
method is in engine.sim.published and docs/twin.md.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from engine.budget.operations import FIT_BOUNDS, OperationEfficiency, fit_efficiency
from engine.sim.profiles import FITTED_EFFICIENCY
from engine.sim.published import PublishedCase, agreement, load_cases

CASES = Path(__file__).with_name("published_gpu_cases.json")
# No published case runs many chunks or sequences at small cost, so those stay at zero.
PROFILE_FIELDS = tuple(f for f in FIT_BOUNDS if f not in ("chunk_s", "sequence_s"))


def loss(cases: list[PublishedCase], efficiency: OperationEfficiency) -> float:
    """Squared log errors: a case 20% slow weighs as one 20% fast, whatever its unit."""
    return sum(math.log(c.predicted(efficiency) / c.measured) ** 2 for c in cases)


def table(cases: list[PublishedCase], efficiency: OperationEfficiency) -> str:
    lines = [f"{'case':<38}{'source':<9}{'measured':>12}{'twin':>12}  {'unit':<14}{'error':>8}"]
    for c in cases:
        lines.append(f"{c.id:<38}{c.source:<9}{c.measured:>12.5g}"
                     f"{c.predicted(efficiency):>12.5g}  {c.unit:<14}{c.error(efficiency):>+8.1%}")
    judged = agreement(cases, efficiency)
    lines.append(f"median |error| {judged.median_abs:.1%}, worst {judged.worst_abs:.1%} over "
                 f"{len(cases)} cases")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the factors first")
    args = parser.parse_args()
    cases = load_cases(CASES)
    fitted = [c for c in cases if not c.held_back]
    held = [c for c in cases if c.held_back]
    efficiency = (fit_efficiency(lambda e: loss(fitted, e), FITTED_EFFICIENCY,
                                 PROFILE_FIELDS) if args.fit
                  else FITTED_EFFICIENCY)
    print(f"factors: {efficiency.to_dict()}")
    print(f"\nfitted on ({len(fitted)} cases):\n{table(fitted, efficiency)}")
    print(f"\nheld back ({len(held)} cases):\n{table(held, efficiency)}")
    print(f"\nall {len(cases)}: median |error| {agreement(cases, efficiency).median_abs:.1%}, "
          f"worst {agreement(cases, efficiency).worst_abs:.1%}; sources "
          f"{len({c.source for c in cases})}")


if __name__ == "__main__":
    main()
