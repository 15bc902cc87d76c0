"""Readable charts: a legend, a time axis, labelled lines and change marks, sparklines when a
pane is short; the history they read (rates, changes, before/after); the header's state."""

from __future__ import annotations

import dataclasses

import pytest
from rich.text import Text
from textual.app import App, ComposeResult
from textual.widgets import Static

from console.tui.change_effect import AROUND_S, Load
from console.tui.collectors import ConfigChangesLoaded
from console.tui.history import MetricHistory
from console.tui.screens.tuning import TuningScreen
from console.tui.widgets.bandwidth import Bandwidth
from console.tui.widgets.chunk_queue import ChunkQueue
from console.tui.widgets.header import EngineHeader, warnings
from console.tui.widgets.keyed_table import KeyedTable
from console.tui.widgets.plot import Line, Plot, Series, ms, per_s
from engine.clock import VirtualClock
from engine.slo_targets import ServiceSLO
from engine.snapshot import Percentiles, RequestView, Snapshot
from engine.store import ConfigChangeRecord
from tests.console.conftest import replay_app, replayed, until, workers_done

pytestmark = pytest.mark.anyio

TIMES = tuple(float(t) for t in range(0, 120, 2))
TTFT = Series("TTFT p99", tuple(100.0 + 10 * (t % 7) for t in TIMES), TIMES)


class OnePlot(App[None]):
    def __init__(self, plot: Plot | ChunkQueue) -> None:
        super().__init__()
        self.plot = plot

    def compose(self) -> ComposeResult:
        yield self.plot


async def drawn(plot: Plot, size: tuple[int, int]) -> str:
    async with OnePlot(plot).run_test(size=size) as pilot:
        await pilot.pause()
        rendered = plot.render()
        assert isinstance(rendered, Text)
        return rendered.plain


async def test_a_chart_has_a_legend_a_time_axis_labelled_lines_and_change_marks() -> None:
    plot = Plot(unit=ms)
    plot.show((TTFT,), lines=(Line(1500.0, "SLO 1.5 s", "red"),), marks=(60.0,))
    text = await drawn(plot, (60, 12))
    rows = text.splitlines()
    assert rows[0].startswith("━ TTFT p99") and "┈ SLO 1.5 s" in rows[0] and "┊ change" in rows[0]
    assert len(rows) == 12 and all(len(row) <= 60 for row in rows)  # the pane's own size
    assert rows[-2].strip().startswith("└")  # the time axis, its ticks below
    assert rows[-1].strip().startswith("-2m") and "-60s" in rows[-1]
    assert rows[-1].rstrip().endswith("now")
    canvas = rows[1:-2]
    assert any(row.rstrip().endswith("SLO 1.5 s") for row in canvas)  # the line, labelled
    assert any("┈" in row for row in canvas)  # drawn across
    assert "1.7 s┤" in text and "0 ms┤" in text  # the y axis in the series' unit
    assert sum("┊" in row for row in canvas) >= 3  # the change, down the chart
    assert any(set(row) & {chr(c) for c in range(0x2801, 0x2900)} for row in canvas)  # braille


async def test_an_outlier_is_clipped_and_said_so_and_a_pane_shares_one_window() -> None:
    """A resume's burst (146k tok/s) over a run of 340 and 45: the axis scales to the run,
    the burst touches the top edge, and the legend says what was cut."""
    values = tuple([146_000.0] + [340.0] * 29 + [45.0] * 30)
    plot = Plot(unit=per_s)
    plot.show((Series("prompt+output tok/s", values, TIMES),))
    text = await drawn(plot, (70, 12))
    assert "↑ clipped, peak 146k/s" in text.splitlines()[0]
    assert "146k/s┤" not in text and "1.5k/s┤" in text  # 4× the bulk, with headroom
    # a window that must reach back further than this series' own samples
    plot.show((Series("prompt+output tok/s", values[30:], TIMES[30:]),), start=TIMES[0])
    assert (await drawn(plot, (70, 12))).splitlines()[-1].strip().startswith("-2m")


