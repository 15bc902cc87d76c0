"""Re-planning in-flight prefills when the tuning changes or a new arrival shares the budget."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from engine.batch import ScheduledChunk
from engine.budget.controller import BudgetController
from engine.budget.plan import PlanItem, PlanRules, plan_prefills, replanned
from engine.config import EngineConfig
from engine.core.admission import Admission
from engine.core.request import Request, RequestState


class Replanner:
    """Keeps the prefill plans that budget_score is measured against (engine.budget.plan)."""

    def __init__(self, admission: Admission, controller: BudgetController) -> None:
        self.admission = admission
        self.controller = controller
        self._plan_rules: PlanRules | None = None  # the rules the plans in force assume
        # rules()'s last answer, with the configuration and the budget it was made for
        self._rules_made: tuple[EngineConfig, int, PlanRules] | None = None

    def rules(self, cfg: EngineConfig, budget: int) -> PlanRules:
        """The normal-mode rules this step's budget and configuration set."""
        made = self._rules_made
        # read every step: made again only when the configuration or the budget changed
        if made is not None and made[0] is cfg and made[1] == budget:
            return made[2]
        # a cap under a tile rounds partial chunks to nothing; unchunked, capped prompts never run
        cap = max(cfg.long_prefill_threshold, cfg.chunk_tile) \
            if cfg.long_prefill_threshold and cfg.chunked_prefill else math.inf
        rules = PlanRules(budget=budget, tile=cfg.chunk_tile, slots=cfg.max_prefill_chunks,
                          chunk_cap=cap, chunked=cfg.chunked_prefill)
        self._rules_made = (cfg, budget, rules)
        return rules

    def replan_if_retuned(self, rules: PlanRules, decodes: Sequence[ScheduledChunk],
                          steps: int) -> None:
        """Re-plan what is in flight when the tuning (configuration, auto budget's C*) changed."""
        if rules is not self._plan_rules and rules != self._plan_rules:
            self._plan_rules = rules
            self.replan(rules, decodes, (), steps)

    def replan(self, rules: PlanRules, decodes: Sequence[ScheduledChunk],
               fresh: Iterable[Request], steps: int) -> None:
        """Plan every prefill in flight beside this step's `decodes` (all share the steps). Only
        plans made since calibration and unbroken by preemption are replaced: one admitted
        before calibration gets no verdict, and a preempted one's recompute counts as overrun."""
        if not self.controller.calibrated:
            return
        fresh = set(fresh)
        prefilling = sorted((r for r in self.admission.running
                             if r.state is RequestState.PREFILL_CHUNKING),
                            key=self.admission.queue_key)
        if not prefilling:
            return
        self._plan_rules = rules
        items = [PlanItem(r, r.num_computed_tokens, r.num_tokens) for r in prefilling]
        # the decodes' contexts, counted only here: most steps re-plan nothing
        decode_contexts = tuple([c.start + 1 for c in decodes])
        plans = plan_prefills(items, decode_contexts, rules, self.controller.plan_price())
        for request in prefilling:
            if request in fresh:
                request.planned = plans[request]
            elif request.planned and not request.num_preemptions:
                request.planned = replanned(request.planned, request.num_computed_tokens,
                                            steps - request.last_chunk_step, plans[request])
                request.replans += 1
