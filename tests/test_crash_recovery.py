"""Kill `tokenflow run` with SIGKILL mid-prefill and mid-decode, resume, and get exactly the
outputs of a run that was never interrupted, none emitted twice (pitfall 12)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine import Engine, EngineConfig, SamplingParams
from engine.harness.chaos import query_journal

FLAGS = ["--model", "synthetic:tiny", "--device", "cpu", "--max-num-batched-tokens", "8",
         "--chunk-tile", "8"]
POLL_S = 0.01
DEADLINE_S = 120
# Enough work that each run is still going when it is killed: with 30, a faster engine once
# finished the resumed run before the journal showed a decode (CI).
REQUESTS = 60


def _requests(path: Path) -> list[dict]:
    rng = random.Random(3)
    rows = [{"id": f"r{i:02d}", "prompt_token_ids": [rng.randrange(3, 300)
                                                     for _ in range(rng.randrange(40, 160))],
             "max_tokens": rng.randrange(12, 40)} for i in range(REQUESTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _run_until(args: list[str], condition, env: dict[str, str]) -> bool:
    """Start `tokenflow run`, SIGKILL it once `condition()` holds; False if it ended first."""
    process = subprocess.Popen([sys.executable, "-m", "console.cli.main", "run", *args], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + DEADLINE_S
    while process.poll() is None and time.monotonic() < deadline:
        if condition():
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        time.sleep(POLL_S)  # polling another process's progress, not waiting on our threads
    process.wait()
    assert process.returncode == 0, process.stderr.read().decode()
    return False


def test_sigkill_mid_prefill_and_mid_decode_then_resume(tmp_path: Path) -> None:
    requests_file, output, db = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "j.db"
    rows = _requests(requests_file)
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu"))
    expected = {r["id"]: engine.generate([r["prompt_token_ids"]],
                                         SamplingParams(max_tokens=r["max_tokens"]))[0]
                for r in rows}

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = [*FLAGS, "--requests", str(requests_file), "--output", str(output), "--db", str(db)]
    prefilling = "SELECT 1 FROM request_journal WHERE prefilled_tokens > 0 AND generated_tokens = 0"
    decoding = "SELECT 1 FROM request_journal WHERE generated_tokens > 0 AND state = 'DECODING'"
    mid_prefill = _run_until(args, lambda: bool(query_journal(db, prefilling)), env)
    mid_decode = _run_until([*args, "--resume"], lambda: bool(query_journal(db, decoding)), env)
    assert mid_prefill and mid_decode, "the run finished before it could be killed"
    assert not _run_until([*args, "--resume"], lambda: False, env)

    lines = [json.loads(line) for line in output.read_text().splitlines()]
    ids = [line["id"] for line in lines]
    assert len(ids) == len(set(ids)) == REQUESTS
    assert {line["id"]: line["token_ids"] for line in lines} == expected
