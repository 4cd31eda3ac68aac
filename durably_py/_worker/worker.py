"""The worker loop: claim due runs from the storage's queue, run them, park and release them, repeat.

A worker serves one engine (`Worker(engine, ...)`) through the narrow `Client` port below: the worker layer
sits below the engine and never imports it. `Engine.start()` runs one in-process (and `Engine.join`, `drain`
and `stop` ask it); `durably worker` runs one as a long-lived process. Several workers, in one process or
many, on one machine (a shared `.durably/`, leases are OS file locks) or many (SQLite or PostgreSQL,
time-based leases fenced by epoch), share one queue: a claim is exclusive, so a run is never
run by two workers at once, and a worker that dies leaves its runs due again (at once for files, once the
lease lapses for databases).

A graceful stop (`Worker.stop`, SIGTERM/SIGINT in `durably worker`) claims nothing more and starts no new
step: each running run stops before its next step, keeping every finished step, and is released due at
once, so another worker takes it over without waiting for a lease to lapse.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Collection
from concurrent.futures import Executor
from typing import Any, Protocol

from .. import records as log_format
from .._authoring.calls import RunHandle
from .._authoring.queues import check_queue_name
from .._authoring.workflow import Workflow
from .._replay.kernel import Parked
from .._state.history import History
from ..errors import DurablyError, LeaseLostError, RunCancelledError, ValidationError
from .admission import Admission
from .schedules import ScheduleHost, fire_due

JOIN_POLL = 0.05

ENDING_MAX = 4  # ended runs per slot that may wait for a group commit (each holds its lease until then)
AHEAD_FOR = 1.0  # seconds a run claimed ahead waits for a slot at most; then it is let go, due again at once
SKIP_SECONDS = 30.0  # how long a run whose code cannot be found is left alone before the next try
SETTINGS_DOCS = "docs/deploying.md#settings"


def check_concurrency(concurrency: Any) -> int:
    """Validate `concurrency=` (runs, and child runs, at once: an int >= 1)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValidationError(f"concurrency must be an int >= 1, got {concurrency!r}",
                              hint="concurrency=4 runs up to four runs at once.", docs=SETTINGS_DOCS)
    return concurrency


def check_poll(poll: Any) -> float:
    """Validate a worker's `poll=` (seconds between looks at the queue when idle: 0.01 to 60)."""
    if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0.01 <= poll <= 60:
        raise ValidationError(f"poll must be 0.01 to 60 seconds, got {poll!r}",
                              hint="poll=0.2 (the default) looks for due runs five times a second when idle.",
                              docs=SETTINGS_DOCS)
    return float(poll)


class Code(Protocol):
    """Which workflows a worker serves (`CodeSource`)."""

    def claims(self) -> frozenset[str] | None: ...

    def describe(self) -> dict[str, object]: ...


class Pruned(Protocol):
    """What a prune deleted (`PruneReport`)."""

    runs: list[str]
    bytes: int


class Client(ScheduleHost, Protocol):
    """What a worker asks of the engine it serves: its storage and settings, the code of a run, running a
    claimed run (`drive`) and pruning ended runs. `Engine` is one."""

    @property
    def owner(self) -> str: ...

    @property
    def executor(self) -> Executor: ...

    @property
    def code(self) -> Code: ...

    @property
    def retention(self) -> float | None: ...

    @property
    def checkpoint_every(self) -> int | None: ...

    @property
    def lease_ttl(self) -> float: ...

    def code_for(self, header: log_format.Header) -> Workflow: ...

    async def drive(self, workflow: Workflow, lease: Any, history: History, wire_input: Any,
                    budget: dict[str, float] | None, checkpoint_every: int | None, advisories: str | None,
                    on_advisory: Any, on_step: Any, torn: str | None, wait: bool = True,
                    stopping: Callable[[], bool] | None = None,
                    ends: Callable[[Any], None] | None = None) -> Any: ...

    async def prune(self, *, older_than: float) -> Pruned: ...


