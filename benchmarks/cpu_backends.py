"""`tokenflow run` as shipped (the CPU backends measured at start) against every forced path,
and with the journal on and off, runs alternating.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_backends.py --repeat 2
    TOKENFLOW_KERNEL_MARCH=x86-64-v3 PYTHONPATH=. .venv/bin/python benchmarks/cpu_backends.py
    PYTHONPATH=. .venv/bin/python benchmarks/cpu_backends.py --runs auto,auto-nodb --repeat 4

The model, the requests and the `tokenflow run` command are benchmarks/vs_vllm.py's (the 40M
Llama, the conversation trace, every request at t = 0, greedy, 2 GiB of KV). The runs, in
turn within each repeat so that a load on the machine falls on all of them alike:

- auto: as shipped, journal on (the backend choice read from the cache; the first run of
  a fresh cache measures it);
- auto-nodb: as shipped, --no-db (against auto: the journal's cost);
- torch: --attention-backend torch (torch attention and dense ops, no graphs);
- paged-graphs: --attention-backend paged --cpu-graphs;
- paged-eager: --attention-backend paged --no-cpu-graphs.

TOKENFLOW_KERNEL_MARCH builds (and keys) the kernels for another -march: x86-64-v3 is the
AVX2 stand-in on an AVX-512 machine. Prints each run, then per configuration the median
output tok/s and its spread, auto against the fastest forced path, and the journal's cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from vs_vllm import (
    MAX_MODEL_LEN,
    VOCAB,
    RunResult,
    run_tokenflow,
    save_model,
    write_requests,
)

from engine.harness.workload import build_workload

FLAGS = {
    "auto": [],
    "auto-nodb": [],
    "torch": ["--attention-backend", "torch"],
    "paged-graphs": ["--attention-backend", "paged", "--cpu-graphs"],
    "paged-eager": ["--attention-backend", "paged", "--no-cpu-graphs"],
}
FORCED = ("torch", "paged-graphs", "paged-eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each configuration")
    parser.add_argument("--runs", default=",".join(FLAGS),
                        help="comma-separated, from: %(default)s")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the model and outputs here (default: a temp directory)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()
    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in FLAGS]
    if unknown:
        parser.error(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(FLAGS)}")
    if args.num_requests < 1 or args.repeat < 1:
        parser.error("--num-requests and --repeat must be at least 1")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tokenflow-backends-"))
    work.mkdir(parents=True, exist_ok=True)
    model, requests = work / "model", work / "requests.jsonl"
    if not (model / "config.json").exists():
        save_model(model, args.seed)
    write_requests(requests, build_workload("conv", vocab_size=VOCAB,
                                            max_model_len=MAX_MODEL_LEN,
                                            num_requests=args.num_requests, rate=float("inf"),
                                            seed=args.seed, length_scale=1.0))
    results: list[RunResult] = []
    reference: dict[str, list[int]] | None = None
    for repeat in range(args.repeat):
        for name in runs:
            # vs_vllm's run_tokenflow reads its flags from the namespace: one per run here
            options = argparse.Namespace(tokenflow_arg=FLAGS[name])
            result, tokens, tpot_ms = run_tokenflow(options, model, requests, work,
                                                    f"{name}-{repeat}", None,
                                                    db=name != "auto-nodb")
            reference = reference if reference is not None else tokens
            identical = sum(1 for rid, ids in reference.items() if tokens.get(rid) == ids)
            row = RunResult(name, repeat, result["output_tok_s"], tpot_ms, result["wall_s"],
                            sum(map(len, tokens.values())), identical, len(reference))
            results.append(row)
            print(f"{name:13} #{repeat}  {row.output_tok_s:7.1f} out tok/s  "
                  f"{row.identical}/{row.requests} identical  ({result['attention']})",
                  flush=True)
    summary = _summary(results, runs)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in results],
                                         "summary": summary}, indent=2))


def _summary(results: list[RunResult], runs: list[str]) -> dict[str, object]:
    rates = {name: [r.output_tok_s for r in results if r.run == name] for name in runs}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    summary: dict[str, object] = {
        "output_tok_s": {name: {"median": round(medians[name], 1),
                                "min": round(min(rates[name]), 1),
                                "max": round(max(rates[name]), 1)} for name in runs}}
    forced = [name for name in FORCED if name in medians]
    if "auto" in medians and forced:
        fastest = max(forced, key=medians.__getitem__)
        summary["auto_vs_fastest_forced"] = {
            "fastest": fastest, "ratio": round(medians["auto"] / medians[fastest], 3)}
    if "auto" in medians and "auto-nodb" in medians:
        summary["journal_cost"] = round(1 - medians["auto"] / medians["auto-nodb"], 3)
    return summary


if __name__ == "__main__":
    sys.exit(main())
