"""The GPU twin against published GPU measurements: prints each case's error, the fitted
cases apart from the held-back ones.

    python -m benchmarks.twin_published          # the shipped factors (engine.sim.profiles)
    python -m benchmarks.twin_published --fit    # refit the factors on the fitted cases

The cases, their sources and conditions are in engine/sim/published_gpu_cases.json; the
method is in engine.sim.published and docs/twin.md. The fit is coordinate descent on the
squared log errors of the fitted cases, over per-GPU shares (GEMM, attention, bandwidth,
the GEMM's half-share rows), shared kernel and tensor-parallel costs, and each fitted
source's engine cost a step. Held-back cases are priced once, after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from engine.budget.operations import FIT_BOUNDS, OperationEfficiency
from engine.sim.profiles import PROFILES, profile
from engine.sim.published import (
    NEVER_FITTED_GPUS,
    NEVER_FITTED_SOURCES,
    PUBLISHED_CASES,
    Agreement,
    PublishedCase,
    load_cases,
    too_fast,
)
from engine.sim.trust import decoding_batch

if TYPE_CHECKING:
    from engine.harness.driver import RunResult

CASES = PUBLISHED_CASES
# Prefill attention is not fitted: the profile takes it from the kernels' published curves.
PER_GPU = ("gemm_flops", "memory", "gemm_m_half")
# An engine's own: its host time a step, and its decode attention kernel's share of the peak.
PER_ENGINE = ("step_s", "decode_attention_flops")
SHARED = ("gemm_flops_8bit", "weight_only_memory", "layer_s", "allreduce_s", "tp_step_s",
          "tp_allreduce_s")
# GPUs with enough cases for factors of their own; others keep the profile's.
FITTED_GPUS = ("a100", "h100")
# Sources whose engine is vLLM: they share the profile's step cost, which `bench --simulate`
# (vLLM's defaults) charges.
VLLM_SOURCES = ("argonne", "gpustack", "lambda")
# Held out whole by the rule written before fitting (docs/twin.md, "the hold-out rule").
HELD_OUT_SOURCES = ("gpustack",)
Params = dict[str, float]
ROUNDS_PER_STEP = 6


def case_efficiency(case: PublishedCase, params: Params) -> OperationEfficiency:
    """`case`'s factors under `params`: its GPU's, the shared ones, its engine's step."""
    e = profile(case.gpu).efficiency
    changes = {name: params[name] for name in SHARED}
    if case.gpu in FITTED_GPUS:
        changes.update({name: params[f"{case.gpu}.{name}"] for name in PER_GPU})
    for name in PER_ENGINE:
        changes[name] = params.get(f"{case.source}.{name}", params[f"vllm.{name}"])
    return dataclasses.replace(e, **changes)


def start_params(cases: list[PublishedCase]) -> Params:
    params: Params = {}
    for gpu in FITTED_GPUS:
        e = profile(gpu).efficiency
        params.update({f"{gpu}.{name}": getattr(e, name) for name in PER_GPU})
    e = profile("a100").efficiency
    params.update({name: getattr(e, name) for name in SHARED})
    engines = {"vllm"} | {c.source for c in cases
                          if c.source not in VLLM_SOURCES and c.kind != "layer"}
    for engine in engines:
        params.update({f"{engine}.{name}": getattr(e, name) for name in PER_ENGINE})
    return params


def bounds_of(name: str) -> tuple[float, float]:
    return FIT_BOUNDS[name.rsplit(".", 1)[-1]]


def loss(cases: list[PublishedCase], params: Params) -> float:
    """Squared log errors: a case 20% slow weighs as one 20% fast, whatever its unit."""
    return sum(math.log(c.predicted(case_efficiency(c, params)) / c.measured) ** 2
               for c in cases)


