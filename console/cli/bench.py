"""`tokenflow bench`: one workload under several configurations in one process.

Built-in configurations: `chunked` (the default token budget), `unchunked` (a budget as large
as the longest prompt plus a decode per running request, prompts never split), `auto` (each
step's budget is the recommended C* for the live decode load), `nocache` (`chunked` with prefix
caching off: every prompt prefilled from its first token) and `hf` (transformers' `generate` in
static batches on the same weights). More with `--config NAME:field=value,...`.
Every run replays the same requests at the same times. `--capacity` searches each
configuration's highest sustainable arrival rate; `--report DIR` writes markdown and plots.
`--simulate TARGET` runs the same scheduler on the GPU twin (engine.sim): no weights, step
times predicted; `--against-real N` also runs each configuration N times for real beside it
and reports how far the simulation lies from the real runs' median.
"""

from __future__ import annotations

# torch, the model code, the store and the plots are imported where a run needs them: a
# simulated run needs none of them, and they are most of its start-up.
import argparse
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from console.cli.db import add_db_argument
from console.cli.engine_flags import WATCHED_FLAGS, add_engine_flags, engine_config, flag_of
from console.cli.given_flags import given
from console.cli.process_age import process_age_s
from console.cli.progress import RunProgress, add_quiet_flag
from console.cli.twin_flags import add_twin_flags, twin_flags_given
from console.cli.workload_flags import (
    add_fixed_length_flags,
    add_workload_flags,
    workload_for,
    workload_name,
)
from console.errors import UserError
from engine import Engine
from engine.budget.predictor import StepTimePredictor
from engine.config import LIVE_FIELDS, EngineConfig
from engine.harness.driver import RunResult, drive
from engine.harness.slo import (
    LATENCY_METRICS,
    SLO,
    capacity,
    goodput,
    isolated_prefill,
    measure_decode_step,
)
from engine.harness.workload import (
    MAX_ARRIVAL_S,
    MAX_REQUESTS,
    WorkloadRequest,
    describe,
    steady_count,
    steady_traffic,
)
from engine.ops.host import HostLoadMeter
from engine.sim.executor import VirtualClock, simulated_engine
from engine.sim.fleet import MAX_REPLICAS, FleetResult, run_fleet
from engine.sim.profiles import profile, server_defaults, vllm_defaults
from engine.sim.router import RoutePolicy
from engine.sim.target import SimTarget, StepTimeRatios, needs_store, resolve_target
from engine.sim.trust import Trust, run_shape, trust
from engine.stats import ms, quantile

PROBE_KV_BYTES = 1 << 30  # on CUDA: a decode step of 8 x 128 tokens, even on a 7B model


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="compare configurations on one workload",
                                   description=__doc__)
    add_engine_flags(parser, skip=WATCHED_FLAGS)
    add_workload_flags(parser)
    add_fixed_length_flags(parser)
    parser.add_argument("--compare", default="chunked,unchunked",
                        help="comma-separated configuration names (default chunked,unchunked)")
    parser.add_argument("--config", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="define a named configuration, e.g. small:max_num_batched_tokens=128")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    add_quiet_flag(parser)
    add_db_argument(parser)
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="static batch size of the hf baseline (default 8)")
    parser.add_argument("--capacity", action="store_true",
                        help="binary-search each configuration's capacity at the SLOs")
    parser.add_argument("--capacity-requests", type=int, default=None,
                        help="fewest requests in a capacity probe (default 24)")
    parser.add_argument("--capacity-duration", type=float, default=None, metavar="SECONDS",
                        help="each capacity probe sends the workload, repeated, at the probed "
                             "rate for this long, so an unsustainable rate shows as a growing "
                             "queue rather than a burst that drains (default 10)")
    parser.add_argument("--capacity-iterations", type=int, default=None,
                        help="steps of the capacity search (default 5)")
    parser.add_argument("--capacity-metric", choices=LATENCY_METRICS, default=None,
                        help="latency held to the TPOT SLO: each request's mean time per "
                             "token (tpot, the default) or every gap between tokens (tbt, "
                             "Sarathi-Serve's)")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="write report.md and PNG plots into DIR")
    add_twin_flags(parser)
    parser.add_argument("--replicas", type=int, default=1,
                        help="with --simulate: a fleet of this many replicas behind a router")
    parser.add_argument("--router", default=None, choices=[p.value for p in RoutePolicy],
                        help="with --replicas: how the fleet routes requests (default "
                             "least-tokens)")
    parser.add_argument("--against-real", type=int, nargs="?", const=1, default=0,
                        metavar="N",
                        help="with --simulate: also run every configuration N times for real "
                             "(default 1), reported as NAME:real, NAME:real2, ..., and the "
                             "simulation against the real runs' median under sim_vs_real")
    parser.set_defaults(func=bench)


