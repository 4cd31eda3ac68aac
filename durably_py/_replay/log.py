"""A run's log as one execution writes it (`RunLog`): appends, fsyncs, loop compaction, the start records of
long steps, advisories, and the fence that ends all writing once the process is dead, the lease lost or the
storage full."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from .. import records
from .._state.advisories import AdvisoryTracker, level_for
from .._state.history import History
from ..errors import LeaseLostError, StorageFullError
from .stops import HALTED, Crash, Parked

if TYPE_CHECKING:
    from .._authoring.calls import Attempt
    from ..storage.base import Lease, Storage
    from ..storage.roles import AppTransaction
    from .watchdog import Watchdog

DEFAULT_SYNC_STEPS = 1000
DEFAULT_SYNC_SECONDS = 1.0
LOOP_COMPACT_BYTES = 64 * 1024


class InFlight(Protocol):
    """The steps of the run running now (`steps.Steps`): what the heartbeat's start records are about."""

    @property
    def running(self) -> Mapping[Attempt, Any]: ...

    @property
    def step_running_since(self) -> float | None: ...

    @property
    def watchdog(self) -> Watchdog: ...


class RunLog:
    """Appends one execution makes to its run's log (thread-safe), and when they are made durable."""

    def __init__(self, storage: Storage, lease: Lease, history: History, advisories: AdvisoryTracker,
                 checkpoint_every: int | None) -> None:
        self.storage = storage
        self.lease = lease
        self.history = history
        self.run_id: str = history.header.run_id
        self.advisories = advisories
        self.lock = threading.Lock()
        self.sync_every = checkpoint_every or DEFAULT_SYNC_STEPS
        self.sync_by_time = checkpoint_every is None
        self.unsynced = 0
        self.last_sync = time.monotonic()
        self.syncs = 0
        self.since_compaction = 0
        self.dead = False  # the process is (as good as) killed: nothing more is written
        self.lost: LeaseLostError | None = None  # the lease went to another process
        self.full: StorageFullError | None = None  # a write refused for space: nothing more is written
        self.flight: InFlight | None = None  # the steps running, for `record_long_steps`
        self.marked: set[Attempt] = set()  # running attempts whose start the heartbeat recorded
        self.began: dict[Attempt, float] = {}  # when each of those started (as near as the heartbeat can tell)
        # a storage that commits appends in groups (PostgreSQL): `write` hands records in without waiting, and
        # `pending` is the last one's commit, which `settled` awaits before a step's result is handed back
        self.grouped: bool = getattr(storage, "groups_appends", False)
        self.pending: Future[Any] | asyncio.Future[Any] | None = None

    def fence(self) -> None:
        """Raise what stops every write, if anything does."""
        if self.dead:
            raise Crash()
        if self.lost is not None:
            raise self.lost
        if self.full is not None:
            raise self.full

    def stops(self, exc: BaseException) -> bool:
        """Whether `exc` stops the whole run rather than failing one operation."""
        return isinstance(exc, Crash | Parked) or exc is self.lost or exc is self.full or exc is HALTED

    @contextlib.contextmanager
    def stopping(self) -> Iterator[None]:
        """Around a write: remember a lost lease or a full storage for good (the run stops at either)."""
        try:
            yield
        except LeaseLostError as exc:
            self.lost = exc
            raise
        except StorageFullError as exc:  # a smaller record might still fit: the run stops here all the same
            self.full = exc
            raise

    def _append(self, data: bytes) -> None:
        """Append `data` (the lock held), remembering a lost lease or a full storage for good."""
        with self.stopping():
            self.storage.append(self.lease, data)
        self.since_compaction += len(data)

    def write(self, rec: records.Record) -> None:
        """Append one record (thread-safe); in a crashed run nothing more is written."""
        if self.dead or self.lost is not None or self.full is not None:
            self.fence()
        data = records.encode(rec)
        with self.lock:
            try:  # `_append` written out: every step's record comes here
                if self.grouped:
                    self.hand_in(data)
                else:
                    self.storage.append(self.lease, data)
            except LeaseLostError as exc:
                self.lost = exc
                raise
            except StorageFullError as exc:
                self.full = exc
                raise
            self.since_compaction += len(data)
            if type(rec) is records.Ok and rec.signal is None and rec.ts is not None:
                self.history.add_ok(rec)
            else:
                self.history.add(rec)

    def hand_in(self, data: bytes) -> None:
        """Hand `data` to the storage's next group commit (the lock held), after raising what made the last one
        handed in fail, if it did."""
        prior = self.pending
        if prior is not None and prior.done():
            self.pending = None
            error = prior.exception()
            if error is not None:
                raise error
        self.pending = self.storage.append_soon(self.lease, data)  # type: ignore[attr-defined] # roles.GroupCommits

    async def settled(self) -> None:
        """Once the records written so far are durable (with a storage that commits appends in groups: the last
        group commit carrying one of them returned; else at once), yielding to the loop once meanwhile. A write
        that failed stops the run as at `write` (a lost lease, a full storage)."""
        pending = self.pending
        if pending is None:
            await asyncio.sleep(0)
            return
        if not pending.done():
            try:  # a cancel does not undo a write handed in
                await asyncio.shield(pending if isinstance(pending, asyncio.Future) else asyncio.wrap_future(pending))
            except Exception:  # noqa: BLE001 - the write's error, raised below
                pass
        else:
            await asyncio.sleep(0)
        if self.pending is pending:
            self.pending = None
        error = pending.exception()
        if error is not None:
            with self.stopping():
                raise error

    def commit(self, tx: AppTransaction, rec: records.Record) -> None:
        """Append `rec` inside the application's transaction `tx` and commit both (`ctx.transaction`): fenced as
        `write` is, and folded into the history once committed. A lost lease or a full storage rolls `tx` back
        and stops the run as they do at any write."""
        self.fence()
        data = records.encode(rec)
        with self.stopping():  # not under `lock`: a thread holding it may wait for the database lock `tx` holds
            tx.commit(self.lease, data)
        with self.lock:
            self.since_compaction += len(data)
            self.history.add(rec)

    def write_unkept(self, recs: list[records.Record], batch: str) -> None:
        """Append `recs` in one storage append (one write or transaction for all) without folding them into
        the in-memory history (`History.kept_out`): the spawn and join records of a wide fan-out, which
        nothing in this process reads again."""
        self.fence()
        data = b"".join([records.encode(rec) for rec in recs])
        with self.lock:
            self._append(data)
            self.history.kept_out(batch, getattr(recs[-1], "ts", None))

    def record_long_steps(self) -> None:
        """Record a `start` for every attempt still running since the heartbeat's last look (called from the
        heartbeat thread while a step has run for a while), so a process killed inside a long step leaves
        which step it was in for `inspect`. Quick steps never pay for it; nothing is fsynced; the in-memory
        history is left alone (the records matter to a later process only)."""
        flight = self.flight
        if flight is None:
            return
        running = list(flight.running)
        since = flight.step_running_since
        for att in running:
            if att in self.marked:
                continue
            self.marked.add(att)
            # the time it started when it is the only step running (else: now, the latest it can have started)
            ts = time.time() - (time.monotonic() - since) if len(running) == 1 and since is not None else time.time()
            self.began[att] = ts
            recorded = self.history.starts.get(att.path)
            if recorded is not None and recorded.attempt == att.number:  # an unsafe step's start, fsynced
                continue
            data = records.encode(records.Start(path=att.path, label=att.label, attempt=att.number, ts=ts))
            with self.lock:
                if self.dead or self.lost is not None or att not in flight.running:
                    continue
                self.storage.append(self.lease, data)
        self.marked.intersection_update(running)
        for att in [att for att in self.began if att not in self.marked]:
            del self.began[att]
        timed = {att for _, _, att in list(flight.watchdog.running.values())}
        now = time.time()
        for att, began in list(self.began.items()):  # a slow step with no timeout= is advised while it runs
            if att not in timed and level_for("SLOW_STEP_NO_TIMEOUT", now - began) is not None:
                self.advise("SLOW_STEP_NO_TIMEOUT", now - began,
                            f"step {att.label!r} has run {now - began:.0f}s with no timeout= and still runs")

    def compact_loops(self) -> list[str]:
        """After a loop snapshot: rewrite the log without the records snapshots cover, every
        `LOOP_COMPACT_BYTES` written, so a resumed loop reads a bounded log however many iterations ran.
        Returns the paths whose records were dropped.

        The in-memory history drops the same records, so each compaction costs what the log keeps, not
        what the run wrote. Off when the storage does not compact (`compact_above_bytes=None`)."""
        if self.dead or self.since_compaction < LOOP_COMPACT_BYTES \
                or getattr(self.storage, "compact_above_bytes", None) is None:
            return []
        with self.lock:
            self.since_compaction = 0
            history = self.history
            covered = [p for p in history.done if history.snapshotted(p)]
            if not covered:
                return []
            kept = self.logged().compacted() if history.elided else history.compacted()
            self.storage.rewrite(self.lease, b"".join(records.encode(r) for r in kept))
            for table in (history.fails, history.starts, history.stashes, history.waits, history.wakes):
                for p in [p for p in table if p in history.done]:
                    del table[p]
            for p in covered:
                del history.done[p]
            return covered

    def logged(self) -> History:
        """The run's whole history read back from its log (for when the in-memory one forgot records)."""
        log = self.storage.read(self.run_id)
        assert log is not None
        return History(log.records, log.where)

    def step_done(self, now: float | None = None) -> None:
        """Count a completed step and fsync when the checkpoint policy says so (`now`: a monotonic reading the
        caller already has)."""
        self.unsynced += 1
        if self.unsynced >= self.sync_every or (
            self.sync_by_time and (time.monotonic() if now is None else now) - self.last_sync >= DEFAULT_SYNC_SECONDS
        ):
            self.sync()

    def steps_done(self, count: int) -> None:
        """Count `count` steps completed together (one batch of writes): at most one fsync for all of them."""
        self.unsynced += count - 1
        self.step_done()

    def sync(self) -> None:
        """Make everything written so far survive a machine crash."""
        if self.dead:
            return
        with self.lock:
            self.storage.sync(self.lease)
        self.syncs += 1
        self.unsynced = 0
        self.last_sync = time.monotonic()

    def advise(self, code: str, measure: float, msg: str, level: str | None = None, **fmt: Any) -> None:
        """Report an advisory when `measure` crosses one of the code's thresholds (or at `level`); store emissions.
        `fmt` fills the `{names}` of the catalogue's hint."""
        level = level or level_for(code, measure)
        if level is None:
            return
        emitted = self.advisories.report(code, level, msg, **fmt)
        if emitted is not None and not self.dead:
            self.write(records.Advice(advisory=emitted.to_dict()))
