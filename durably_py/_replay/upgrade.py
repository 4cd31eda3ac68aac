"""The upgrade guard: a run resumed on changed code runs no live step until its recorded history has replayed.

A run records the code it started with (its workflow's fingerprint and the digest of its source file). When a
parked, interrupted or failed run resumes on other code, replay checks each recorded step against the step the
new code calls at its path: a different one stops the run as `stale` (`StaleRunError`). In a workflow of one
strand that check comes before anything new can run. With parallel branches it may not: one branch could reach
a step past the recorded frontier while another has still to meet its divergence. So, on changed code, a step
(or child run) not in the log waits until every recorded outcome has been delivered and the run is quiet: by
then any divergence has been met, and the run went stale before a single step ran. Replay-safe edits (steps
after the frontier, comments) pass: the held steps then run in turn, and nobody notices the wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import records
from .._authoring.workflow import Workflow
from .turns import Turns


class UpgradeGuard:
    """Holds a run's first live effects on changed code until its replay is over (see the module docstring)."""

    __slots__ = ("active", "failed", "turns", "released")

    def __init__(self, turns: Turns, active: bool, failed: Callable[[], BaseException | None]) -> None:
        self.turns = turns
        self.active = active  # code changed and there is history to replay first
        self.failed = failed  # the replay's failure (a stale or impure run), if any
        self.released: Callable[[], None] | None = None  # told once when the guard goes off (the kernel's step)

    async def hold(self) -> None:
        """Wait, if the guard is on, until every recorded outcome was delivered and the run is quiet; then raise
        the replay's failure if it met one (nothing live runs after a divergence)."""
        if self.active:
            await self.turns.live(time.time())
            self.active = False
            if self.released is not None:
                self.released()
        error = self.failed()
        if error is not None:
            raise error


def code_changed(header: records.Header, workflow: Workflow) -> bool:
    """Whether `workflow` is other code than the run started with: its function's fingerprint, or the source file
    defining it (when both sides know it)."""
    if header.fingerprint != workflow.fingerprint:
        return True
    if header.source is None:
        return False
    source = workflow.source
    return source is not None and source[0] != header.source
