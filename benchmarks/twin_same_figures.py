"""Whether two trees' `bench --simulate` reports agree figure for figure.

A change meant only to make the twin faster must leave every simulated figure as it was. This
runs a set of simulated bench commands from a tree and keeps their JSON reports, less what the
host decides (its wall time, its load); `--against DIR` then names every figure that differs.

    cd /work/main && python benchmarks/twin_same_figures.py --out /tmp/before
    cd /work/wt/me && python benchmarks/twin_same_figures.py --out /tmp/after --against /tmp/before
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# the command docs/benchmarks.md times, then other workloads, GPUs, fleets and configurations
COMMANDS: dict[str, list[str]] = {
    "conv3000-h100": ["--simulate", "h100", "--workload", "conv", "--num-requests", "3000",
                      "--compare", "chunked"],
    "conv400-a100-all": ["--simulate", "a100", "--workload", "conv", "--num-requests", "400",
                         "--compare", "chunked,unchunked,auto,nocache"],
    "code300-h100-tp2": ["--simulate", "h100", "--tp", "2", "--workload", "code",
                         "--num-requests", "300", "--compare", "chunked"],
    "multiturn-fleet": ["--simulate", "h100", "--workload", "multiturn", "--num-requests", "40",
                        "--replicas", "3", "--router", "session", "--compare", "chunked"],
    "chat-fp8": ["--simulate", "a100", "--workload", "chat", "--num-requests", "200",
                 "--rate", "20", "--kv-cache-dtype", "fp8", "--compare", "chunked,auto"],
    "long-doc-windowed": ["--model", "synthetic:gemma2-small", "--simulate", "h100",
                          "--workload", "long-doc", "--num-requests", "40",
                          "--compare", "chunked,unchunked"],
}
# what the host running the twin decides, not the twin
HOST_FIELDS = {"host", "host_wall_s", "x_real_time"}


def run(name: str, out: Path) -> dict[str, Any]:
    args = COMMANDS[name]
    model = [] if "--model" in args else ["--model", "synthetic:8b"]
    done = subprocess.run([sys.executable, "-m", "console.cli.main", "bench", *model, *args,
                           "--json", "--quiet"], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr}")
    report = _without_host(json.loads(done.stdout))
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    return report


def _without_host(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_host(v) for k, v in value.items() if k not in HOST_FIELDS}
    if isinstance(value, list):
        return [_without_host(v) for v in value]
    return value


def differences(before: Any, after: Any, path: str = "") -> list[str]:
    """Each path where `after` differs from `before`, with both values."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [d for key in sorted(before.keys() | after.keys())
                for d in differences(before.get(key), after.get(key), f"{path}/{key}")]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for i, (b, a) in enumerate(zip(before, after, strict=True))
                for d in differences(b, a, f"{path}/{i}")]
    return [] if before == after else [f"{path}: {before!r} -> {after!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the reports")
    parser.add_argument("--against", type=Path, help="a folder of reports to compare with")
    parser.add_argument("--only", action="append", choices=sorted(COMMANDS),
                        help="run only this command (repeatable)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.only or COMMANDS:
        report = run(name, args.out)
        if args.against is None:
            print(f"{name}: kept")
            continue
        before = json.loads((args.against / f"{name}.json").read_text())
        found = differences(before, report)
        failed += bool(found)
        print(f"{name}: {'identical' if not found else f'{len(found)} figures differ'}")
        for line in found[:20]:
            print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