async def test_a_long_peak_is_clipped_so_the_slo_keeps_its_own_row() -> None:
    """After a pause, TTFT p99 sat near 100 s for half the window: no outlier by count, but
    a 2 s SLO fell on the `0 ms` row. The axis stops where the SLO is a row above zero."""
    values = tuple([100_000.0] * 30 + [300.0] * 30)
    plot = Plot(unit=ms)
    plot.show((Series("TTFT p99", values, TIMES),), lines=(Line(2000.0, "SLO 2.0 s", "red"),))
    rows = (await drawn(plot, (60, 12))).splitlines()
    assert "↑ clipped, peak 100.0 s" in rows[0]
    canvas = rows[1:-2]
    [slo] = [row for row in canvas if row.rstrip().endswith("SLO 2.0 s")]
    assert "0 ms┤" not in slo and canvas.index(slo) < len(canvas) - 1


async def test_a_chart_without_times_plots_by_position_with_no_time_axis() -> None:
    plot = Plot()
    plot.show((Series("prefill ms/1k tok", tuple(float(i % 5) for i in range(40))),))
    rows = (await drawn(plot, (50, 10))).splitlines()
    assert rows[0].startswith("━ prefill ms/1k tok") and "change" not in rows[0]
    assert rows[-1].strip().startswith("└") and not any(c.isalnum() for c in rows[-1])
    assert "4.4┤" in rows[1]  # the highest point with headroom, on the top row


async def test_a_short_pane_gets_sparklines_with_their_values() -> None:
    plot = Plot(unit=ms)
    plot.show((TTFT, Series("ITL p99", (5.0, 7.5), (0.0, 2.0))))
    text = await drawn(plot, (40, 3))
    first, second = text.splitlines()[:2]
    assert first.startswith("TTFT p99 ") and first.endswith(ms(TTFT.values[-1]))
    assert second.startswith("ITL p99 ") and second.endswith("7.5 ms")
    assert len(first) <= 40


def snap(step: int, ts: float, **fields: object) -> Snapshot:
    return dataclasses.replace(Snapshot(step=step, ts=ts, config={"max_num_batched_tokens": 256}),
                               **fields)


def test_history_rates_changes_and_the_figures_around_a_change() -> None:
    history = MetricHistory()
    history.record(snap(1, 0.0, num_waiting=4, tokens_per_s=100.0))
    history.record(snap(2, 2.0, num_waiting=6, requests_finished_total=2, tokens_per_s=100.0))
    history.record(snap(3, 4.0, num_waiting=6, requests_finished_total=2, tokens_per_s=300.0,
                        config={"max_num_batched_tokens": 512}))
    # 2 finished and 2 more waiting: 4 arrived in 2 s; then none, so 4 in the 4 s so far
    assert history.values("arrival_rate") == [2.0, 1.0]
    assert history.values("finish_rate") == [1.0, 0.5]
    [change] = history.changes
    assert (change.ts, change.field, change.old, change.new) == (4.0, "max_num_batched_tokens",
                                                                 256, 512)
    assert history.change_times == (4.0,)
    assert history.mean_between("tokens_per_s", 4.0 - 30, 4.0) == 100.0
    assert history.mean_between("tokens_per_s", 4.0, 34.0) == 300.0
    history.clear()
    assert not history.changes and history.newest_ts is None


