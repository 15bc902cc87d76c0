"""lm-evaluation-harness's `local-completions` against `tokenflow serve`, beside `--model hf`
on the same model: one loglikelihood task and one generation task, on the few examples
shipped in benchmarks/lm_eval_tasks/ (the machine has no datasets hub).

    pip install "lm-eval[api]"     # not a tokenflow dependency
    python -m benchmarks.lm_eval_run [--work DIR]

The model is benchmarks/vs_vllm.py's random Llama with a word-level tokenizer (the task
texts are words of its vocabulary). Prints one JSON object: each task's metrics from both
backends, the requests served, and the largest difference between the per-choice
loglikelihoods tokenflow returned and transformers computed (the target: under 1e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.vs_vllm import save_model

TASKS = Path(__file__).parent / "lm_eval_tasks"
ROOT = Path(__file__).resolve().parents[1]


def serve(model: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """`tokenflow serve` on `model` (with `flags`); its URL from the banner."""
    server = subprocess.Popen(
        [sys.executable, "-m", "console.cli.main", "serve", "--model", str(model),
         "--device", "cpu", "--dtype", "float32", "--port", "0", "--no-db", *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert server.stdout is not None
    banner = server.stdout.readline()
    if "http://" not in banner:
        server.kill()
        raise SystemExit(f"tokenflow serve did not start: {banner}{server.stderr.read()}")
    return server, banner.split("http://")[1].split(",")[0]


def evaluate(model: str, model_args: dict[str, Any], tasks: list[str]) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                                   task_manager=TaskManager(include_path=str(TASKS)),
                                   log_samples=True, batch_size=1)


def loglikelihoods(result: dict[str, Any], task: str) -> list[float]:
    return [resp[0][0] for sample in result["samples"][task] for resp in sample["resps"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="where the model is saved")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="tokenflow-lm-eval-"))
    model = work / "model"
    if not (model / "config.json").exists():
        save_model(model, seed=0)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.chdir(TASKS)  # the tasks' data_files are relative
    server, address = serve(model)
    try:
        ours = evaluate("local-completions", {
            "model": str(model), "base_url": f"http://{address}/v1/completions",
            "tokenizer": str(model), "tokenized_requests": True, "num_concurrent": 1,
            "max_retries": 1}, ["tf_choice", "tf_continue"])
    finally:
        server.terminate()
        server.wait(timeout=60)
    theirs = evaluate("hf", {"pretrained": str(model), "dtype": "float32", "device": "cpu"},
                      ["tf_choice"])
    served, reference = loglikelihoods(ours, "tf_choice"), loglikelihoods(theirs, "tf_choice")
    print(json.dumps({
        "tokenflow": {task: ours["results"][task] for task in ("tf_choice", "tf_continue")},
        "hf": {"tf_choice": theirs["results"]["tf_choice"]},
        "generation_samples": len(ours["samples"]["tf_continue"]),
        "loglikelihoods_compared": len(served),
        "max_abs_loglikelihood_diff": max(abs(a - b) for a, b in
                                          zip(served, reference, strict=True)),
    }, indent=2, default=str))


if __name__ == "__main__":
    main()
