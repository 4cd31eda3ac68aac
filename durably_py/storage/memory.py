"""Runs in process memory, for tests and throwaway runs; same semantics as the file adapter.

Each run keeps the raw bytes of its log and decodes them on read, so what goes in comes back exactly as it
would from a file. Leases are time-based (`ttl` seconds, renewed by `heartbeat`) and fenced by epoch: a lease
is current while no later claim happened and it was not released, even after its ttl ran out.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import LeaseLostError, RunNotFoundError, ValidationError
from .base import (
    Check,
    Choose,
    Lease,
    LimitStep,
    Log,
    NewRun,
    QueueEntry,
    QueueStats,
    RunInfo,
    bind_and_create,
    checked,
    claim_candidates,
    claimed,
    count_queues,
    decode_record,
    decode_signal,
    decode_worker,
    due_order,
    ended,
    fair_order,
    finish_each,
    last_line,
    parse_log,
    queue_allows,
    sync_each,
)
from .catalog import OPEN, RunFilter, header_fields, queue_fields, state_after
from .front import StorageFront, amended_values
from .valuestore import resolve_line


class _Run:
    """One run's log bytes, lease state and signal inbox."""

    __slots__ = ("data", "epoch", "owner", "expires", "updated", "order", "synced", "signals", "state", "fields",
                 "place", "values")

    def __init__(self, data: bytes, order: int) -> None:
        self.data = bytearray(data)
        self.epoch = 0
        self.owner: str | None = None
        self.expires = 0.0
        self.updated = time.time()
        self.order = order
        self.synced = 0
        self.signals: list[tuple[str, bytes]] = []  # (signal id, line), in send order
        self.state = OPEN  # the catalog state: "open" or the end status
        header = decode_record(data)
        self.fields = header_fields(header)  # workflow, key, parent
        self.place = queue_fields(header)  # the queue and partition its entries are in
        self.values: dict[str, bytes] = {}  # the run's stored values by digest (`valuestore`)


def _kept(entry: QueueEntry) -> bool:
    """Every entry `fair_order` is given is kept (the memory adapter filters them first)."""
    return True


