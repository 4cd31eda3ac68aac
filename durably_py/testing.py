"""Test workflows fast and exactly: memory storage, a fake clock, crash injection and shadow replay.

`TestEngine` runs workflows through the real engine and kernel, over `MemoryStorage` and a
`FakeClock` (retry backoffs and `ctx.now()` use virtual time, so an hour of backoff takes
milliseconds). `crash_after=` / `crash_in_step=` stop a run exactly as a killed process would,
`resume()` continues it, and every completed run is replayed once more against its own log
(shadow replay): a step path that moved or a step that ran again fails the test with
`ShadowReplayError`. `engine.sync` offers the same calls for plain, non-async tests.

`Crash` is the simulated process death itself: raising it from a step or a compensation stops
the run right there, exactly like crash injection does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from .advisories import Advisory
from .clock import FakeClock
from .codec import encode, load_error, load_value
from .engine import Engine
from .errors import PurityError, RunNotFoundError, RunParkedError, ValidationError
from .events import StepEvent
from .history import History, RunState
from .kernel import Crash, Selector
from .storage import MemoryStorage, Storage
from .workflow import Workflow, as_workflow

__all__ = ["Crash", "ShadowReplayError", "SyncTestEngine", "TestEngine", "TestRunResult", "TestStep"]

RunStatus = Literal["completed", "failed", "crashed", "waiting", "sleeping", "paused"]
StepListener = Callable[[StepEvent], Any]


class ShadowReplayError(PurityError):
    """Replaying a completed run against its own log did not reproduce it: the workflow is not deterministic."""

    default_hint = (
        "Code between steps must make the same calls in the same order on every replay: read time, randomness, "
        "environment and I/O through ctx.now()/ctx.random()/ctx.uuid()/ctx.step(), never directly in the "
        "workflow body."
    )
    anchor = "shadowreplayerror"


@dataclass(frozen=True)
class TestStep:
    """One step of a test run: its recorded state plus how often its function actually ran."""

    __test__ = False

    path: tuple[int, ...]
    label: str
    status: str
    executions: int
    attempts: int
    output: Any = None
    error: BaseException | None = None
    stashed: Any = None
    compensation: str | None = None


@dataclass(frozen=True)
class TestRunResult:
    """How a test run ended (`completed`, `failed` or `crashed`), with its steps and advisories."""

    __test__ = False

    run_id: str
    status: RunStatus
    result: Any
    error: BaseException | None
    advisories: list[Advisory]
    steps: list[TestStep]

    def step(self, selector: Selector) -> TestStep:
        """The step at a path tuple, the first with a label, or the nth (from 1) with a label as `(label, nth)`."""
        if isinstance(selector, str):
            label, nth = selector, 1
        elif len(selector) == 2 and isinstance(selector[0], str):
            label, nth = selector
        else:
            for step in self.steps:
                if step.path == tuple(selector):
                    return step
            raise LookupError(f"run {self.run_id} has no step at path {tuple(selector)}; "
                              f"it has {[s.path for s in self.steps]}")
        matching = [s for s in self.steps if s.label == label]
        if len(matching) < nth:
            raise LookupError(f"run {self.run_id} has {len(matching)} step(s) labelled {label!r}, not {nth}; "
                              f"labels: {[s.label for s in self.steps]}")
        return matching[nth - 1]

    @property
    def executions(self) -> dict[str, int]:
        """Executions summed per label (handy when a label is used at several paths)."""
        out: dict[str, int] = {}
        for step in self.steps:
            out[step.label] = out.get(step.label, 0) + step.executions
        return out


class TestEngine:
    """The real engine over memory storage and a fake clock, with crash injection and shadow replay."""

    __test__ = False

    def __init__(self, *, clock: FakeClock | None = None, shadow: bool = True, storage: Storage | None = None) -> None:
        self.clock: FakeClock = clock if clock is not None else FakeClock()
        self.storage: Storage = storage if storage is not None else MemoryStorage()
        self.engine = Engine(self.storage, clock=self.clock)
        self.shadow = shadow
        self.sync = SyncTestEngine(self)
        self._workflows: dict[str, Workflow] = {}
        self._advisories: dict[str, str | None] = {}
        self._executions: dict[str, dict[tuple[int, ...], int]] = {}
        self._live: dict[str, dict[tuple[int, ...], tuple[str, int]]] = {}

    async def run(self, wf: Any, input: Any = None, *, key: str | None = None, crash_after: Selector | None = None,
                  crash_in_step: Selector | None = None, budget: dict[str, float] | None = None,
                  advisories: str | None = None, on_step: StepListener | None = None) -> TestRunResult:
        """Run a workflow under the engine's identity and resume rules; report how it ended instead of raising."""
        workflow = as_workflow(wf)

        def start(found: Callable[[str], None]) -> Awaitable[Any]:
            return self.engine.run(workflow, input, key=key, budget=budget, advisories=advisories,
                                   on_step=self._listener(on_step), on_run=found, crash_after=crash_after,
                                   crash_in_step=crash_in_step, wait=False)

        return await self._drive(workflow, start, advisories)

    async def resume(self, run_id: str, *, on_step: StepListener | None = None, crash_after: Selector | None = None,
                     crash_in_step: Selector | None = None) -> TestRunResult:
        """Continue a crashed or failed run of this engine; finished steps answer from the log."""
        workflow = self._workflows.get(run_id)
        if workflow is None:
            raise RunNotFoundError(f"no run {run_id!r} was started by this TestEngine",
                                   hint="Resume the run_id of a TestRunResult returned by this engine's run().",
                                   run_id=run_id)
        advisories = self._advisories.get(run_id)

        def start(found: Callable[[str], None]) -> Awaitable[Any]:
            return self.engine.run(workflow, run_id=run_id, advisories=advisories, on_step=self._listener(on_step),
                                   on_run=found, crash_after=crash_after, crash_in_step=crash_in_step, wait=False)

        return await self._drive(workflow, start, advisories)

    async def signal(self, run_id: str, name: str, payload: Any = None) -> None:
        """Send signal `name` to a run; the next `resume` hands `payload` to its `ctx.wait_for(name)`."""
        await self.engine.signal(run_id, name, payload)

    async def inspect(self, run_id: str) -> RunState:
        """The run's state as `durably inspect` shows it."""
        return await self.engine.inspect(run_id)

    async def verify(self, run_id: str) -> None:
        """Shadow-replay a completed run against its log; raise `ShadowReplayError` if anything differs."""
        workflow = self._workflows.get(run_id)
        if workflow is None:
            raise RunNotFoundError(f"no run {run_id!r} was started by this TestEngine", run_id=run_id)
        kernel = await self.engine.shadow(workflow, run_id)
        end = self._history(run_id).end
        recorded = end.result if end is not None else None
        replayed = kernel.result_wire
        same_result = kernel.divergence is None and encode(recorded) == encode(replayed)
        if kernel.divergence is None and same_result:
            return
        lines = [f"shadow replay of run {run_id} (workflow {workflow.name!r}) did not reproduce the recorded run"]
        if kernel.divergence is not None:
            lines.append(f"  first divergence: {kernel.divergence}")
        lines.append(f"  result recorded: {load_value(recorded)!r}")
        lines.append(f"  result replayed: {load_value(replayed)!r}" if kernel.divergence is None
                     else "  result replayed: (none: the replay stopped at the divergence)")
        raise ShadowReplayError("\n".join(lines), docs="docs/testing.md#shadow-replay", run_id=run_id,
                                divergence=kernel.divergence,
                                recorded=load_value(recorded), replayed=load_value(replayed))

    def close(self) -> None:
        """Release the engine's worker threads (the pytest fixture does this after each test)."""
        self.engine.executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> TestEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------
    def _listener(self, user: StepListener | None) -> StepListener:
        """Count executions per run and path (each `running` event is one), then pass the event on."""

        def listen(event: StepEvent) -> None:
            if event.status == "running":
                counts = self._executions.setdefault(event.run_id, {})
                counts[event.path] = counts.get(event.path, 0) + 1
                self._live.setdefault(event.run_id, {})[event.path] = (event.label, event.attempt)
            if user is not None:
                user(event)

        return listen

    async def _drive(self, workflow: Workflow, start: Callable[[Callable[[str], None]], Awaitable[Any]],
                     advisories: str | None) -> TestRunResult:
        found: list[str] = []

        def on_run(run_id: str) -> None:
            found.append(run_id)
            self._workflows[run_id] = workflow
            self._advisories[run_id] = advisories

        status: RunStatus
        value: Any = None
        error: BaseException | None = None
        try:
            value = await start(on_run)
            status = "completed"
        except Crash:
            if not found:
                raise
            status = "crashed"
        except RunParkedError as parked:
            status = parked.status  # type: ignore[assignment]
        except Exception as exc:
            if not found:
                raise
            status, error = "failed", exc
        run_id = found[-1]
        if status == "completed" and self.shadow:
            await self.verify(run_id)
        return await self._result(run_id, status, value, error)

    def _history(self, run_id: str) -> History:
        log = self.storage.read(run_id)
        if log is None:
            raise RunNotFoundError(f"no run {run_id!r} in this TestEngine's storage", run_id=run_id)
        return History(log.records, log.where)

    async def _result(self, run_id: str, status: RunStatus, value: Any, error: BaseException | None) -> TestRunResult:
        state = await self.engine.inspect(run_id)
        counts = self._executions.get(run_id, {})
        steps = [TestStep(s.path, s.label, s.status, counts.get(s.path, 0), s.attempts, s.output,
                          load_error(s.error) if s.error else None, s.stashed, s.compensation)
                 for s in state.steps]
        recorded = {s.path for s in steps}
        history = self._history(run_id)
        for path, (label, attempt) in self._live.get(run_id, {}).items():
            if path in recorded:
                continue
            stash = history.stashes.get(".".join(map(str, path)))
            steps.append(TestStep(path, label, "interrupted", counts.get(path, 0), attempt,
                                  stashed=load_value(stash.value) if stash else None))
        steps.sort(key=lambda s: s.path)
        return TestRunResult(run_id=run_id, status=status, result=value, error=error,
                             advisories=[Advisory.from_dict(a) for a in state.advisories], steps=steps)