def bench(args: argparse.Namespace) -> int:
    report = bench_report(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    if "report_error" in report:  # the runs' figures are printed first: nothing is lost
        print(f"tokenflow bench: {report['report_error']}", file=sys.stderr)
        return 1
    return 0


def simulated_traffic(store: str, gpu: str, budget: int, model: str = "synthetic:8b",
                      max_model_len: int | None = None) -> dict[str, Any]:
    """The traffic a traced fleet served (its OTLP traces in `store`) replayed on the twin of
    `gpu` at a token budget of `budget` (and a context of `max_model_len`, None: the
    model's): `bench --simulate GPU --workload traced:STORE`'s run report, as the console's
    fleet view asks for it."""
    parser = argparse.ArgumentParser(prog="tokenflow")
    register(parser.add_subparsers())
    context = [] if max_model_len is None else [f"--max-model-len={max_model_len}"]
    # flag=value: a typed model such as "-h" is a value, not a flag argparse acts on
    args = parser.parse_args(["bench", f"--simulate={gpu}", f"--model={model}",
                              f"--workload=traced:{store}", "--compare=chunked", "--quiet",
                              f"--max-num-batched-tokens={budget}", f"--db={store}",
                              *context])
    return bench_report(args)["runs"]["chunked"]


# What a flag tunes, and its value when not given; given for nothing it tunes, it is refused.
_TUNING_DEFAULTS = {"capacity_requests": 24, "capacity_duration": 10.0,
                    "capacity_iterations": 5, "capacity_metric": "tpot",
                    "hf_batch_size": 8, "router": RoutePolicy.LEAST_TOKENS.value}


def _settle_tuning_flags(args: argparse.Namespace, names: list[str]) -> None:
    """Refuse a tuning flag given without what it tunes; then fill in the defaults."""
    capacity = given(args, ("capacity_requests", "capacity_duration", "capacity_iterations",
                            "capacity_metric"))
    if capacity and not args.capacity:
        raise UserError(f"{', '.join(capacity)} tune the capacity search; add --capacity")
    if given(args, ("hf_batch_size",)) and "hf" not in names:
        raise UserError("--hf-batch-size sizes the hf baseline's batches; add hf to --compare")
    if given(args, ("router",)) and args.replicas < 2:
        raise UserError("--router routes a fleet's requests between replicas; add --replicas "
                        "N with N of at least 2")
    for dest, default in _TUNING_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def bench_report(args: argparse.Namespace) -> dict[str, Any]:
    names = [n.strip() for n in args.compare.split(",") if n.strip()]
    if not names:
        raise UserError(f"--compare {args.compare!r} names no configuration; give one or more "
                        f"of {', '.join(BUILT_IN_CONFIGS)} or a --config NAME")
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise UserError(f"--compare names {', '.join(twice)} twice; a configuration runs once "
                        "(define another with --config NAME:field=value)")
    _settle_tuning_flags(args, names)
    if args.report:
        from console.cli.report import check_report_dir
        check_report_dir(args.report)
    if args.capacity_requests < 1:
        raise UserError(f"--capacity-requests must be at least 1, got {args.capacity_requests}")
    if not 0 <= args.capacity_duration <= MAX_ARRIVAL_S:
        raise UserError(f"--capacity-duration must be a number of seconds in [0, "
                        f"{MAX_ARRIVAL_S:g}], as a workload's span, got {args.capacity_duration}")
    if args.capacity_iterations < 1:
        raise UserError(f"--capacity-iterations must be at least 1 (a probe each), got "
                        f"{args.capacity_iterations}")
    if args.against_real < 0:
        raise UserError("--against-real takes a number of real runs of at least 1")
    base = engine_config(args)
    custom = _custom_configs(args.config, names)
    # before the target: its KV pool is what vLLM's profile run leaves at these defaults
    gpu_defaults = _gpu_defaults(args, base)
    base = dataclasses.replace(base, **gpu_defaults)
    target = _sim_target(args, base)
    base.validate()
    if target is not None and args.against_real:
        _check_real_fits(base)
    sim = None if target is None else _Simulation(target, args.replicas,
                                                  RoutePolicy.parse(args.router))
    if target is None:
        # The store is only read here, for the stored calibration, which every run applies.
        starting = RunProgress("tokenflow bench", 0, quiet=args.quiet)
        starting.stage(f"loading {base.model}")
        from engine.serve.session import EngineSession
        with EngineSession.start(_probe_config(base), db=args.db, journal=False,
                                 observers=(starting.on_calibration,)) as session:
            probe = session.engine
            calibration = (None if session.calibration is None
                           else StepTimePredictor.from_dict(session.calibration.params))
    else:
        probe, calibration = simulated_engine(base, target, VirtualClock()), target.calibration
    slo = SLO.from_decode_step(measure_decode_step(probe))
    workload = workload_for(args, probe)
    if args.capacity:
        _check_probe_size(args, workload)
    longest = max(len(w.prompt_token_ids) for w in workload)
    # auto aims each step at half the TPOT SLO: headroom for steps the predictor misjudges
    configs = {name: _named_config(name, base, custom, longest, probe.max_model_len,
                                   slo.tpot_s * 1e3 / 2) for name in names}
    prefill_s = isolated_prefill(probe)
    report: dict[str, Any] = {
        "workload": {"spec": _workload_spec(args), **describe(workload).to_dict()},
        "machine": _machine(probe),
        "slo": {**slo.to_dict(), "ttft_ms": _ttft_slo_ms(workload, slo, prefill_s)},
        "calibrated": calibration is not None,  # step predictions from `tokenflow calibrate`
        "runs": {},
    }
    if target is not None:
        report.update(simulated=True, predictor=target.predictor,
                      predictor_source=target.source, target=target.describe(),
                      gpu_defaults=gpu_defaults)
    results: dict[str, RunResult] = {}
    startup_s = process_age_s()  # what the first run waited for: interpreter, imports, set-up
    for name, config in configs.items():
        meter = HostLoadMeter()
        if sim is None:
            results[name] = _run(name, config, workload, args.hf_batch_size, calibration,
                                 progress=RunProgress(f"tokenflow bench {name}", len(workload),
                                                      quiet=args.quiet))
            report["runs"][name] = _run_report(name, config, results[name], probe, slo,
                                               prefill_s)
        else:
            results[name], report["runs"][name] = sim.report(name, config, workload, probe, slo,
                                                             prefill_s)
        report["runs"][name]["host"] = meter.reading().to_dict()
        reals = _real_names(name, args.against_real)
        for real in reals:
            meter = HostLoadMeter()
            results[real] = _run(name, config, workload, args.hf_batch_size, calibration)
            report["runs"][real] = {**_run_report(real, config, results[real], probe, slo,
                                                  prefill_s),
                                    "host": meter.reading().to_dict()}
        if reals and sim is not None:
            real_runs = [report["runs"][real] for real in reals]
            drift = _drift(real_runs)
            matched = None
            if drift is not None:
                # the same twin on a machine as fast as the real runs found it: what is left
                # of the disagreement is the twin's, not the machine's drift since calibration
                paced = dataclasses.replace(sim, target=dataclasses.replace(sim.target,
                                                                            drift=drift))
                meter = HostLoadMeter()
                results[f"{name}:at-real-speed"], matched = paced.report(
                    name, config, workload, probe, slo, prefill_s)
                report["runs"][f"{name}:at-real-speed"] = {
                    **matched, "target_drift": drift._asdict(),
                    "host": meter.reading().to_dict()}
            report.setdefault("sim_vs_real", {})[name] = sim_vs_real(
                report["runs"][name], real_runs, matched)
    if args.capacity:
        report["capacity"] = _capacities(args, configs, workload, slo, calibration, sim)
    if args.report:
        from console.cli.report import write_report
        try:
            report["report"] = str(write_report(args.report, report, results))
        except OSError as exc:
            report["report_error"] = (f"cannot write the report into {args.report} "
                                      f"({exc.strerror or exc}); the figures printed are the "
                                      "runs'; name a directory you can write to keep its plots")
    if sim is not None and startup_s is not None:
        report["process"] = _process_time([*report["runs"].values(),
                                           *report.get("capacity", {}).values()],
                                          startup_s, process_age_s() or 0.0)
    return report


def _check_real_fits(config: EngineConfig) -> None:
    """Before the twin runs: --against-real loads the model for real on this host, and one
    that does not fit would end the bench after the twin's runs."""
    from engine.core.model_runner import resolve_device, resolve_dtype
    from engine.model.loader import check_memory, free_memory, model_config_for
    device = resolve_device(config.device)
    check_memory(config.model, model_config_for(config.model),
                 resolve_dtype(config.dtype, device).itemsize, *free_memory(device),
                 fix="drop --against-real to price it on the twin alone")


def _probe_rates(workload: list[WorkloadRequest]) -> tuple[float, float]:
    """The capacity search's slowest and fastest probe: 1/16 and 4 times the workload's rate."""
    offered = len(workload) / (max(w.arrival_s for w in workload) or 1.0)
    return offered / 16, offered * 4


def _check_probe_size(args: argparse.Namespace, workload: list[WorkloadRequest]) -> None:
    """Before any run: the fastest probe's requests, which steady traffic sends for the whole
    --capacity-duration, must fit one run as a workload's do."""
    _, high = _probe_rates(workload)
    most = steady_count(high, args.capacity_duration, args.capacity_requests)
    if most > MAX_REQUESTS:
        raise UserError(f"the capacity search's fastest probe, {high:.4g} requests/s for "
                        f"--capacity-duration {args.capacity_duration:g} s (at least "
                        f"--capacity-requests {args.capacity_requests}), would send {most} "
                        f"requests, past the {MAX_REQUESTS} one run holds; lower them")


def _process_time(runs: list[dict[str, Any]], startup_s: float,
                  age_s: float) -> dict[str, float]:
    """The whole command against the time it simulated: its start-up (to the first run),
    the simulated runs' step loops (a capacity search's probes too), and the rest (the real
    runs beside them, the reports)."""
    simulated = [r for r in runs if "host_wall_s" in r]
    loops = sum(r["host_wall_s"] for r in simulated)
    simulated_s = sum(r["wall_s"] for r in simulated)
    return {"startup_s": round(startup_s, 3), "step_loops_s": round(loops, 3),
            "other_s": round(max(0.0, age_s - startup_s - loops), 3),
            "process_s": round(age_s, 3), "simulated_s": round(simulated_s, 3),
            "x_real_time": round(simulated_s / age_s, 1) if age_s > 0 else None}


def _workload_spec(args: argparse.Namespace) -> str:
    """What the requests were, as the report names them."""
    if args.requests is not None:
        return f"requests:{args.requests}"
    if args.input_len is not None:
        return f"fixed:{args.input_len}in/{args.output_len}out"
    return workload_name(args)


def _drift(real_runs: list[dict[str, Any]]) -> StepTimeRatios | None:
    """The real runs' median step time ratios, prefill and decode-only steps apart."""
    medians = []
    for kind in ("prefill", "decode"):
        ratios = [r["step_time_ratios"][kind] for r in real_runs
                  if r["step_time_ratios"][kind] is not None]
        medians.append(statistics.median(ratios) if ratios else None)
    prefill, decode = medians
    if prefill is None and decode is None:
        return None
    return StepTimeRatios(prefill or decode or 1.0, decode or prefill or 1.0)


def _probe_config(base: EngineConfig) -> EngineConfig:
    """The probe engine lives through every run. On CUDA, where each engine's KV pool is a
    share of the memory free when it starts, its pool is kept small (it measures one decode
    step) so that the runs' engines get the GPU."""
    from engine.core.model_runner import resolve_device
    if base.kv_cache_bytes is None and resolve_device(base.device).type == "cuda":
        return base.replace(kv_cache_bytes=PROBE_KV_BYTES)
    return base


@dataclass(frozen=True)
class _Simulation:
    target: SimTarget
    replicas: int
    policy: RoutePolicy

    def run(self, name: str, config: EngineConfig,
            workload: list[WorkloadRequest]) -> FleetResult:
        if name == "hf":
            raise UserError("the hf baseline runs transformers' own model; it cannot be "
                            "simulated: drop hf from --compare")
        return run_fleet(config, self.target, workload, self.replicas, self.policy)

    def report(self, name: str, config: EngineConfig, workload: list[WorkloadRequest],
               probe: Engine, slo: SLO, prefill_s: Callable[[int], float],
               ) -> tuple[RunResult, dict[str, Any]]:
        """Run `name` simulated: the fleet's merged result and its report (with each
        replica's figures when there are several)."""
        fleet = self.run(name, config, workload)
        # the merged run's summary is _run_report's: the fleet adds only its routing
        report = {**fleet.routing(per_replica=self.replicas > 1),
                  **_run_report(name, config, fleet.merged, probe, slo, prefill_s)}
        if self.replicas == 1:
            del report["router"]
        if self.target.calibration is None:  # a named GPU: judged by the published cases
            target = self.target
            report["trust"] = trust(run_shape(
                target.spec, target.dtype, probe.model_config, target.details.get("tp", 1),
                fleet.merged, workload), no_band=target.no_band).to_dict()
        return fleet.merged, report


# Engine flags only a real model runner reads (weights, device, kernels, threads).
_RUNNER_FLAGS = ("device", "seed", "attention_backend", "compile", "cpu_threads", "cpu_graphs")
_BOTH_WAYS = {"compile": "--[no-]compile", "cpu_graphs": "--[no-]cpu-graphs"}


def _sim_target(args: argparse.Namespace, base: EngineConfig) -> SimTarget | None:
    if args.simulate is None:
        if twin_flags_given(args) or args.against_real or args.replicas != 1:
            raise UserError("--tp, --replicas, --against-real, --kv-cache-dtype and "
                            "--gpu-profile apply to simulated runs; add --simulate")
        return None
    if not 1 <= args.replicas <= MAX_REPLICAS:
        raise UserError(f"--replicas must be 1 to {MAX_REPLICAS} (each is a whole engine in "
                        f"this process), got {args.replicas}")
    runner = given(args, _RUNNER_FLAGS, _BOTH_WAYS)
    if runner and not args.against_real:
        raise UserError(f"{', '.join(runner)} configure the model runner, which a simulated "
                        "run replaces with predicted step times; drop them, or add "
                        "--against-real to run for real beside it")
    if not needs_store(args.simulate):
        return resolve_target(args.simulate, base, tp=args.tp, kv_cache_dtype=args.kv_cache_dtype,
                              gpu_profile=args.gpu_profile)
    from engine.store import open_database
    database = open_database(args.db)
    try:
        with database.session() as session:
            return resolve_target(args.simulate, base, tp=args.tp, session=session,
                                  kv_cache_dtype=args.kv_cache_dtype,
                                  gpu_profile=args.gpu_profile)
    finally:
        database.close()


def _gpu_defaults(args: argparse.Namespace, base: EngineConfig) -> dict[str, Any]:
    """A vLLM server's scheduling defaults on the simulated GPU, for the fields the command
    line left unset: a GPU target does not inherit this CPU's (a calibrated twin does)."""
    if args.simulate is None or needs_store(args.simulate):
        return {}
    gpu = profile(args.simulate, args.gpu_profile)
    typed = frozenset(name for name in vllm_defaults(gpu) if getattr(args, name, None) is not None)
    return server_defaults(gpu, base, typed)


def _run(name: str, config: EngineConfig, workload: list[WorkloadRequest],
         hf_batch_size: int, calibration: StepTimePredictor | None,
         sim: _Simulation | None = None, progress: RunProgress | None = None) -> RunResult:
    if sim is not None:
        return sim.run(name, config, workload).merged
    # A dropped engine's parts refer to each other (its bus holds its metrics' handlers), so
    # the runs before this one keep their weights and KV pools (0.5 GB a run of
    # synthetic:small) until a full collection: collect them before this one allocates.
    gc.collect()
    engine = Engine(config)
    if calibration is not None:
        engine.apply_calibration(calibration)
    if name == "hf":
        from engine.harness.hf_baseline import hf_model, run_hf
        model = hf_model(engine.runner.model, engine.model_config)
        return run_hf(model, workload, batch_size=hf_batch_size)
    if progress is None:
        return drive(engine, workload)
    progress.start(len(workload))
    try:
        return drive(engine, workload, on_output=progress.on_output)
    finally:
        progress.close()


def _ttft_slo_ms(workload: list[WorkloadRequest], slo: SLO,
                 prefill_s: Callable[[int], float]) -> dict[str, float | None]:
    """The TTFT SLOs of the shortest and the longest prompt: each request has its own."""
    lengths = [len(w.prompt_token_ids) for w in workload]
    return {"min": ms(slo.ttft_s(prefill_s(min(lengths)))),
            "max": ms(slo.ttft_s(prefill_s(max(lengths))))}


def _run_report(name: str, config: EngineConfig, result: RunResult, probe: Engine, slo: SLO,
                prefill_s: Callable[[int], float]) -> dict[str, Any]:
    errors = [abs(e) for e in result.prediction_errors()]
    return {
        "config": {"name": name, **config.live_values()},
        **result.summary(),
        **result.utilisation(probe.peaks),
        "goodput": goodput(result, slo, prefill_s),
        "prediction_error": {"median_abs": statistics.median(errors) if errors else None,
                             "p90_abs": quantile(errors, 0.9)},
        "step_time_ratio": result.step_time_ratio(),
        "step_time_ratios": {"prefill": result.step_time_ratio(prefill=True),
                             "decode": result.step_time_ratio(prefill=False)},
    }


def _capacities(args: argparse.Namespace, configs: dict[str, EngineConfig],
                workload: list[WorkloadRequest], slo: SLO,
                calibration: StepTimePredictor | None,
                sim: _Simulation | None) -> dict[str, Any]:
    low, high = _probe_rates(workload)
    out: dict[str, Any] = {}
    for name, config in configs.items():
        twin_runs: list[FleetResult] = []  # a simulated probe's times count in the process's

        def run_at(rate: float, name: str = name, config: EngineConfig = config,
                   twin_runs: list[FleetResult] = twin_runs) -> RunResult:
            traffic = steady_traffic(workload, rate, args.capacity_duration,
                                     args.capacity_requests)
            if sim is None:
                return _run(name, config, traffic, args.hf_batch_size, calibration)
            twin_runs.append(sim.run(name, config, traffic))
            return twin_runs[-1].merged
        best, probes = capacity(run_at, slo, low=low, high=high,
                                iterations=args.capacity_iterations,
                                metric=args.capacity_metric)
        out[name] = {"rate": best, "metric": args.capacity_metric,
                     "probe_duration_s": args.capacity_duration,
                     "probes": [dataclasses.asdict(p) for p in probes],
                     **({"wall_s": sum(f.merged.wall_s for f in twin_runs),
                         "host_wall_s": sum(f.host_wall_s for f in twin_runs)}
                        if twin_runs else {})}
    return out


def _named_config(name: str, base: EngineConfig, custom: dict[str, dict[str, str]],
                  longest: int, max_model_len: int, tpot_target_ms: float) -> EngineConfig:
    if name in custom:
        return base.replace(**custom[name])
    if name in ("chunked", "hf"):
        return base
    if name == "auto":
        return base.replace(auto_budget=True, auto_tpot_ms=tpot_target_ms)
    if name == "nocache":
        return base.replace(enable_prefix_caching=False)
    if name == "unchunked":
        budget = max(base.max_num_batched_tokens, min(longest, max_model_len) + base.max_num_seqs)
        return base.replace(max_num_batched_tokens=budget, chunked_prefill=False)
    known = ", ".join([*BUILT_IN_CONFIGS, *custom])
    raise UserError(f"unknown configuration {name!r}; known: {known} "
                    f"(define more with --config NAME:field=value)")


BUILT_IN_CONFIGS = ("chunked", "unchunked", "auto", "nocache", "hf")


def _custom_configs(specs: list[str], compared: list[str]) -> dict[str, dict[str, str]]:
    """Each --config by name: a name given twice, a built-in's name (unchunked:x=1 was
    chunked with x), or one --compare does not run would be a definition dropped."""
    custom: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, fields = _parse_config(spec)
        if name in BUILT_IN_CONFIGS:
            raise UserError(f"--config {spec!r}: {name} is a built-in configuration; give "
                            "yours another name")
        if name in custom:
            raise UserError(f"--config defines {name} twice; give one --config NAME all its "
                            "fields (NAME:a=1,b=2)")
        custom[name] = fields
    if unused := [name for name in custom if name not in compared]:
        raise UserError(f"--config defines {', '.join(unused)}, which --compare does not run; "
                        f"add it to --compare or drop the --config")
    return custom


def _parse_config(spec: str) -> tuple[str, dict[str, str]]:
    name, sep, body = spec.partition(":")
    if not sep or not name:
        raise UserError(f"--config {spec!r}: expected NAME:field=value,...")
    fields: dict[str, str] = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--config {spec!r}: {item!r} is not field=value")
        fields[key.strip()] = value.strip()
    fixed = sorted(set(fields) - LIVE_FIELDS & {f.name for f in dataclasses.fields(EngineConfig)})
    if fixed:  # one engine's start sets them: every configuration of the bench shares them
        flag = flag_of(fixed[0])
        fix = (f"set it with {flag}" if flag is not None and flag not in WATCHED_FLAGS
               else "a bench does not set it")
        raise UserError(f"--config {spec!r}: {fixed[0]} is fixed at an engine's start, so "
                        f"every configuration of a bench shares it; {fix}")
    EngineConfig().replace(**fields)  # ConfigError names a bad field now, before any run
    return name, fields


def _machine(engine: Engine) -> dict[str, Any]:
    peaks = engine.peaks
    cuda = engine.runner.device.type == "cuda"
    if cuda or "torch" in sys.modules:
        import torch
    return {
        "device": str(engine.runner.device),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": importlib.metadata.version("torch"),
        # a simulated run imports no torch: its threads never ran anything
        "torch_threads": torch.get_num_threads() if "torch" in sys.modules else None,
        "model": engine.config.model,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "peak_flops": peaks.flops,
        "peak_bandwidth": peaks.bandwidth,
        "peaks_source": peaks.source,
        **({"gpu": torch.cuda.get_device_name(engine.runner.device)} if cuda else {}),
    }


def _print_table(report: dict[str, Any]) -> None:
    runs = report["runs"]
    header = (f"{'config':<14}{'out tok/s':>10}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p99':>9}{'ITL max':>9}{'preempt':>9}"
              f"{'slow':>6}{'goodput':>9}{'prefilled':>10}{'hit rate':>9}")
    print(f"workload {report['workload']['spec']}: {report['workload']['requests']} requests "
          f"on {report['machine']['model']} ({report['machine']['device']})")
    units = (f"{'':<14}{'tok/s':>10}{'tok/s':>9}{'ms':>10}{'ms':>10}{'ms':>10}{'ms':>10}"
             f"{'ms':>9}{'ms':>9}{'count':>9}{'count':>6}{'share':>9}{'tokens':>10}{'share':>9}")
    print(header)
    print(units)
    rows = {}
    for name, r in runs.items():
        rows[name] = (f"{r['output_tok_s']:>10.1f}{r['throughput_tok_s']:>9.1f}"
                      f"{_f(r['ttft_ms']['p50']):>10}{_f(r['ttft_ms']['p99']):>10}"
                      f"{_f(r['tpot_ms']['p50']):>10}{_f(r['tpot_ms']['p99']):>10}"
                      f"{_f(r['itl_ms']['p99']):>9}{_f(r['itl_ms']['max']):>9}"
                      f"{r['preemptions']:>9}{r['slow_queries']:>6}{r['goodput']:>9.2f}"
                      f"{_f(r.get('prefill_tokens_computed')):>10}{_pct(r.get('hit_rate')):>9}")
        print(f"{name:<14}{rows[name]}")
    note = _same_rows_note(report, rows)
    if note:
        print(note)
    for name, c in report.get("capacity", {}).items():
        print(f"capacity {name}: {c['rate']:.2f} requests/s (P99 {c['metric'].upper()})")
    _print_agreement(report)
    for name, r in runs.items():
        if "trust" in r:
            print(f"trust {name}: {Trust.from_dict(r['trust']).line()}")
    if report.get("gpu_defaults"):
        print("vLLM's GPU server defaults applied: " + ", ".join(
            f"{k}={v}" for k, v in report["gpu_defaults"].items()))
    if (p := report.get("process")) and p["x_real_time"] is not None:
        print(f"time: {p['simulated_s']:.1f} s simulated; start-up {p['startup_s']:.2f} s, "
              f"step loops {p['step_loops_s']:.2f} s, the rest {p['other_s']:.2f} s: the "
              f"whole command {p['process_s']:.2f} s so far, {p['x_real_time']:.0f}x real time")
    for name, run in runs.items():
        host = run.get("host")
        # a simulated run's figures are simulated time, which host load cannot change
        simulated = report.get("simulated") and ":real" not in name
        if host is not None and not host["quiet"] and not simulated:
            print(f"{name} shared its machine: other processes used {host['others_cpus']:.2f} "
                  f"CPUs, the hypervisor stole {host['steal']:.0%}; not a quiet machine's "
                  "figures")


def _same_rows_note(report: dict[str, Any], rows: dict[str, str]) -> str:
    """Why `chunked` and `unchunked` print the same figures, when they do: no prompt was
    longer than the chunked budget, so no prefill was ever split."""
    if "chunked" not in rows or rows["chunked"] != rows.get("unchunked"):
        return ""
    longest = report["workload"].get("prompt_tokens", {}).get("max")
    budget = report["runs"]["chunked"].get("config", {}).get("max_num_batched_tokens")
    return (f"note: chunked and unchunked are identical: the longest prompt ({longest} tokens) "
            f"fits the chunked token budget ({budget}), so no prefill was split; a workload "
            "with longer prompts (long-doc) tells them apart")


def _real_names(name: str, count: int) -> list[str]:
    """The report's names for a config's real runs beside its simulation."""
    return [f"{name}:real{n if n > 1 else ''}" for n in range(1, count + 1)]


def real_runs(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The real runs of configuration `name` that an `--against-real` report kept, to judge
    another twin against the same runs (benchmarks/twin_validation.py --against)."""
    runs = report["runs"]
    return [runs[real] for real in _real_names(name, len(runs)) if real in runs]


def _reals(agreement: dict[str, Any]) -> int:
    return max(len(a["real"]) for a in agreement.values())


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


# what the GPU twin is judged on against real runs, as (field, quantile, tolerance)
AGREEMENT = (("output_tok_s", None, 0.10), ("ttft_ms", "p50", 0.10), ("ttft_ms", "p99", 0.20),
             ("tpot_ms", "p50", 0.10), ("tpot_ms", "p99", 0.20))


def sim_vs_real(sim: dict[str, Any], reals: list[dict[str, Any]],
                matched: dict[str, Any] | None = None) -> dict[str, Any]:
    """The simulated run's figures against the real runs' median, with the real runs' spread:
    identical real runs differ (arrivals fall between different steps), so one real run is a
    noisy yardstick. `error` is sim / median − 1; `within` whether it is inside the figure's
    tolerance. `real_vs_rest` holds each real run against the median of the others, the same
    test a real run would face in the twin's place: how far the yardstick itself agrees.
    `matched`, the twin rerun at the real runs' median step time ratios (prefill and
    decode-only steps apart), faces the same test (`at_real_speed`): what it misses is the
    twin's, not the machine's drift."""
    def pick(run: dict[str, Any], field: str, q: str | None) -> float | None:
        return run[field] if q is None else (run[field] or {}).get(q)

    out = {}
    for field, q, tolerance in AGREEMENT:
        real = [v for v in (pick(r, field, q) for r in reals) if v is not None]
        figure = {"real": real, "real_median": statistics.median(real) if real else None,
                  "tolerance": tolerance,
                  **_judged(pick(sim, field, q), real, tolerance),
                  "real_vs_rest": [_relative(v, real[:i] + real[i + 1:])
                                   for i, v in enumerate(real)] if len(real) > 1 else []}
        if matched is not None:
            figure["at_real_speed"] = _judged(pick(matched, field, q), real, tolerance)
        out[field if q is None else f"{field}_{q}"] = figure
    return out


def _judged(value: float | None, real: list[float], tolerance: float) -> dict[str, Any]:
    error = _relative(value, real)
    return {"sim": value, "error": error,
            "within": None if error is None else _within_tolerance(error, tolerance)}


def _within_tolerance(error: float, tolerance: float) -> bool:
    """Whether a relative error is inside its tolerance, to 0.01% (110 against 100 is within
    10% despite binary fractions)."""
    return round(abs(error), 4) <= tolerance


def _relative(value: float | None, yardstick: list[float]) -> float | None:
    median = statistics.median(yardstick) if yardstick else None
    return value / median - 1 if value is not None and median else None


def within_counts(agreements: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """(figures within tolerance, figures judged) for the twin, the twin at the real runs'
    speed, and each real run against the median of the others."""
    figures = [a for agreement in agreements for a in agreement.values()]
    twin = [a["within"] for a in figures if a["within"] is not None]
    matched = [a["at_real_speed"]["within"] for a in figures
               if a.get("at_real_speed", {}).get("within") is not None]
    each = real_within_each(agreements)
    return {"twin": (sum(twin), len(twin)), "at_real_speed": (sum(matched), len(matched)),
            "real": (sum(inside for inside, _ in each), sum(judged for _, judged in each))}


def real_within_each(agreements: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(figures within tolerance, figures judged) for each real run against the median of
    the others: a run of the machine itself in the twin's place, on every figure at once."""
    each: dict[int, list[bool]] = {}
    for figure in (a for agreement in agreements for a in agreement.values()):
        for i, error in enumerate(figure["real_vs_rest"]):
            if error is not None:
                each.setdefault(i, []).append(_within_tolerance(error, figure["tolerance"]))
    return [(sum(within), len(within)) for _, within in sorted(each.items())]


def _print_agreement(report: dict[str, Any]) -> None:
    runs, agreements = report["runs"], report.get("sim_vs_real", {})
    for name, agreement in agreements.items():
        print(f"{name} simulated against the median of {_reals(agreement)} real runs: "
              + _errors(agreement))
        ratios = [runs[real]["step_time_ratio"] for real in _real_names(name, _reals(agreement))
                  if runs.get(real, {}).get("step_time_ratio") is not None]
        if ratios:
            # a machine whose speed drifts since calibration moves every figure: say so
            print(f"  their steps took {min(ratios):.2f}-{max(ratios):.2f}x the predicted "
                  "time (median step; 1.00 = as calibrated)")
        drift = runs.get(f"{name}:at-real-speed", {}).get("target_drift")
        if drift is not None:
            print(f"  simulated at their median speeds (prefill steps {drift['prefill']:.2f}x, "
                  f"decode steps {drift['decode']:.2f}x): "
                  + _errors({m: a["at_real_speed"] for m, a in agreement.items()}))
    if agreements:
        counts = within_counts(list(agreements.values()))
        parts = [f"the twin {_share(*counts['twin'])}"]
        if counts["at_real_speed"][1]:
            parts.append(f"at the real runs' speed {_share(*counts['at_real_speed'])}")
        if counts["real"][1]:
            parts.append(f"a real run against the median of the others "
                         f"{_share(*counts['real'])}")
        print("within tolerance (10% throughput and medians, 20% p99s): " + "; ".join(parts))


def _errors(figures: dict[str, Any]) -> str:
    return ", ".join(f"{metric} {_signed(a['error'])}"
                     + ("" if a["within"] is not False else " (past tolerance)")
                     for metric, a in figures.items())


def _share(inside: int, judged: int) -> str:
    return f"{inside} of {judged} ({inside / max(judged, 1):.0%})"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"

