"""`tokenflow bench --report DIR`: a markdown report with PNG plots of one bench run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from console.errors import UserError
from engine.harness.driver import RunResult
from engine.sim.trust import Trust

# What a report writes into its directory (capacity.png only with --capacity).
REPORT_FILES = ("report.md", "ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png",
                "predicted_vs_measured.png", "capacity.png")


def check_report_dir(directory: Path) -> None:
    """Refuse, before the runs, a --report DIR that is a file or holds a report already: a
    report is kept, never written over (nor through a symlink of its names)."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--report {directory} is a file; name a directory")
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing != directory and not existing.is_dir():
        raise UserError(f"--report {directory}: {existing} is a file, so no directory can be "
                        "made under it; name a directory")
    taken = [name for name in REPORT_FILES
             if (directory / name).exists() or (directory / name).is_symlink()]
    if taken:
        raise UserError(f"--report {directory} holds {', '.join(taken)} already; choose a new "
                        "directory, or move the old report away")


def write_report(directory: Path, report: dict[str, Any], results: dict[str, RunResult]) -> Path:
    check_report_dir(directory)  # again: one may have been written since the runs began
    directory.mkdir(parents=True, exist_ok=True)
    markdown, ttft, tpot_cdf, itl, predicted, capacity = (directory / n for n in REPORT_FILES)
    slo, tpot = report["slo"], report["slo"]["tpot_ms"]
    plots = [
        _cdf(ttft, "TTFT",
             {n: [r.ttft_s * 1e3 for r in res.records.values() if r.ttft_s is not None]
              for n, res in results.items()}, _ttft_lines(slo)),
        _cdf(tpot_cdf, "TPOT",
             {n: [r.tpot_s * 1e3 for r in res.records.values() if r.tpot_s is not None]
              for n, res in results.items()}, [(tpot, f"TPOT SLO {_ms(tpot)}")]),
        # every gap between two tokens, held to the same SLO as TPOT (Sarathi-Serve's TBT)
        _cdf(itl, "ITL",
             {n: [gap * 1e3 for r in res.records.values() for gap in r.inter_token_s()]
              for n, res in results.items()}, [(tpot, f"ITL SLO {_ms(tpot)}")]),
        _predicted_vs_measured(predicted, results),
    ]
    if "capacity" in report:
        plots.append(_capacity(capacity, report["capacity"]))
    markdown.write_text(_markdown(report, [p.name for p in plots]))
    return markdown


def _ttft_lines(slo: dict[str, Any]) -> list[tuple[float, str]]:
    """Each request's TTFT SLO is its own prefill plus the delay: the shortest and longest."""
    low, high = slo["ttft_ms"]["min"], slo["ttft_ms"]["max"]
    if _ms(low) == _ms(high):
        return [(low, f"TTFT SLO {_ms(low)}")]
    return [(low, f"TTFT SLO, shortest prompt {_ms(low)}"),
            (high, f"TTFT SLO, longest prompt {_ms(high)}")]


def _cdf(path: Path, name: str, series: dict[str, list[float]],
         slos: list[tuple[float, str]]) -> Path:
    figure, axes = cdf_figure(name, series, slos)
    return _save(figure, axes, path)


def cdf_figure(name: str, series: dict[str, list[float]],
               slos: list[tuple[float, str]]) -> tuple[plt.Figure, plt.Axes]:
    """The share of samples at or below each latency (ms), on a log axis labelled in ms and s,
    with each SLO a labelled dashed line."""
    figure, axes = plt.subplots(figsize=(6, 4))
    for label, values in series.items():
        if values:
            ordered = sorted(values)
            axes.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))],
                      label=label, where="post")
    for (value, label), style in zip(slos, ("--", ":"), strict=False):  # at most two
        axes.axvline(value, color="black", linestyle=style, linewidth=1.2, label=label)
    axes.set_xlabel(f"{name} (log scale)")
    axes.set_ylabel("share of requests" if name != "ITL" else "share of token gaps")
    axes.set_xscale("log")
    _readable_log_axis(axes)
    return figure, axes


