"""A fault no request caused: the engine restarts and resumes what it held, or stops."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.engine_core import EngineCore, RequestOutput
from engine.core.request import Request
from engine.events import EngineRestarted
from engine.serve.outputs import Outputs, failed
from engine.serve.supervisor import Supervisor
from engine.store.recovery import Resumption

log = logging.getLogger(__name__)

JournalResume = Callable[[EngineCore], Resumption]


@dataclass(frozen=True)
class Healed:
    owed: list[RequestOutput]  # to deliver, in this order
    stopped: BaseException | None  # the supervisor stopped the engine: a crash loop
    failed_while_down: int  # requests failed because it stopped


class Healer:
    """Restarts the engine after a fault, from the journal when there is one."""

    def __init__(self, engine: EngineCore, supervisor: Supervisor, journal: JournalResume | None,
                 outputs: Outputs) -> None:
        self.engine = engine
        self.supervisor = supervisor
        self.journal = journal
        self.outputs = outputs

    def heal(self, exc: Exception) -> Healed:
        """Restart from the journal, or stop on a crash loop; what is owed to the listeners."""
        engine, supervisor = self.engine, self.supervisor
        fault = supervisor.judge(exc)
        log.error("engine fault at %s: %s\n%s", fault.place, fault.error, fault.traceback)
        stopped = supervisor.stopped
        live = list(engine.scheduler.requests)
        doomed = (set(live) if stopped is not None
                  else supervisor.struck_out(engine.stepping, live))
        reason = (str(stopped) if stopped is not None else
                  f"the engine failed twice in a step holding this request: {fault.error} at "
                  f"{fault.place}")
        kept, owed = engine.restart(dict.fromkeys(doomed, reason))
        resumed = [] if stopped is not None else self._resume(kept, owed)
        engine.bus.publish(EngineRestarted(restarts=supervisor.restarts, place=fault.place,
                                           error=fault.error, resumed=len(resumed),
                                           failed=len(doomed), stopped=stopped is not None,
                                           traceback=fault.traceback))
        try:
            engine.bus.drain()
        except Exception:
            log.exception("delivering the events of a restart failed")
        return Healed(owed, stopped, len(doomed) if stopped is not None else 0)

    def _resume(self, kept: list[Request], owed: list[RequestOutput]) -> list[str]:
        """Re-add what the engine had accepted: from the journal when there is one, else in hand."""
        engine = self.engine
        handled: set[str] = set()
        generated = {r.id: r.output_token_ids for r in kept}
        if self.journal is not None:
            try:
                engine.bus.drain()
                resumption = self.journal(engine)
            except Exception:
                log.exception("resuming from the journal failed; resuming what is in memory")
            else:
                handled = {*resumption.resumed, *resumption.quarantined, *resumption.failed}
                closed = {*resumption.quarantined, *resumption.failed}
                owed.extend(failed(r.id, "not resumed after an engine restart (see the "
                                         "journal)")
                            for r in kept if r.id in closed)
                generated.update(resumption.generated)
        for request in kept:
            if request.id not in handled:
                engine.add_request(request.prompt_token_ids, request.params,
                                   tenant=request.tenant, priority=request.priority,
                                   request_id=request.id, tag=request.tag,
                                   arrival=request.arrival,
                                   generated=request.output_token_ids)
        # ahead of what is owed: a resumed request that ended at once is owed its end
        owed[:0] = self.outputs.resumed(generated)
        return list(engine.scheduler.requests)
