"""The one script to run when a session is lent a GPU: checks every CUDA path and measures.

Each check writes one JSON line as it ends, to stdout and to $OUT/gpu_check.jsonl (or
--out), with its figures, its threshold and `pass`; the script exits 1 if any check failed,
so a run cut off at its time limit still returns every line it finished.

- exactness: greedy tokens on the device equal the CPU engine's (fp32) on every attention
  path (torch, flex, flash where it can run), eager and compiled; bf16 logits within
  BF16_TOLERANCE of fp32's.
- later_chunk: a prompt prefilled in 64-token chunks gives the logits of one whole prefill
  (torch and flex in fp32; flash, where it runs, in bf16 within BF16_TOLERANCE).
- memory_headroom: the worst step the engine allows (a chunk of the budget's cap at the
  deepest context beside decodes) runs beside a pool sized by the engine, under
  gpu_memory_utilization of the device.
- live_budget: the engine loop with the budget raised mid-run: the same tokens.
- transfers: one read back and one upload a step (tests.host_syncs).
- throughput: decode tok/s and MBU, prefill MFU at batch 1/32/128 on synthetic:1b and :8b.
- attention_paths: a decode step and a later chunk on torch, flex and flash, side by side,
  and the path `auto` took from its own timed step (measured on CUDA, untimed on the CPU).
- telemetry: NVML's reading over TELEMETRY_LOAD_S of copies against the bandwidth achieved,
  the GPU found by UUID; no engine's sampler thread outlives its close.
- console: the console under tmux for 60 s: live panes, no traceback.
- calibration, targets (only when named): the quick calibration's held-out error; the
  mixed-load and conversation-trace `tokenflow bench` comparisons.

`--dry-run` runs every check's code that needs no CUDA, on the CPU with tiny shapes (figures
not judged), so the script is tested where no GPU is.

Here, once: `./scripts/gpu_prepare` (the wheels the GPU image lacks, into .gpu/).
There, with the device tool's `run`, carry [".gpu"]:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .gpu/wheels/*.whl && PYTHONPATH=/tmp/site:. \
        python3 benchmarks/gpu_check.py --checks all
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from step_micro import _decodes, _request, _timed  # run from benchmarks/, as the usage says

from engine import Engine, EngineConfig, SamplingParams
from engine.batch import StepShape
from engine.core.request import RequestState
from engine.kernels.attention import describe_gpu, flash_available, flash_refusal
from engine.model.loader import model_config_for
from engine.ops.telemetry import NvmlBandwidth, TelemetryError, cuda_uuid, nvml_available
from tests.host_syncs import HostReads
from tests.prompt_logits import prompt_logits

PROMPTS = [[3 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((1, 17, 64, 200))]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
BF16_TOLERANCE = 0.05  # of the fp32 logits' largest magnitude
CHUNK_TOLERANCE = 1e-3  # fp32 logits, chunked against whole
SMALL_KV = 256 << 20  # a check's engine takes this, not a share of the device
MBU_TARGET = 0.3  # decode at batch 1 reads the weights: at least this share of the peak
MFU_TARGET = 0.2  # a 2,048-token prefill chunk
TELEMETRY_LOAD_S = 3.5  # several NVML samples and more than one GPM period
TELEMETRY_TOLERANCE = 0.25  # |NVML's utilisation - achieved / peak|
CONSOLE_S = 60.0


@dataclass(frozen=True)
class Setting:
    device: str
    dry: bool
    model: str
    big_model: str


_OPEN: list[Engine] = []  # engines made since the last _free, closed there


def _engine(s: Setting, model: str = "synthetic:tiny", *, dtype: str = "float32",
            kv: int | None = SMALL_KV, **changes: Any) -> Engine:
    """An engine on the check's device; a fixed pool unless `kv` is None (the engine sizes
    it), so engines of one process never find the device taken."""
    engine = Engine(EngineConfig(model=model, device=s.device, dtype=dtype, kv_cache_bytes=kv,
                                 **changes))
    _OPEN.append(engine)
    return engine


def _free() -> None:
    """Close the engines made so far (their NVML sampler threads stop) and give their memory
    back, so the next one sizes against a free device."""
    while _OPEN:
        _OPEN.pop().close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sampler_threads() -> int:
    return sum(t.name == "nvml-bandwidth" for t in threading.enumerate())


PATHS = ("torch", "flex")  # the paths that run fp32: flash takes none (its guard)


def _last_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The prompt's last logits in fp32 on the host, where paths and dtypes are compared."""
    return prompt_logits(engine, prompt).float().cpu()


