"""`tokenflow roofline`: the seed-003 what-if table for chunk sizes, from a few numbers.

With no flags it reproduces the worked example (a 7B model on a 300 TFLOP/s, 2 TB/s machine with
32 decodes at 2048 tokens of context); flags swap in a GPU preset, a model's shape, or any of
the inputs, and --json prints the same as one object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from console.cli.given_flags import given
from console.errors import UserError
from engine.budget.cost_model import DEFAULT_STEP_TIME_S, BudgetSegment, budget_table
from engine.budget.peaks import GPU_PRESETS
from engine.budget.roofline import Roofline
from engine.config import ConfigError
from engine.model.config import ModelConfig, from_hf_config, preset

# The worked example every default below comes from.
SEED_PARAMS = 7e9
SEED_FLOPS = 300e12
SEED_BANDWIDTH = 2e12
SEED_KV_BYTES_PER_TOKEN = 524288  # 2 · 32 layers · 32 KV heads · 128 dims · 2 bytes
SEED_CHUNKS = "128,486,2048,4096"
GIB = 1 << 30


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "roofline", help="what-if table of chunk sizes from the seed-003 formulas",
        description=__doc__.splitlines()[0])
    machine = parser.add_argument_group("machine")
    machine.add_argument("--gpu", help=f"datasheet peaks of one of: {', '.join(GPU_PRESETS)}")
    machine.add_argument("--flops", type=float, help="dense FLOP/s (default 300e12)")
    machine.add_argument("--bandwidth", type=float, help="memory bytes/s (default 2e12)")
    model = parser.add_argument_group("model")
    model.add_argument("--model", help="synthetic:<preset> or a model directory with config.json;"
                       " gives P (non-embedding parameters) and k at bf16")
    model.add_argument("--params", type=float, help="P, parameters (default 7e9)")
    model.add_argument("--kv-bytes-per-token", type=float,
                       help="k, KV bytes per token over all layers (default 524288)")
    model.add_argument("--weight-bits", type=int, help="bits per weight (default 16)")
    load = parser.add_argument_group("load")
    load.add_argument("--decode-seqs", type=int, help="D, decodes per step (default 32)")
    load.add_argument("--context", type=int, help="S, context of each decode (default 2048)")
    load.add_argument("--prompt", type=int, help="T, prompt tokens for TTFT (default 4096)")
    load.add_argument("--chunks", help=f"chunk sizes C to compare (default {SEED_CHUNKS})")
    load.add_argument("--hit-rate", type=float, help="prefix-cache hit rate h (default 0)")
    load.add_argument("--kv-gib", type=float, help="KV pool in GiB (2^30 bytes; default 20)")
    load.add_argument("--step-ms", type=float,
                      help="step time budget of the three-constraint table (default "
                           f"{DEFAULT_STEP_TIME_S * 1e3:g})")
    machine.add_argument("--show-profile", action="store_true",
                         help="print the GPU twin's profile of --gpu (peaks per precision, "
                              "memory, link, efficiency factors, each figure's source)")
    machine.add_argument("--gpu-profile", type=Path, metavar="FILE",
                         help="a JSON profile over --gpu's (or a new GPU's) for --show-profile")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


# The worked example's figures that are plain defaults; the machine's and the model's are
# resolved in `_roofline`, after --gpu and --model.
_TABLE_DEFAULTS = {"weight_bits": 16, "decode_seqs": 32, "context": 2048, "prompt": 4096,
                   "chunks": SEED_CHUNKS, "hit_rate": 0.0, "kv_gib": 20.0,
                   "step_ms": DEFAULT_STEP_TIME_S * 1e3}
MAX_KV_GIB = 1 << 20
MAX_STEP_MS = 60_000
_TABLE_ONLY = ("flops", "bandwidth", "model", "params", "kv_bytes_per_token", *_TABLE_DEFAULTS)


def run(args: argparse.Namespace) -> int:
    table = given(args, _TABLE_ONLY)
    if args.show_profile:
        if table:
            raise UserError(f"{', '.join(table)} shape the what-if table, which --show-profile "
                            "does not print; drop them, or drop --show-profile")
        return _show_profile(args)
    if args.gpu_profile is not None:
        raise UserError("--gpu-profile is printed by --show-profile; add --show-profile "
                        "(the table takes the datasheet peaks of --gpu)")
    for dest, default in _TABLE_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    roofline = _roofline(args)
    report = _report(args, roofline)
    print(json.dumps(report, indent=2) if args.json else _render(report))
    return 0


def _roofline(args: argparse.Namespace) -> Roofline:
    flops, bandwidth = SEED_FLOPS, SEED_BANDWIDTH
    if args.gpu is not None:
        peaks = GPU_PRESETS.get(args.gpu.lower())
        if peaks is None:
            raise UserError(f"--gpu: unknown GPU {args.gpu!r}; choose one of "
                            f"{', '.join(GPU_PRESETS)} or give --flops and --bandwidth")
        flops, bandwidth = peaks.flops, peaks.bandwidth
    params, kv_bytes_per_token = SEED_PARAMS, SEED_KV_BYTES_PER_TOKEN
    window, windowed_share = None, 0.0
    if args.model is not None:
        config = _model_config(args.model)
        params = config.num_params(include_embeddings=False)
        kv_bytes_per_token = config.kv_bytes_per_token(2)
        window, windowed_share = config.sliding_window, config.windowed_share
    _require(args.decode_seqs >= 0, "--decode-seqs", "must be >= 0")
    _require(args.context >= 1, "--context", "must be >= 1")
    _require(args.prompt >= 1, "--prompt", "must be >= 1")
    _require(0 <= args.hit_rate <= 1, "--hit-rate", "must be in [0, 1]")
    # bounded above too: a pool of 1e300 GiB holds more tokens than an integer counts
    _require(0 < args.kv_gib <= MAX_KV_GIB, "--kv-gib", f"must be in (0, {MAX_KV_GIB}] GiB")
    _require(0 < args.step_ms <= MAX_STEP_MS, "--step-ms", f"must be in (0, {MAX_STEP_MS}] ms")
    _chunks(args.chunks)
    try:
        return Roofline(
            params=args.params if args.params is not None else params,
            flops=args.flops if args.flops is not None else flops,
            bandwidth=args.bandwidth if args.bandwidth is not None else bandwidth,
            kv_bytes_per_token=(args.kv_bytes_per_token if args.kv_bytes_per_token is not None
                                else kv_bytes_per_token),
            weight_bits=args.weight_bits, sliding_window=window, windowed_share=windowed_share,
        )
    except ConfigError as exc:
        raise UserError(f"--{exc.field.replace('_', '-')}: {exc.message}") from None


def _model_config(spec: str) -> ModelConfig:
    if spec.startswith("synthetic:"):
        return preset(spec.removeprefix("synthetic:"))
    return from_hf_config(Path(spec) / "config.json")


def _chunks(text: str) -> list[int]:
    try:
        chunks = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--chunks: {text!r} is not a comma-separated list of integers, "
                        "e.g. 128,512,2048") from None
    _require(all(c >= 1 for c in chunks), "--chunks", "every chunk must be >= 1 token")
    return chunks


def _require(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise UserError(f"{flag}: {message}")


def _report(args: argparse.Namespace, roofline: Roofline) -> dict[str, Any]:
    kv_bytes = args.kv_gib * GIB
    capacity = roofline.kv_capacity_tokens(kv_bytes)
    rows = roofline.table(_chunks(args.chunks), args.prompt, args.decode_seqs, args.context,
                          args.hit_rate)
    grid = [2**i for i in range(7, 64) if 2**i <= capacity] or [capacity]
    segments = budget_table(roofline, kv_bytes, grid, decode_seqs=args.decode_seqs,
                            step_time_s=args.step_ms / 1e3)
    max_concurrency = roofline.max_concurrency(kv_bytes, args.context)
    return {
        "warnings": _warnings(args, max_concurrency, segments),
        "balance_chunk": roofline.balance_chunk(args.decode_seqs, args.context),
        "machine_balance": roofline.machine_balance,
        "rows": [dataclasses.asdict(row) for row in rows],
        "kv_capacity_tokens": capacity,
        "max_concurrency": max_concurrency,
        "decode_intensity": roofline.decode_intensity(args.decode_seqs, args.context),
        "preempt_cost_flops": roofline.preempt_cost_flops(args.context),
        "budget_segments": [dataclasses.asdict(segment) for segment in segments],
        "inputs": {
            "params": roofline.params, "flops": roofline.flops, "bandwidth": roofline.bandwidth,
            "kv_bytes_per_token": roofline.kv_bytes_per_token,
            "sliding_window": roofline.sliding_window, "windowed_share": roofline.windowed_share,
            "weight_bits": roofline.weight_bits, "weight_bytes": roofline.weight_bytes,
            "decode_seqs": args.decode_seqs, "context": args.context, "prompt": args.prompt,
            "hit_rate": args.hit_rate, "kv_gib": args.kv_gib, "step_ms": args.step_ms,
            "gpu": args.gpu, "model": args.model,
        },
    }


def _warnings(args: argparse.Namespace, max_concurrency: int,
              segments: list[BudgetSegment]) -> list[str]:
    """What makes the table's figures unreachable, so a reader does not trust them."""
    if args.decode_seqs <= max_concurrency:
        return []
    zero = any(s.max_batched_tokens == 0 for s in segments)
    return [f"D = {args.decode_seqs} decodes exceed B_max = {max_concurrency} sequences at "
            f"S = {args.context}: the {args.kv_gib:g} GiB KV pool cannot hold them all"
            + ("; the budget rows governed by kv_capacity read 0 tokens" if zero else "")
            + "; raise --kv-gib, or lower --decode-seqs or --context"]


