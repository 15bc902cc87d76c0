"""The engine's configuration flags, shared by every command that starts an engine."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from console.cli.given_flags import given
from engine.config import EngineConfig
from engine.model.config import PRESETS
from engine.slo_targets import CHAT_ITL_MS, CHAT_TTFT_MS

if TYPE_CHECKING:
    from engine.serve.session import EngineSession

# serve's bound on a mixed step's prompt tokens: a decode beside a long prompt's chunks
# costs a few times a decode-only step, not a whole budget's prefill
SERVE_MIXED_STEP_PREFILL_TOKENS = 32
# flag name -> (EngineConfig field, type, help)
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model": ("model", str, f"synthetic:<preset> ({', '.join(PRESETS)}) or a local "
                              "Hugging Face directory"),
    "--device": ("device", str, "auto, cpu, cuda or cuda:N"),
    "--dtype": ("dtype", str, "auto (float32 on CPU, bfloat16 on CUDA), float32 or bfloat16"),
    "--seed": ("seed", int, "seed of synthetic weights"),
    "--block-size": ("block_size", int, "tokens per KV block"),
    "--kv-cache-bytes": ("kv_cache_bytes", int, "KV pool size in bytes (default: 256 MiB on "
                                                "CPU, --gpu-memory-utilization on CUDA)"),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float,
                                 "share of the GPU's total memory the engine may use"),
    "--max-model-len": ("max_model_len", int, "longest prompt + output (default: the "
                                              "model's max_position_embeddings, which it may "
                                              "not exceed)"),
    "--max-num-seqs": ("max_num_seqs", int, "most requests running at once"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "the token budget of a step"),
    "--chunk-tile": ("chunk_tile", int, "prefill chunks are multiples of this"),
    "--max-prefill-chunks": ("max_prefill_chunks", int, "prefills that may share a step"),
    "--long-prefill-threshold": ("long_prefill_threshold", int,
                                 "cap on one request's chunk (0 = none)"),
    "--mixed-step-prefill-tokens": ("mixed_step_prefill_tokens", int,
                                    "the most prompt tokens a step that holds decodes takes "
                                    "after them (0 = the budget's rest; serve's default: "
                                    f"{SERVE_MIXED_STEP_PREFILL_TOKENS})"),
    "--max-prefill-tokens": ("max_prefill_tokens", int, "circuit breaker base (0 = model limit)"),
    "--cadence-min-decodes": ("cadence_min_decodes", int,
                              "a step with this many decodes starts new prefills only with a "
                              "step's worth of prompt tokens waiting or the oldest waiting "
                              "--cadence-max-wait-ms (0 = off)"),
    "--cadence-max-wait-ms": ("cadence_max_wait_ms", float,
                              "the longest the decode cadence holds a prompt (default 250)"),
    "--slow-query-threshold": ("slow_query_threshold", float, "budget_score of a slow query"),
    "--slow-query-min-overrun-ms": ("slow_query_min_overrun_ms", float,
                                    "a slow query also overran its plan by this much (ms)"),
    "--slo-ttft-ms": ("slo_ttft_ms", float,
                      f"the time to first token users are promised; a request past it is "
                      f"stored as a slow query (default {CHAT_TTFT_MS:g}, a chat service's; "
                      f"0: none)"),
    "--slo-itl-ms": ("slo_itl_ms", float,
                     f"the time between tokens users are promised; a request with a longer "
                     f"gap is stored as a slow query (default {CHAT_ITL_MS:g}; 0: none)"),
    "--stats-window-s": ("stats_window_s", float,
                         "seconds the latency percentiles cover (default 60)"),
    "--attention-backend": ("attention_backend", str,
                            "auto (on CUDA the fastest of torch, flex and flash-attn where "
                            "installed, timed at start; on CPU whichever of the paged C++ "
                            "kernels and torch measures faster, cached per machine), torch, "
                            "flash, flex or paged"),
    "--logprobs-mode": ("logprobs_mode", str,
                        "raw_logprobs (default, as vLLM's) scores the model's own logits; "
                        "processed_logprobs scores the logits sampled from, after bias, "
                        "penalties, temperature, min_p, top-k and top-p"),
    "--compile": ("compile", bool, "torch.compile the model at start, warmed up before the "
                                   "first request (default: on CUDA only)"),
    "--cpu-threads": ("cpu_threads", int, "torch threads on a CPU device (default 0: every "
                                          "core but one, left to the UI, HTTP and the store)"),
    "--cpu-graphs": ("cpu_graphs", bool, "replay CPU decode steps as recorded kernel calls "
                                         "(default: where measured faster; --no-cpu-graphs "
                                         "runs them eagerly)"),
    "--enable-prefix-caching": ("enable_prefix_caching", bool,
                                "reuse the KV blocks of prompt prefixes already computed "
                                "(default: on; --no-prefix-caching recomputes every prompt)"),
}
# the command line's defaults where they differ from EngineConfig's (the Python API's: no SLO)
_CLI_DEFAULTS: dict[str, object] = {"slo_ttft_ms": CHAT_TTFT_MS, "slo_itl_ms": CHAT_ITL_MS}
# vLLM's spelling first; the short one as tokenflow's docs write it
_ALIASES = {"--enable-prefix-caching": ("--prefix-caching",)}


DEFAULT_MODEL = "synthetic:small"


def add_engine_flags(parser: argparse.ArgumentParser, model_default: str | None = DEFAULT_MODEL,
                     skip: frozenset[str] = frozenset(),
                     defaults: dict[str, object] | None = None) -> None:
    """Every engine flag but those in `skip` (a command they would mean nothing to);
    `defaults`: this command's own, by EngineConfig field."""
    group = parser.add_argument_group("engine")
    for flag in _FLAGS:
        if flag not in skip:
            add_engine_flag(group, flag, model_default, defaults)


