"""`tokenflow-console`: the Textual console on an embedded, recorded or remote engine.

This entry module stays light on purpose: it checks the flags and launches the embedded
engine's process first, so that the child's start-up (torch, the model) runs while this
process imports Textual, instead of after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from console.cli.engine_flags import add_engine_flag
from console.cli.otlp_flags import add_otlp_token_flags, otlp_token
from console.cli.output_file import check_output
from console.cli.twin_flags import add_twin_flags, twin_flags_given
from console.cli.workload_flags import add_rate_flag, workload_name
from console.errors import UserError
from engine.clock import SIM_SPEEDS
from engine.config import MAX_PERIOD_S
from engine.slo_targets import CHAT_ITL_MS, CHAT_TTFT_MS


class _TokenEnv(argparse.Action):
    """`--token-env NAME` after `--attach URL`: that server's bearer token is in $NAME. A token
    goes only to the server it was given with, never to every attached URL."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        if not namespace.attach:
            parser.error("--token-env NAME follows the --attach URL whose token $NAME holds")
        namespace.attach_tokens[namespace.attach[-1]] = str(values)


def attach_tokens(names: dict[str, str]) -> dict[str, str]:
    """Each --attach target's token, read from the variable --token-env named for it."""
    tokens = {}
    for target, name in names.items():
        token = os.environ.get(name, "").strip()
        if not token:
            raise UserError(f"--attach {target} --token-env {name}: ${name} is not set or "
                            "empty; export the server's token in it")
        tokens[target] = token
    return tokens


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the problem, not a usage dump (see --help for that)."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenflow-console", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="synthetic:<preset> or a Hugging Face model directory "
                        "(default: synthetic:small on CPU, a bigger preset on CUDA)")
    parser.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument("--workload", default=None,
                        help="mixed, chat, long-doc, multiturn, conv or code (the Azure LLM "
                        "inference traces), conversations:FILE, trace:FILE or traced:DB (the "
                             "requests an attached fleet served, from the OTLP traces stored "
                             "in DB) (default: mixed)")
    add_rate_flag(parser)
    add_engine_flag(parser, "--enable-prefix-caching")
    add_engine_flag(parser, "--max-model-len")
    parser.add_argument("--db", metavar="PATH|URL",
                        help="the store: a SQLite file (default: the user data dir) or a "
                        "PostgreSQL URL (postgresql+psycopg://user@host/db) a fleet shares; "
                        "with --otlp-listen, where traced requests are kept")
    parser.add_argument("--server-name", metavar="NAME",
                        help="the name the embedded engine's rows carry in the store "
                        "(default: this host)")
    parser.add_argument("--attach", action="append", metavar="URL", default=[],
                        help="watch a running server instead (repeatable: a fleet): tokenflow "
                        "serve, vLLM or SGLang, told apart by /metrics or by a prefix "
                        "(tokenflow+http://, vllm+http://, sglang+http://)")
    parser.add_argument("--token-env", action=_TokenEnv, metavar="NAME",
                        help="after --attach URL: the environment variable holding that "
                        "server's bearer token (sent to it alone; e.g. TOKENFLOW_ADMIN_TOKEN "
                        "to tune a tokenflow serve)")
    parser.set_defaults(attach_tokens={})
    parser.add_argument("--attach-vllm", metavar="URL", help="watch a vLLM server's /metrics")
    parser.add_argument("--attach-sglang", metavar="URL",
                        help="watch an SGLang server's /metrics (started with --enable-metrics)")
    parser.add_argument("--gpu", metavar="NAME",
                        help="the attached servers' GPU, for bandwidth shares and budget scores: "
                        "a datasheet name (h100, h200, a100, ...) or cpu to measure this "
                        "machine (default: NVML when the server is local)")
    parser.add_argument("--otlp-listen", metavar="HOST:PORT",
                        help="receive OTLP/HTTP traces (vLLM --otlp-traces-endpoint "
                        "http://HOST:PORT/v1/traces): a Requests row and budget_score each")
    add_otlp_token_flags(parser)
    parser.add_argument("--roofline-model", metavar="MODEL",
                        help="the traced model's shape (a model directory or synthetic:PRESET) "
                        "that budget scores are predicted for: by its calibration stored for "
                        "--gpu in --db when there is one, else by its roofline")
    parser.add_argument("--slo-ttft-ms", type=float, default=CHAT_TTFT_MS, metavar="MS",
                        help="the time-to-first-token users are promised: latency figures "
                             f"turn red beyond it (default {CHAT_TTFT_MS:g}, a chat service's)")
    parser.add_argument("--slo-itl-ms", type=float, default=CHAT_ITL_MS, metavar="MS",
                        help="the time between tokens users are promised (default "
                             f"{CHAT_ITL_MS:g})")
    parser.add_argument("--replay", type=Path, metavar="FILE",
                        help="review a session recorded with --record")
    parser.add_argument("--speed", type=float, default=None,
                        help="replay speed (default 1.0; 0 steps one snapshot per refresh)")
    parser.add_argument("--record", type=Path, metavar="FILE",
                        help="write every snapshot and the store's records to FILE (JSONL)")
    add_twin_flags(parser)
    parser.add_argument("--sim-speed", type=float, default=1.0, metavar="X",
                        help="with --simulate: simulated seconds per wall-clock second "
                             "(default 1.0)")
    return parser