class SyncTestEngine:
    """`TestEngine.sync`: the same calls for plain `def` tests, each run to its end with `asyncio.run`."""

    __test__ = False

    def __init__(self, engine: TestEngine) -> None:
        self._engine = engine

    @property
    def clock(self) -> FakeClock:
        """The test engine's fake clock."""
        return self._engine.clock

    def run(self, wf: Any, input: Any = None, *, key: str | None = None, crash_after: Selector | None = None,
            crash_in_step: Selector | None = None, budget: dict[str, float] | None = None,
            advisories: str | None = None, on_step: StepListener | None = None) -> TestRunResult:
        """`TestEngine.run` from synchronous code."""
        return _block(self._engine.run(wf, input, key=key, crash_after=crash_after, crash_in_step=crash_in_step,
                                       budget=budget, advisories=advisories, on_step=on_step))

    def resume(self, run_id: str, *, on_step: StepListener | None = None, crash_after: Selector | None = None,
               crash_in_step: Selector | None = None) -> TestRunResult:
        """`TestEngine.resume` from synchronous code."""
        return _block(self._engine.resume(run_id, on_step=on_step, crash_after=crash_after,
                                          crash_in_step=crash_in_step))

    def signal(self, run_id: str, name: str, payload: Any = None) -> None:
        """`TestEngine.signal` from synchronous code."""
        _block(self._engine.signal(run_id, name, payload))

    def inspect(self, run_id: str) -> RunState:
        """`TestEngine.inspect` from synchronous code."""
        return _block(self._engine.inspect(run_id))

    def verify(self, run_id: str) -> None:
        """`TestEngine.verify` from synchronous code."""
        _block(self._engine.verify(run_id))


def _block(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to its end; refuse inside a running event loop, where it would deadlock."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise ValidationError("TestEngine.sync was called inside a running event loop",
                          hint="In async code, await the TestEngine's own run()/resume().",
                          docs="docs/testing.md")