def _long(s: Setting) -> int | None:
    """A context of 4,096 on the GPU's models; a dry run's synthetic:tiny has 2,048."""
    return None if s.dry else 4096


def _flash_runs(s: Setting, model: str = "synthetic:tiny") -> bool:
    """Whether flash-attn's guard lets `model` run on flash here, in bf16."""
    if s.device == "cpu" or not flash_available(torch.device(s.device)):
        return False
    return flash_refusal(describe_gpu(torch.device(s.device)), torch.bfloat16,
                         model_config_for(model).head_dim) is None


def exactness(s: Setting) -> dict[str, Any]:
    reference = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                    kv_cache_bytes=SMALL_KV)).generate(PROMPTS, GREEDY)
    equal: dict[str, bool] = {}
    for path in PATHS:
        for budget in (16, 4096):
            engine = _engine(s, attention_backend=path, max_num_batched_tokens=budget,
                             chunk_tile=16, compile=False)
            equal[f"{path}/eager/{budget}"] = engine.generate(PROMPTS, GREEDY) == reference
            del engine
        compiled = _engine(s, attention_backend=path, max_num_batched_tokens=16,
                           chunk_tile=16, compile=True)
        equal[f"{path}/compiled/16"] = compiled.generate(PROMPTS, GREEDY) == reference
        del compiled
        _free()
    prompt = PROMPTS[-1]
    # the references run eagerly: the compiled paths are judged above (a compile each costs
    # the cold run time it must fit in)
    fp32 = _last_logits(_engine(s, attention_backend="torch", compile=False), prompt)
    bf16_paths = ["torch", "flex"] + (["flash"] if _flash_runs(s) else [])
    bf16 = {}
    for path in bf16_paths if s.device != "cpu" else []:  # no bf16 matmuls judged on CPU
        logits = _last_logits(_engine(s, dtype="bfloat16", attention_backend=path), prompt)
        bf16[path] = float((logits - fp32).abs().max() / fp32.abs().max())
    _free()
    return {"greedy_equal_to_cpu": equal, "bf16_relative_error": bf16,
            "threshold": {"greedy": "equal to the CPU fp32 engine's",
                          "bf16_relative_error": BF16_TOLERANCE},
            "pass": all(equal.values()) and all(v <= BF16_TOLERANCE for v in bf16.values())}


def later_chunk(s: Setting) -> dict[str, Any]:
    prompt = [3 + (i * 11) % 300 for i in range(300)]
    errors = {}
    for path in PATHS:
        whole = _last_logits(_engine(s, attention_backend=path, max_num_batched_tokens=4096,
                                     compile=False), prompt)
        chunked = _last_logits(_engine(s, attention_backend=path, max_num_batched_tokens=64,
                                       chunk_tile=16, compile=False), prompt)
        errors[path] = float((whole - chunked).abs().max())
    _free()
    # flash runs bf16 only: its later chunks (paged block tables) against its own whole prefill
    flash = {}
    if _flash_runs(s):
        whole = _last_logits(_engine(s, dtype="bfloat16", attention_backend="flash",
                                     max_num_batched_tokens=4096), prompt)
        chunked = _last_logits(_engine(s, dtype="bfloat16", attention_backend="flash",
                                       max_num_batched_tokens=64, chunk_tile=16), prompt)
        flash["flash"] = float((whole - chunked).abs().max() / whole.abs().max())
        _free()
    return {"max_abs_error": errors, "bf16_relative_error": flash,
            "threshold": {"max_abs_error": CHUNK_TOLERANCE,
                          "bf16_relative_error": BF16_TOLERANCE},
            "pass": all(e <= CHUNK_TOLERANCE for e in errors.values())
            and all(e <= BF16_TOLERANCE for e in flash.values())}