def _readable_log_axis(axes: plt.Axes) -> None:
    """Few major ticks, each labelled in ms or s; minor ticks unlabelled. Matplotlib's default
    labels minor ticks too on a short log range, and those labels overlap."""
    low, high = axes.get_xlim()
    decades = math.log10(high / low)
    # 1-2-3-5 ticks within a decade, 1-2-5 within two, one a decade on a longer range
    subs = (1.0, 2.0, 3.0, 5.0) if decades <= 1 else (1.0, 2.0, 5.0) if decades <= 2 else (1.0,)
    axes.xaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=7))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _ms(value)))
    axes.xaxis.set_minor_formatter(NullFormatter())


def _save(figure: plt.Figure, axes: plt.Axes, path: Path) -> Path:
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _predicted_vs_measured(path: Path, results: dict[str, RunResult]) -> Path:
    figure, axes = plt.subplots(figsize=(5, 5))
    top = 0.0
    for name, result in results.items():
        steps = [s for s in result.steps if s.predicted_s > 0]
        if steps:
            measured = [s.duration_s * 1e3 for s in steps]
            predicted = [s.predicted_s * 1e3 for s in steps]
            axes.scatter(measured, predicted, s=6, alpha=0.5, label=name)
            top = max(top, *measured, *predicted)
    axes.plot([0, top], [0, top], color="grey", linewidth=1)
    axes.set_xlabel("measured step time (ms)")
    axes.set_ylabel("predicted step time (ms)")
    return _save(figure, axes, path)


def _capacity(path: Path, capacities: dict[str, Any]) -> Path:
    figure, axes = plt.subplots(figsize=(5, 3.5))
    names = list(capacities)
    axes.bar(names, [capacities[n]["rate"] for n in names], color="#4c72b0")
    axes.set_ylabel("requests/s within SLO")
    return _save(figure, axes, path)


def _markdown(report: dict[str, Any], images: list[str]) -> str:
    machine, workload, slo = report["machine"], report["workload"], report["slo"]
    lines = [
        f"# tokenflow bench: {workload['spec']}",
        "",
        f"{workload['requests']} requests on {machine['model']} ({machine['device']}, "
        f"{machine['dtype']}); peaks {machine['peak_flops'] / 1e9:.1f} GFLOP/s and "
        f"{machine['peak_bandwidth'] / 1e9:.1f} GB/s ({machine['peaks_source']}).",
        "",
        # a twin's figures are only as good as the published cases near them
        *(f"- trust, {name}: {Trust.from_dict(r['trust']).line()}"
          for name, r in report["runs"].items() if "trust" in r),
        *([""] if any("trust" in r for r in report["runs"].values()) else []),
        f"SLOs: TPOT and ITL ≤ {slo['tpot_ms']:.1f} ms, scheduling delay ≤ "
        f"{slo['scheduling_delay_ms']:.1f} ms (5× and 25× one decode step of "
        f"{slo['decode_step_ms']:.1f} ms); TTFT ≤ a request's own prefill time + the delay: "
        f"{_ms(slo['ttft_ms']['min'])} for the shortest prompt, "
        f"{_ms(slo['ttft_ms']['max'])} for the longest. ITL is every gap between two tokens, "
        "TPOT a request's mean.",
        "",
        "| config | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
        "ITL p50 ms | ITL p99 ms | goodput | prefill MFU | decode MBU | step error (median) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in report["runs"].items():
        lines.append(
            f"| {name} | {r['output_tok_s']:.1f} | {_f(r['ttft_ms']['p50'])} | "
            f"{_f(r['ttft_ms']['p99'])} | {_f(r['tpot_ms']['p50'])} | {_f(r['tpot_ms']['p99'])} "
            f"| {_f(r['itl_ms']['p50'])} | {_f(r['itl_ms']['p99'])} | {r['goodput']:.2f} | "
            f"{_pct(r['prefill_mfu'])} | {_pct(r['decode_mbu'])} | "
            f"{_pct(r['prediction_error']['median_abs'])} |")
    if "capacity" in report:
        lines += ["", "| config | capacity (requests/s) | held to |", "| --- | --- | --- |"]
        lines += [f"| {n} | {c['rate']:.2f} | P99 {c['metric'].upper()} |"
                  for n, c in report["capacity"].items()]
    lines += [""] + [f"![{name}]({name})" for name in images] + [""]
    return "\n".join(lines)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value: float) -> str:
    """A latency in ms as a tick or SLO label: in ms below a second, in s above."""
    return f"{value:.3g} ms" if value < 1000 else f"{value / 1000:.3g} s"
