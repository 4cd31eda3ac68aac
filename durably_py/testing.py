"""Test workflows fast and exactly: memory storage, a fake clock, crash injection, shadow replay, and
replaying recorded histories against new code.

`TestEngine` runs workflows through the real engine and kernel, over `MemoryStorage` and a
`FakeClock` (retry backoffs and `ctx.now()` use virtual time, so an hour of backoff takes
milliseconds). `crash_after=` / `crash_in_step=` stop a run exactly as a killed process would,
`resume()` continues it, and every completed run is replayed once more against its own log
(shadow replay): a step path that moved or a step that ran again fails the test with
`ShadowReplayError`. `engine.sync` offers the same calls for plain, non-async tests.

`TestEngine.replay(history, workflow)` (and `assert_replays`) replays a history exported with
`durably export` against the current code without running any step the history answers, and
raises `ReplayDivergenceError` at the first path where the code calls another step than the one
recorded. `replay_check` does the same for the runs of a store (`durably replay-check`).

All of it watches the kernel through one hook, `kernel.Observer`: production kernels have none.
`Crash` is the simulated process death itself: raising it from a step or a compensation stops
the run right there, exactly like crash injection does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from . import records
from ._authoring.calls import RunHandle
from ._authoring.context import AttemptContext, WorkflowContext
from ._authoring.workflow import Workflow, as_workflow
from ._clock import FakeClock
from ._codec import encode, load_error, load_value
from ._engine.awakeables import AwakeableResolution
from ._engine.engine import Engine
from ._engine.forks import UNSET
from ._events import StepEvent
from ._replay.kernel import Crash, Observer, Parked, RunKernel, Selector, observing, selects
from ._state.advisories import Advisory, AdvisoryTracker
from ._state.history import History, RunState, path_tuple
from ._worker.schedules import Schedule, fire_due
from .errors import (
    CorruptLogError,
    DurablyError,
    PurityError,
    ReplayDivergenceError,
    RunNotFoundError,
    RunParkedError,
    StaleRunError,
    StepFailedError,
    ValidationError,
)
from .storage import MemoryStorage, Storage
from .storage.base import parse_log

__all__ = ["Crash", "ReplayDivergenceError", "ReplayReport", "ShadowReplayError", "SyncTestEngine", "TestEngine",
           "TestRunResult", "TestStep", "assert_replays", "inject_crash", "load_history", "replay_check"]

RunStatus = Literal["completed", "failed", "crashed", "waiting", "sleeping", "paused", "needs_attention",
                    "over_budget"]
StepListener = Callable[[StepEvent], Any]
HistorySource = str | os.PathLike[str] | bytes
UNFINISHED = ("pending", "running", "interrupted", "needs_attention", "over_budget", "waiting", "sleeping", "paused", "stale",
              "corrupt")


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


# ---- crash injection ----------------------------------------------------------------------------

class _CrashInjection:
    """Stops the first run it sees, after (or inside) the step a selector names, as a killed process would."""

    def __init__(self, after: Selector | None, in_step: Selector | None) -> None:
        self.after = after
        self.in_step = in_step
        self.run_id: str | None = None
        self.seen: dict[str, int] = {}
        self.nth: dict[str, int] = {}

    def attach(self, kernel: RunKernel) -> Observer | None:
        if self.run_id is None:
            self.run_id = kernel.run_id
        return self if kernel.run_id == self.run_id else None

    def unrecorded(self, kernel: RunKernel, path: str, kind: str, label: str) -> None:
        if kind == "step":
            self.nth[path] = self.seen[label] = self.seen.get(label, 0) + 1

    def step_ran(self, kernel: RunKernel, path: str, label: str, recorded: bool) -> None:
        selector = self.after if recorded else self.in_step
        if selector is not None and selects(selector, path, label, self.nth.get(path, 0)):
            kernel.dead = True
            raise Crash()


@contextlib.contextmanager
def inject_crash(*, after: Selector | None = None, in_step: Selector | None = None) -> Iterator[None]:
    """Within the block, the first run an engine starts or resumes dies like a killed process: right after the
    step `after` names was recorded, or inside the step `in_step` names once its function returned (its
    result unrecorded). A selector is a label, `(label, nth)` (the nth execution of that label, from 1) or a
    path tuple. The engine's `run` then raises `Crash`; resume the run to continue it.

        with inject_crash(after="reserve"):
            asyncio.run(engine.run(place_order, order))   # raises Crash
    """
    if after is None and in_step is None:
        yield
        return
    token = observing.set(_CrashInjection(after, in_step).attach)
    try:
        yield
    finally:
        observing.reset(token)


# ---- replaying recorded histories -----------------------------------------------------------------

@dataclass(frozen=True)
class ReplayReport:
    """How a recorded history replayed against the current code.

    `ok` is False at a divergence (at `path` the history recorded step `recorded` and the code now calls
    `called`; `message` says it in full) or when the history is `damaged` (`message` names file and line).
    `frontier` is the path where the code went past the end of the history (None when the replay reached
    the recorded end); `recorded_steps` counts the results the history holds; `status` is the recorded
    run's status when it was exported; `result` is what the code returned when the replay completed."""

    run_id: str
    workflow: str
    status: str
    ok: bool
    recorded_steps: int
    frontier: tuple[int, ...] | None = None
    frontier_label: str | None = None
    path: tuple[int, ...] | None = None
    recorded: str | None = None
    called: str | None = None
    message: str = ""
    damaged: bool = False
    result: Any = None
    recorded_result: Any = None

    def line(self) -> str:
        """One line for a report: `ok ...` or `diverged at path P: recorded X, now Y`."""
        if self.damaged:
            return f"{self.run_id}: damaged: {self.message}"
        if not self.ok:
            if self.path is not None and self.recorded is not None:
                return (f"{self.run_id}: diverged at path {self.path}: recorded {self.recorded!r}, "
                        f"now {self.called!r}")
            return f"{self.run_id}: diverged: {self.message}"
        where = f"stopped at the recorded frontier, path {self.frontier} ({self.frontier_label})" \
            if self.frontier is not None else "replayed to the recorded end"
        return f"{self.run_id}: ok ({self.recorded_steps} recorded results; {where})"

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (`durably replay-check --json`)."""
        return {"run_id": self.run_id, "workflow": self.workflow, "status": self.status,
                "result": "ok" if self.ok else "damaged" if self.damaged else "diverged",
                "recorded_steps": self.recorded_steps,
                "frontier": list(self.frontier) if self.frontier is not None else None,
                "frontier_label": self.frontier_label,
                "path": list(self.path) if self.path is not None else None,
                "recorded": self.recorded, "called": self.called, "message": self.message}


class _Replay:
    """The observer of a replay: the first unrecorded work stops the run there (a divergence when `strict`)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.stopped_at: tuple[str, str, str] | None = None  # (path, kind, label)

    def unrecorded(self, kernel: RunKernel, path: str, kind: str, label: str) -> None:
        if self.stopped_at is None:
            self.stopped_at = (path, kind, label)
        kernel.dead = True
        raise Crash()

    def step_ran(self, kernel: RunKernel, path: str, label: str, recorded: bool) -> None:
        """Never called: a replay stops before any step body runs."""


