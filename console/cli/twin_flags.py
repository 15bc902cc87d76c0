"""The GPU twin's flags, shared by `tokenflow bench` and `tokenflow-console`: which GPU (or
calibration) to simulate, split how, its KV precision and a profile of the user's. Light on
purpose: the console's entry module imports it before anything heavy."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_twin_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--simulate", metavar="TARGET",
                        help="run on the GPU twin: this (the calibration stored for this "
                             "device), a GPU profile (a100, a100-pcie, h100, h100-pcie, h200, "
                             "l40s, b200, a10, mi300x: each operation on its roofline, "
                             "docs/twin.md; or a new GPU --gpu-profile defines) or "
                             "calibration:ID; no weights are loaded")
    parser.add_argument("--tp", type=int, default=1,
                        help="with --simulate GPU: tensor-parallel GPUs (default 1)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="with --simulate GPU: the KV cache's precision (--dtype fp8 or "
                             "int8 sets the weights')")
    parser.add_argument("--gpu-profile", type=Path, metavar="FILE",
                        help="with --simulate GPU: a JSON profile over the named GPU's, or a "
                             "new GPU's (`tokenflow roofline --gpu NAME --show-profile --json` "
                             "prints one)")


def twin_flags_given(args: argparse.Namespace) -> list[str]:
    """The twin's flags given beyond their defaults, as the command line spells them."""
    return [flag for flag, given in (("--tp", args.tp != 1),
                                     ("--kv-cache-dtype", args.kv_cache_dtype != "auto"),
                                     ("--gpu-profile", args.gpu_profile is not None)) if given]