def memory_headroom(s: Setting) -> dict[str, Any]:
    """The engine sizes its own pool; then the worst step it allows runs beside it."""
    model, cap, context = ("synthetic:tiny", 256, 1024) if s.dry else (s.model, 2048, 8192)
    engine = _engine(s, model, dtype="float32" if s.dry else "bfloat16",
                     kv=SMALL_KV if s.dry else None, max_model_len=context,
                     max_num_batched_tokens=cap, max_num_batched_tokens_cap=cap,
                     max_num_seqs=64)
    if s.device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    deep = _request(engine, "deep", context, RequestState.PREFILL_CHUNKING)
    decodes = _decodes(engine, 8, min(context, 1024))
    step = [deep.chunk(context - cap, cap), *decodes]
    seconds = _timed(engine, step, 1, 2)
    result: dict[str, Any] = {"model": model, "chunk": cap, "context": context,
                              "kv_blocks": engine.runner.num_blocks, "step_s": seconds}
    if s.device == "cpu":
        return {**result, "threshold": "judged on a GPU", "pass": True}
    free, total = torch.cuda.mem_get_info()
    limit = engine.config.gpu_memory_utilization * total
    peak = torch.cuda.max_memory_reserved()
    del engine, deep, decodes, step
    _free()
    return {**result, "peak_reserved_gib": peak / 2**30, "limit_gib": limit / 2**30,
            "free_after_gib": free / 2**30, "threshold": "peak reserved <= utilization x total",
            "pass": peak <= limit}


def live_budget(s: Setting) -> dict[str, Any]:
    """Steps with the budget raised from 16 to 256 tokens after three: the same tokens."""
    reference = _engine(s, max_num_batched_tokens=16, chunk_tile=16,
                        compile=False).generate(PROMPTS, GREEDY)
    engine = _engine(s, max_num_batched_tokens=16, chunk_tile=16)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            engine.update_config(max_num_batched_tokens=256)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
    equal = [tokens[rid] for rid in ids] == reference
    return {"steps": steps, "budget_after": engine.config.max_num_batched_tokens,
            "threshold": "the same tokens as a fixed budget", "pass": equal}


def transfers(s: Setting) -> dict[str, Any]:
    engine = _engine(s, max_num_batched_tokens=64, chunk_tile=16)
    kinds = [GREEDY, SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.9),
             SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, seed=1,
                            logprobs=2, repetition_penalty=1.1)]
    for i, prompt in enumerate(PROMPTS * 2):
        engine.add_request(prompt, kinds[i % 3])
    reads, uploads = [], []
    device = engine.runner.device
    while engine.has_unfinished():
        before = engine.runner.staging.uploads
        with HostReads(device) as counted:
            engine.step()
        reads.append(counted.total)
        uploads.append(engine.runner.staging.uploads - before)
    most_uploads = 1 if device.type == "cuda" else 0
    return {"steps": len(reads), "max_reads_per_step": max(reads),
            "max_uploads_per_step": max(uploads),
            "threshold": {"reads": 1, "uploads": most_uploads},
            "pass": max(reads) <= 1 and max(uploads) <= most_uploads}