def conflict(args: argparse.Namespace) -> str | None:
    """Why the flags cannot go together, or None: exactly one source, and engine flags only
    for the embedded engine."""
    attached = [flag for flag, value in (("--attach", args.attach),
                                         ("--attach-vllm", args.attach_vllm),
                                         ("--attach-sglang", args.attach_sglang)) if value]
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-itl-ms", args.slo_itl_ms)):
        if not 0 < value <= MAX_PERIOD_S * 1e3:  # the engine's bound on every latency target
            return (f"{flag} must be a number of milliseconds in (0, {MAX_PERIOD_S * 1e3:,.0f}]"
                    f", a day at most; got {value:g}")
    chosen = (["--replay"] if args.replay else []) + attached
    if args.replay and attached:
        return f"{' and '.join(chosen)} cannot be combined; pick one source"
    attach_only = [flag for flag, value in (("--gpu", args.gpu),
                                            ("--otlp-listen", args.otlp_listen),
                                            ("--otlp-token-file", args.otlp_token_file),
                                            ("--otlp-insecure", args.otlp_insecure),
                                            ("--roofline-model", args.roofline_model)) if value]
    if attach_only and not attached:
        return f"{', '.join(attach_only)} describe attached servers; add --attach URL"
    engine_flags = [flag for flag, value in (("--model", args.model), ("--device", args.device),
                                             ("--workload", args.workload),
                                             ("--rate", args.rate is not None),
                                             ("--db", args.db and not args.otlp_listen),
                                             ("--server-name", args.server_name),
                                             ("--simulate", args.simulate),
                                             ("--[no-]prefix-caching",
                                              args.enable_prefix_caching is not None),
                                             ("--max-model-len", args.max_model_len is not None))
                    if value]
    twin = twin_flags_given(args) + (["--sim-speed"] if args.sim_speed != 1.0 else [])
    if twin and not args.simulate:
        return f"{', '.join(twin)} apply to a simulated engine; add --simulate"
    if not SIM_SPEEDS[0] <= args.sim_speed <= SIM_SPEEDS[1]:
        return (f"--sim-speed must be in [{SIM_SPEEDS[0]:g}, {SIM_SPEEDS[1]:g}], got "
                f"{args.sim_speed}; for a run as fast as this host goes, use tokenflow bench "
                "--simulate")
    if args.simulate and args.device:
        return ("--device places the model's weights, which --simulate does without (step "
                "times predicted); drop --device")
    if args.speed is not None and not args.replay:
        return "--speed paces a recorded session; add --replay FILE"
    if args.record is not None:
        try:  # a recording is kept: a new file, never an old one's place or a symlink's
            check_output(args.record, may_exist=False, keep_hint="move the old recording away",
                         flag="--record")
        except UserError as exc:
            return str(exc)
    if chosen and engine_flags:
        return (f"{', '.join(engine_flags)} configure the embedded engine; "
                f"drop them with {chosen[0]}")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = conflict(args)
    try:  # before the engine starts: a receiver nobody guards must be asked for
        args.otlp_token = otlp_token(args) if args.otlp_listen else None
        args.attach_tokens = attach_tokens(args.attach_tokens)
    except UserError as exc:
        problem = problem or str(exc)
    if problem is not None:
        print(f"tokenflow-console: {problem}", file=sys.stderr)
        return 2
    engine = None
    if not (args.replay or args.attach or args.attach_vllm or args.attach_sglang):
        # Seen at once, while the engine process spawns and Textual loads (seconds on a
        # busy machine); the console's splash then shows the engine's stages.
        print("tokenflow-console: starting the engine…", file=sys.stderr, flush=True)
        from console.sources.process import ProcessSource
        from engine.config import ConfigError, EngineConfig

        simulate = None
        if args.simulate is not None:  # the twin's module imports torch: seconds before a spawn
            from engine.sim.executor import Simulation

            simulate = Simulation(args.simulate, args.tp, args.sim_speed,
                                  args.kv_cache_dtype, args.gpu_profile)
        config = EngineConfig(slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms)
        if args.enable_prefix_caching is not None:
            config = config.replace(enable_prefix_caching=args.enable_prefix_caching)
        if args.max_model_len is not None:  # fixed at start: not a live replace()
            config = dataclasses.replace(config, max_model_len=args.max_model_len)
            try:
                config.validate()
            except ConfigError as exc:
                print(f"tokenflow-console: --max-model-len {args.max_model_len}: {exc.message}",
                      file=sys.stderr)
                return 2
        engine = ProcessSource.launch(model=args.model, device=args.device,
                                      workload=workload_name(args), rate=args.rate,
                                      db=args.db,
                                      server=args.server_name,
                                      simulate=simulate, config=config)
    from console.tui.app import run  # Textual and the screens: seconds, overlapping the child's

    return run(args, engine, simulated_traffic)


def simulated_traffic(store: str, gpu: str, budget: int, model: str,
                      max_model_len: int | None = None) -> dict[str, Any]:
    """The fleet view's twin run; bench's module (and torch) loads only when it is asked."""
    from console.cli.bench import simulated_traffic as run

    return run(store, gpu, budget, model, max_model_len)


if __name__ == "__main__":
    sys.exit(main())
