"""One console chart rendered off-screen: 58×12 cells, two series of 600 samples, an SLO line
and a change mark (plotext must keep rendering fast). Prints JSON: the best and the
median of `--repeats` renders, in ms.

    PYTHONPATH=. .venv/bin/python benchmarks/chart_render.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from console.tui.widgets.plot import Line, Plot, Series, ms

WIDTH, HEIGHT, SAMPLES = 58, 12, 600


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    times = tuple(float(t) for t in range(SAMPLES))
    plot = Plot(unit=ms)
    plot.show((Series("TTFT p50", tuple(100.0 + 10 * (t % 7) for t in times), times),
               Series("p99", tuple(300.0 + 25 * (t % 13) for t in times), times)),
              lines=(Line(500.0, "SLO 500 ms", "red"),), marks=(300.0,))
    samples = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        plot._build(WIDTH, HEIGHT)  # the drawing itself, without a running app
        samples.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"size": f"{WIDTH}x{HEIGHT}", "samples": 2 * SAMPLES,
                      "best_ms": round(min(samples), 2),
                      "median_ms": round(statistics.median(samples), 2)}))


if __name__ == "__main__":
    main()