def throughput(s: Setting) -> dict[str, Any]:
    models = ["synthetic:tiny"] if s.dry else [s.model, s.big_model]
    batches, chunk, context = ((1, 4), 64, 128) if s.dry else ((1, 32, 128), 2048, 1024)
    rows = []
    for model in models:
        engine = _engine(s, model, dtype="float32" if s.dry else "bfloat16",
                         kv=SMALL_KV if s.dry else None,
                         max_model_len=None if s.dry else max(4096, context + 1),
                         max_num_batched_tokens=chunk, max_num_batched_tokens_cap=chunk)
        peaks, budget = engine.peaks, engine.budget
        for batch in batches:
            seconds = _timed(engine, _decodes(engine, batch, context), 2, 5 if s.dry else 20)
            moved = budget.bytes_moved(StepShape(decode_contexts=(context - 1,) * batch))
            rows.append({"model": model, "decode_batch": batch, "context": context,
                         "tok_s": batch / seconds, "mbu": moved / seconds / peaks.bandwidth})
        prefill = _request(engine, "prefill", chunk, RequestState.PREFILL_CHUNKING)
        seconds = _timed(engine, [prefill.chunk(0, chunk)], 1, 3 if s.dry else 10)
        flops = budget.flops(StepShape(prefill=((chunk, 0),)))
        rows.append({"model": model, "prefill_chunk": chunk, "mfu":
                     flops / seconds / peaks.flops, "tok_s": chunk / seconds})
        del engine, prefill
        _free()
    ones = [r["mbu"] for r in rows if r.get("decode_batch") == 1]
    mfus = [r["mfu"] for r in rows if "mfu" in r]
    judged = not s.dry
    return {"rows": rows, "threshold": {"mbu_at_batch_1": MBU_TARGET, "prefill_mfu": MFU_TARGET,
                                        "judged": judged},
            "pass": not judged or (min(ones) >= MBU_TARGET and min(mfus) >= MFU_TARGET)}