def _render(report: dict[str, Any]) -> str:
    inputs = report["inputs"]
    d, s = inputs["decode_seqs"], inputs["context"]
    lines = [
        f"P = {inputs['params']:.3g} params ({inputs['weight_bits']}-bit weights, "
        f"{inputs['weight_bytes'] / 1e9:.3g} GB)   F = {inputs['flops'] / 1e12:.4g} TFLOP/s   "
        f"W = {inputs['bandwidth'] / 1e12:.4g} TB/s   "
        f"k = {inputs['kv_bytes_per_token']:,.0f} B/token",
        f"D = {d} decodes at S = {s} tokens of context; prompt T = {inputs['prompt']}"
        + (f", prefix hit rate {inputs['hit_rate']:.0%}" if inputs["hit_rate"] else ""),
        "",
        _table(["chunk C", "tau ms", "bound", "TPOT ms", "TTFT ms", "rounds"],
               [[f"{r['chunk']}", f"{r['tau_ms']:.1f}", r["bound"], f"{r['tpot_ms']:.1f}",
                 f"{r['ttft_ms']:.1f}", f"{r['rounds']}"] for r in report["rows"]]),
        "",
        f"machine balance  R = F/W = {report['machine_balance']:.1f} FLOP/byte",
        f"balance chunk    C* = R(weights + DSk)/2P - D = {report['balance_chunk']:.1f} tokens",
        f"decode intensity 2PD/(weights + DSk) = {report['decode_intensity']:.1f} FLOP/byte",
        f"KV pool {inputs['kv_gib']:g} GiB  S_cap = {report['kv_capacity_tokens']:,} tokens, "
        f"B_max = {report['max_concurrency']} sequences at S = {s}",
        f"preempting at S = {s} recomputes {report['preempt_cost_flops']:.3g} FLOPs",
        "",
        f"token budget per step ({inputs['step_ms']:g} ms step, {d} decodes, 15% bandwidth "
        "headroom):",
        _table(["sequence length", "governed by", "max batched tokens"],
               [[_span(seg["lo"], seg["hi"]), seg["governing"], f"{seg['max_batched_tokens']:,}"]
                for seg in report["budget_segments"]]),
    ]
    lines += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


