"""How far to trust a live simulated engine (the console's `--simulate GPU`): the published
cases nearest the traffic it has served so far, as `bench --simulate` reports them for a run.

The run's shape is the same as bench's (engine.sim.trust.run_shape): the mean number of
sequences decoding, weighted by step time (the same DecodingBatch), and the mean prompt and
requested output of the requests added. Here they are sums kept as the engine's events
arrive, since a live engine has no end to take them at.
"""

from __future__ import annotations

from engine.events import Event, RequestAdded, StepComplete
from engine.model.config import ModelConfig
from engine.sim.target import SimTarget
from engine.sim.trust import DecodingBatch, PublishedCases, shape


class LiveTrust:
    """Hears a simulated engine's steps and requests (`observe`, on the engine's bus);
    `line()` places what it has served so far among the published cases."""

    def __init__(self, target: SimTarget, model: ModelConfig,
                 cases: PublishedCases | None = None) -> None:
        self.target = target
        self.model = model
        self.cases = cases or PublishedCases()
        self.batch = DecodingBatch()
        self.requests = 0
        self.prompt_tokens = 0
        self.output_tokens = 0

    def observe(self, event: Event) -> None:
        if isinstance(event, StepComplete):
            self.batch.add(event.decode_seqs, event.duration_s)
        elif isinstance(event, RequestAdded):
            self.requests += 1
            self.prompt_tokens += len(event.prompt_token_ids)
            self.output_tokens += int(event.sampling.get("max_tokens") or 0)

    def line(self) -> str:
        """The traffic so far placed, in brief ("" before any request: nothing to place)."""
        if not self.requests:
            return ""
        target = self.target
        run = shape(target.spec, target.dtype, self.model, target.details.get("tp", 1),
                    self.batch.mean, self.prompt_tokens / self.requests,
                    self.output_tokens / self.requests)
        return self.cases.trust(run, target.no_band).brief()