async def test_the_header_flags_a_backlog_and_kv_above_the_watermark() -> None:
    class OneHeader(App[None]):
        def compose(self) -> ComposeResult:
            yield EngineHeader()

    calm = Snapshot(config={"cache_high_watermark": 0.85, "max_num_batched_tokens": 64},
                    num_waiting=3, num_running=8, kv_usage=0.5)
    jammed = dataclasses.replace(calm, num_waiting=285, kv_usage=0.87,
                                 ttft_ms=Percentiles(p50=21_000.0), step_ms=Percentiles(p50=20.0))
    slo = ServiceSLO(ttft_ms=2000.0, itl_ms=200.0)
    assert warnings(calm, slo) == []
    assert warnings(jammed, slo) == [
        ("BACKLOG 285 waiting, TTFT p50 21.0 s > SLO 2.0 s", "bold red"),
        ("KV 87% ≥ 85%", "bold yellow")]
    # a backlog whose first tokens are still on time is yellow; another engine's KV, unmarked
    queued = dataclasses.replace(jammed, ttft_ms=Percentiles(p50=100.0), config={})
    assert warnings(queued, slo) == [("BACKLOG 285 waiting", "bold yellow")]
    # a few waiting while first tokens are late is a backlog too: the SLO is absolute
    late = dataclasses.replace(calm, ttft_ms=Percentiles(p50=17_700.0))
    assert warnings(late, slo)[0] == ("BACKLOG 3 waiting, TTFT p50 17.7 s > SLO 2.0 s",
                                      "bold red")
    async with OneHeader().run_test(size=(200, 5)) as pilot:
        header = pilot.app.query_one(EngineHeader)
        header.update_from(calm, "test", slo)
        assert str(header.render()).startswith("NORMAL  budget 64")
        header.update_from(jammed, "test", slo)
        assert str(header.render()).startswith(
            "NORMAL · BACKLOG 285 waiting, TTFT p50 21.0 s > SLO 2.0 s · KV 87% ≥ 85%  budget 64")


async def test_the_header_names_the_clamp_omits_what_is_not_exported_and_fits() -> None:
    class OneHeader(App[None]):
        def compose(self) -> ComposeResult:
            yield EngineHeader()

    slo = ServiceSLO()
    config = {"max_num_batched_tokens": 256, "chunk_tile": 16}
    tile = Snapshot(config=config, calibration="calibrated", recommended_chunk_size=16,
                    recommended_chunk_unclamped=7, tokens_per_s=340.0)
    budget = dataclasses.replace(tile, recommended_chunk_size=256,
                                 recommended_chunk_unclamped=1840)
    calibrating = dataclasses.replace(tile, calibration="calibrating (pass 1/3, shape 7/16)",
                                      recommended_chunk_size=None)
    vllm = Snapshot(config={"block_size": 16}, tokens_per_s=90.0)
    source = "embedded synthetic:small on cpu"
    async with OneHeader().run_test(size=(160, 5)) as pilot:
        header = pilot.app.query_one(EngineHeader)
        for snapshot, words in ((tile, "C* 7 (clamped to tile 16)"),
                                (budget, "C* 1840 (clamped to budget 256)"),
                                (calibrating, "C* calibrating (shape 7/16)")):
            header.update_from(snapshot, source, slo)
            assert words in str(header.render())
        header.update_from(vllm, "vllm http://127.0.0.1:8000", slo)
        shown = str(header.render())
        assert "?" not in shown and "budget" not in shown and "C*" not in shown
        await pilot.resize_terminal(60, 5)
        await pilot.pause()
        header.update_from(budget, source, slo)  # too wide: figures go, the name stays
        shown = str(header.render())
        assert shown.startswith("NORMAL") and shown.rstrip().endswith(source), shown


async def test_chunk_queue_ids_are_cut_in_the_middle() -> None:
    """Ids of one workload differ at the end: a tail cut made them all read `long-doc`."""
    prefilling = tuple(RequestView(f"long-doc-0001{n}", "default", "PREFILL_CHUNKING", "", 400,
                                   100 * n, n, 4, 0, None, None, None, 0.0) for n in (1, 2))
    queue = ChunkQueue()
    async with OnePlot(queue).run_test(size=(60, 6)) as pilot:
        queue.update_from(Snapshot(chunk_queue_length=5, requests=prefilling))
        await pilot.pause()
        rows = queue.render().plain.splitlines()
    assert rows[0].startswith("5 chunks queued · 2 prefilling")
    assert rows[1].startswith("long-…0011 ") and rows[1].endswith("1/4    25%")
    assert rows[2].startswith("long-…0012 ") and rows[2].endswith("2/4    50%")


POLL_S = 0.5


def arrivals(history: MetricHistory, clock: VirtualClock, seconds: float,
             per_poll: tuple[int, ...], tokens_per_s: float, finished: int = 0) -> int:
    """A poll every POLL_S on `clock` for `seconds`, `per_poll[i % len]` requests arriving
    (and finishing at once) before the i-th, counted on from `finished`; the count after."""
    for i in range(round(seconds / POLL_S)):
        clock.sleep(POLL_S)
        finished += per_poll[i % len(per_poll)]
        history.record(snap(history.last_step + 1, clock(), requests_finished_total=finished,
                            tokens_per_s=tokens_per_s))
    return finished