def read_start(path: Path, known: Params) -> Params:
    """A --start file's parameters: a JSON object of `known`'s names, each within its bounds."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--start {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--start {path} must hold one JSON object of parameters")
    for name, value in data.items():
        if name not in known:
            raise SystemExit(f"--start {path}: {name!r} is no parameter of the fit; it takes "
                             f"{', '.join(sorted(known))}")
        lo, hi = bounds_of(name)
        if not (isinstance(value, int | float) and not isinstance(value, bool)
                and lo <= value <= hi):
            raise SystemExit(f"--start {path}: {name} must be a number in [{lo:g}, {hi:g}], "
                             f"got {value!r}")
    return {name: float(value) for name, value in data.items()}


def fit(cases: list[PublishedCase], params: Params) -> Params:
    """Coordinate descent in multiplicative steps, halving the step when none helps."""
    best, best_loss = dict(params), loss(cases, params)
    step, rounds = 0.5, 0
    while step > 2e-3:
        improved = False
        rounds += 1
        for name in best:
            lo, hi = bounds_of(name)
            for direction in (1 + step, 1 / (1 + step)):
                value = best[name]
                moved = value * direction if value > 0 else (hi - lo) * step / 20
                candidate = {**best, name: min(hi, max(lo, moved))}
                candidate_loss = loss(cases, candidate)
                if candidate_loss < best_loss - 1e-12:
                    best, best_loss, improved = candidate, candidate_loss, True
        # a valley of two factors trading off crawls: the step halves after a few rounds
        if not improved or rounds >= ROUNDS_PER_STEP:
            step, rounds = step / 2, 0
    return best


def errors_of(cases: list[PublishedCase], params: Params | None,
              runs: dict[str, RunResult] | None = None) -> dict[str, float]:
    """Each case's error; a served case's twin run kept in `runs` where given, so --write and
    --served-detail read it again rather than run it again (seconds each)."""
    errors = {}
    for c in cases:
        efficiency = None if params is None else case_efficiency(c, params)
        if runs is not None and c.kind == "served":
            run = runs[c.id] = c.served_run(efficiency)
            errors[c.id] = c.error_of(run.wall_s)
        else:
            errors[c.id] = c.error(efficiency)
    return errors


def sets_table(sets: dict[str, list[PublishedCase]], errors: dict[str, float]) -> str:
    """Each set's median and worst |error| and its too fast / too slow counts."""
    lines = ["| set | cases | median |error| | worst | too fast | too slow |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, cases in sets.items():
        if not cases:
            continue
        judged = Agreement({c.id: errors[c.id] for c in cases})
        fast = sum(too_fast(c, errors[c.id]) for c in cases)
        lines.append(f"| {name} | {len(cases)} | {judged.median_abs:.1%} | "
                     f"{judged.worst_abs:.1%} | {fast} | {len(cases) - fast} |")
    return "\n".join(lines)


def table(cases: list[PublishedCase], errors: dict[str, float], markdown: bool = False) -> str:
    lines = (["| case | source | conditions | measured | twin | error |",
              "| --- | --- | --- | --- | --- | --- |"] if markdown else
             [f"{'case':<44}{'measured':>11}{'twin':>11}  {'unit':<13}{'error':>8}  side"])
    for c in cases:
        error = errors[c.id]
        predicted = c.measured * (1 + error)
        if markdown:
            lines.append(f"| {c.id} | {c.source} | {c.conditions} | {c.measured:,.4g} {c.unit} "
                         f"| {predicted:,.4g} | {error:+.1%} |")
        else:
            lines.append(f"{c.id:<44}{c.measured:>11.5g}{predicted:>11.5g}  {c.unit:<13}"
                         f"{error:>+8.1%}  {'fast' if too_fast(c, error) else 'slow'}")
    judged = Agreement({c.id: errors[c.id] for c in cases})
    fast = sum(too_fast(c, errors[c.id]) for c in cases)
    lines.append(("\n" if markdown else "")
                 + f"median |error| {judged.median_abs:.1%}, worst {judged.worst_abs:.1%} over "
                 f"{len(cases)} cases; too fast {fast}, too slow {len(cases) - fast}")
    return "\n".join(lines)


# A served run's summary figures beside the source's printed ones: (label, summary key, pct).
LATENCIES = (("TTFT p50", "ttft_ms", "p50"), ("TPOT p50", "tpot_ms", "p50"),
             ("ITL p50", "itl_ms", "p50"), ("ITL p99", "itl_ms", "p99"))


def served_detail(cases: list[PublishedCase], runs: dict[str, RunResult]) -> str:
    """Each served case's latencies, printed against the twin's (ms): a step priced wrong
    shows in every ITL, a schedule or front end wrong in TTFT alone. The client times TTFT
    from its send, so the twin's counts the front end's intake too."""
    lines = ["| case | " + " | ".join(f"{label} printed / twin" for label, _, _ in LATENCIES)
             + " |", "| --- |" + " --- |" * len(LATENCIES)]
    for c in cases:
        printed = dict(c.printed_ms)
        if c.kind != "served" or not printed:
            continue
        summary = (runs[c.id] if c.id in runs else c.served_run()).summary()
        intake_ms = c.front_end_s() * 1e3
        cells = []
        for _, key, pct in LATENCIES:
            name = f"{key.removesuffix('_ms')}_{pct}"
            twin = summary[key][pct] + (intake_ms if key == "ttft_ms" else 0.0)
            cells.append(f"{printed[name]:,.0f} / {twin:,.0f} ({twin / printed[name] - 1:+.0%})")
        lines.append(f"| {c.id} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_errors(cases: list[PublishedCase], known: dict[str, float],
                 runs: dict[str, RunResult]) -> None:
    """Each case's error on the shipped factors into the cases file (those in `known`, and
    the served runs in `runs`, already priced on them), and a served case's decoding batch in
    its twin run (`placed_batch`, where the trust band places it); a case the KV rule leaves
    out has none (its schedule is not the publication's)."""
    runs = {c.id: runs[c.id] if c.id in runs else c.served_run()
            for c in cases if c.kind == "served"}
    errors = {c.id: round(c.error_of(runs[c.id].wall_s) if c.id in runs
                          else known[c.id] if c.id in known else c.error(), 4) for c in cases}
    batches = {case_id: round(decoding_batch(run), 2) for case_id, run in runs.items()}
    data = json.loads(CASES.read_text())
    for case in data["cases"]:
        case.pop("twin_error", None)
        case.pop("placed_batch", None)
        if case["id"] in errors:
            case["twin_error"] = errors[case["id"]]
        if case["id"] in batches:
            case["placed_batch"] = batches[case["id"]]
    CASES.write_text(json.dumps(data, indent=1) + "\n")


def priced_as(cases: list[PublishedCase], spec: str) -> list[PublishedCase]:
    """`cases` with every case of GPU FROM priced on GPU TO's profile (`spec` "FROM=TO")."""
    source, sep, target = spec.partition("=")
    gpus = sorted({c.gpu for c in cases})
    if not sep or source not in gpus or target not in PROFILES:
        raise SystemExit(f"--gpu-as takes FROM=TO: FROM a GPU of the cases ({', '.join(gpus)}),"
                         f" TO a GPU profile ({', '.join(PROFILES)}); got {spec!r}")
    return [dataclasses.replace(c, gpu=target) if c.gpu == source else c for c in cases]


def with_host_steps(cases: list[PublishedCase], spec: str) -> list[PublishedCase]:
    """`cases` with SOURCE's host time a step paid once per N steps (`spec` "SOURCE=N"), as
    vLLM 0.6's `--num-scheduler-steps N` runs the host's half of a step."""
    source, sep, count = spec.partition("=")
    sources = sorted({c.source for c in cases})
    if not sep or source not in sources or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"--host-steps takes SOURCE=N: SOURCE one of the cases' sources "
                         f"({', '.join(sources)}), N a whole number of steps >= 1; got {spec!r}")
    return [dataclasses.replace(c, engine=(*c.engine, ("step_s",
                                                       c.efficiency().step_s / int(count))))
            if c.source == source else c for c in cases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the factors first")
    parser.add_argument("--start", type=Path, help="a JSON of parameters to start the fit from")
    parser.add_argument("--write", action="store_true",
                        help="store each case's error under the shipped factors in the cases "
                             "file (`twin_error`: what `bench --simulate` reports as its band), "
                             "and each served case's decoding batch (`placed_batch`)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the per-case tables as docs/twin.md holds them")
    parser.add_argument("--served-detail", action="store_true",
                        help="also print each served case's printed latencies against the "
                             "twin's (from the runs that priced them)")
    parser.add_argument("--no-served", action="store_true",
                        help="skip the served cases (each runs the twin's engine: seconds)")
    parser.add_argument("--gpu-as", metavar="FROM=TO",
                        help="price every case of GPU FROM on GPU TO's profile, a diagnostic: "
                             "which board a source's figures behave like (not with --fit or "
                             "--write)")
    parser.add_argument("--host-steps", metavar="SOURCE=N",
                        help="price SOURCE's host time a step once per N steps, as vLLM 0.6's "
                             "multi-step scheduling runs it, a diagnostic (not with --fit or "
                             "--write)")
    args = parser.parse_args()
    if args.start is not None and not args.fit:
        parser.error("--start is where --fit starts from; add --fit, or drop --start")
    for flag, given in (("--served-detail", args.served_detail), ("--write", args.write)):
        if given and args.no_served:
            parser.error(f"{flag} reads the served cases, which --no-served skips; drop one")
    every = load_cases(CASES, fitting_only=False)
    for flag, value, change in (("--gpu-as", args.gpu_as, priced_as),
                                ("--host-steps", args.host_steps, with_host_steps)):
        if value is None:
            continue
        if args.fit or args.write:
            parser.error(f"{flag} is a diagnostic: it cannot fit the factors or write the "
                         "shipped errors; drop --fit and --write")
        every = change(every, value)
    cases = [c for c in every if c.kv_fits()]
    left_out = [c.id for c in every if not c.kv_fits()]
    fitted = [c for c in cases if not c.held_back]
    held = [c for c in cases if c.held_back and not (args.no_served and c.kind == "served")]
    params = None
    if args.fit:
        start = start_params(fitted)
        if args.start is not None:
            start.update(read_start(args.start, start))
        params = fit(fitted, start)
        for name, value in params.items():
            print(f"{name:<26}{value:.6g}")
    judged = [*fitted, *held]
    # the served runs on the shipped factors, kept for --write and --served-detail
    runs: dict[str, RunResult] = {}
    errors = errors_of(judged, params, runs if params is None else None)
    print(f"\nleft out by the KV rule: {', '.join(left_out) or 'none'}")
    print(f"\nfitted on ({len(fitted)} cases):\n{table(fitted, errors, args.markdown)}")
    print(f"\nheld back ({len(held)} cases):\n{table(held, errors, args.markdown)}")
    if args.write:
        write_errors(cases, errors if params is None else {}, runs)
    sets = {"fitted on": fitted,
            "the first table's held-back cases": [
                c for c in held
                if c.source not in (*HELD_OUT_SOURCES, *NEVER_FITTED_SOURCES)
                and c.gpu not in NEVER_FITTED_GPUS],
            **{f"held out: {s}, whole": [c for c in held if c.source == s]
               for s in HELD_OUT_SOURCES},
            **{f"{g.upper()}, never fitted": [c for c in held if c.gpu == g]
               for g in NEVER_FITTED_GPUS},
            **{f"{s}, a new source, never fitted": [c for c in held if c.source == s]
               for s in NEVER_FITTED_SOURCES},
            "all": judged}
    print(f"\n{sets_table(sets, errors)}\n\nsources "
          f"{len({c.source for c in judged})}")
    if args.served_detail:
        print(f"\nserved cases, latencies in ms:\n{served_detail(held, runs)}")


if __name__ == "__main__":
    main()