class EndCommit:
    """Group commit of the ends of the runs one worker holds. A served run that ended hands its lease here and
    waits: every lease handed over while the previous commit was under way goes into the next one, a single
    `Storage.finish_all` on a worker thread (one fsync or durable commit for all of them, each run out of the
    queue and released), so a worker running several runs at once pays one durable write for several ends. A
    storage whose commits are grouped on a thread of their own (`finish_soon`: PostgreSQL) takes each end from the
    loop directly, into the group commit of the records and ends the loop's pass hands in."""

    def __init__(self, storage: Any, run_in_thread: Callable[[Callable[[], Any]], Any]) -> None:
        self.storage = storage
        self.run_in_thread = run_in_thread
        self.waiting: list[tuple[Any, asyncio.Future[BaseException | None]]] = []
        self.task: asyncio.Task[None] | None = None
        self.commits = 0

    async def finish(self, lease: Any) -> BaseException | None:
        """Make the ended run of `lease` durable, out of the queue and released in the next group commit; the
        error that kept it from being so (None: done)."""
        soon = getattr(self.storage, "finish_soon", None)
        if soon is not None:  # the loop's own future, in the commit of what the loop's pass hands in
            (future,) = soon([lease])
            self.commits += 1
            try:
                await future
            except LeaseLostError as lost:
                return lost
            except Exception as exc:  # noqa: BLE001 - as a failed group below: its end is recorded again later
                self.storage.release(lease)
                return exc
            return None
        loop = asyncio.get_running_loop()
        done: asyncio.Future[BaseException | None] = loop.create_future()
        self.waiting.append((lease, done))
        if self.task is None:
            self.task = loop.create_task(self._commit())
        return await asyncio.shield(done)

    async def _commit(self) -> None:
        try:
            while self.waiting:
                group, self.waiting = self.waiting, []
                leases = [lease for lease, _ in group]
                try:
                    errors = await self.run_in_thread(functools.partial(self.storage.finish_all, leases))
                except Exception as exc:  # noqa: BLE001 - each run's own outcome: its end is recorded again later
                    errors = [exc] * len(group)
                    for lease in leases:
                        self.storage.release(lease)
                self.commits += 1
                for (_, done), error in zip(group, errors, strict=True):
                    if not done.done():
                        done.set_result(error)
        finally:
            self.task = None


