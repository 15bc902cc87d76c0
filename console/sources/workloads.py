"""The requests a `--workload` name gives an engine: a profile, a trace, or traced:DB (what
an attached fleet served). `run`, `bench` and the console's embedded engine take it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from console.errors import UserError

if TYPE_CHECKING:  # the engine pulls in torch: kept off the console's launch path
    from engine.core.engine_core import EngineCore
    from engine.harness.workload import WorkloadRequest

TRACED = "traced:"


def named_workload(spec: str, engine: EngineCore, *, num_requests: int | None = None,
                   rate: float | None = None, seed: int = 0, length_scale: float | None = None,
                   time_scale: float = 1.0) -> list[WorkloadRequest]:
    """The requests `--workload SPEC` names for `engine`, as `run`, `bench` and the
    console's embedded engine take it: a profile, a trace, or traced:DB."""
    from engine.harness.workload import UnknownWorkload, build_workload, default_length_scale

    if spec.startswith(TRACED):  # what an attached fleet served, from the store
        from engine.harness.traced_workload import traced_requests

        if rate is not None:
            raise UserError("--rate does not apply to traced:DB, which replays the recorded "
                            "arrivals; stretch or squeeze them with --time-scale instead")
        if length_scale is not None:
            raise UserError("--length-scale does not apply to traced:DB, which replays the "
                            "recorded prompt and completion lengths; drop it")
        return traced_requests(spec, vocab_size=engine.model_config.vocab_size,
                               max_model_len=engine.max_model_len, seed=seed,
                               num_requests=num_requests, time_scale=time_scale)
    scale = default_length_scale(engine.runner.device.type) if length_scale is None \
        else length_scale
    try:
        return build_workload(spec, vocab_size=engine.model_config.vocab_size,
                              max_model_len=engine.max_model_len, num_requests=num_requests,
                              rate=rate, seed=seed, length_scale=scale, time_scale=time_scale,
                              encode=engine.tokenizer.encode)
    except UnknownWorkload as exc:  # this door also takes what a traced fleet served
        raise UserError(str(UnknownWorkload(exc.spec, [*exc.choices, f"{TRACED}DB"]))) from None
