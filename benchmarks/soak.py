"""The real-time soak: `tokenflow serve` under sporadic traffic for `--duration-s` seconds
(30 minutes by default): bursts of `--burst` requests, half of them streaming, separated by
idle gaps drawn from 0 to `--max-gap-s` seconds (longer than every window the engine keeps).
Every `--sample-s` seconds the server's RSS, open file descriptors, threads and store size
are sampled from /proc. Prints one JSON object: the samples, the replies by status, and the
spread of RSS and fds after the warm-up, sampled between bursts (the bar: 0 5xx,
both flat within 10%).

    python benchmarks/soak.py [--duration-s 1800] [--model synthetic:tiny] > soak.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def proc_figures(pid: int, store: Path) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    size = sum(p.stat().st_size for p in store.parent.glob(store.name + "*"))
    return {"rss_mib": round(rss_kib / 1024, 1), "fds": fds, "threads": threads,
            "store_mib": round(size / 2**20, 2)}


def send(url: str, rng: random.Random, stream: bool) -> int:
    body = {"prompt": "x" * rng.randrange(8, 400), "max_tokens": rng.randrange(1, 64),
            "stream": stream}
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            if not stream:
                return http.post("/v1/completions", json=body).status_code
            with http.stream("POST", "/v1/completions", json=body) as reply:
                lines = list(reply.iter_lines())
                errors = [x for x in lines if x.startswith('data: {"error"')]
                return 500 if errors else reply.status_code
    except httpx.HTTPError:
        return 0  # no answer at all: counted apart from the statuses


def spread(values: list[float]) -> float | None:
    """(max - min) / min, the flatness the issue asks of RSS and fds."""
    return round((max(values) - min(values)) / min(values), 4) if values and min(values) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--max-gap-s", type=float, default=180.0)
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--model", default="synthetic:tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "soak.db"
        server = subprocess.Popen(
            [sys.executable, "-m", "console.cli.main", "serve", "--model", args.model,
             "--device", "cpu", "--dtype", "float32", "--port", "0", "--db", str(store)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            banner = server.stdout.readline()
            url = re.search(r"http://[^,\s]+", banner)
            if url is None:
                raise SystemExit(f"serve did not start: {banner}{server.communicate()[1]}")
            statuses: Counter[int] = Counter()
            samples: list[dict[str, float]] = []
            start = time.monotonic()
            done, busy = threading.Event(), threading.Event()

            def sample() -> None:
                while not done.wait(args.sample_s):
                    samples.append({"t_s": round(time.monotonic() - start, 1),
                                    "busy": busy.is_set(), **proc_figures(server.pid, store)})

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            bursts, gaps = 0, []
            with ThreadPoolExecutor(args.burst) as pool:
                while time.monotonic() - start < args.duration_s:
                    seeds = [rng.random() for _ in range(args.burst)]
                    busy.set()
                    statuses.update(pool.map(
                        lambda s: send(url.group(0), random.Random(s), s < 0.5), seeds))
                    busy.clear()
                    bursts += 1
                    gap = rng.uniform(0, args.max_gap_s)
                    gaps.append(round(gap, 1))
                    time.sleep(min(gap, max(0.0, args.duration_s - (time.monotonic() - start))))
            done.set()
            sampler.join()
            health = httpx.get(url.group(0) + "/health", timeout=30).status_code
        finally:
            server.send_signal(signal.SIGTERM)
            _out, err = server.communicate(timeout=120)
    # between bursts: open connections come and go with a burst, a leak stays
    settled = [s for s in samples if s["t_s"] >= args.warmup_s and not s["busy"]]
    report = {
        "duration_s": args.duration_s, "bursts": bursts, "gaps_s": gaps,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors_5xx": sum(v for k, v in statuses.items() if k >= 500),
        "no_answer": statuses.get(0, 0), "health_at_end": health,
        "exit_code": server.returncode, "traceback_in_log": "Traceback" in err,
        "rss_spread_after_warmup": spread([s["rss_mib"] for s in settled]),
        "fds_spread_after_warmup": spread([s["fds"] for s in settled]),
        "threads_after_warmup": sorted({s["threads"] for s in settled}),
        "store_mib_first_last": [samples[0]["store_mib"], samples[-1]["store_mib"]]
        if samples else None,
        "samples": samples,
    }
    print(json.dumps(report, indent=1))
    ok = (report["server_errors_5xx"] == 0 and report["no_answer"] == 0 and health == 200
          and (report["rss_spread_after_warmup"] or 0) <= 0.10
          and (report["fds_spread_after_warmup"] or 0) <= 0.10)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