SLO_FLAGS = frozenset({"--slo-ttft-ms", "--slo-itl-ms"})
# what only a watched engine reads: live percentiles (the console, /metrics) and the logprobs a
# request asks for; a batch's or a sweep's requests ask none, and nobody reads its window
WATCHED_FLAGS = frozenset({"--stats-window-s", "--logprobs-mode"})


def add_engine_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str,
                    model_default: str | None = DEFAULT_MODEL,
                    defaults: dict[str, object] | None = None) -> None:
    """One of the engine flags, for a command that takes only a few of them."""
    field, kind, text = _FLAGS[flag]
    if kind is bool:  # --flag / --no-flag; neither keeps EngineConfig's default
        parser.add_argument(flag, *_ALIASES.get(flag, ()), dest=field,
                            action=argparse.BooleanOptionalAction, help=text)
        return
    default = model_default if field == "model" else {**_CLI_DEFAULTS, **(defaults or {})}.get(
        field)
    parser.add_argument(flag, dest=field, type=kind, default=default, help=text)


def engine_flags_given(args: argparse.Namespace, but: Iterable[str] = ()) -> list[str]:
    """The engine flags the command line set, as the user writes them, but those of `but`'s
    fields."""
    fields = [field for field, _, _ in _FLAGS.values() if field not in but]
    spelled = {field: f"--[no-]{flag[2:]}" for flag, (field, kind, _) in _FLAGS.items()
               if kind is bool}
    return given(args, fields, spelled)


def flag_of(field: str) -> str | None:
    """The engine flag that sets EngineConfig's `field`, or None if no flag does."""
    return next((flag for flag, (name, _, _) in _FLAGS.items() if name == field), None)


def engine_config(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """An EngineConfig from the flags given; ConfigError names a bad value."""
    values = {field: getattr(args, field) for _, (field, _, _) in _FLAGS.items()
              if getattr(args, field, None) is not None}
    values.update(overrides)
    config = dataclasses.replace(EngineConfig(), **values)
    config.validate()
    return config


def start_session(config: EngineConfig, *, db: str | Path | None, store: bool,
                  server: str | None = None, **options: Any) -> EngineSession:
    """EngineSession.start (with its `options`), saying on stderr when compiling makes the
    start take a while."""
    # torch comes in here, not at import: tokenflow-console takes a flag from this module
    # and launches its engine process before importing anything heavy
    from engine.core.model_runner import compiles
    from engine.serve.session import EngineSession

    compiling = compiles(config)
    if compiling:
        print("compiling the model (torch.compile, once at start; --no-compile skips it)...",
              file=sys.stderr, flush=True)
    session = EngineSession.start(config, db=db, store=store, server=server, **options)
    if compiling:
        print(f"compiled and warmed up in {session.engine.runner.compile_s:.1f} s",
              file=sys.stderr, flush=True)
    if session.orphans:
        assert session.database is not None
        print(f"closed {len(session.orphans)} request(s) the last process on "
              f"{session.database.location} left unfinished, as aborted", file=sys.stderr,
              flush=True)
    return session
