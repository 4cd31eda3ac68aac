"""A run's child runs (`Children`): spawns, joins, `join_all`, task graphs, the children it keeps attached (cancelled
with it, awaited before it ends), and the parking of a run a worker serves on the children it waits for."""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from .. import records
from .._authoring import graphs
from .._authoring.calls import RunHandle, check_handle, spawn_pairs
from .._authoring.handles import Handle
from .._authoring.paths import Scope
from .._authoring.result import Err, Ok
from .._authoring.workflow import Workflow, as_workflow
from .._codec import dump_error, dump_value, load_error, load_value
from .._state.history import path_tuple
from ..errors import DependencyFailedError, PurityError, StaleRunError, ValidationError
from .control import Control
from .log import RunLog
from .ports import EngineServices, Spawned
from .stops import Crash, Parked, Rest
from .tasks import current_task, internal
from .turns import Turns
from .upgrade import UpgradeGuard

if TYPE_CHECKING:
    from .._authoring.graphs import Task
    from .ports import Hooks

SPAWN_BATCH = 1024  # a spawn_all creates and records its children this many at a time
CHILDREN_PRUNE = 64  # settled child outcomes are dropped from `Children.children` once it holds this many
JOIN_AHEAD = 1024  # a join_all asks for the outcomes of this many children ahead of the one it records next
PARK_LISTS = 100  # a join's park record names at most this many of the children it waits for (and counts all)


class Busy(Protocol):
    """What of the run's steps decides whether it may park at its end (`steps.Steps`)."""

    @property
    def running(self) -> Mapping[Any, Any]: ...

    @property
    def branches(self) -> int: ...


class Calls(Protocol):
    """What the kernel lends its child runs: path allocation, handles, replay checks, fan-out."""

    def scope(self) -> Scope: ...

    def op(self, scope: Scope, path: str, label: str, body: Callable[..., Awaitable[Any]], *args: Any) -> Handle: ...

    def composite(self, scope: Scope, path: str, label: str, body: Callable[..., Awaitable[Any]],
                  *args: Any) -> Handle: ...

    def replay_next(self, label: str) -> tuple[str, Scope, Handle | None]: ...

    def check_label(self, path: str, rec: records.Ok | records.Err, label: str) -> None: ...

    def replay_failed(self, error: PurityError | StaleRunError) -> PurityError | StaleRunError: ...

    def branch_out(self, prefix: str | None, items: list[Any], concurrency: int | None) -> Awaitable[list[Any]]: ...

    def emit(self, path: str, label: str, status: str, attempt: int, ms: float | None = None) -> None: ...


