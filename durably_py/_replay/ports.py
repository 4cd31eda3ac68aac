"""What the kernel asks of the engine that runs it (`EngineServices`, `Spawned`), and what a test harness sees
of a run (`Observer`, step selectors)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._authoring.calls import RunHandle
from .._authoring.engine_api import EngineAPI
from .._authoring.workflow import Workflow
from .._state.history import path_tuple

if TYPE_CHECKING:
    from .._authoring.resources import Gates
    from .._threads import SyncPlacement
    from .kernel import RunKernel


class EngineServices(EngineAPI, Protocol):
    """What the kernel asks of the engine that runs it (`engine.Engine` implements it): child runs, gates, and
    what a workflow asks of it through `ctx.engine` (`EngineAPI`)."""

    concurrency: int
    gates: Gates
    callback_url: str | None  # the base URL of awakeables' callback URLs (`durably ui` serves them)
    placement: SyncPlacement

    def create_child(self, parent: str, path: str, workflow: Workflow, input: Any, detached: bool, *,
                     queued: bool = True) -> str: ...

    def create_children(self, parent: str, children: list[tuple[str, Workflow, Any]],
                        detached: bool, *, queued: bool = True) -> list[str]: ...

    def start_child(self, run_id: str, workflow: Workflow | None, *,
                    rerun_failed: bool = False) -> asyncio.Future[Any]: ...

    def start_children(self, handles: list[RunHandle], *, rerun_failed: bool,
                       on_start: Callable[[str, asyncio.Future[Any]], None]) -> Spawned | None: ...

    def parked_in_join(self) -> contextlib.AbstractAsyncContextManager[None]: ...

    def ended_child(self, run_id: str, workflow: Workflow | None) -> asyncio.Future[Any] | None: ...

    def queued_child(self, run_id: str) -> None: ...


class Spawned(Protocol):
    """Spawned children waiting in the engine to start, in spawn order (`EngineServices.start_children`): no
    future each until one starts, when its run id and outcome are handed to the spawning run (`on_start`)."""

    def done(self) -> bool:
        """True once every child started, or the wait was cancelled."""

    def cancel(self) -> None:
        """Start none of those still waiting."""

    def wait(self) -> asyncio.Future[None]:
        """Done once `done()` is."""





Selector = tuple[int, ...] | str | tuple[str, int]


def selects(selector: Selector | None, path: str, label: str, nth: int) -> bool:
    """Whether a step selector (a path tuple, a label, or `(label, nth)` from 1) picks the nth step so labelled."""
    if selector is None:
        return False
    if isinstance(selector, str):
        return selector == label
    if len(selector) == 2 and isinstance(selector[0], str):
        return selector[0] == label and selector[1] == nth
    return tuple(selector) == path_tuple(path)


class Observer(Protocol):
    """What a test harness sees of one live execution (`durably_py.testing`: crash injection, replay checks).

    A kernel has none unless `observing` makes one for it, so each hook point costs one attribute check.
    A hook may set `kernel.dead` and raise `Crash` to stop the run exactly as a killed process would."""

    def unrecorded(self, kernel: RunKernel, path: str, kind: str, label: str) -> None:
        """Work the log has no record of is about to start at `path`: a step (`kind` "step", `label` its label),
        a compensation (`kind` "compensation", `label` its step's label) or a ctx call (`kind` and `label` both
        "ctx.sleep", "ctx.wait_for", "ctx.spawn", "ctx.join", "ctx.graph", "ctx.loop", "ctx.now", "ctx.random"
        or "ctx.uuid")."""

    def step_ran(self, kernel: RunKernel, path: str, label: str, recorded: bool) -> None:
        """A step's function returned: called before its result is written (`recorded` False) and after (True)."""


observing: contextvars.ContextVar[Callable[[RunKernel], Observer | None] | None] = contextvars.ContextVar(
    "durably_observing", default=None)
"""Makes the `Observer` of each kernel created in this context (`durably_py.testing` sets it)."""


class Hooks:
    """An `Observer` bound to the kernel it watches: what the parts of a kernel call (they never see the kernel)."""

    __slots__ = ("observer", "kernel")

    def __init__(self, observer: Observer, kernel: RunKernel) -> None:
        self.observer = observer
        self.kernel = kernel

    def unrecorded(self, path: str, kind: str, label: str) -> None:
        self.observer.unrecorded(self.kernel, path, kind, label)

    def step_ran(self, path: str, label: str, recorded: bool) -> None:
        self.observer.step_ran(self.kernel, path, label, recorded)