def attention_paths(s: Setting) -> dict[str, Any]:
    """Each attention path's decode step and later chunk on the same model: the measurement
    from which `auto` would choose on a GPU (as backend_choice does on the CPU)."""
    model, dtype = ("synthetic:tiny", "float32") if s.dry else (s.model, "bfloat16")
    batch, context, chunk = (4, 128, 64) if s.dry else (32, 1024, 2048)
    paths = [*PATHS, *(["flash"] if _flash_runs(s, model) else [])]
    rows = {}
    for path in paths:
        engine = _engine(s, model, dtype=dtype, kv=SMALL_KV if s.dry else None,
                         attention_backend=path, max_model_len=_long(s),
                         max_num_batched_tokens=chunk, max_num_batched_tokens_cap=chunk,
                         compile=False)
        warm, repeats = (0, 1) if s.dry else (2, 20)  # eager flex is slow on the CPU
        decode_s = _timed(engine, _decodes(engine, batch, context), warm, repeats)
        later = _request(engine, "later", 2 * chunk, RequestState.PREFILL_CHUNKING)
        chunk_s = _timed(engine, [later.chunk(chunk, chunk)], warm, max(1, repeats // 2))
        rows[path] = {"decode_ms": decode_s * 1e3, "later_chunk_ms": chunk_s * 1e3}
        del engine, later
        _free()
    engine = _engine(s, model, dtype=dtype, kv=SMALL_KV if s.dry else None, max_model_len=_long(s),
                     max_num_batched_tokens=chunk, max_num_batched_tokens_cap=chunk,
                     compile=False)
    choice = engine.runner.attention
    auto = {"path": choice.name, "how": choice.how, "step_ms": choice.step_ms}
    del engine
    _free()
    # a GPU times every candidate (or took a choice it timed at an earlier start, with its
    # figures); the CPU takes the gather path untimed
    chose = (choice.how in ("measured", "cached") and set(PATHS) <= set(choice.step_ms)) \
        if not s.dry else choice.how == "forced"
    return {"model": model, "decode_batch": batch, "context": context, "chunk": chunk,
            "paths": rows, "auto": auto,
            "threshold": "every path runs; auto timed each candidate", "pass": chose}


def telemetry(s: Setting) -> dict[str, Any]:
    """A copy loop held for TELEMETRY_LOAD_S while NVML samples; its achieved share of the
    measured copy peak against what NVML reads."""
    device = torch.device(s.device)
    elements = (64 << 20) if s.device != "cpu" else (8 << 20)
    src = torch.ones(elements, device=device)
    dst = torch.empty_like(src)
    monitor = None
    reason = None
    if s.device == "cpu" or not nvml_available():
        reason = "no NVML on this machine"
    else:
        monitor = NvmlBandwidth(interval_s=0.1, torch_device=s.device,
                                uuid=cuda_uuid(s.device))  # CUDA_VISIBLE_DEVICES-proof
        try:
            monitor.start()
        except TelemetryError as exc:
            monitor, reason = None, str(exc)
    copies = 0
    started = time.perf_counter()
    load_s = TELEMETRY_LOAD_S if not s.dry else 1.0
    while time.perf_counter() - started < load_s:
        for _ in range(20):
            dst.copy_(src)
        copies += 20
        if device.type == "cuda":
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    achieved = 2 * copies * src.numel() * src.element_size() / elapsed
    peak = _peak_bandwidth(s)
    result: dict[str, Any] = {"load_s": elapsed, "achieved_gb_s": achieved / 1e9,
                              "achieved_share": achieved / peak}
    if monitor is None:
        return {**result, "nvml": reason, "threshold": "judged where NVML reads a GPU",
                "pass": s.dry}
    reading = monitor.reading()
    monitor.stop()
    _free()
    left = _sampler_threads()  # every engine so far is closed: none of theirs may run on
    gap = abs(reading.util_5s - achieved / peak)
    return {**result, "nvml": {"util": reading.util_5s, "source": reading.source,
                               "measured": reading.measured, "note": reading.note},
            "sampler_threads_left": left,
            "threshold": {"measured": True, "gap": TELEMETRY_TOLERANCE,
                          "sampler_threads_left": 0},
            "pass": reading.measured and gap <= TELEMETRY_TOLERANCE and left == 0}


def _peak_bandwidth(s: Setting) -> float:
    from engine.budget.peaks import measure_peaks

    return measure_peaks(s.device, torch.float32).bandwidth


def console(s: Setting) -> dict[str, Any]:
    """The console under tmux on this machine's engine for CONSOLE_S seconds."""
    seconds = 5.0 if s.dry else CONSOLE_S
    if shutil.which("tmux") is None:
        return {"threshold": "live panes, no traceback", "pass": s.dry,
                "skipped": "tmux is not installed"}
    root = Path(__file__).resolve().parents[1]
    socket = f"gpu-check-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        # Textual draws on stderr: it stays on the pane; the pane outlives a crash to show it
        command = (f"cd {root} && {sys.executable} -m console.cli.console --db {tmp}/c.db; "
                   f"echo console exited $?; sleep 3600")
        tmux = ["tmux", "-L", socket]
        subprocess.run([*tmux, "new-session", "-d", "-s", "c", "-x", "120", "-y", "40",
                        command], check=True)
        try:
            time.sleep(seconds)
            pane = subprocess.run([*tmux, "capture-pane", "-p", "-t", "c"], check=True,
                                  capture_output=True, text=True).stdout
        finally:
            subprocess.run([*tmux, "kill-server"], check=False)
    live = all(p in pane for p in ("Requests", "Bandwidth"))
    broken = "Traceback" in pane or "console exited" in pane
    return {"watched_s": seconds, "live_panes": live, "ended_or_raised": broken,
            "pane_tail": pane.strip()[-800:],
            "threshold": "live panes (judged on a GPU), still running, no traceback",
            "pass": not broken and (live or s.dry)}


def calibration(s: Setting) -> dict[str, Any]:
    from engine.calibration.calibrate import calibrate

    engine = _engine(s, "synthetic:tiny" if s.dry else s.model,
                     dtype="float32" if s.dry else "bfloat16", kv=SMALL_KV if s.dry else None,
                     max_model_len=_long(s))
    result = calibrate(engine, quick=True)
    error = result.heldout_median_abs_error
    return {"heldout_median_abs_error": error, "points": len(result.points),
            "threshold": 0.25, "pass": error is not None and error <= 0.25}


# mixed load; the conversation trace against hf; capacity at the TPOT SLO
TARGET_BENCHES = {
    "mixed": ["--workload", "mixed", "--compare", "chunked,unchunked"],
    "conv": ["--workload", "conv", "--compare", "chunked,hf"],
    "capacity": ["--workload", "conv", "--compare", "auto,unchunked", "--capacity"],
}


def targets(s: Setting) -> dict[str, Any]:
    """`tokenflow bench --json` for each of TARGET_BENCHES (only bench's front door is
    imported: the others need packages the GPU image lacks)."""
    from console.cli import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    db = Path(tempfile.mkdtemp()) / "bench.db"
    reports = {}
    for name, flags in TARGET_BENCHES.items():
        args = parser.parse_args(["bench", "--model", s.model, "--device", s.device,
                                  "--dtype", "bfloat16", "--db", str(db), "--json", *flags])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            args.func(args)
        reports[name] = json.loads(printed.getvalue())
    return {"reports": reports, "threshold": "reported, not judged", "pass": True}


CHECKS: dict[str, Callable[[Setting], dict[str, Any]]] = {
    "exactness": exactness, "later_chunk": later_chunk, "memory_headroom": memory_headroom,
    "live_budget": live_budget, "transfers": transfers, "throughput": throughput,
    "attention_paths": attention_paths, "telemetry": telemetry, "console": console,
    "calibration": calibration, "targets": targets}
ALL = ("exactness", "later_chunk", "memory_headroom", "live_budget", "transfers",
       "throughput", "attention_paths", "telemetry", "console")


def run_check(name: str, setting: Setting) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        line = {"check": name, **CHECKS[name](setting)}
    except Exception as exc:  # every check reports, even after one fails
        line = {"check": name, "error": f"{type(exc).__name__}: {exc}", "pass": False}
    _free()
    return {**line, "seconds": round(time.perf_counter() - started, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:1b")
    parser.add_argument("--big-model", default="synthetic:8b")
    parser.add_argument("--checks", default="all",
                        help=f"comma-separated, or 'all' ({', '.join(ALL)}); also "
                             f"{', '.join(sorted(set(CHECKS) - set(ALL)))}")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU with tiny shapes: every path that needs no CUDA")
    parser.add_argument("--out", type=Path, default=None,
                        help="where gpu_check.jsonl goes (default: $OUT, else nowhere)")
    args = parser.parse_args()
    chosen = ALL if args.checks == "all" else tuple(args.checks.split(","))
    unknown = set(chosen) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here; --dry-run runs the checks' CPU paths")
    setting = Setting("cpu" if args.dry_run else "cuda:0", args.dry_run, args.model,
                      args.big_model)
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    sink = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        sink = (out_dir / "gpu_check.jsonl").open("a", encoding="utf-8")
    header = {"check": "setup", "torch": torch.__version__, "device": setting.device,
              "dry_run": args.dry_run, "pass": True,
              "gpu": torch.cuda.get_device_name(0) if not args.dry_run else None,
              "flash_attn": _flash_runs(setting, setting.model)}
    failed = False
    # lazily: each line is out before the next check starts (a tuple would run them all first)
    for line in itertools.chain((header,), (run_check(name, setting) for name in chosen)):
        text = json.dumps(line, default=str, ensure_ascii=False)
        print(text, flush=True)
        if sink is not None:
            sink.write(text + "\n")
            sink.flush()
        failed |= not line["pass"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