class _ReplayServices:
    """What a replayed kernel asks of an engine: children are answered from the history, never started."""

    def __init__(self, engine: Engine) -> None:
        self.concurrency = engine.concurrency
        self.gates = engine.gates
        self.placement = engine.placement
        self._engine = engine

    def create_child(self, parent: str, path: str, workflow: Workflow, input: Any, detached: bool, *,
                     queued: bool = True) -> str:
        raise Crash()  # unreachable: the observer stops an unrecorded spawn first

    def create_children(self, parent: str, children: list[tuple[str, Workflow, Any]], detached: bool, *,
                        queued: bool = True) -> list[str]:
        raise Crash()  # unreachable: the observer stops an unrecorded spawn first

    def start_child(self, run_id: str, workflow: Workflow | None, *, rerun_failed: bool = False) -> asyncio.Future[Any]:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)  # a parent reads its children's results from its own join records
        return done

    def start_children(self, handles: list[RunHandle], *, rerun_failed: bool,
                       on_start: Callable[[str, asyncio.Future[Any]], None]) -> None:
        return None  # a parent reads its children's results from its own join records

    def parked_in_join(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._engine.parked_in_join()

    def ended_child(self, run_id: str, workflow: Workflow | None) -> asyncio.Future[Any] | None:
        return None  # a replay never parks: it is not served by a worker

    def queued_child(self, run_id: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        """Anything else a replayed workflow asks of `ctx.engine` (inspect, list, ...) the real engine answers."""
        return getattr(self._engine, name)


def _without_holds(typed: list[records.Record]) -> list[records.Record]:
    """The records replay reads: pause/resume requests only hold a live run, and a replay never holds."""
    return [r for r in typed if not isinstance(r, records.Pause | records.Resume)]


async def _replay(engine: Engine, typed: list[records.Record], where: str, workflow: Workflow, *,
                  strict: bool) -> tuple[ReplayReport, records.End | None]:
    """Replay validated records against `workflow` in a scratch store, running no step; report the outcome
    and the end record the replay wrote (None when it stopped before the end)."""
    history = History(_without_holds(typed), where)
    recorded_end = history.end
    report = await _replay_history(engine, history, History(typed, where).paused, where, workflow, strict=strict)
    return report, history.end if history.end is not recorded_end else None


async def _replay_history(engine: Engine, history: History, paused: bool, where: str, workflow: Workflow, *,
                          strict: bool) -> ReplayReport:
    header = history.header
    run_id = header.run_id
    recorded_status = history.end.status if history.end is not None else \
        ("paused" if paused else (history.parked() or "interrupted"))
    if header.workflow != workflow.name:
        raise ValidationError(f"{where} is a history of workflow {header.workflow!r}, not {workflow.name!r}",
                              hint=f"Replay it against the workflow named {header.workflow!r}.",
                              docs="docs/testing.md#replaying-recorded-histories", run_id=run_id)
    scratch = MemoryStorage()
    scratch.create(run_id, records.encode(header))
    lease = scratch.claim(run_id, "replay", 3600.0)
    assert lease is not None
    tracker = AdvisoryTracker(run_id, now=engine.clock.now, silent=True,
                              restored=[Advisory.from_dict(a) for a in history.advisories.values()])
    kernel = RunKernel(engine=_ReplayServices(engine), storage=scratch, lease=lease, history=history,
                       workflow=workflow, attempt_cls=AttemptContext, input=None, clock=engine.clock,
                       executor=engine.executor, checkpoint_every=None, on_step=None, advisories=tracker, wait=False)
    observer = _Replay(strict)
    kernel.observer = observer
    recorded_done = len(history.done)
    recorded_end = history.end
    value = load_value(header.input)
    kernel.input = workflow.input_schema.convert(value, "input") if workflow.input_schema else value
    base: dict[str, Any] = {"run_id": run_id, "workflow": workflow.name, "status": recorded_status,
            "recorded_result": load_value(recorded_end.result) if recorded_end is not None else None}
    try:
        result = await kernel.run(WorkflowContext(kernel))
    except Crash:
        assert observer.stopped_at is not None
        path, kind, label = observer.stopped_at
        what = f"step {label!r}" if kind == "step" else label if kind != "compensation" else \
            f"the compensation of step {label!r}"
        if strict:
            return ReplayReport(**base, ok=False, recorded_steps=recorded_done, path=path_tuple(path),
                                message=f"{what} at path {path_tuple(path)} ran again: the recorded run has "
                                        "nothing there")
        return ReplayReport(**base, ok=True, recorded_steps=recorded_done, frontier=path_tuple(path),
                            frontier_label=label)
    except (PurityError, StaleRunError) as exc:
        where_at: Any = getattr(exc, "path", None)
        return ReplayReport(**base, ok=False, recorded_steps=recorded_done,
                            path=tuple(where_at) if where_at is not None else None, recorded=getattr(exc, "recorded", None),
                            called=getattr(exc, "called", None), message=str(exc))
    except Parked as parked:
        return ReplayReport(**base, ok=True, recorded_steps=recorded_done,
                            frontier=path_tuple(parked.path) if parked.path is not None else None,
                            frontier_label=parked.label or parked.status, message=f"the replay parked: {parked.detail}")
    except Exception as exc:  # noqa: BLE001 - the replayed workflow's own error is compared with the record
        now = exc.type_name if isinstance(exc, StepFailedError) else f"{type(exc).__module__}:{type(exc).__qualname__}"
        if recorded_end is not None and recorded_end.status in ("failed", "cancelled") and recorded_end.error \
                and recorded_end.error.get("type") == now:
            return ReplayReport(**base, ok=True, recorded_steps=recorded_done)
        return ReplayReport(**base, ok=False, recorded_steps=recorded_done,
                            message=f"the replayed workflow raised {type(exc).__name__}: {exc}")
    return ReplayReport(**base, ok=True, recorded_steps=recorded_done, result=result)


class TestEngine:
    """The real engine over memory storage and a fake clock, with crash injection, shadow replay and replay
    of recorded histories."""

    __test__ = False

    def __init__(self, *, clock: FakeClock | None = None, shadow: bool = True, storage: Storage | None = None) -> None:
        self.clock: FakeClock = clock if clock is not None else FakeClock()
        self.storage: Storage = storage if storage is not None else MemoryStorage(
            clock=lambda: self.clock.now().timestamp())
        self.engine = Engine(self.storage, clock=self.clock)
        self.shadow = shadow
        self.sync = SyncTestEngine(self)
        self._workflows: dict[str, Workflow] = {}
        self._advisories: dict[str, str | None] = {}
        self._executions: dict[str, dict[tuple[int, ...], int]] = {}
        self._live: dict[str, dict[tuple[int, ...], tuple[str, int]]] = {}
        self._firing = False
        self.clock.on_advance = self._fire_timers

    async def run(self, wf: Any, input: Any = None, *, key: str | None = None, crash_after: Selector | None = None,
                  crash_in_step: Selector | None = None, budget: dict[str, float] | None = None,
                  advisories: str | None = None, on_step: StepListener | None = None) -> TestRunResult:
        """Run a workflow under the engine's identity and resume rules; report how it ended instead of raising."""
        workflow = as_workflow(wf)

        async def start(found: Callable[[str], None]) -> Any:
            with inject_crash(after=crash_after, in_step=crash_in_step):
                return await self.engine.run(workflow, input, key=key, budget=budget, advisories=advisories,
                                             on_step=self._listener(on_step), on_run=found, wait=False)

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

        async def start(found: Callable[[str], None]) -> Any:
            with inject_crash(after=crash_after, in_step=crash_in_step):
                return await self.engine.run(workflow, run_id=run_id, advisories=advisories,
                                             on_step=self._listener(on_step), on_run=found, wait=False)

        return await self._drive(workflow, start, advisories)

    async def fork(self, run_id: str, *, from_step: Selector, set_output: Any = UNSET,
                   on_step: StepListener | None = None) -> TestRunResult:
        """Fork a run of this engine's storage from a completed step (`Engine.fork`: its history up to that step
        copied, its output replaced by `set_output` when given) and run the fork until it ends or parks; report
        how it ended, with each step's executions counted for the fork alone."""
        workflow = self._workflows.get(run_id) or self.engine.workflow_for(run_id)
        advisories = self._advisories.get(run_id)

        async def start(found: Callable[[str], None]) -> Any:
            return await self.engine.fork(run_id, from_step=from_step, set_output=set_output,
                                          on_step=self._listener(on_step), on_run=found, wait=False)

        return await self._drive(workflow, start, advisories)

    async def signal(self, run_id: str, name: str, payload: Any = None) -> None:
        """Send signal `name` to a run; the next `resume` hands `payload` to its `ctx.wait_for(name)`."""
        await self.engine.signal(run_id, name, payload)

    async def resolve_awakeable(self, awakeable: str, value: Any = None, *,
                                token: str | None = None) -> AwakeableResolution:
        """Resolve an awakeable (`Engine.resolve_awakeable`); the next `resume` of its run hands `value` to its
        ``await``. Its deadline is on the fake clock."""
        return await self.engine.resolve_awakeable(awakeable, value, token=token)

    async def reject_awakeable(self, awakeable: str, error: str) -> AwakeableResolution:
        """Reject an awakeable (`Engine.reject_awakeable`): the next `resume` raises `AwakeableRejectedError`."""
        return await self.engine.reject_awakeable(awakeable, error)

    async def raise_budget(self, run_id: str, **amounts: Any) -> TestRunResult:
        """Raise the budget of a run parked over it (`Engine.raise_budget`: `usd=`, `tokens=`, `units=`, `to=`)
        and continue it until it ends or parks again."""
        await self.engine.raise_budget(run_id, **amounts)
        return await self._continue(run_id)

    def schedule(self, wf: Any, cron: str, *, input: Any = None, name: str | None = None) -> Schedule:
        """Start `wf(input)` on every tick of `cron` (UTC) that `fire_schedules` finds due (`Engine.schedule`)."""
        return self.engine.schedule(wf, cron, input=input, name=name)

    async def fire_schedules(self) -> list[TestRunResult]:
        """What a worker's loop does once on the fake clock's time: start the latest due tick of every schedule
        this engine serves (its own and `durably_py.schedule` ones) that has not started yet, and run each
        started run until it ends or parks; one result per run, in schedule order."""
        results = []
        for run_id in await fire_due(self.engine, self.clock.now()):
            results.append(await self._continue(run_id))
        return results

    async def inspect(self, run_id: str) -> RunState:
        """The run's state as `durably inspect` shows it."""
        return await self.engine.inspect(run_id)

    async def verify(self, run_id: str) -> None:
        """Shadow-replay a completed run against its log; raise `ShadowReplayError` if anything differs."""
        workflow = self._workflows.get(run_id)
        if workflow is None:
            raise RunNotFoundError(f"no run {run_id!r} was started by this TestEngine", run_id=run_id)
        log = self.storage.read(run_id)
        if log is None:
            raise RunNotFoundError(f"no run {run_id!r} in this TestEngine's storage", run_id=run_id)
        typed = records.load(log.records, log.where)
        end = self._history(run_id).end
        report, replayed_end = await _replay(self.engine, typed, f"run {run_id}", workflow, strict=True)
        divergence = None if report.ok else report.message
        if divergence is None and replayed_end is None:
            divergence = f"the replay ended {report.frontier_label or 'early'}: {report.message}"
        recorded = end.result if end is not None else None
        replayed = replayed_end.result if replayed_end is not None else None
        if divergence is None and encode(recorded) == encode(replayed):
            return
        lines = [f"shadow replay of run {run_id} (workflow {workflow.name!r}) did not reproduce the recorded run"]
        if divergence is not None:
            lines.append(f"  first divergence: {divergence}")
        lines.append(f"  result recorded: {load_value(recorded)!r}")
        lines.append(f"  result replayed: {load_value(replayed)!r}" if divergence is None
                     else "  result replayed: (none: the replay stopped at the divergence)")
        raise ShadowReplayError("\n".join(lines), docs="docs/testing.md#shadow-replay", run_id=run_id,
                                divergence=divergence, recorded=load_value(recorded), replayed=load_value(replayed))

    async def replay(self, history: HistorySource, wf: Any) -> ReplayReport:
        """Replay a recorded history (an exported file's path, or its bytes) against the workflow's current code.

        No step the history answers runs. The first path where the code calls another step (or ctx call)
        than the one recorded raises `ReplayDivergenceError` naming the path, the recorded label and the one
        now called; a history that does not decode raises `CorruptLogError` naming file and line. Code that
        goes past the end of the history stops there and passes (new code may legitimately do more): the
        report's `frontier` says where."""
        workflow = as_workflow(wf)
        typed, where = load_history(history)
        report, _ = await _replay(self.engine, typed, where, workflow, strict=False)
        if not report.ok:
            raise _divergence(report, where)
        return report

    def close(self) -> None:
        """Release the engine's worker threads (the pytest fixture does this after each test) and its clock."""
        self.engine.executor.shutdown(wait=False, cancel_futures=True)
        if self.clock.on_advance == self._fire_timers:
            self.clock.on_advance = None

    def __enter__(self) -> TestEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------
    async def _continue(self, run_id: str) -> TestRunResult:
        """Run an existing run of this engine's storage until it ends or parks (as a worker would)."""
        workflow = self._workflows.get(run_id) or self.engine.workflow_for(run_id)
        advisories = self._advisories.get(run_id)

        async def start(found: Callable[[str], None]) -> Any:
            return await self.engine.run(workflow, run_id=run_id, advisories=advisories,
                                         on_step=self._listener(None), on_run=found, wait=False)

        return await self._drive(workflow, start, advisories)

    def _fire_timers(self, until: datetime) -> None:
        """`clock.advance()` on this engine's clock: every sleep, wait deadline and parked retry of a parked run
        due by `until` fires at its own instant, earliest first, the run continuing until it parks again or
        ends; so a loop of 30-day sleeps goes through three of them in `advance(90 days)`. Inside a running
        event loop the timers fire on a loop of their own in a helper thread, while the caller's loop waits."""
        if self._firing:
            return
        self._firing = True
        try:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                asyncio.run(self._timers(until))
                return
            with ThreadPoolExecutor(1, thread_name_prefix="durably-test-clock") as pool:
                pool.submit(asyncio.run, self._timers(until)).result()
        finally:
            self._firing = False

    async def _timers(self, until: datetime) -> None:
        fired: set[tuple[str, float]] = set()
        while True:
            due = [(at, run_id) for run_id, at in self._parked_timers() if at <= until.timestamp()
                   and (run_id, at) not in fired]
            if not due:
                return
            at, run_id = min(due)
            fired.add((run_id, at))
            self.clock.reach(datetime.fromtimestamp(at, UTC))
            await self._continue(run_id)

    def _parked_timers(self) -> list[tuple[str, float]]:
        """Each sleeping or waiting run (no process holds it) and the instant its next timer is due."""
        out = []
        for info in self.storage.list_runs(state="open"):
            if info.held:
                continue
            entry = self.storage.entry(info.run_id)  # where the run parked: due at its earliest timer
            log = self.storage.read(info.run_id)
            if entry is None or entry.at is None or log is None:
                continue
            history = History(log.records, log.where)
            if history.end is None and not history.paused and history.parked() is not None:
                out.append((info.run_id, entry.at))
        return out

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

    def fork(self, run_id: str, *, from_step: Selector, set_output: Any = UNSET,
             on_step: StepListener | None = None) -> TestRunResult:
        """`TestEngine.fork` from synchronous code."""
        return _block(self._engine.fork(run_id, from_step=from_step, set_output=set_output, on_step=on_step))

    def signal(self, run_id: str, name: str, payload: Any = None) -> None:
        """`TestEngine.signal` from synchronous code."""
        _block(self._engine.signal(run_id, name, payload))

    def resolve_awakeable(self, awakeable: str, value: Any = None, *,
                          token: str | None = None) -> AwakeableResolution:
        """`TestEngine.resolve_awakeable` from synchronous code."""
        return _block(self._engine.resolve_awakeable(awakeable, value, token=token))

    def reject_awakeable(self, awakeable: str, error: str) -> AwakeableResolution:
        """`TestEngine.reject_awakeable` from synchronous code."""
        return _block(self._engine.reject_awakeable(awakeable, error))

    def schedule(self, wf: Any, cron: str, *, input: Any = None, name: str | None = None) -> Schedule:
        """`TestEngine.schedule`."""
        return self._engine.schedule(wf, cron, input=input, name=name)

    def fire_schedules(self) -> list[TestRunResult]:
        """`TestEngine.fire_schedules` from synchronous code."""
        return _block(self._engine.fire_schedules())

    def raise_budget(self, run_id: str, **amounts: Any) -> TestRunResult:
        """`TestEngine.raise_budget`, run to its end."""
        return _block(self._engine.raise_budget(run_id, **amounts))

    def inspect(self, run_id: str) -> RunState:
        """`TestEngine.inspect` from synchronous code."""
        return _block(self._engine.inspect(run_id))

    def verify(self, run_id: str) -> None:
        """`TestEngine.verify` from synchronous code."""
        _block(self._engine.verify(run_id))

    def replay(self, history: HistorySource, wf: Any) -> ReplayReport:
        """`TestEngine.replay` from synchronous code."""
        return _block(self._engine.replay(history, wf))


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


# ---- recorded histories: loading, asserting, checking a store ---------------------------------------

def load_history(source: HistorySource) -> tuple[list[records.Record], str]:
    """The validated records of an exported history (a file path, or its bytes) and where they came from.

    A history that does not decode is a `CorruptLogError` naming the file, the line and the field; a
    history cut short (a last line without its newline that is not a whole record) is one too."""
    if isinstance(source, bytes | bytearray):
        data, where = bytes(source), "history"
    else:
        where = os.fspath(source)
        try:
            data = Path(where).read_bytes()
        except OSError as exc:
            raise ValidationError(f"cannot read history {where}: {exc.strerror or exc}",
                                  hint="Pass the file `durably export RUN > run.jsonl` wrote.",
                                  docs="docs/testing.md#replaying-recorded-histories") from None
    if data and not data.endswith(b"\n"):
        data += b"\n"
    lines, good, torn = parse_log(data, where)
    if torn is not None:
        line = data.count(b"\n", 0, good) + 1
        raise CorruptLogError(f"{where}, line {line}: the line is not a JSON object; {torn}",
                              hint="Export the run again with `durably export RUN > FILE`.",
                              path=where, line=line, field=None)
    return records.load(lines, where), where


def _divergence(report: ReplayReport, where: str) -> ReplayDivergenceError:
    if report.path is not None and report.recorded is not None:
        head = (f"{where} (run {report.run_id}) diverged at path {report.path}: recorded {report.recorded!r}, "
                f"now {report.called!r}")
    else:
        head = f"{where} (run {report.run_id}) diverged"
    return ReplayDivergenceError(f"{head}\n  {report.message}", run_id=report.run_id, path=report.path,
                                 recorded=report.recorded, called=report.called, report=report)


def assert_replays(history: HistorySource, wf: Any) -> ReplayReport:
    """Replay an exported history against `wf` in a fresh `TestEngine`; raise `ReplayDivergenceError` (an
    `AssertionError`) at the first divergence, else return the report. For plain (non-async) tests."""
    with TestEngine() as engine:
        return engine.sync.replay(history, wf)


async def replay_check(engine: Engine, wf: Any, *, status: str | Iterable[str] | None = None) -> list[ReplayReport]:
    """Replay every run of workflow `wf` in `engine`'s store whose status is one of `status` (default: the
    unfinished ones, and damaged logs) against `wf`'s current code; one report per run, nothing written.

    `durably replay-check` is this function with a report line per run."""
    workflow = as_workflow(wf)
    statuses = UNFINISHED if status is None else (status,) if isinstance(status, str) else tuple(status)
    reports = []
    for state in await engine.list(status=statuses, workflow=workflow.name):
        try:
            typed, where = load_history(await engine.export(state.run_id))
            report, _ = await _replay(engine, typed, f"run {state.run_id}", workflow, strict=False)
        except DurablyError as exc:
            report = ReplayReport(run_id=state.run_id, workflow=workflow.name, status=state.status, ok=False,
                                  recorded_steps=0, message=f"{type(exc).__name__}: {exc}", damaged=True)
        reports.append(report)
    return reports
