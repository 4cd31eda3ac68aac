"""How an execution of a run stops short of its end, and the durable waits it may park on.

`Crash` (a simulated process death), `Parked` (the run left its process to be due again later) and
`Halted` (the run is stopping) are control flow, not errors: nothing of the workflow ever sees them. A
`Rest` is a durable wait one strand of the run is in, and how the run would park on it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .. import records


class Crash(BaseException):  # noqa: N818 - it is not an error but a simulated process death
    """Raised by crash injection: the run stops exactly as a killed process would."""


class Parked(BaseException):  # noqa: N818 - control flow, not an error
    """The run parked (`status` "waiting", "sleeping" or "paused") and its engine was asked not to wait, or
    its worker is stopping ("interrupted"). It is due again at `at` (epoch seconds; None: only when woken), at
    once on a signal named in `names`, or (`children`) when the child runs it waits for in a join ended."""

    def __init__(self, status: str, detail: str, children: tuple[str, ...] = (), *, at: float | None = None,
                 names: tuple[str, ...] = (), path: str | None = None, label: str = "") -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.children = children
        self.at = at
        self.names = names
        self.path = path  # where the first strand that parks waits, and on what
        self.label = label


@dataclass(slots=True)
class Rest:
    """A durable wait a strand of the run is in, and how the run would park on it."""

    status: str  # "sleeping", "waiting", "paused" or "interrupted"
    detail: str
    parkable: bool  # False: the wait goes on only in this process (a child run here, a short backoff)
    at: float | None = None  # due again then (epoch seconds)
    signal: str | None = None  # a signal whose arrival makes it due
    children: tuple[str, ...] = ()  # child runs whose end makes it due
    record: records.Park | None = None  # what parking on it records
    fallback: asyncio.Future[None] | None = None  # set when the run cannot park: the wait goes on here
    task: asyncio.Task[Any] | None = None  # the strand that waits
    path: str | None = None  # the operation waiting, and its label
    label: str = ""


class Halted(BaseException):  # noqa: N818 - control flow, not an error
    """The run is stopping; raised by a ctx call made after that."""


HALTED = Halted()
CLEANUP_OVER = Halted("the clean-up window of the cancelled run ended")

CANCEL_PATH = "$cancel"  # a cancel's place in the order of a run's outcomes (`Turns`)
CANCEL_MSG = "durably: the run was cancelled"  # the message of the CancelledError a cancel request causes
CANCELLED_TYPE = "asyncio.exceptions:CancelledError"  # the recorded error of an operation the workflow cancelled
CUT_OFF = asyncio.CancelledError("cancelled by the workflow")
ABANDONED = asyncio.CancelledError("abandoned: the workflow ended before this step did")


def is_run_cancel(exc: BaseException | None) -> bool:
    """Whether `exc` is the `CancelledError` a cancel request of the run put into its workflow."""
    return isinstance(exc, asyncio.CancelledError) and bool(exc.args) and exc.args[0] == CANCEL_MSG


async def forever() -> None:
    """Wait until cancelled (a strand of a run that is stopping)."""
    await asyncio.get_running_loop().create_future()
