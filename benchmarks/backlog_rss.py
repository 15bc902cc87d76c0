"""The embedded engine's memory under a long backlog, with its growth attributed.

The console's engine as it runs in the console's child process (an EmbeddedSource on the
mixed workload, with its store and journal), here in this process so its memory can be
traced: a pool of 4 threads takes a snapshot every `--poll-s` and pickles it, as the child
answers the console's polls over its pipe. The arrival rate is set from the snapshot's
waiting count to hold the backlog between `--low` and `--high`.

Every `--sample-s` it prints one JSON line: RSS; anonymous memory and the main heap from
/proc/self/smaps; glibc's arenas (in use and free, from mallinfo2); what Python's allocator
holds (sys._debugmallocstats' arena total) and, with --trace, what tracemalloc traces, and its
largest growing sites. The last line is the verdict: RSS at `--mark-s` and at the end, and
the growth after the mark, with the snapshots taken and requests finished.

    MALLOC_ARENA_MAX=2 python benchmarks/backlog_rss.py --minutes 10 --model synthetic:tiny
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import pickle
import sys
import tempfile
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from console.sources.embedded import EmbeddedSource  # noqa: E402
from engine.config import EngineConfig  # noqa: E402


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def arenas(libc: ctypes.CDLL | None) -> dict[str, int]:
    """glibc's heap over every arena: bytes in use, free inside arenas, and mmapped."""
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return {}
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return {"malloc_in_use": info.uordblks, "malloc_free": info.fordblks,
            "malloc_mmapped": info.hblkhd}


def smaps() -> dict[str, int]:
    """Anonymous memory of this process, and the part in the main heap."""
    anon = heap = 0
    current = ""
    with open("/proc/self/smaps") as lines:
        for line in lines:
            head = line.split()
            if not head:
                continue
            if not head[0].endswith(":"):
                current = head[5] if len(head) > 5 else ""
            elif head[0] == "Anonymous:":
                kib = int(head[1]) * 1024
                anon += kib
                heap += kib if current == "[heap]" else 0
    return {"anon": anon, "heap": heap}


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default="synthetic:small")
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals/s under the band")
    parser.add_argument("--hold-rate", type=float, default=1.0, help="arrivals/s above it")
    parser.add_argument("--low", type=int, default=800)
    parser.add_argument("--high", type=int, default=1000)
    parser.add_argument("--poll-s", type=float, default=0.4, help="the console polls at 0.4 s")
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--mark-s", type=float, default=300.0)
    parser.add_argument("--trace", action="store_true", help="tracemalloc (slows the engine)")
    parser.add_argument("--top", type=int, default=8, help="growing sites shown with --trace")
    parser.add_argument("--trim-s", type=float, default=0.0,
                        help="call malloc_trim(0) this often (0: never), to see what it returns")
    parser.add_argument("--no-pickle", action="store_true",
                        help="take snapshots without pickling them")
    args = parser.parse_args()
    if args.minutes * 60 <= args.mark_s:
        parser.error("--minutes must reach beyond --mark-s")
    logging.basicConfig(level=logging.ERROR)  # the drift monitor's per-chunk warnings
    if args.trace:
        tracemalloc.start(16)
    libc = glibc()
    db = Path(tempfile.mkdtemp(prefix="backlog-rss-")) / "rss.db"
    source = EmbeddedSource.start(model=args.model, device="cpu", workload=args.workload,
                                  db=db, rate=args.rate, config=EngineConfig())
    stop = threading.Event()
    polls = [0, 0]  # snapshots, pickled bytes of the last

    def poll() -> None:
        snapshot = source.snapshot()
        polls[0] += 1
        if not args.no_pickle:
            polls[1] = len(pickle.dumps(snapshot))

    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenflow-call")
    start = time.monotonic()
    base_trace = tracemalloc.take_snapshot() if args.trace else None
    samples: list[dict[str, Any]] = []
    rate = args.rate
    next_sample = start
    next_trim = start + args.trim_s
    trimmed = 0
    try:
        while (now := time.monotonic()) - start < args.minutes * 60 and not stop.is_set():
            pool.submit(poll).result()
            snap = source.snapshot()
            wanted = rate
            if snap.num_waiting > args.high:
                wanted = args.hold_rate
            elif snap.num_waiting < args.low:
                wanted = args.rate
            if wanted != rate:
                rate = source.set_arrival_rate(wanted)
            if args.trim_s and libc is not None and now >= next_trim:
                libc.malloc_trim(0)
                trimmed += 1
                next_trim += args.trim_s
            if now >= next_sample:
                sample: dict[str, Any] = {
                    "t_s": round(now - start, 1), "rss": rss(), **smaps(), **arenas(libc),
                    "waiting": snap.num_waiting, "running": snap.num_running,
                    "finished": snap.requests_finished_total, "snapshots": polls[0],
                    "snapshot_bytes": polls[1], "load": round(os.getloadavg()[0], 2)}
                if args.trace:
                    traced = tracemalloc.take_snapshot()
                    sample["traced"] = tracemalloc.get_traced_memory()[0]
                    assert base_trace is not None
                    sample["growing"] = [
                        f"{stat.size_diff / 2**20:+.1f} MiB {stat.count_diff:+d} "
                        f"{stat.traceback[0].filename}:{stat.traceback[0].lineno}"
                        for stat in traced.compare_to(base_trace, "lineno")[:args.top]]
                    if sample["t_s"] < args.mark_s:
                        base_trace = traced  # growth is judged after the mark
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                next_sample += args.sample_s
            time.sleep(max(0.0, start + polls[0] * args.poll_s - time.monotonic()))
    finally:
        pool.shutdown()
        with contextlib.suppress(Exception):
            source.close()
    mark = min(samples, key=lambda s: abs(s["t_s"] - args.mark_s))
    after = [s for s in samples if s["t_s"] >= mark["t_s"]]
    last = samples[-1]
    print(json.dumps({"verdict": {
        "rss_at_mark": mark["rss"], "rss_at_end": last["rss"], "t_end_s": last["t_s"],
        "growth_after_mark": round((max(s["rss"] for s in after) - mark["rss"]) / mark["rss"],
                                   4),
        # anonymous memory alone: on a machine short of memory the kernel drops the shared
        # libraries' file pages from RSS and reads them back, whatever the engine does
        "anon_at_mark": mark["anon"], "anon_at_end": last["anon"],
        "anon_growth_after_mark": round(
            (max(s["anon"] for s in after) - mark["anon"]) / mark["anon"], 4),
        "finished_after_mark": last["finished"] - mark["finished"],
        "snapshots_after_mark": last["snapshots"] - mark["snapshots"],
        "malloc_free_growth": last.get("malloc_free", 0) - mark.get("malloc_free", 0),
        "malloc_in_use_growth": last.get("malloc_in_use", 0) - mark.get("malloc_in_use", 0),
        "arena_max": os.environ.get("MALLOC_ARENA_MAX"), "trims": trimmed,
        "model": args.model}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