def _span(lo: int, hi: int) -> str:
    return f"{lo:,}" if lo == hi else f"{lo:,} - {hi:,}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned numeric columns, left-aligned text; widths fit the longest cell."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.rjust(w) if num else cell.ljust(w)
                         for cell, w, num in zip(cells, widths, numeric, strict=True)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _is_number(cell: str) -> bool:
    try:
        return math.isfinite(float(cell.replace(",", "")))
    except ValueError:
        return False


def _show_profile(args: argparse.Namespace) -> int:
    from engine.sim.profiles import profile

    if args.gpu is None:
        raise UserError("--show-profile: name the GPU with --gpu")
    try:
        gpu = profile(args.gpu, args.gpu_profile)
    except ConfigError as exc:
        raise UserError(f"--gpu: {exc.message}") from None
    data = gpu.to_dict()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    source = gpu.source_of
    lines = [f"{gpu.name} ({gpu.key})",
             f"memory        {gpu.memory_bytes / 2**30:.1f} GiB   [{source('memory_bytes')}]",
             f"bandwidth     {gpu.bandwidth / 1e12:.3g} TB/s   [{source('bandwidth')}]"]
    lines += [f"{precision + ' peak':<13} {flops / 1e12:,.0f} TFLOP/s   "
              f"[{source(f'flops.{precision}')}]" for precision, flops in gpu.flops.items()]
    link = gpu.interconnect
    lines.append(f"interconnect  {link.name}, {link.bandwidth / 1e9:.0f} GB/s one way   "
                 f"[{link.source}]")
    lines.append(f"efficiency    [{gpu.efficiency_source}]")
    # a factor taken from a publication rather than the fit says which
    published = {"attention_flops": "attention", "attention_context_half": "attention",
                 "saturated_clock": "saturated_clock"}
    for name, value in gpu.efficiency.to_dict().items():
        own = source(f"efficiency.{name}") or gpu.sources.get(published.get(name, ""), "")
        lines.append(f"  {name:<16} {value:.4g}" + (f"   [{own}]" if own else ""))
    print("\n".join(lines))
    return 0
