"""Every command that starts an engine takes the torch thread count on a CPU device
(`--cpu-threads`, EngineConfig.cpu_threads; 0 leaves a core to the other threads), and a
negative one is refused by name."""

from __future__ import annotations

import argparse

import pytest
import torch

from console.cli.engine_flags import engine_config
from console.cli.serve import register
from engine.config import ConfigError, EngineConfig
from engine.core.model_runner import ModelRunner


def test_serve_takes_the_thread_count_and_refuses_a_negative_one() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert engine_config(parser.parse_args(["serve", "--cpu-threads", "2"])).cpu_threads == 2
    assert engine_config(parser.parse_args(["serve"])).cpu_threads == 0
    with pytest.raises(ConfigError) as caught:
        engine_config(parser.parse_args(["serve", "--cpu-threads", "-1"]))
    assert caught.value.field == "cpu_threads"


def test_the_runner_runs_torch_on_the_threads_it_is_given() -> None:
    previous = torch.get_num_threads()
    try:
        ModelRunner(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 cpu_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)
