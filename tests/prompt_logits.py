"""The logits of a prompt's last position, as the engine computes them: the reference both the
exactness tests and the GPU check compare paths by (no transformers, so the GPU machine can
import it)."""

from __future__ import annotations

import torch

from engine import Engine, SamplingParams


def prompt_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """Serve `prompt` for one token and return the logits its last position sampled from."""
    captured: list[torch.Tensor] = []
    model = engine.runner.model
    original = model.logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        out = original(hidden)
        captured.append(out)
        return out

    model.logits = capture
    try:
        engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        model.logits = original
    return captured[-1][0]
