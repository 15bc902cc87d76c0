"""The memory a CPU engine keeps for oneDNN's GEMM primitives stops growing once its bounded
caches are full, however many step sizes the traffic brings (engine.core.model_runner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.model_runner import ONEDNN_CACHE_ENTRIES, ONEDNN_CACHE_ENV
from tests.heap import heap

ROOT = Path(__file__).resolve().parents[1]
BOUND_BYTES = 16 * 2**20  # what the bounded engine may retain beyond its full caches
OLD_DEFAULT = 1024  # oneDNN's and ideep's own capacity

# A fresh process, so the caches are first used by the engine (they read their capacity
# then). One request per prompt length, each a prefill step of that many rows: every request
# brings a GEMM row count no earlier one had, for each of the model's weight shapes (more
# than one, so `entries` / 2 of them fill the caches). The allocated bytes are counted then,
# and again after `entries` more lengths.
CHILD = """
import json, os, sys
from engine import Engine, EngineConfig, SamplingParams
from tests.heap import heap
from engine.kernels.cpu_kernels import PANEL_MAX_ROWS

entries = int(sys.argv[1])
engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                             max_num_batched_tokens=4096, enable_prefix_caching=False))
params = SamplingParams(max_tokens=1)
first = PANEL_MAX_ROWS + 1  # the smallest step that runs oneDNN's GEMMs, not linear_rows
for length in range(first, first + entries // 2):
    engine.generate([[7] * length], params)
full = heap().allocated
for length in range(first + entries // 2, first + entries // 2 + entries):
    engine.generate([[7] * length], params)
print(json.dumps({"capacity": [os.environ.get(name) for name in sys.argv[2:]],
                  "grown": heap().allocated - full}))
"""


def run_child(env: dict[str, str]) -> dict[str, Any]:
    if heap() is None:
        pytest.skip("needs glibc's mallinfo2 (glibc 2.33 or later) to count allocated bytes")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    done = subprocess.run([sys.executable, "-c", CHILD, str(ONEDNN_CACHE_ENTRIES),
                           *ONEDNN_CACHE_ENV], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def child_env(**capacities: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in ONEDNN_CACHE_ENV}
    return {**env, **capacities}


@pytest.mark.slow  # many step sizes
@pytest.mark.soak
def test_primitive_memory_stays_flat_over_many_step_sizes() -> None:
    figures = run_child(child_env())
    assert figures["capacity"] == [str(ONEDNN_CACHE_ENTRIES)] * len(ONEDNN_CACHE_ENV)
    assert figures["grown"] < BOUND_BYTES


@pytest.mark.slow  # many step sizes
@pytest.mark.soak
def test_a_capacity_the_user_set_is_kept() -> None:
    """And the count has teeth: at oneDNN's own capacity the same traffic grows by far more."""
    figures = run_child(child_env(**dict.fromkeys(ONEDNN_CACHE_ENV, str(OLD_DEFAULT))))
    assert figures["capacity"] == [str(OLD_DEFAULT)] * len(ONEDNN_CACHE_ENV)
    assert figures["grown"] > 4 * BOUND_BYTES