def test_a_change_compares_its_two_sides_only_at_equal_load() -> None:
    """Arrivals that doubled across a change make its before and after incomparable, and it
    says so with the two rates; arrivals that only jitter (1 or 2 a poll, 3/s) are equal."""
    clock = VirtualClock(start=1000.0)
    history = MetricHistory()
    finished = arrivals(history, clock, AROUND_S, (1,), 300.0)  # 2/s
    change = clock()
    arrivals(history, clock, AROUND_S, (2,), 150.0, finished)  # 4/s
    doubled = Load.around(history, change)
    assert doubled.before == pytest.approx(2.0, rel=0.05)
    assert doubled.after == pytest.approx(4.0, rel=0.05)
    assert doubled.comparable is False
    assert doubled.sentence() == "arrivals changed (2/s → 4/s): not comparable"
    assert doubled.cell() == "2→4/s unequal"
    assert doubled.cell(rate_change=True) == "2→4/s"  # the change itself: unequal by design

    history.clear()
    finished = arrivals(history, clock, AROUND_S, (1, 2), 300.0)
    steady = clock()
    arrivals(history, clock, AROUND_S, (2, 1), 280.0, finished)
    level = Load.around(history, steady)
    assert level.comparable is True and level.cell() == "equal, 3/s"
    # nothing after the change yet: no verdict on the load
    assert Load.around(history, clock() + 1.0).comparable is None
    assert Load.around(history, clock() + 1.0).cell() == "–"


async def test_the_changes_table_says_when_arrivals_changed_around_a_change() -> None:
    """The Tuning screen's stored changes, each with its load: a budget change across which
    arrivals doubled reads "not comparable" with both rates, and the table says why."""
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        await workers_done(pilot)
        app.collector.stop()
        await workers_done(pilot)
        screen = app.screen
        assert isinstance(screen, TuningScreen)
        state, clock, wall = app.state, VirtualClock(start=1000.0), 1.7e9
        state.forget_history()
        finished = 0
        for per_poll in ((1,), (2,)):  # 2/s for the 30 s before the change, 4/s after
            for _ in range(round(AROUND_S / POLL_S)):
                clock.sleep(POLL_S)
                finished += per_poll[0]
                state.record(snap(state.history.last_step + 1, clock(), wall_offset=wall,
                                  requests_finished_total=finished, tokens_per_s=300.0))
        changed = ConfigChangeRecord(1, wall + 1000.0 + AROUND_S, "max_num_batched_tokens", 256,
                                     288, "console")
        screen.post_message(ConfigChangesLoaded([changed]))
        await pilot.pause()
        changes = screen.query_one("#config-changes", KeyedTable)
        load = str(changes.table.get_cell("1", "load"))
        assert load == "2→4/s unequal"
        assert str(changes.border_subtitle) == ("Token budget: arrivals changed "
                                                "(2/s → 4/s): not comparable")


