"""An EngineActor whose scheduler breaks on cue, for the engine-loop fault tests. It lives in
its own module so Ray's actor process imports it by name."""

from __future__ import annotations

from cadenza.actors.engine_actor import EngineActor
from cadenza.messages import EngineRequest

BREAK_SCHEDULER = "break-the-scheduler"  # a request with this id makes schedule() raise
BREAK_FOR_GOOD = "break-for-good"  # ... and the scheduler's invariants fail too


class SchedulerBreaksEngine(EngineActor):
    async def start(self) -> int:
        max_len = await super().start()
        scheduler = self.core.scheduler
        schedule, check = scheduler.schedule, scheduler.check_invariants

        def broken_schedule():  # noqa: ANN202
            if BREAK_SCHEDULER in scheduler.requests or BREAK_FOR_GOOD in scheduler.requests:
                raise RuntimeError("a scheduler bug")
            return schedule()

        def broken_check() -> None:
            if self.broken_for_good:
                raise AssertionError("block tables and pool disagree")
            check()

        self.broken_for_good = False
        scheduler.schedule, scheduler.check_invariants = broken_schedule, broken_check
        return max_len

    async def add_request(self, request: EngineRequest) -> str | None:
        if BREAK_FOR_GOOD in request.request_id:
            self.broken_for_good = True
        return await super().add_request(request)