class Children:
    """The child runs of one execution of a run, and what it keeps of them."""

    def __init__(self, *, engine: EngineServices, log: RunLog, control: Control, turns: Turns, busy: Busy,
                 calls: Calls, code_changed: bool, guard: UpgradeGuard, emits: bool) -> None:
        self.engine = engine
        self.log = log
        self.history = log.history
        self.done = log.history.done
        self.run_id = log.run_id
        self.control = control
        self.turns = turns
        self.flight = busy
        self.code_changed = code_changed
        self.guard = guard  # a child is not started on changed code before the replay is over
        self.emits = emits  # an `on_step` listener hears replayed joins
        self.scope = calls.scope
        self.op = calls.op
        self.composite = calls.composite
        self.replay_next = calls.replay_next
        self.check_label = calls.check_label
        self.replay_failed = calls.replay_failed
        self.branch_out = calls.branch_out
        self.emit = calls.emit
        self.hooks: Hooks | None = None
        self.children: list[asyncio.Future[Any] | Spawned] = []  # attached children (`attach`), pruned as they settle
        self.children_limit = CHILDREN_PRUNE
        self.retrying = False
        self.resumed: set[str] = set()  # failed children this retry has resumed already (never twice in one retry)
        self.joining = 0
        self.join_watch: asyncio.Task[None] | None = None
        self.interrupted_by: asyncio.Future[None] | None = None
        self.parks = False  # served by a worker: children are queued runs; joins and long backoffs park the run
        self.attached: dict[str, None] = {}  # unjoined attached children while `parks` (the end waits for them)

    def cancel_all(self) -> None:
        """Cancel every attached child (the run is cancelled)."""
        for outcome in list(self.children):
            outcome.cancel()

    def spawn(self, wf: Any, input: Any, detached: bool) -> Handle:
        """Allocate the spawn's path now; the child gets its own durable run, started in this process."""
        workflow = as_workflow(wf)
        scope = self.scope()
        path = scope.alloc()
        return self.op(scope, path, "ctx.spawn", self._spawn, path, workflow, input, detached)

    def spawn_all(self, definitions: list[Any], detached: bool) -> Handle:
        """Spawn one child per `(workflow, input)` pair, under one path."""
        pairs = spawn_pairs(definitions)
        scope = self.scope()
        prefix = scope.alloc()
        if len(pairs) > self.engine.concurrency:
            self.log.advise("CONCURRENCY_CAPPED", len(pairs) - self.engine.concurrency,
                            f"ctx.spawn_all of {len(pairs)} children; the engine runs {self.engine.concurrency} at once",
                            children=len(pairs), concurrency=self.engine.concurrency)
        return self.op(scope, prefix, "ctx.spawn_all", self._spawn_all, prefix, pairs, detached)

    async def _spawn_all(self, h: Handle, prefix: str, pairs: list[tuple[Workflow, Any]], detached: bool) -> Any:
        """Create the children not recorded yet in batches of `SPAWN_BATCH` (one durable write for each), record
        each batch's spawns as soon as it is created (one append for the batch), and make the records durable
        once: a crash leaves the children created before the records, and a resumed parent finds each one
        created but not recorded through its identity. Nothing per child is kept but its run id (in its
        handle): spawn records are not kept in memory, and only one batch's paths and inputs are in hand at a time.
        The whole spawn reaches the workflow in the turn of its last record."""
        run_ids: list[str] = []
        written = 0
        forget = self.history.forget
        take = self.turns.take
        last = f"{prefix}.{len(pairs) - 1}"
        for first in range(0, len(pairs), SPAWN_BATCH):
            missing: list[tuple[str, Workflow, Any]] = []
            for i in range(first, min(first + SPAWN_BATCH, len(pairs))):
                path = f"{prefix}.{i}"
                if path in self.done:
                    run_ids.append(self.spawned_id(path))
                    forget(path, prefix)
                    if path != last:
                        take(path)
                else:
                    wf, value = pairs[i]
                    missing.append((path, wf, value))
                    run_ids.append("")
            if not missing:
                continue
            await self.guard.hold()
            if self.hooks is not None:
                for path, _, _ in missing:
                    self.hooks.unrecorded(path, "ctx.spawn", "ctx.spawn")
            created = iter(self.engine.create_children(self.run_id, missing, detached, queued=self.parks))
            spawns: list[records.Record] = []
            ts = time.time()
            for i in range(first, len(run_ids)):
                if not run_ids[i]:
                    run_ids[i] = next(created)
                    spawns.append(records.Ok(attempt=1, path=f"{prefix}.{i}", label="ctx.spawn",
                                             value={"run_id": run_ids[i], "detached": detached}, ms=0, ts=ts))
            if first + SPAWN_BATCH >= len(pairs):
                await self.control.live_turn()
            self.log.write_unkept(spawns, prefix)
            written += len(missing)
        if written:
            self.log.steps_done(written)
        elif pairs:
            await self.recorded_turn(h, last)
        result = self._spawned([RunHandle(run_id, wf) for run_id, (wf, _) in zip(run_ids, pairs, strict=True)],
                               detached)
        return result

    async def _spawn(self, h: Handle, path: str, workflow: Workflow, input: Any, detached: bool) -> RunHandle:
        if path in self.done:
            run_id = self.spawned_id(path)
            await self.recorded_turn(h, path)
        else:
            await self.guard.hold()
            if self.hooks is not None:
                self.hooks.unrecorded(path, "ctx.spawn", "ctx.spawn")
            run_id = self.engine.create_child(self.run_id, path, workflow, input, detached, queued=self.parks)
            await self.control.live_turn()
            self.log.write(records.Ok(attempt=1, path=path, label="ctx.spawn",
                                      value={"run_id": run_id, "detached": detached}, ms=0, ts=time.time()))
            self.log.step_done()
        return self._spawned([RunHandle(run_id, workflow)], detached)[0]

    async def recorded_turn(self, h: Handle, path: str) -> None:
        """Wait for the turn of the recorded outcome at `path` (of `h`'s operation)."""
        turns = self.turns
        if not turns.now(path):
            h.driver = current_task()
            await turns.recorded(path)

    def spawned_id(self, path: str) -> str:
        """The child run the spawn recorded at `path` names."""
        rec = self.done[path]
        self.check_label(path, rec, "ctx.spawn")
        run_id = rec.value.get("run_id") if isinstance(rec, records.Ok) and isinstance(rec.value, dict) else None
        if not isinstance(run_id, str):
            raise self.replay_failed(PurityError(
                f"the record of ctx.spawn at path {path_tuple(path)} names no child run",
                hint="The log was edited; start over with fresh=True.", run_id=self.run_id))
        return run_id

    def _spawned(self, handles: list[RunHandle], detached: bool) -> list[RunHandle]:
        """Hand spawned children to whoever runs them (a worker when this run parks, else this process, where
        they wait in spawn order with nothing of their own: the attached ones' outcomes come to `attach` as
        they start)."""
        if self.parks:
            for child in handles:
                if not detached:
                    self.attached[child.run_id] = None
                self.engine.queued_child(child.run_id)
        else:
            waiting = self.engine.start_children(list(handles), rerun_failed=self.retrying,
                                                  on_start=functools.partial(self.child_started, detached))
            if waiting is not None and not detached and not waiting.done():
                self.attach(waiting)
        return handles

    def child_started(self, detached: bool, run_id: str, outcome: asyncio.Future[Any]) -> None:
        """A spawned child started: an attached one's outcome is kept (`attach`), and in a retry the child is
        not resumed again by a join that comes after it ended."""
        if self.retrying:
            self.resumed.add(run_id)
        if not detached:
            self.attach(outcome)

    def start_child(self, child: RunHandle) -> asyncio.Future[Any]:
        """The outcome of a child this run waits for (a retry resumes a failed child once, however often
        its joins ask for it)."""
        rerun = self.retrying and child.run_id not in self.resumed
        if rerun:
            self.resumed.add(child.run_id)
        return self.engine.start_child(child.run_id, child.workflow, rerun_failed=rerun)

    def attach(self, outcome: asyncio.Future[Any] | Spawned) -> None:
        """Keep an attached child's outcome, or spawned children waiting to start (cancelled with this run,
        awaited before it ends). Outcomes that settled are dropped whenever the list doubles, not by a callback
        on each. A list, not a set: 8 bytes a child where a set's table took about 100 at 20,000 children; an
        outcome attached twice is cancelled or awaited twice, which does nothing more."""
        if len(self.children) >= self.children_limit:
            self.drop_settled()
        self.children.append(outcome)

    def drop_settled(self) -> None:
        """Forget the outcomes of attached children that ended (and the results they hold)."""
        self.children = [c for c in self.children if not c.done()]
        self.children_limit = max(CHILDREN_PRUNE, 2 * len(self.children))

    def join(self, child: RunHandle) -> Handle:
        """Allocate the join's path now; it returns the child's result (or raises its error) once it ends."""
        check_handle(child)
        path, scope, replayed = self.replay_next("ctx.join")
        if replayed is not None:
            self.attached.pop(child.run_id, None)
            return replayed
        return self.op(scope, path, "ctx.join", self._join, path, child)

    async def _join(self, h: Handle, path: str, child: RunHandle) -> Any:
        if self.hooks is not None:
            self.hooks.unrecorded(path, "ctx.join", "ctx.join")
        h.driver = current_task()
        try:
            value = await self.wait_child(child, path)
            wire = dump_value(value, "child result")
        except (Crash, GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as exc:
            if exc is self.control.cancel_error or exc is self.log.lost:
                raise
            await self.control.live_turn()
            self.log.write(records.Err(attempt=1, path=path, label="ctx.join", error=dump_error(exc),
                                       ts=time.time()))
            self.log.step_done()
            raise
        await self.control.live_turn()
        self.log.write(records.Ok(attempt=1, path=path, label="ctx.join", value=wire, ms=0, ts=time.time()))
        self.log.step_done()
        return load_value(wire)

    def park_join(self, path: str, children: list[str]) -> NoReturn:
        """Park the run at its end until `children` end: record on what it waits, and leave its process."""
        self.log.write(records.Park(path=path, children=children[:PARK_LISTS], count=len(children), ts=time.time()))
        self.log.sync()
        raise Parked("waiting", f"waiting for {len(children)} child run{'s' if len(children) != 1 else ''}",
                     tuple(children))

    async def rest_on_children(self, path: str, children: list[str]) -> None:
        """A run a worker serves waits for `children` (queued runs any worker may run): it parks on them when
        the rest of it is quiet; this returns only when it cannot park, for the join to go on in this process."""
        count = len(children)
        rest = Rest("waiting", f"waiting for {count} child run{'s' if count != 1 else ''}", parkable=True,
                    children=tuple(children),
                    record=records.Park(path=path, children=children[:PARK_LISTS], count=count, ts=time.time()),
                    path=path, label="ctx.join")
        rest.fallback = asyncio.get_running_loop().create_future()
        with self.control.resting(rest):
            await rest.fallback

    async def wait_child(self, child: RunHandle, path: str) -> Any:
        """Wait for a child to end, giving back this run's engine slot meanwhile; a cancel or pause request
        for this run is acted on while it waits (one inbox watcher for all of the run's joins). A run a
        worker serves parks instead while the child has not ended (when nothing else of it is busy)."""
        if self.parks:
            ended = self.engine.ended_child(child.run_id, child.workflow)
            if ended is not None:
                self.attached.pop(child.run_id, None)
                return ended.result()
            await self.rest_on_children(path, [child.run_id])
        outcome = self.start_child(child)
        await self.parked_on(outcome)
        return await asyncio.shield(outcome)

    async def parked_on(self, child: asyncio.Future[Any]) -> None:
        """Wait until `child` is done, unless a cancel request (or a lost lease) for this run comes first."""
        self.joining += 1
        if self.join_watch is None or self.join_watch.done():
            self.interrupted_by = asyncio.get_running_loop().create_future()
            self.join_watch = internal(self._watch_joins(self.interrupted_by))
        interrupted = self.interrupted_by
        assert interrupted is not None
        try:
            with self.control.resting(Rest("waiting", "waiting for a child run in this process", parkable=False)):
                async with self.engine.parked_in_join():
                    if not child.done():
                        await asyncio.wait((child, interrupted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.joining -= 1
            if self.joining == 0 and self.join_watch is not None:
                self.join_watch.cancel()
                self.join_watch = None
        if not child.done() and interrupted.done():
            interrupted.result()

    async def _watch_joins(self, interrupted: asyncio.Future[None]) -> None:
        """While any strand waits for a child: act on control requests every `poll` seconds."""
        try:
            while True:
                await asyncio.sleep(self.control.poll)
                if self.log.lost is not None:
                    raise self.log.lost
                self.control.control(force=True)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting join
            if not interrupted.done():
                interrupted.set_exception(exc)
                interrupted.exception()

    async def wait_attached(self) -> None:
        """Before a served run ends: its attached children still running end first (it parks until they do)."""
        running = [c for c in self.attached if self.engine.ended_child(c, None) is None]
        self.attached = {}
        if running and self.can_park():
            self.park_join("", running)
        for child in running:
            outcome = self.engine.start_child(child, None, rerun_failed=False)
            if not outcome.done():
                self.attach(outcome)

    def can_park(self) -> bool:
        """True when parking the whole run now cuts nothing short (its workflow code ended, no step runs)."""
        return not self.flight.running and not self.flight.branches and not self.joining

    async def attached_ended(self) -> None:
        """Wait until every attached child ended: those still waiting to start start first (their outcomes
        come to `children` as they do)."""
        while waiting := [c.wait() for c in self.children if not isinstance(c, asyncio.Future) and not c.done()]:
            await asyncio.wait(waiting)
        await asyncio.gather(*[c for c in self.children if isinstance(c, asyncio.Future) and not c.done()],
                             return_exceptions=True)

    def join_all(self, handles: list[RunHandle]) -> Handle:
        """Join every child concurrently; one `Ok`/`Err` per handle, in order (join ``i`` at ``<path>.i.0``)."""
        handles = list(handles)
        for child in handles:
            if not isinstance(child, RunHandle):
                raise ValidationError(f"ctx.join_all takes the RunHandles that ctx.spawn_all returned, got {child!r}",
                                      hint="results = await ctx.join_all(await ctx.spawn_all([...]))",
                                      docs="docs/authoring.md#child-runs")
        scope = self.scope()
        prefix = scope.alloc()
        return self.op(scope, prefix, "ctx.join_all", self._joined_all, prefix, handles)

    async def _joined_all(self, h: Handle, prefix: str, handles: list[RunHandle]) -> list[Ok[Any] | Err]:
        """One waiter for all the children (no task, coroutine, context or callback per child): the children's
        joins are recorded in order as they end, and nothing of a child is kept but its result (its join record
        is forgotten once written or replayed). The whole join reaches the workflow in the turn of its last
        record."""
        results: list[Any] = [None] * len(handles)
        unended: list[int] = []
        forget = self.history.forget
        take = self.turns.take
        batch = f"{prefix}.0.0"
        last = f"{prefix}.{len(handles) - 1}.0"
        last_recorded = False
        for i, child in enumerate(handles):
            path = f"{prefix}.{i}.0"
            rec = self.done.get(path)
            if rec is not None:
                self.check_label(path, rec, "ctx.join")
                self.attached.pop(child.run_id, None)
                if self.emits:
                    self.emit(path, rec.label, "replayed", rec.attempt, rec.ms)
                results[i] = Err(load_error(rec.error)) if isinstance(rec, records.Err) else Ok(load_value(rec.value))
                forget(path, batch)
                if path != last:
                    take(path)
                else:
                    last_recorded = True
                continue
            if self.hooks is not None:
                self.hooks.unrecorded(path, "ctx.join", "ctx.join")
            if self.parks:
                outcome = self.engine.ended_child(child.run_id, child.workflow)
                if outcome is not None:
                    self.attached.pop(child.run_id, None)
                    if path == last:
                        await self.control.live_turn()
                    results[i] = self._record_join(path, outcome, batch)
                    continue
            unended.append(i)
        if not unended:
            if last_recorded:
                await self.recorded_turn(h, last)
            return results
        if self.parks:
            await self.rest_on_children(prefix, [handles[i].run_id for i in unended])
        ahead: collections.deque[asyncio.Future[Any]] = collections.deque()
        asked = 0

        def ask() -> None:
            """Hold the outcomes of the next `JOIN_AHEAD` children (a child waiting to start gets its future now)."""
            nonlocal asked
            while asked < len(unended) and len(ahead) < JOIN_AHEAD:
                outcome = self.start_child(handles[unended[asked]])
                if not outcome.done():
                    self.attach(outcome)
                ahead.append(outcome)
                asked += 1

        ask()
        all_ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def record_in_order() -> None:
            joins: list[records.Record] = []
            joined = 0

            def flush() -> None:
                if joins:
                    self.log.write_unkept(joins, batch)
                    self.log.steps_done(len(joins))
                    joins.clear()

            try:
                for n, i in enumerate(unended):
                    outcome = ahead.popleft()
                    if not outcome.done():
                        flush()
                        await asyncio.wait((outcome,))
                    if outcome.cancelled():
                        flush()
                        return  # the run is being cancelled: the join never ends on its own
                    ask()
                    try:
                        rec, results[i] = self._join_record(f"{prefix}.{i}.0", outcome)
                    except BaseException:
                        flush()
                        raise
                    if n == len(unended) - 1:
                        flush()
                        await self.control.live_turn()
                    joins.append(rec)
                    if len(joins) >= SPAWN_BATCH:
                        flush()
                    joined += 1
                    if joined >= CHILDREN_PRUNE and 2 * joined >= len(self.children):
                        self.drop_settled()  # the joined children's futures (and results) go as the join goes
                        joined = 0
                flush()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - a crash or lost lease stops the whole join
                if not all_ended.done():
                    all_ended.set_exception(exc)
                return
            if not all_ended.done():
                all_ended.set_result(None)

        recorder = asyncio.ensure_future(record_in_order())
        try:
            await self.parked_on(all_ended)
            all_ended.result()
        finally:
            if not all_ended.done():
                all_ended.cancel()
            recorder.cancel()
        self.drop_settled()
        return results

    def _record_join(self, path: str, outcome: asyncio.Future[Any], batch: str) -> Ok[Any] | Err:
        """Record how a joined child ended (as `ctx.join` at `path` does) and return it as an `Ok` / `Err`;
        the record is not kept in memory (`write_unkept`, `batch` standing for the join_all's)."""
        rec, result = self._join_record(path, outcome)
        self.log.write_unkept([rec], batch)
        self.log.step_done()
        return result

    def _join_record(self, path: str, outcome: asyncio.Future[Any]) -> tuple[records.Record, Ok[Any] | Err]:
        """The `ctx.join` record at `path` of how a joined child ended, and the child's `Ok` / `Err`."""
        exc = outcome.exception()
        if exc is not None and not isinstance(exc, Exception):
            raise exc
        if exc is None:
            try:
                wire = dump_value(outcome.result(), "child result")
            except Exception as error:  # noqa: BLE001 - an unserialisable result fails this join only
                exc = error
        if exc is not None:
            return records.Err(attempt=1, path=path, label="ctx.join", error=dump_error(exc), ts=time.time()), Err(exc)
        return (records.Ok(attempt=1, path=path, label="ctx.join", value=wire, ms=0, ts=time.time()),
                Ok(load_value(wire)))

    # ---- task graphs --------------------------------------------------------------------------
    def graph(self, tasks: Mapping[str, Task]) -> Handle:
        """Validate a DAG of child runs now (before any work) and allocate its path; each task runs as
        soon as its prerequisites completed."""
        nodes = graphs.validate(tasks)
        scope = self.scope()
        prefix = scope.alloc()
        return self.composite(scope, prefix, "ctx.graph", self._graph, prefix, nodes)

    async def _graph(self, prefix: str, nodes: list[graphs.Node]) -> dict[str, Ok[Any] | Err]:
        shape = {n.id: {"workflow": n.workflow.name, "depends_on": list(n.depends_on)} for n in nodes}
        recorded = self.history.graphs.get(prefix)
        if recorded is None:
            if self.hooks is not None:
                self.hooks.unrecorded(prefix, "ctx.graph", "ctx.graph")
            self.log.write(records.Graph(path=prefix, tasks=shape, ts=time.time()))
        elif recorded.tasks != shape:
            changed = StaleRunError if self.code_changed else PurityError
            raise self.replay_failed(changed(
                f"ctx.graph at path {path_tuple(prefix)} was recorded with tasks {recorded['tasks']!r}, "
                f"now {shape!r}", hint="Keep a started graph's tasks unchanged, or start over with fresh=True.",
                docs=graphs.DOCS, path=path_tuple(prefix)))
        loop = asyncio.get_running_loop()
        outcomes: dict[str, asyncio.Future[Any]] = {n.id: loop.create_future() for n in nodes}

        async def node(n: graphs.Node) -> Any:
            try:
                deps = {}
                for dep in n.depends_on:
                    try:
                        deps[dep] = await asyncio.shield(outcomes[dep])
                    except Exception as exc:
                        raise DependencyFailedError(
                            f"graph task {n.id!r} did not run: its prerequisite {dep!r} failed "
                            f"({type(exc).__name__}: {exc})", task=n.id, dependency=dep) from None
                value = await self.join(await self.spawn(n.workflow, n.make_input(deps), False))
            except BaseException as exc:
                if not outcomes[n.id].done():
                    outcomes[n.id].set_exception(exc)
                raise
            outcomes[n.id].set_result(value)
            return value

        try:
            results = await self.branch_out(prefix, [lambda n=n: node(n) for n in nodes], None)
        finally:
            for outcome in outcomes.values():
                if outcome.done() and not outcome.cancelled():
                    outcome.exception()
        return {n.id: result for n, result in zip(nodes, results, strict=True)}