async def test_a_busy_host_is_marked_in_the_header_and_the_bandwidth_pane_says_who() -> None:
    class Panes(App[None]):
        def compose(self) -> ComposeResult:
            yield EngineHeader()
            yield Bandwidth()

    slo = ServiceSLO()
    quiet = Snapshot(config={"max_num_batched_tokens": 64}, host_measured=True,
                     host_others_cpus=0.1, host_own_cpus=1.8, bandwidth_util_5s=0.98,
                     throttle_note="throttle off: the bandwidth figure is modelled, not "
                                   "measured (on a GPU, NVML measures it)")
    busy = dataclasses.replace(quiet, host_contended=True, host_others_cpus=1.6,
                               host_own_cpus=0.4)
    async with Panes().run_test(size=(120, 20)) as pilot:
        pilot.app.query_one(EngineHeader).update_from(quiet, "test", slo)
        assert str(pilot.app.query_one(EngineHeader).render()).startswith("NORMAL  budget 64")
        pilot.app.query_one(EngineHeader).update_from(busy, "test", slo)
        assert str(pilot.app.query_one(EngineHeader).render()).startswith(
            "NORMAL · HOST BUSY  budget 64")
        pane = pilot.app.query_one(Bandwidth)
        pane.update_from(busy, MetricHistory())
        line = str(pane.query_one("#bandwidth-line", Static).render())
        assert "throttle off: the bandwidth figure is modelled" in line
        assert "throttle 2" not in line and "concurrency 1" not in line
        assert line.endswith("host busy · others 1.6 CPUs · steal 0% · engine 0.4 CPUs")
        # on a GPU, who else computes on it (NVML's names are outside text: never markup)
        gpu = dataclasses.replace(busy, host_others_cpus=0.0, host_others_gpu=0.4,
                                  host_gpu_others="[bold]x[/bold][4242] 40% SM 2.0 GiB")
        pilot.app.query_one(EngineHeader).update_from(gpu, "test", slo)
        assert "HOST BUSY" in str(pilot.app.query_one(EngineHeader).render())
        pane.update_from(gpu, MetricHistory())
        line = str(pane.query_one("#bandwidth-line", Static).render())
        assert line.endswith("host busy · others 0.0 CPUs · steal 0% · engine 0.4 CPUs · GPU "
                             "others 40% SM: [bold]x[/bold][4242] 40% SM 2.0 GiB")


async def test_a_twins_bandwidth_pane_says_how_far_its_figures_go() -> None:
    class Pane(App[None]):
        def compose(self) -> ComposeResult:
            yield Bandwidth()

    twin = Snapshot(config={"max_num_batched_tokens": 64}, bandwidth_util_5s=0.4,
                    twin_trust="band ±17% · nearest lambda-h100-x: twin +13%")
    async with Pane().run_test(size=(120, 20)) as pilot:
        pane = pilot.app.query_one(Bandwidth)
        pane.update_from(twin, MetricHistory())
        line = str(pane.query_one("#bandwidth-line", Static).render())
        assert line.endswith("twin: band ±17% · nearest lambda-h100-x: twin +13%")
        assert "host" not in line  # the host running a twin is not the GPU it simulates
        pane.update_from(dataclasses.replace(twin, twin_trust=""), MetricHistory())
        assert "twin:" not in str(pane.query_one("#bandwidth-line", Static).render())


async def test_a_short_legend_keeps_the_marks_before_a_line_labelled_on_the_chart() -> None:
    plot = Plot(unit=ms)
    plot.show((TTFT,), lines=(Line(150.0, "SLO 150 ms", "red"),), marks=(60.0,))
    text = await drawn(plot, (30, 12))
    rows = text.splitlines()
    assert rows[0] == "━ TTFT p99  ┊ change"  # the SLO gave way: it is named on its row
    assert any(row.rstrip().endswith("SLO 150 ms") for row in rows[1:-2])


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_the_tuning_charts_keep_every_series_and_name_the_marks_they_draw(
        size: tuple[int, int]) -> None:
    """Six charts a third of the width each: the marks' key sits once on their frame, so
    no legend drops a mark's key or a series for it; sparklines draw no marks, name none."""
    app = replay_app()
    async with app.run_test(size=size) as pilot:
        await replayed(pilot)
        await pilot.press("2", "t")  # the hour view: the recording's changes and its pause
        frame = app.screen.query_one("#tuning-charts")
        plots = list(frame.query(Plot).results(Plot))
        await until(pilot, lambda: all(p._marks and p._events for p in plots), "the marks")
        await until(pilot, lambda: frame.border_subtitle is not None, "the frame's key")
        key = str(frame.border_subtitle)
        drawn = [plot.drawn_marks() for plot in plots]
        for plot in plots:
            rows = plot.render().plain.splitlines()
            named = rows[0] if size[0] >= 110 else "\n".join(rows)  # a legend, or sparklines
            assert all(series.label in named for series in plot.series), named
            assert all(len(row) <= plot.size.width for row in rows)
        if size[0] >= 110:
            assert all(changes and events for changes, events in drawn)
            assert "┊ change" in key and "┊ drift/pause/restart" in key
        else:
            assert not any(changes or events for changes, events in drawn) and key == ""
