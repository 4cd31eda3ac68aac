"""Child runs of one engine: created once under their parent's path, executed in this process at most
`concurrency` at once (a child waiting in a join frees its slot), and their outcomes read back.

The children a spawn hands the pool wait in it in spawn order, each a slot in its spawn's list of handles
(`Queued`), with no future until it starts or a join asks for it (an attached child of a parent running here has
no queue entry in storage either: the parent's stands for it). Only running children have a Task, and nothing
of a child (task, coroutine, context) is kept once it ended: the future that carried its outcome is dropped as
soon as it is settled and taken, so a parent that spawned 100,000 children holds memory for the children
running now, not for those waiting or finished. A child's end is made durable in a group commit with its
siblings' (`EndGroup`) before its outcome reaches its parent.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import contextvars
import functools
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .. import _ids
from .._codec import digest, dump_value, load_value
from .._state.history import History
from ..errors import LeaseLostError
from ..storage.base import NewRun, Storage
from .identity import check_bound, new_header

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from .._authoring.workflow import Workflow

CREATE_BATCH = 1024  # children created per durable write: the headers of a wide spawn_all wait in memory at most this many
FRESH_MAX = 16_384  # children created here and not started yet that are known not to have ended (no look needed)
SPAWNS_LOOKED_AT = 8  # waiting spawns whose next child a child asked for by id is compared with
ENDING_MAX = 256  # child ends waiting for one group commit at most (each holds its lease: two descriptors on files)

RunChild = Callable[[str, "Workflow | None", bool], Awaitable[Any]]


class ChildSlot:
    """The slot one running child holds; given back while every strand of it waits in a join."""

    __slots__ = ("pool", "held", "joining")

    def __init__(self, pool: ChildPool) -> None:
        self.pool = pool
        self.held = True
        self.joining = 0

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.pool.free += 1
            self.pool.pump()

    async def take(self) -> None:
        pool = self.pool
        if pool.free > 0 and not pool.waiters:
            pool.free -= 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            pool.waiters.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    pool.free += 1
                    pool.pump()
                raise
        self.held = True

    @contextlib.asynccontextmanager
    async def parked(self) -> AsyncIterator[None]:
        self.joining += 1
        if self.joining == 1:
            self.give_back()
        try:
            yield
        finally:
            self.joining -= 1
            if self.joining == 0 and not self.held:
                await self.take()


CHILD_SLOT: contextvars.ContextVar[ChildSlot | None] = contextvars.ContextVar("durably_child_slot", default=None)


class EndGroup:
    """Group commit of child runs' ends. A child whose run ended hands its lease here and its task ends; its
    log is made durable together with every sibling that ended meanwhile (one `Storage.sync_all` in a worker
    thread for all of them), then its queue entry goes, its lease is released and only then its outcome
    reaches its parent, so a parent never records a result whose child end a machine crash could still lose."""

    def __init__(self, sync_all: Callable[[builtins.list[Any]], None], finish: Callable[[Any, bool], None],
                 run_in_thread: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
        self.sync_all = sync_all
        self.finish = finish
        self.run_in_thread = run_in_thread
        self.waiting: builtins.list[tuple[Any, Callable[[BaseException | None], None]]] = []
        self.in_flight = 0
        self.task: asyncio.Task[None] | None = None
        self.room: asyncio.Event | None = None

    def full(self) -> bool:
        """True while `ENDING_MAX` ends wait (each holds its lease: a log and a lock descriptor on files)."""
        return len(self.waiting) + self.in_flight >= ENDING_MAX

    async def has_room(self) -> None:
        while self.full():
            if self.room is None:
                self.room = asyncio.Event()
            await self.room.wait()

    def add(self, lease: Any, settle: Callable[[BaseException | None], None]) -> None:
        """Make `lease`'s appends durable in the next group commit, then finish its run and call `settle`
        (with the error when its log could not be made durable)."""
        self.waiting.append((lease, settle))
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._commit())

    def now(self, lease: Any) -> None:
        """Finish one handed-over run at once, in this thread (its child task was cancelled)."""
        self._settle([(lease, lambda error: None)], None, durable_each=True)

    async def _commit(self) -> None:
        group: builtins.list[tuple[Any, Callable[[BaseException | None], None]]] = []
        try:
            while self.waiting:
                group, self.waiting = self.waiting, []
                self.in_flight = len(group)
                error: BaseException | None = None
                try:
                    await self.run_in_thread(functools.partial(self.sync_all, [lease for lease, _ in group]))
                except Exception as exc:  # noqa: BLE001 - each end is then made durable (or fails) on its own
                    error = exc
                self._settle(group, error, durable_each=error is not None)
                group = []
                self.in_flight = 0
                if self.room is not None:
                    self.room.set()
                    self.room = None
        except BaseException:  # cancelled (the loop is closing): the ends still waiting are finished here
            rest, self.waiting = group + self.waiting, []
            self._settle(rest, None, durable_each=True)
            raise
        finally:
            self.task = None
            self.in_flight = 0

    def _settle(self, group: builtins.list[tuple[Any, Callable[[BaseException | None], None]]],
                error: BaseException | None, *, durable_each: bool) -> None:
        for lease, settle in group:
            own = None
            if durable_each:
                try:
                    self.sync_all([lease])
                except Exception as exc:  # noqa: BLE001 - this child's outcome
                    own = exc
            try:
                self.finish(lease, own is None)
            except Exception as exc:  # noqa: BLE001 - this child's outcome
                own = own or exc
            settle(own)


class Outcome(asyncio.Future[Any]):
    """The outcome of one child run in the pool, carrying what starting it needs: a child a join asked for
    waits in `ChildPool.asked` as this future alone (no tuple beside it), its run id shared with its handle
    and its workflow with its siblings'; `started` once it runs."""

    __slots__ = ("run_id", "workflow", "rerun_failed", "started")

    def __init__(self, run_id: str, workflow: Workflow | None, rerun_failed: bool,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.run_id = run_id
        self.workflow = workflow
        self.rerun_failed = rerun_failed
        self.started = False


class Queued:
    """The children one spawn hands the pool, waiting in spawn order: a child not started yet is its handle's
    slot in `handles` (no future, no entry of its own), and gets its outcome future when the pool starts it
    (handed to `on_start`, its parent's, to cancel or await) or when a join asks for it first (`ChildPool.start`).
    `done()` once every child started or the spawn was cancelled, as its parent's attached outcomes are."""

    __slots__ = ("handles", "next", "rerun_failed", "on_start", "drained")

    def __init__(self, handles: builtins.list[Any], rerun_failed: bool,
                 on_start: Callable[[str, asyncio.Future[Any]], None]) -> None:
        self.handles = handles
        self.next = 0
        self.rerun_failed = rerun_failed
        self.on_start = on_start
        self.drained: asyncio.Future[None] | None = None

    def done(self) -> bool:
        """True once every child started (or was taken out by a join that asked for it), or after `cancel`."""
        return self.next >= len(self.handles)

    def cancel(self) -> None:
        """No child not started yet will start (those running are cancelled through their outcomes)."""
        self.next = len(self.handles)
        self.settle()

    def settle(self) -> None:
        """Wake whoever waits in `wait` (called once `done()`)."""
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """Settled once every child started (their outcomes are then all with `on_start`'s owner)."""
        if self.drained is None:
            self.drained = asyncio.get_running_loop().create_future()
            if self.done():
                self.drained.set_result(None)
        return self.drained


class ChildPool:
    """Runs child runs of one event loop, `size` at a time; running children that want their slot back (after
    a join) go first, then children a join asked for by id (`asked`), then those spawned (`queued`, in spawn
    order), so a deep fan-out finishes branches before widening."""

    def __init__(self, size: int, run: RunChild, ending: EndGroup | None = None) -> None:
        self.size = size
        self.free = size
        self.run = run
        self.ending = ending
        self.handed: dict[str, Any] = {}  # run id -> the lease of a child whose end `ending` makes durable
        self.outcomes: dict[str, Outcome] = {}  # children running, or asked for and not started
        self.asked: deque[Outcome] = deque()
        self.queued: deque[Queued] = deque()
        self.early: set[str] = set()  # asked for out of spawn order while spawns wait: their turn passes over them
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.running: dict[asyncio.Future[Any], asyncio.Task[None]] = {}

    def current(self, run_id: str, rerun_failed: bool) -> Outcome | None:
        """The outcome of the child running (or asked for) now, unless a failed one is to run again."""
        outcome = self.outcomes.get(run_id)
        if outcome is None or outcome.cancelled() or (
                rerun_failed and outcome.done() and outcome.exception() is not None):
            return None
        return outcome

    def start(self, run_id: str, workflow: Workflow | None, rerun_failed: bool) -> asyncio.Future[Any]:
        """The future of the child's outcome; the child starts before the spawned ones still waiting, unless it
        runs already. One still waiting in its spawn's `Queued` leaves it: the next in spawn order is taken
        out (a join_all in spawn order), any other is noted in `early` so that its turn passes over it."""
        outcome = self.current(run_id, rerun_failed)
        if outcome is not None:
            return outcome
        if self.queued:
            for queued in itertools.islice(self.queued, SPAWNS_LOOKED_AT):
                if not queued.done() and queued.handles[queued.next].run_id == run_id:
                    queued.next += 1
                    if queued.done():
                        queued.settle()
                    break
            else:
                self.early.add(run_id)
        outcome = Outcome(run_id, workflow, rerun_failed, asyncio.get_running_loop())
        self.outcomes[run_id] = outcome
        self.asked.append(outcome)
        self.pump()
        return outcome

    def start_all(self, handles: builtins.list[Any], rerun_failed: bool,
                  on_start: Callable[[str, asyncio.Future[Any]], None]) -> Queued:
        """Queue spawned children (`RunHandle`s) behind those waiting already; each starts in turn."""
        queued = Queued(handles, rerun_failed, on_start)
        if handles:
            self.queued.append(queued)
            self.pump()
        return queued

    def _settled(self, run_id: str, outcome: asyncio.Future[Any]) -> None:
        if self.outcomes.get(run_id) is outcome:
            del self.outcomes[run_id]
        if outcome.cancelled():
            task = self.running.pop(outcome, None)
            if task is not None:
                task.cancel()
        else:
            outcome.exception()

    def _next_asked(self) -> Outcome | None:
        while self.asked:
            outcome = self.asked.popleft()
            if outcome.done():  # cancelled while it waited
                if self.outcomes.get(outcome.run_id) is outcome:
                    del self.outcomes[outcome.run_id]
            elif not outcome.started:
                return outcome
        return None

    def _next_queued(self) -> Outcome | None:
        while self.queued:
            queued = self.queued[0]
            if queued.done():
                self.queued.popleft()
                queued.settle()
                if not self.queued:
                    self.early.clear()
                continue
            handle = queued.handles[queued.next]
            queued.next += 1
            if handle.run_id in self.early:  # started when a join asked for it
                self.early.discard(handle.run_id)
                continue
            outcome = self.current(handle.run_id, queued.rerun_failed)
            if outcome is None:
                outcome = Outcome(handle.run_id, handle.workflow, queued.rerun_failed, asyncio.get_running_loop())
                self.outcomes[handle.run_id] = outcome
                queued.on_start(handle.run_id, outcome)
            if not outcome.started and not outcome.done():
                return outcome
        return None

    def pump(self) -> None:
        """Hand free slots to running children waiting for theirs, then to asked-for, then to spawned children."""
        while self.free > 0:
            if self.waiters:
                turn = self.waiters.popleft()
                if not turn.done():
                    self.free -= 1
                    turn.set_result(None)
                continue
            outcome = self._next_asked() or self._next_queued()
            if outcome is None:
                return
            self.free -= 1
            outcome.started = True
            task = asyncio.get_running_loop().create_task(self._child(outcome.run_id, outcome.workflow,
                                                                      outcome.rerun_failed, outcome),
                                                          context=contextvars.Context())
            self.running[outcome] = task
            outcome.add_done_callback(functools.partial(self._settled, outcome.run_id))  # once running only

    async def _child(self, run_id: str, workflow: Workflow | None, rerun_failed: bool,
                     outcome: asyncio.Future[Any]) -> None:
        slot = ChildSlot(self)
        CHILD_SLOT.set(slot)
        value: Any = None
        failed: BaseException | None = None
        try:
            try:
                value = await self.run(run_id, workflow, rerun_failed)
            except asyncio.CancelledError:
                lease = self.handed.pop(run_id, None)
                if lease is not None and self.ending is not None:
                    self.ending.now(lease)
                if not outcome.done():
                    outcome.cancel()
                raise
            except BaseException as exc:  # noqa: BLE001 - the child's outcome, whatever it is, goes to its joiners
                failed = exc
            lease = self.handed.pop(run_id, None)
            if lease is not None and self.ending is not None:
                await self.ending.has_room()
                self.ending.add(lease, functools.partial(_settle, outcome, value, failed))
            else:
                _settle(outcome, value, failed, None)
            if isinstance(failed, KeyboardInterrupt | SystemExit):
                raise failed
        finally:
            self.running.pop(outcome, None)
            slot.give_back()


def _settle(outcome: asyncio.Future[Any], value: Any, failed: BaseException | None,
            error: BaseException | None) -> None:
    """Hand a child's outcome to its joiners: its value, its error, or the error that kept its end from
    becoming durable."""
    if outcome.done():
        return
    if error is not None or failed is not None:
        outcome.set_exception(error if error is not None else failed)  # type: ignore[arg-type]
    else:
        outcome.set_result(value)


def parked_in_join() -> contextlib.AbstractAsyncContextManager[None]:
    """While the calling run waits in a join, the slot it runs in (if it is a child) is free for others."""
    slot = CHILD_SLOT.get()
    return slot.parked() if slot is not None else contextlib.nullcontext()


def joined(workflow: Workflow | None, history: History) -> Any:
    """The result of a run another process finished (or that had finished already), or raise its error."""
    return history.outcome(workflow.output_schema if workflow is not None else None)


class ChildRuns:
    """The child runs of one engine (`Engine.children`): creating them, running them here, reading how they ended.

    The pool belongs to one event loop; a new loop starts it afresh. What it asks of its engine it is given:
    running a run (`run`, `Engine.run`), the code of a run by id (`workflow_for`), reading a run's history
    (`read`, `Runs.read`), the runs a retry reopens (`retries`), the pool size (`concurrency`, read per pool)
    and waking the engine's worker (`poke`)."""

    def __init__(self, storage: Storage, executor: Executor, *, concurrency: Callable[[], int],
                 run: Callable[..., Awaitable[Any]], workflow_for: Callable[[str], Workflow],
                 read: Callable[[str], tuple[History, str | None]], retries: set[str],
                 poke: Callable[[], None]) -> None:
        self.storage = storage
        self.executor = executor
        self.concurrency = concurrency
        self.run = run
        self.workflow_for = workflow_for
        self.read = read
        self.retries = retries
        self.poke = poke
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pool = self._new_pool()
        self.fresh: set[str] = set()  # created by this engine and not started: no need to look whether they ended

    def _new_pool(self) -> ChildPool:
        storage = self.storage

        def run_in_thread(call: Callable[[], None]) -> Awaitable[None]:
            return asyncio.get_running_loop().run_in_executor(self.executor, call)

        def finish(lease: Any, durable: bool) -> None:
            try:
                if durable:
                    storage.unschedule(lease.run_id)
            finally:
                storage.release(lease)

        return ChildPool(self.concurrency(), self._run_child, EndGroup(storage.sync_all, finish, run_in_thread))

    def in_pool(self) -> bool:
        """True in a child run this engine's pool runs: its end is made durable with its siblings' ends."""
        slot = CHILD_SLOT.get()
        return slot is not None and slot.pool is self.pool and self.pool.ending is not None

    def hand_over(self, lease: Any) -> None:
        """A pool child's run ended unsynced: the group commit makes it durable, takes it out of the queue and
        releases its lease before its outcome reaches its parent."""
        self.pool.handed[lease.run_id] = lease

    def create_child(self, parent: str, path: str, workflow: Workflow, input: Any, detached: bool, *,
                     queued: bool = True) -> str:
        """The child run spawned at `path` of `parent` (created once: a resumed parent finds the same one)."""
        return self.create_children(parent, [(path, workflow, input)], detached, queued=queued)[0]

    def create_children(self, parent: str, children: builtins.list[tuple[str, Workflow, Any]],
                        detached: bool, *, queued: bool = True) -> builtins.list[str]:
        """The child runs spawned at each `(path, workflow, input)` of `parent`, in order; they are looked up and
        those not created yet created in batches of `CREATE_BATCH` (`Storage.lookup_many`: one query for each;
        `Storage.create_bound`: one fsync or commit for each). Each child
        is bound to its identity `child:<parent>:<path>` before its log exists, so a parent resumed after a
        crash finds the children it created whether or not it recorded them. `queued` False (the parent runs
        its attached children in its own process): they get no queue entry, the parent's entry brings them
        back (`ended_child` queues one it finds unended and out of the queue)."""
        storage = self.storage
        run_ids: builtins.list[str] = []
        batch: builtins.list[NewRun] = []
        for first in range(0, len(children), CREATE_BATCH):
            part = children[first:first + CREATE_BATCH]
            identities = [f"child:{parent}:{path}" for path, _, _ in part]
            for identity, found, (_, workflow, input) in zip(identities, storage.lookup_many(identities), part,
                                                             strict=True):
                info = storage.info(found) if found is not None else None
                if info is not None:
                    check_bound(identity, info, parent)
                    run_ids.append(info.run_id)
                    continue
                schema = workflow.input_schema
                wire = dump_value(schema.to_builtins(input) if schema else input, "child input")
                if schema is not None:
                    wire = dump_value(schema.to_builtins(schema.convert(load_value(wire), "child input")), "child input")
                run_id = _ids.new_run_id(workflow.name)
                header = new_header(run_id, workflow, wire, digest(load_value(wire)), None, identity, None,
                                    self.storage, parent=parent, detached=detached)
                batch.append(NewRun(run_id, header, identity, found, queued or detached))
                run_ids.append(run_id)
                if not queued and not detached and len(self.fresh) < FRESH_MAX:
                    self.fresh.add(run_id)
                if len(batch) >= CREATE_BATCH:
                    self._create_bound(parent, batch)
                    batch = []
        self._create_bound(parent, batch)
        return run_ids

    def _create_bound(self, parent: str, batch: builtins.list[NewRun]) -> None:
        if batch:
            lost = self.storage.create_bound(batch)
            if lost is not None:
                raise LeaseLostError(f"child {lost} of run {parent} was created by another process", run_id=parent)

    def start_child(self, run_id: str, workflow: Workflow | None, *, rerun_failed: bool = False) -> asyncio.Future[Any]:
        """The outcome of a child run in this process (at most `concurrency` children run at once).

        A child that already ended is not run again, its end is its outcome; only `rerun_failed` (a failed
        parent being retried joins it again) resumes a failed child at its failed step."""
        self.bind_loop()
        return self.pool.start(run_id, workflow, rerun_failed)

    def start_children(self, handles: builtins.list[Any], *, rerun_failed: bool,
                       on_start: Callable[[str, asyncio.Future[Any]], None]) -> Queued:
        """Queue spawned children (`RunHandle`s) to run in this process in order, with no future each until one
        starts (`on_start` is given its run id and outcome then) or a join asks for it (`start_child`)."""
        self.bind_loop()
        return self.pool.start_all(handles, rerun_failed, on_start)

    async def _run_child(self, run_id: str, workflow: Workflow | None, rerun_failed: bool) -> Any:
        if run_id in self.fresh:  # created here a moment ago: it has not ended
            self.fresh.discard(run_id)
            return await self.run(workflow or self.workflow_for(run_id), run_id=run_id, advisories="silent")
        info = self.storage.info(run_id)
        if info is not None and info.ended and (
                info.end_status != "failed" or not rerun_failed):
            return joined(workflow, History([info.header, info.last], f"run {run_id}"))
        if not rerun_failed:
            return await self.run(workflow or self.workflow_for(run_id), run_id=run_id, advisories="silent")
        self.retries.add(run_id)  # retried with its parent: failed, or killed while failing, it is reopened
        try:
            return await self.run(workflow or self.workflow_for(run_id), run_id=run_id, advisories="silent")
        finally:
            self.retries.discard(run_id)

    async def join_child(self, run_id: str, workflow: Workflow | None, *, rerun_failed: bool = False) -> Any:
        """Wait for a child to end (running it here if no process does) and return its result or raise."""
        return await asyncio.shield(self.start_child(run_id, workflow, rerun_failed=rerun_failed))

    def ended_child(self, run_id: str, workflow: Workflow | None) -> asyncio.Future[Any] | None:
        """How a child run ended, as a settled future (its result or error), or None while it has not ended.

        A run out of the queue has ended even when its last record is not its end (a worker that listed it
        as due just before it ended claimed it once more), so then its whole log is read; one that has not
        ended (a child its parent ran in place, without a queue entry, before that process died) is queued,
        due now, so a worker runs it and a parent parked in a join waits for it."""
        info = self.storage.info(run_id)
        if info is None:
            return None
        if info.ended:
            history = History([info.header, info.last], f"run {run_id}")
        elif self.storage.entry(run_id) is None:
            history, _ = self.read(run_id)
            if history.end is None:
                self.storage.schedule(run_id, time.time())
                return None
        else:
            return None
        outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            outcome.set_result(joined(workflow, history))
        except BaseException as exc:  # noqa: BLE001 - the child's error is its outcome
            outcome.set_exception(exc)
        return outcome

    def queued_child(self, run_id: str) -> None:
        """A child a served run spawned waits in the queue: this engine's worker looks for it at once."""
        self.poke()

    def parked_in_join(self) -> contextlib.AbstractAsyncContextManager[None]:
        """While the calling run waits in a join, the slot it runs in (if it is a child) is free for others."""
        return parked_in_join()

    def bind_loop(self) -> asyncio.AbstractEventLoop:
        """Child-run state belongs to one event loop; a new loop starts it afresh."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:
            self.loop, self.pool = loop, self._new_pool()
        return loop