class Worker:
    """One worker loop over an engine's storage, running at most `concurrency` runs at once, of the workflows
    its engine's `code` claims (`CodeSource.claims`)."""

    def __init__(self, engine: Client, *, concurrency: int = 4, poll: float = 0.2,
                 log: Callable[[str], Any] | None = None, queues: Collection[str] | None = None) -> None:
        self.engine = engine
        self.admission = Admission(engine.storage, frozenset(check_queue_name(q) for q in queues)
                                   if queues else None)  # the named queues it serves (None: all) and their limits
        self.concurrency = check_concurrency(concurrency)
        self.poll = check_poll(poll)
        self._schedules_at = 0.0
        self._prune_at = 0.0
        self.pruned = 0
        self.log = log
        self.active: dict[str, asyncio.Task[None]] = {}
        self.ending: dict[str, asyncio.Task[None]] = {}  # ended runs waiting for the group commit: no slot held
        self.stopped: list[str] = []
        self.ran = 0
        self.finished = False
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._skip: dict[str, float] = {}
        self._ahead: list[tuple[float, Any]] = []  # (claimed at, lease) of runs claimed ahead, waiting for a slot
        self._claiming: asyncio.Future[Any] | None = None  # a claim ahead under way on a thread
        self._more = False  # the last claim took as many runs as it asked for: more may be due
        self._pace: float | None = None  # how long a run held a slot here lately (a moving average), seconds
        self._advertised_at = 0.0
        self.started = time.time()
        self.ends = EndCommit(engine.storage, lambda call: asyncio.get_running_loop().run_in_executor(
            engine.executor, call))

    # ---- control --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop as a task of the running event loop (idempotent)."""
        if self._task is None:
            self._wake, self._changed = asyncio.Event(), asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def run(self) -> None:
        """Start the loop and return once it has stopped (after `stop()` or `request_stop()`)."""
        self.start()
        assert self._task is not None
        await asyncio.shield(self._task)

    def request_stop(self) -> None:
        """Ask for a graceful stop without waiting for it (safe from a signal handler)."""
        self._stopping = True
        self.poke()

    async def stop(self) -> list[str]:
        """Stop gracefully and wait for it; the ids of the runs stopped part-way (due again at once)."""
        self.request_stop()
        if self._task is not None:
            await asyncio.shield(self._task)
        self.finished = True
        return list(self.stopped)

    def poke(self) -> None:
        """Look for due work now instead of at the next poll."""
        if self._wake is not None:
            self._wake.set()

    def skipped(self) -> tuple[str, ...]:
        """Runs this worker leaves alone for now (their code could not be found), plus those it runs."""
        now = time.monotonic()
        return (tuple(r for r, until in self._skip.items() if until > now) + tuple(self.active) + tuple(self.ending)
                + tuple(lease.run_id for _, lease in self._ahead))

    async def join(self, handle: RunHandle) -> Any:
        """Wait for a run this worker (or any other) runs to end; return its value or raise its error."""
        storage = self.engine.storage
        schema = handle.workflow.output_schema if handle.workflow is not None else None
        while True:
            info = storage.info(handle.run_id)
            if info is not None and info.ended:
                return History([info.header, info.last]).outcome(schema)
            await self.settled(JOIN_POLL * 4)

    async def drain(self, enqueued: Collection[str]) -> None:
        """Wait until the queue holds no run that is due now or running here, and every run of `enqueued` (the
        runs its engine enqueued, read again as it grows) has ended or parked for later."""
        storage = self.engine.storage
        waiting = list(enqueued)
        while True:
            while waiting and self._settled(waiting[-1]):  # each run is looked at until it settles, once
                waiting.pop()
            if not waiting and not self.active and not self.ending and not self._ahead and self._claiming is None \
                    and not storage.due(1, skip=self.skipped()):
                waiting = [r for r in enqueued if not self._settled(r)]  # one that was queued again
                if not waiting:
                    return
            await self.settled(JOIN_POLL * 4)

    def _settled(self, run_id: str) -> bool:
        """True when an enqueued run ended, parked for later, or left the queue."""
        storage = self.engine.storage
        info = storage.info(run_id)
        if info is None or info.ended:
            return True
        entry = storage.entry(run_id)
        return entry is None or (info.kind != "run" and (entry.at is None or entry.at > time.time()))

    async def settled(self, timeout: float) -> None:
        """Wait until a run this worker ran stops, or `timeout` seconds."""
        if self._changed is None:
            await asyncio.sleep(timeout)
            return
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    def _say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    # ---- the loop -------------------------------------------------------------------------------
    async def _loop(self) -> None:
        engine = self.engine
        assert self._wake is not None
        unwatch = self._watch()
        try:
            while not self._stopping:
                self._let_go_stale()
                self._advertise()
                await self._fire_schedules()
                await self._prune()
                free = self.concurrency - len(self.active)
                claimed = 0
                if free > 0:
                    admission = self.admission
                    leases = self._take_ahead(free)
                    try:
                        if len(leases) < free:
                            full = admission.full()
                            leases += self._claim_orphans(free - len(leases))
                        if len(leases) < free:
                            asked = free - len(leases)
                            found = self._claim_due(asked, full)()
                            self._more = len(found) == asked
                            leases += found
                    except Exception as exc:  # noqa: BLE001 - a storage hiccup (a restarting database) is retried
                        self._say(f"claiming due runs failed: {type(exc).__name__}: {exc}")
                    for lease in leases:
                        if self._stopping or not self._admitted(lease):
                            engine.storage.release(lease)
                            continue
                        self.active[lease.run_id] = asyncio.get_running_loop().create_task(self._serve(lease))
                        claimed += 1
                    self._claim_ahead()
                if claimed and len(self.active) < self.concurrency:
                    continue
                self._wake.clear()
                waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._wake.wait())]
                try:
                    await asyncio.wait([*waits, *self.active.values()], timeout=self._idle(free > claimed),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            self._stopping = True
            if unwatch is not None:
                unwatch()
            if self._claiming is not None:
                await asyncio.gather(self._claiming, return_exceptions=True)
            for _, lease in self._ahead:  # claimed ahead and never started: due again at once
                engine.storage.release(lease)
            self._ahead = []
            while self.active or self.ending:
                await asyncio.gather(*self.active.values(), *self.ending.values(), return_exceptions=True)
            try:
                engine.storage.retire(engine.owner)
            except Exception as exc:  # noqa: BLE001 - its advertisement lapses with its lease instead
                self._say(f"retiring this worker's advertisement failed: {type(exc).__name__}: {exc}")
            self.finished = True

    def _take_ahead(self, free: int) -> list[Any]:
        """Up to `free` of the runs claimed ahead, oldest first (`_let_go_stale` first)."""
        self._let_go_stale()
        taken = [lease for _, lease in self._ahead[:free]]
        del self._ahead[:free]
        return taken

    def _let_go_stale(self) -> None:
        """Release the runs claimed ahead that waited longer than `AHEAD_FOR` for a slot (due again at once for any
        worker) rather than start them late: their leases are not renewed while they wait. The loop calls this at
        every pass, at least once a `poll`, busy slots or not."""
        now = time.monotonic()
        while self._ahead and now - self._ahead[0][0] > AHEAD_FOR:
            _, lease = self._ahead.pop(0)
            try:
                self.engine.storage.release(lease)
            except Exception as exc:  # noqa: BLE001 - its lease lapses instead
                self._say(f"{lease.run_id}: releasing it failed: {type(exc).__name__}: {exc}")

    def _claim_ahead(self) -> None:
        """On a storage whose claims are round trips to a server (`claims_ahead`), while the last claim found as many
        due runs as it asked for and runs lately held their slots for less than a quarter of `AHEAD_FOR`: once
        fewer than `concurrency` runs wait for a slot, claim up to twice that many on a worker thread, so a run that
        ends is followed by the next at once instead of after a claim that stops the loop, and a claim serves
        several turns of the slots. Each run waits so for `AHEAD_FOR` seconds at most."""
        engine = self.engine
        want = 2 * self.concurrency - len(self._ahead)
        if (self._claiming is not None or not self._more or self._stopping or len(self._ahead) >= self.concurrency
                or self._pace is None or self._pace > AHEAD_FOR / 4
                or not getattr(engine.storage, "claims_ahead", False)):
            return  # (runs that hold their slots long would wait long, or be let go and claimed again)
        try:
            full = self.admission.full()
        except Exception:  # noqa: BLE001 - the claim when a slot frees asks again
            return
        loop = asyncio.get_running_loop()
        self._claiming = loop.run_in_executor(engine.executor, self._claim_due(want, full))

        def claimed(done: asyncio.Future[Any]) -> None:
            self._claiming = None
            try:
                leases = done.result()
            except Exception as exc:  # noqa: BLE001 - a storage hiccup: the next claim tries again
                self._say(f"claiming due runs failed: {type(exc).__name__}: {exc}")
                self._more = False
                return
            self._more = len(leases) == want
            now = time.monotonic()
            self._ahead += [(now, lease) for lease in leases]
            if leases:
                self.poke()
        self._claiming.add_done_callback(claimed)

    def _claim_due(self, count: int, full: Any) -> Callable[[], list[Any]]:
        """The claim of up to `count` due runs this worker serves, its arguments taken now (on the loop: what the
        worker runs and skips), to be made here or on a thread."""
        engine = self.engine
        return functools.partial(engine.storage.claim_due, engine.owner, engine.lease_ttl, count, skip=self.skipped(),
                                 workflows=engine.code.claims(), queues=self.admission.served, full=full)

    def _claim_orphans(self, free: int) -> list[Any]:
        """Claim up to `free` runs that hold places in full queues and are due with no process (`Admission.orphans`)."""
        engine = self.engine
        leases = []
        for run_id in self.admission.orphans(self.skipped(), engine.code.claims())[:free]:
            lease = engine.storage.claim(run_id, engine.owner, engine.lease_ttl)
            if lease is not None:
                leases.append(lease)
        return leases

    def _left(self, lease: Any) -> None:
        """A run this worker ran stopped: its queue permits go back if it ended."""
        storage = self.engine.storage
        try:
            self.admission.left(lease.run_id, lease.records[0],
                                lambda: (info := storage.info(lease.run_id)) is None or info.ended)
        except Exception as exc:  # noqa: BLE001 - its permits lapse with the run's end all the same
            self._say(f"{lease.run_id}: its queue's permits could not be given back: {type(exc).__name__}: {exc}")

    def _admitted(self, lease: Any) -> bool:
        """Whether the claimed run of `lease` may start: its queue's permits taken (False: another worker took
        the last room first; it stays due)."""
        try:
            return self.admission.admit(lease.run_id, lease.records[0])
        except Exception as exc:  # noqa: BLE001 - a storage hiccup: let it go, it stays due
            self._say(f"{lease.run_id}: its queue's permits could not be taken: {type(exc).__name__}: {exc}")
            return False

    def _watch(self) -> Callable[[], None] | None:
        """Have the storage poke this loop whenever another process makes work due (`Storage.watch`: local
        wake-ups for a shared directory or SQLite file, LISTEN/NOTIFY on PostgreSQL); None: polling only."""
        watch = getattr(self.engine.storage, "watch", None)
        if watch is None:
            return None
        loop = asyncio.get_running_loop()

        def poke() -> None:
            try:
                loop.call_soon_threadsafe(self.poke)
            except RuntimeError:  # the loop closed meanwhile
                pass

        try:
            return watch(poke)
        except Exception as exc:  # noqa: BLE001 - the poll still finds the work
            self._say(f"watching for new work failed: {type(exc).__name__}: {exc}; polling every {self.poll:g}s")
            return None

    def _idle(self, drained: bool) -> float:
        """How long to wait for a poke before looking again: the poll, or less when a queued run falls due
        sooner (a sleep ending, a backoff over), looked up once the due work is `drained`."""
        if not drained:
            return self.poll
        try:
            soonest = self.engine.storage.next_due()
        except Exception:  # noqa: BLE001 - a storage hiccup: the poll interval
            return self.poll
        return self.poll if soonest is None else min(self.poll, max(0.0, soonest - time.time()))

    def _advertise(self) -> None:
        """Tell the storage, every third of the lease, that this worker is live and which workflows it serves
        (`Storage.advertise`): `durably list` and `inspect` say when no live worker serves a queued run."""
        if time.monotonic() < self._advertised_at:
            return
        engine = self.engine
        self._advertised_at = time.monotonic() + max(engine.lease_ttl / 3, self.poll)
        info = {**engine.code.describe(), "pid": os.getpid(), "host": socket.gethostname(),
                "concurrency": self.concurrency, "lease": engine.lease_ttl, "started": self.started,
                "queues": self.admission.advertised()}
        try:
            engine.storage.advertise(engine.owner, info, engine.lease_ttl)
        except Exception as exc:  # noqa: BLE001 - a storage hiccup is retried at the next pass
            self._say(f"advertising this worker failed: {type(exc).__name__}: {exc}")

    async def _fire_schedules(self) -> None:
        """Queue the due ticks of the schedules this process serves (at most once a second)."""
        if time.monotonic() < self._schedules_at:
            return
        self._schedules_at = time.monotonic() + max(self.poll, 1.0)
        try:
            fired = await fire_due(self.engine)
        except Exception as exc:  # noqa: BLE001 - a storage hiccup is retried at the next poll
            self._say(f"firing schedules failed: {type(exc).__name__}: {exc}")
            return
        for run_id in fired:
            self._say(f"{run_id}: queued by its schedule")

    async def _prune(self) -> None:
        """Delete the runs that ended more than the engine's `retention` ago (a tenth of it apart, at most
        hourly), on a worker thread; nothing without a retention."""
        retention = self.engine.retention
        if retention is None or time.monotonic() < self._prune_at:
            return
        self._prune_at = time.monotonic() + min(3600.0, max(retention / 10, self.poll))
        try:
            report = await self.engine.prune(older_than=retention)
        except Exception as exc:  # noqa: BLE001 - a storage hiccup is retried at the next pass
            self._say(f"pruning ended runs failed: {type(exc).__name__}: {exc}")
            return
        if report.runs:
            self.pruned += len(report.runs)
            self._say(f"pruned {len(report.runs)} ended runs ({report.bytes:,} bytes)")

    async def _serve(self, lease: Any) -> None:
        """Run one claimed run until it ends, parks or is stopped; its lease is always released."""
        engine = self.engine
        run_id = lease.run_id
        began = time.monotonic()
        try:
            history = History(lease.records)
            if history.end is not None:
                engine.storage.unschedule(run_id)  # it ended, and its process died before leaving the queue
                engine.storage.release(lease)
                return
            try:
                workflow = engine.code_for(history.header)
            except DurablyError as exc:
                engine.storage.release(lease)
                self.admission.left(run_id, lease.records[0], lambda: True)  # it did not start: no place held
                self._skip[run_id] = time.monotonic() + SKIP_SECONDS
                self._say(f"{run_id}: {exc} (retrying in {SKIP_SECONDS:g}s)")
                return
            self._say(f"{run_id}: running {history.header.get('workflow')}")
            ended: list[Any] = []
            try:
                try:
                    await engine.drive(workflow, lease, history, history.header.get("input"), history.budget,
                                       engine.checkpoint_every, "silent", None, None, lease.torn, wait=False,
                                       stopping=lambda: self._stopping, ends=ended.append)
                finally:
                    for done in ended:  # its end made durable with the others' before anything says it ended
                        if len(self.ending) < ENDING_MAX * self.concurrency and run_id in self.active:
                            self.ending[run_id] = self.active.pop(run_id)  # its slot is free meanwhile
                            self.poke()
                        error = await self.ends.finish(done)
                        if error is not None:
                            self._say(f"{run_id}: its end could not be made durable ({type(error).__name__}: "
                                      f"{error}); it leaves the queue when the run is next claimed")
            except Parked as parked:
                if parked.status == "interrupted":
                    self.stopped.append(run_id)
                self._say(f"{run_id}: {parked.detail}")
            except RunCancelledError:
                self._say(f"{run_id}: cancelled")
            except Exception as exc:  # noqa: BLE001 - the run's error is recorded in its log, not the worker's
                status = "failed" if history.end is not None else "stopped"
                self._say(f"{run_id}: {status}: {type(exc).__name__}: {exc}")
            else:
                self._say(f"{run_id}: completed")
            self.ran += 1
        except Exception as exc:  # noqa: BLE001 - one broken run never stops the worker
            print(f"durably worker: {run_id}: {type(exc).__name__}: {exc}", file=sys.stderr)
            engine.storage.release(lease)
        finally:
            held = time.monotonic() - began
            self._pace = held if self._pace is None else 0.8 * self._pace + 0.2 * held
            self.active.pop(run_id, None)
            self.ending.pop(run_id, None)
            self._left(lease)
            if self._changed is not None:
                self._changed.set()
            self.poke()