class MemoryStorage(StorageFront):
    """Runs in a dict, guarded by one lock; nothing survives the process."""

    def __init__(self, *, clock: Callable[[], float] = time.time, values_once: bool | None = None) -> None:
        """`clock`: the store's clock for limits (epoch seconds; `TestEngine` passes its fake clock's);
        `values_once`: keep large and repeated values once (`valuestore`; None: as `DURABLY_VALUES_ONCE` says)."""
        self.clock = clock
        self.values_once = values_once
        self.compact_above_bytes: int | None = None
        self.fsyncs = 0
        self._runs: dict[str, _Run] = {}
        self._queue: dict[str, QueueEntry] = {}
        self._joins: dict[str, set[str]] = {}  # a run parked in a join -> the children it still waits for
        self._joined: dict[str, str] = {}  # a child -> the run waiting for it in a join
        self._index: dict[str, str] = {}
        self._workers: dict[str, tuple[bytes, float]] = {}  # owner -> (advertisement, expiry on the monotonic clock)
        self._limits: dict[str, bytes] = {}  # limit key -> its document's JSON bytes
        self._partials: dict[tuple[str, str], list[bytes]] = {}  # (run, step path) -> its stream's chunks
        self._blobs: dict[str, bytes] = {}  # sha256 -> bytes kept under it (`keep_blob`)
        self._lock = threading.Lock()
        self._order = itertools.count()

    def __repr__(self) -> str:
        return f"MemoryStorage({len(self._runs)} runs)"

    def _do_create(self, run_id: str, header: bytes, record: dict[str, Any], at: float | None,
                   priority: int) -> None:
        """Create a run whose log starts with the `header` line, queued due at `at` (None: now)."""
        with self._lock:
            if run_id in self._runs:
                raise ValidationError(f"run {run_id} already exists in memory", run_id=run_id)
            run = self._runs[run_id] = _Run(header, next(self._order))
            now = time.time()
            self._queue[run_id] = QueueEntry(run_id, now if at is None else at, priority, (), now, *run.place)

    def _do_read(self, run_id: str) -> Log | None:
        """All records of a run (None if unknown)."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return None
            data = bytes(run.data)
            values = run.values  # only ever added to: every token `data` holds is found
        records, _, torn = parse_log(data, f"memory run {run_id}", lambda: values)
        return Log(records, torn, f"memory run {run_id}")

    def _do_claim(self, run_id: str, owner: str, ttl: float, check: Check | None, reopen: bool) -> Lease | None:
        """Take the lease unless a live owner holds it; bumps the epoch and appends the claim record. An ended
        run (without `reopen`) is refused and taken out of the queue, under the same lock."""
        with self._lock:
            run = self._get(run_id)
            now = time.monotonic()
            if run.owner is not None and run.expires >= now:
                return None
            records, good, torn = parse_log(bytes(run.data), f"memory run {run_id}", lambda: run.values)
            records = checked(records, f"memory run {run_id}", check)
            if not reopen and ended(records):
                self._unschedule(run_id)
                return None
            del run.data[good:]
            run.epoch += 1
            run.owner = owner
            run.expires = now + ttl
            line = claimed(records, run.epoch, owner)
            self._touch(run, line)
            return Lease(run_id, owner, run.epoch, {"memory": self}, records, torn, f"memory run {run_id}")

    def _do_amend(self, run_id: str, choose: Choose, check: Check | None) -> bool:
        """Append the lines `choose` returns to a run no live owner holds, without a claim or a new epoch; a
        lapsed owner loses its lease. False while a live owner holds it."""
        with self._lock:
            run = self._get(run_id)
            if run.owner is not None and run.expires >= time.monotonic():
                return False
            where = f"memory run {run_id}"
            records, good, _ = parse_log(bytes(run.data), where, lambda: run.values)
            line = choose(checked(records, where, check), where)
            if line is not None:
                run.values.update(amended_values(choose))
                del run.data[good:]
                run.owner = None
                self._touch(run, line)
                run.synced = len(run.data)
                self.fsyncs += 1
            return True

    def _get(self, run_id: str) -> _Run:
        """The run, or `RunNotFoundError`."""
        run = self._runs.get(run_id)
        if run is None:
            raise RunNotFoundError(f"no run {run_id} in memory", run_id=run_id)
        return run

    def _current(self, lease: Lease) -> _Run:
        """The run `lease` is current for, or `LeaseLostError` (call with the lock held)."""
        run = self._runs.get(lease.run_id)
        if run is None or run.epoch != lease.epoch or run.owner is None or lease.state.get("memory") is not self:
            raise LeaseLostError(f"the lease on run {lease.run_id} is no longer current", run_id=lease.run_id)
        return run

    def _touch(self, run: _Run, data: bytes) -> None:
        """Append `data` and mark the run as just updated."""
        run.data += data
        run.state = state_after(run.state, data)
        run.updated = time.time()
        run.order = next(self._order)

    def _do_heartbeat(self, lease: Lease, ttl: float) -> bool:
        """Extend the lease by `ttl` seconds from now; False when it was lost."""
        with self._lock:
            try:
                run = self._current(lease)
            except LeaseLostError:
                return False
            run.expires = time.monotonic() + ttl
            return True

    def release(self, lease: Lease) -> None:
        """Give the lease up; a stale lease leaves the current one alone."""
        with self._lock:
            try:
                run = self._current(lease)
            except LeaseLostError:
                return
            run.owner = None

    def _do_held(self, run_id: str) -> bool:
        """True while an owner holds an unexpired lease."""
        with self._lock:
            run = self._runs.get(run_id)
            return run is not None and run.owner is not None and run.expires >= time.monotonic()

    def _do_append(self, lease: Lease, data: bytes) -> None:
        """Append complete lines; `LeaseLostError` if `lease` is no longer current."""
        with self._lock:
            self._touch(self._current(lease), data)

    def _do_append_values(self, lease: Lease, data: bytes, blobs: dict[str, bytes]) -> None:
        """Keep the run's new stored values and append the lines that refer to them, under one hold of the lock."""
        with self._lock:
            run = self._current(lease)
            run.values.update(blobs)
            self._touch(run, data)

    def _do_keep_values(self, lease: Lease, blobs: dict[str, bytes]) -> None:
        """Keep the run's new stored values (`valuestore`)."""
        with self._lock:
            self._current(lease).values.update(blobs)

    def sync(self, lease: Lease) -> None:
        """Count a would-be fsync if anything was appended since the last sync (memory is never durable)."""
        with self._lock:
            run = self._current(lease)
            if run.synced != len(run.data):
                run.synced = len(run.data)
                self.fsyncs += 1

    def sync_all(self, leases: list[Lease]) -> None:
        """`sync` each lease (a grouped commit costs what separate ones do here)."""
        sync_each(self, leases)

    def finish_all(self, leases: list[Lease]) -> list[BaseException | None]:
        """`sync_all`, `unschedule` and `release` of each lease (memory has nothing to group)."""
        return finish_each(self, leases)

    def _do_size(self, run_id: str) -> int:
        """Bytes of the run's log."""
        with self._lock:
            return len(self._get(run_id).data)

    def _do_rewrite(self, lease: Lease, data: bytes) -> None:
        """Replace the whole log with `data` (counted as one fsync, as the file adapter's is); the lease stays current."""
        with self._lock:
            run = self._current(lease)
            run.data = bytearray(data)
            run.state = state_after(OPEN, data)
            run.synced = len(data)
            self.fsyncs += 1
            run.updated = time.time()
            run.order = next(self._order)

    def _do_bind(self, identity: str, run_id: str, expect: str | None) -> bool:
        """Point `identity` at `run_id` if it still points at `expect` (None: at nothing); False if not."""
        with self._lock:
            if self._index.get(identity) != expect:
                return False
            self._index[identity] = run_id
            return True

    def _do_lookup(self, identity: str) -> str | None:
        """The run `identity` is bound to, if any."""
        with self._lock:
            return self._index.get(identity)

    def _do_lookup_many(self, identities: list[str]) -> list[str | None]:
        """The run each identity is bound to (None where none), in order, read under one hold of the lock."""
        with self._lock:
            return [self._index.get(identity) for identity in identities]

    def _do_create_bound(self, runs: list[NewRun], headers: list[dict[str, Any]]) -> str | None:
        """Bind and create each run in order (memory has nothing to make durable)."""
        return bind_and_create(self, runs)

    def _do_info(self, run_id: str) -> RunInfo | None:
        """One run's header, last record and held flag (None if unknown)."""
        with self._lock:
            run = self._runs.get(run_id)
            return None if run is None else self._info(run_id, run, time.monotonic())

    def _info(self, run_id: str, run: _Run, now: float) -> RunInfo:
        """A run's `RunInfo` (call with the lock held)."""
        header = decode_record(bytes(run.data[: run.data.find(b"\n") + 1])) or {}
        last = decode_record(resolve_line(bytes(last_line(run.data)), lambda: run.values)) or header
        return RunInfo(run_id, header, last, run.owner is not None and run.expires >= now, run.updated, run.epoch,
                       run.state)

    def _matching(self, where: dict[str, Any]) -> list[tuple[str, _Run]]:
        """The runs passing the filter, most recently updated first (call with the lock held)."""
        query = RunFilter.of(**where)
        found = [(run_id, run) for run_id, run in self._runs.items()
                 if query.matches(run_id, run.state, *run.fields, run.updated)]
        found.sort(key=lambda item: item[1].order, reverse=True)
        return found

    def _do_list_runs(self, limit: int | None, offset: int, where: dict[str, Any]) -> list[RunInfo]:
        """Runs matching the filter (`catalog.RunFilter`), most recently updated first."""
        now = time.monotonic()
        with self._lock:
            found = self._matching(where)[offset: None if limit is None else offset + limit]
            return [self._info(run_id, run, now) for run_id, run in found]

    def count_runs(self, **where: Any) -> int:
        """How many runs match the filter."""
        with self._lock:
            return len(self._matching(where))

    def _do_delete(self, run_id: str) -> int | None:
        """Remove a run, its inbox, queue entry and identity bindings; the bytes freed, None (nothing removed)
        while an owner holds its lease, 0 for an unknown run."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return 0
            if run.owner is not None and run.expires >= time.monotonic():
                return None
            del self._runs[run_id]
            self._queue.pop(run_id, None)
            self._drop_partials(run_id, None)
            for identity in [i for i, bound in self._index.items() if bound == run_id]:
                del self._index[identity]
            return len(run.data) + sum(len(line) for _, line in run.signals)

    def _do_send(self, run_id: str, line: bytes, signal_id: str) -> None:
        """Store one signal line in the run's inbox; `RunNotFoundError` if unknown."""
        with self._lock:
            self._get(run_id).signals.append((signal_id, line))
        name = (decode_signal(line) or {}).get("name")
        if isinstance(name, str) and name:
            self.wake(run_id, name)

    def _do_inbox(self, run_id: str) -> list[dict[str, Any]]:
        """The run's unacknowledged signals, in send order; `RunNotFoundError` if unknown."""
        with self._lock:
            lines = [line for _, line in self._get(run_id).signals]
        return [signal for signal in map(decode_signal, lines) if signal is not None]

    def _do_ack(self, run_id: str, signal_id: str) -> None:
        """Drop every stored copy of signal `signal_id` (none stored: nothing happens)."""
        with self._lock:
            run = self._get(run_id)
            run.signals = [entry for entry in run.signals if entry[0] != signal_id]

    def _do_schedule(self, run_id: str, at: float | None, wait: tuple[str, ...], priority: int | None) -> None:
        """Set the run's queue entry."""
        with self._lock:
            run = self._get(run_id)
            old = self._queue.get(run_id)
            keep = old.priority if old is not None else 0
            created = old.created if old is not None else time.time()
            self._queue[run_id] = QueueEntry(run_id, at, keep if priority is None else priority, wait, created,
                                             *run.place)
            self._drop_joins(run_id)

    def _drop_joins(self, run_id: str) -> None:
        for child in self._joins.pop(run_id, ()):
            if self._joined.get(child) == run_id:
                del self._joined[child]

    def _do_join_wait(self, run_id: str, children: tuple[str, ...]) -> bool:
        """Park the run until the children still queued end; due now when none is."""
        with self._lock:
            run = self._get(run_id)
            old = self._queue.get(run_id)
            self._drop_joins(run_id)
            waiting = {c for c in children if c in self._queue}
            now = time.time()
            self._queue[run_id] = QueueEntry(run_id, None if waiting else now, old.priority if old else 0, (),
                                             old.created if old else now, *run.place)
            if waiting:
                self._joins[run_id] = waiting
                for child in waiting:
                    self._joined[child] = run_id
            return not waiting

    def _do_unschedule(self, run_id: str) -> None:
        """Drop the run's queue entry; a parent whose last awaited child this was is due now."""
        with self._lock:
            self._unschedule(run_id)

    def _unschedule(self, run_id: str) -> None:
        """`unschedule` with the lock held."""
        self._queue.pop(run_id, None)
        self._drop_joins(run_id)
        parent = self._joined.pop(run_id, None)
        waiting = self._joins.get(parent) if parent is not None else None
        if parent is not None and waiting is not None:
            waiting.discard(run_id)
            entry = self._queue.get(parent)
            if not waiting:
                del self._joins[parent]
                now = time.time()
                if entry is not None and (entry.at is None or entry.at > now):
                    self._queue[parent] = replace(entry, at=now)

    def _do_wake(self, run_id: str, name: str | None) -> bool:
        """Make the run due now if its entry waits for `name` (None: unconditionally)."""
        with self._lock:
            old = self._queue.get(run_id)
            now = time.time()
            if old is None or (name is not None and name not in old.wait) or (old.at is not None and old.at <= now):
                return False
            self._queue[run_id] = replace(old, at=now)
            return True

    def _do_entry(self, run_id: str) -> QueueEntry | None:
        """The run's queue entry, if queued."""
        with self._lock:
            return self._queue.get(run_id)

    def _do_due(self, limit: int, now: float | None, skip: tuple[str, ...], names: frozenset[str] | None,
                queues: frozenset[str] | None, full: frozenset[str]) -> list[str]:
        """Due, unheld runs (of `names` and `queues`, when given, none of `full`) in the queue's fair order."""
        now = time.time() if now is None else now
        clock = time.monotonic()
        with self._lock:
            ready = [e for e in self._queue.values() if e.at is not None and e.at <= now and e.run_id not in skip
                     and e.run_id in self._runs
                     and (names is None or self._runs[e.run_id].fields[0] in names)
                     and queue_allows(e, queues, full)
                     and not (self._runs[e.run_id].owner is not None and self._runs[e.run_id].expires >= clock)]
        ready.sort(key=due_order)
        return [e.run_id for e in itertools.islice(fair_order(ready, _kept), limit)]

    def next_due(self, now: float | None = None) -> float | None:
        """The earliest time after `now` at which a queued run falls due (None: none is to)."""
        now = time.time() if now is None else now
        with self._lock:
            return min((e.at for e in self._queue.values() if e.at is not None and e.at > now), default=None)

    def watch(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """None: a memory store lives in one process, whose engine pokes its own worker."""
        return None

    def _do_claim_due(self, owner: str, ttl: float, limit: int, skip: tuple[str, ...], check: Check | None,
                      names: frozenset[str] | None, queues: frozenset[str] | None,
                      full: frozenset[str]) -> list[Lease]:
        """Claim up to `limit` due runs."""
        due = self._do_due(2 * limit + 2, None, skip, names, queues, full)
        return claim_candidates(self, due, owner, ttl, limit, check)

    def _do_queue_stats(self, now: float) -> list[QueueStats]:
        """Every entry counted under the lock."""
        clock = time.monotonic()
        with self._lock:
            found = [(entry, run is not None and run.owner is not None and run.expires >= clock)
                     for entry in self._queue.values() for run in (self._runs.get(entry.run_id),)]
        return count_queues(found, now)

    # ---- workers --------------------------------------------------------------------------------
    def _do_advertise(self, owner: str, line: bytes, ttl: float) -> None:
        """Keep the worker's advertisement until `ttl` seconds from now."""
        with self._lock:
            self._workers[owner] = (line, time.monotonic() + ttl)

    def _do_retire(self, owner: str) -> None:
        """Forget the worker's advertisement."""
        with self._lock:
            self._workers.pop(owner, None)

    def workers(self) -> list[dict[str, Any]]:
        """The advertisements that have not expired."""
        now = time.monotonic()
        with self._lock:
            lines = [line for line, expires in self._workers.values() if expires >= now]
        return [found for line in lines if (found := decode_worker(line)) is not None]

    # ---- limits ---------------------------------------------------------------------------------
    def _do_limit(self, key: str, step: LimitStep) -> Any:
        """Run `step` on the key's document under the adapter's lock, with `now` from the store's `clock`."""
        with self._lock:
            stored = self._limits.get(key)
            data, result = step(stored, self.clock(), self._live)
            if data is None:
                self._limits.pop(key, None)
            else:
                self._limits[key] = data
            return result

    def _live(self, run_id: str, epoch: int) -> bool:
        """True while the lease taken at `epoch` on `run_id` is the run's current one, held and unexpired (call
        with the lock held)."""
        run = self._runs.get(run_id)
        if epoch < 0:  # held while the run has not ended
            return run is not None and run.state == OPEN
        return (run is not None and run.epoch == epoch and run.owner is not None
                and run.expires >= time.monotonic())

    def _do_limits(self, prefix: str) -> dict[str, bytes]:
        """The documents whose key starts with `prefix`."""
        with self._lock:
            return {key: data for key, data in self._limits.items() if key.startswith(prefix)}

    # ---- stream partials -----------------------------------------------------------------------
    def _do_append_partials(self, run_id: str, path: str, attempt: int, chunks: list[bytes]) -> None:
        with self._lock:
            self._partials.setdefault((run_id, path), []).extend(chunks)

    def _do_read_partials(self, run_id: str, path: str, offset: int) -> list[bytes]:
        with self._lock:
            return self._partials.get((run_id, path), [])[offset:]

    def _do_drop_partials(self, run_id: str, path: str | None) -> None:
        with self._lock:
            self._drop_partials(run_id, path)

    def _drop_partials(self, run_id: str, path: str | None) -> None:
        for key in [key for key in self._partials if key[0] == run_id and path in (None, key[1])]:
            del self._partials[key]

    def _do_partial_paths(self, run_id: str) -> dict[str, int]:
        with self._lock:
            return {path: len(chunks) for (run, path), chunks in self._partials.items() if run == run_id and chunks}

    # ---- blobs ----------------------------------------------------------------------------------
    def _do_keep_blob(self, digest: str, data: bytes) -> None:
        with self._lock:
            self._blobs.setdefault(digest, data)

    def _do_blob(self, digest: str) -> bytes | None:
        with self._lock:
            return self._blobs.get(digest)

    def close(self) -> None:
        """Nothing to release; present so every adapter can be closed alike."""
