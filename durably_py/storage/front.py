"""The front every adapter shares: each public `Storage` method that takes arguments checks them here, once,
then calls the adapter's `_do_<method>` with them checked (and converted: a ttl as float, a wait as a tuple,
a signal as its line and id), so adapters hold no argument checks of their own and every adapter refuses
bad input with the same `ValidationError`.

Methods whose arguments need no check (`release`, `sync`, `sync_all`, `finish_all`, `count_runs`,
`next_due`, `watch`, `workers`) are the adapters' own.

A limit's document is JSON to its caller and bytes to its adapter: the front decodes what is stored, calls the
caller's `update`, checks and encodes what it returns (`_limit_step`), so every adapter stores the same bytes and
refuses the same documents.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import CorruptLogError, ValidationError
from .base import (
    LIMITS_DOCS,
    Check,
    Choose,
    Lease,
    LimitStep,
    Live,
    Log,
    NewRun,
    QueueEntry,
    QueueStats,
    RunInfo,
    decode_limit_doc,
    encode_limit_doc,
    validate_at,
    validate_blob,
    validate_header,
    validate_identity,
    validate_limit,
    validate_limit_key,
    validate_limit_prefix,
    validate_limit_update,
    validate_lines,
    validate_name,
    validate_new_runs,
    validate_owner,
    validate_priority,
    validate_queue_set,
    validate_rewrite,
    validate_run_id,
    validate_signal,
    validate_signal_id,
    validate_ttl,
    validate_wait,
    validate_worker,
    validate_workflows,
)
from .catalog import validate_page
from .partials import PartialsFront
from .roles import LimitUpdate
from .valuestore import LINE_MIN, enabled, externalise

__all__ = ["StorageFront", "amended_values"]


class _Checked:
    """`choose` whose lines are checked before an `amend` appends them, and (`values_once`) their large and
    repeated values replaced by references: the adapter keeps `values` with the lines, in the same step."""

    __slots__ = ("choose", "once", "values")

    def __init__(self, choose: Choose, once: bool) -> None:
        self.choose = choose
        self.once = once
        self.values: dict[str, bytes] = {}

    def __call__(self, records: list[Any], where: str) -> bytes | None:
        line = self.choose(records, where)
        if line is None:
            return None
        line = validate_lines(line)
        if self.once and len(line) >= LINE_MIN:
            line, self.values = externalise(line, set())
        return line


def amended_values(choose: Choose) -> dict[str, bytes]:
    """The stored values the lines an `amend`'s `choose` returned refer to (`_Checked`), for its adapter to
    keep with them."""
    return choose.values if isinstance(choose, _Checked) else {}


def _full(full: object) -> frozenset[str]:
    """`full=` of `due` and `claim_due` as a frozenset of queue and "QUEUE/PARTITION" names."""
    found = validate_queue_set(full, "full", none=False)
    assert found is not None
    return found


def _limit_step(key: str, update: LimitUpdate, where: str) -> LimitStep:
    """The step an adapter runs for `limit(key, update)`: the stored bytes decoded for `update`, its `live`
    checked and answering only while it runs, what it returns checked (a pair) and its document encoded
    (`encode_limit_doc`: plain JSON, else `ValidationError` before anything is written)."""

    def step(stored: bytes | None, now: float, live: Live) -> tuple[bytes | None, Any]:
        doc = None if stored is None else decode_limit_doc(key, stored, where)
        running = True

        def checked_live(run_id: str, epoch: int) -> bool:
            if not running:
                raise ValidationError(f"live() of limit {key!r} was called after its update returned",
                                      hint="Call live(run_id, epoch) inside update only: it answers in the same "
                                           "atomic step.", docs=LIMITS_DOCS)
            validate_run_id(run_id)
            if isinstance(epoch, bool) or not isinstance(epoch, int):
                raise ValidationError(f"live() takes a lease's epoch as an int, got {epoch!r}",
                                      hint="Pass lease.epoch, as recorded when the permit was taken.",
                                      docs=LIMITS_DOCS)
            return -(2**63) <= epoch < 2**63 and bool(live(run_id, epoch))  # an epoch no store holds: not live

        try:
            answer = update(doc, now, checked_live)
        finally:
            running = False
        if not isinstance(answer, tuple) or len(answer) != 2:
            raise ValidationError(
                f"the update of limit {key!r} must return (new document, result), got {answer!r:.120}; nothing "
                "was stored", hint="Return (doc, result); a None document removes it.", docs=LIMITS_DOCS)
        new, result = answer
        return (None if new is None else encode_limit_doc(key, new)), result

    return step


class StorageFront(PartialsFront):
    """The checked public methods of an adapter; a subclass implements each `_do_<method>`."""

    # ---- RunLogs -----------------------------------------------------------------------------------------
    def create(self, run_id: str, header: bytes, *, at: float | None = None, priority: int = 0) -> None:
        """Create a run (`RunLogs.create`)."""
        validate_run_id(run_id)
        record = validate_header(run_id, header)
        self._do_create(run_id, header, record, validate_at(at), validate_priority(priority))

    def read(self, run_id: str) -> Log | None:
        """All records of a run (`RunLogs.read`)."""
        return self._do_read(validate_run_id(run_id))

    def claim(self, run_id: str, owner: str, ttl: float, *, check: Check | None = None,
              reopen: bool = False) -> Lease | None:
        """Take the run's lease (`RunLogs.claim`)."""
        validate_run_id(run_id)
        validate_owner(owner)
        return self._do_claim(run_id, owner, validate_ttl(ttl), check, reopen)

    def amend(self, run_id: str, choose: Choose, *, check: Check | None = None) -> bool:
        """Append what `choose` returns to an unheld run (`RunLogs.amend`); its lines are checked too."""
        return self._do_amend(validate_run_id(run_id), _Checked(choose, enabled(self.values_once)), check)

    def heartbeat(self, lease: Lease, ttl: float) -> bool:
        """Extend the lease (`RunLogs.heartbeat`)."""
        return self._do_heartbeat(lease, validate_ttl(ttl))

    def held(self, run_id: str) -> bool:
        """True while a live owner holds the run (`RunLogs.held`)."""
        return self._do_held(validate_run_id(run_id))

    values_once: bool | None = None
    """Whether long lines keep their large and repeated values once, as blobs of the run (`valuestore`); None:
    as `DURABLY_VALUES_ONCE` says (on unless it is 0). Set by each adapter's `values_once=` argument."""

    def append(self, lease: Lease, data: bytes) -> None:
        """Append complete record lines (`RunLogs.append`); a long line's large or repeated values are kept once
        (`valuestore.externalise`), before the line that refers to them."""
        if type(data) is not bytes or not data.endswith(b"\n"):  # once per step: the common case checks inline
            data = validate_lines(data)
        if len(data) >= LINE_MIN and enabled(self.values_once):
            kept = lease.state.setdefault("kept_values", set())
            data, blobs = externalise(data, kept)
            if blobs:
                self._do_append_values(lease, data, blobs)
                kept.update(blobs)
                return
        self._do_append(lease, data)

    def size(self, run_id: str) -> int:
        """Bytes of the run's log (`RunLogs.size`)."""
        return self._do_size(validate_run_id(run_id))

    def rewrite(self, lease: Lease, data: bytes) -> None:
        """Replace the whole log (`RunLogs.rewrite`)."""
        data = validate_rewrite(lease.run_id, data)
        if len(data) >= LINE_MIN and enabled(self.values_once):
            kept = lease.state.setdefault("kept_values", set())
            data, blobs = externalise(data, kept)
            if blobs:
                self._do_keep_values(lease, blobs)
                kept.update(blobs)
        self._do_rewrite(lease, data)

    # ---- Identities --------------------------------------------------------------------------------------
    def bind(self, identity: str, run_id: str, expect: str | None = None) -> bool:
        """Point an identity at a run if it still points at `expect` (`Identities.bind`)."""
        validate_identity(identity)
        validate_run_id(run_id)
        if expect is not None:
            validate_run_id(expect)
        return self._do_bind(identity, run_id, expect)

    def lookup(self, identity: str) -> str | None:
        """The run an identity points at (`Identities.lookup`)."""
        return self._do_lookup(validate_identity(identity))

    def lookup_many(self, identities: list[str]) -> list[str | None]:
        """The run each identity points at (`Identities.lookup_many`)."""
        for identity in identities:
            validate_identity(identity)
        return self._do_lookup_many(identities)

    def create_bound(self, runs: list[NewRun]) -> str | None:
        """Bind and create a batch of runs (`Identities.create_bound`), every run checked before the first."""
        return self._do_create_bound(runs, validate_new_runs(runs))

    # ---- Catalog -----------------------------------------------------------------------------------------
    def info(self, run_id: str) -> RunInfo | None:
        """One run's summary (`Catalog.info`)."""
        return self._do_info(validate_run_id(run_id))

    def list_runs(self, *, limit: int | None = None, offset: int = 0, **where: Any) -> list[RunInfo]:
        """Runs matching the filter (`Catalog.list_runs`)."""
        limit, offset = validate_page(limit, offset)
        return self._do_list_runs(limit, offset, where)

    def delete(self, run_id: str) -> int | None:
        """Remove a run for good (`Catalog.delete`)."""
        return self._do_delete(validate_run_id(run_id))

    # ---- Inbox -------------------------------------------------------------------------------------------
    def send(self, run_id: str, data: bytes) -> None:
        """Store one signal line for the run (`Inbox.send`)."""
        validate_run_id(run_id)
        line, signal_id = validate_signal(data)
        self._do_send(run_id, line, signal_id)

    def inbox(self, run_id: str) -> list[dict[str, Any]]:
        """The run's unacknowledged signals (`Inbox.inbox`)."""
        return self._do_inbox(validate_run_id(run_id))

    def ack(self, run_id: str, signal_id: str) -> None:
        """Remove a stored signal (`Inbox.ack`)."""
        validate_run_id(run_id)
        self._do_ack(run_id, validate_signal_id(signal_id))

    # ---- DueQueue ----------------------------------------------------------------------------------------
    def schedule(self, run_id: str, at: float | None, *, wait: tuple[str, ...] = (),
                 priority: int | None = None) -> None:
        """Put the run in the queue or move it (`DueQueue.schedule`)."""
        validate_run_id(run_id)
        at = validate_at(at)
        wait = validate_wait(wait)
        self._do_schedule(run_id, at, wait, None if priority is None else validate_priority(priority))

    def join_wait(self, run_id: str, children: tuple[str, ...]) -> bool:
        """Park a run until its children end (`DueQueue.join_wait`)."""
        validate_run_id(run_id)
        for child in children:
            validate_run_id(child)
        return self._do_join_wait(run_id, children)

    def unschedule(self, run_id: str) -> None:
        """Take the run out of the queue (`DueQueue.unschedule`)."""
        self._do_unschedule(validate_run_id(run_id))

    def wake(self, run_id: str, name: str | None = None) -> bool:
        """Make a queued run due now if it waits for `name` (`DueQueue.wake`)."""
        validate_run_id(run_id)
        if name is not None:
            validate_name(name)
        return self._do_wake(run_id, name)

    def entry(self, run_id: str) -> QueueEntry | None:
        """The run's queue entry (`DueQueue.entry`)."""
        return self._do_entry(validate_run_id(run_id))

    def due(self, limit: int, now: float | None = None, *, skip: tuple[str, ...] = (),
            workflows: frozenset[str] | None = None, queues: frozenset[str] | None = None,
            full: frozenset[str] = frozenset()) -> list[str]:
        """Ids of due, unheld runs (`DueQueue.due`)."""
        validate_limit(limit)
        names = validate_workflows(workflows)
        return self._do_due(limit, now, skip, names, validate_queue_set(queues, "queues", none=True),
                            _full(full))

    def claim_due(self, owner: str, ttl: float, limit: int, *, skip: tuple[str, ...] = (),
                  check: Check | None = None, workflows: frozenset[str] | None = None,
                  queues: frozenset[str] | None = None, full: frozenset[str] = frozenset()) -> list[Lease]:
        """Claim up to `limit` due runs (`DueQueue.claim_due`)."""
        validate_owner(owner)
        ttl = validate_ttl(ttl)
        validate_limit(limit)
        names = validate_workflows(workflows)
        return self._do_claim_due(owner, ttl, limit, skip, check, names,
                                  validate_queue_set(queues, "queues", none=True), _full(full))

    def queue_stats(self, now: float | None = None) -> list[QueueStats]:
        """What each queue and partition holds (`DueQueue.queue_stats`)."""
        at = validate_at(now)
        return self._do_queue_stats(time.time() if at is None else at)

    # ---- Fleet -------------------------------------------------------------------------------------------
    def advertise(self, owner: str, info: dict[str, Any], ttl: float) -> None:
        """Record that worker `owner` is live (`Fleet.advertise`)."""
        line = validate_worker(owner, info)
        self._do_advertise(owner, line, validate_ttl(ttl))

    def retire(self, owner: str) -> None:
        """Remove worker `owner`'s advertisement (`Fleet.retire`)."""
        self._do_retire(validate_owner(owner))

    # ---- Limits ------------------------------------------------------------------------------------------
    def limit(self, key: str, update: LimitUpdate) -> Any:
        """Atomically change the document stored under `key` (`Limits.limit`); checked key, callable update,
        and a plain-JSON document, else `ValidationError` and nothing written."""
        validate_limit_key(key)
        return self._do_limit(key, _limit_step(key, validate_limit_update(update), repr(self)))

    def limits(self, prefix: str = "") -> dict[str, Any]:
        """Every stored limit document whose key starts with `prefix`, by key in key order (`Limits.limits`); a
        document damaged outside durably is left out (`limit` of its key names it)."""
        found = self._do_limits(validate_limit_prefix(prefix))
        docs: dict[str, Any] = {}
        for key in sorted(found):
            try:
                docs[key] = decode_limit_doc(key, found[key], repr(self))
            except CorruptLogError:
                continue
        return docs

    # ---- Blobs -------------------------------------------------------------------------------------------
    def keep_blob(self, digest: str, data: bytes) -> None:
        """Keep `data` under its sha256 (`Blobs.keep_blob`); a digest that is not the data's is a `ValidationError`
        and nothing is written."""
        self._do_keep_blob(validate_blob(digest, data), bytes(data))

    def blob(self, digest: str) -> bytes | None:
        """The data kept under `digest` (`Blobs.blob`)."""
        return self._do_blob(validate_blob(digest))

    # ---- what each adapter implements, its arguments checked ---------------------------------------------
    def _do_create(self, run_id: str, header: bytes, record: dict[str, Any], at: float | None,
                   priority: int) -> None:
        raise NotImplementedError

    def _do_read(self, run_id: str) -> Log | None:
        raise NotImplementedError

    def _do_claim(self, run_id: str, owner: str, ttl: float, check: Check | None, reopen: bool) -> Lease | None:
        raise NotImplementedError

    def _do_amend(self, run_id: str, choose: Choose, check: Check | None) -> bool:
        raise NotImplementedError

    def _do_heartbeat(self, lease: Lease, ttl: float) -> bool:
        raise NotImplementedError

    def _do_keep_values(self, lease: Lease, blobs: dict[str, bytes]) -> None:
        """Keep the run's new stored values (digest -> bytes) where its log's readers find them, before the lines
        that refer to them are written: made durable no later than the log's next sync."""
        raise NotImplementedError

    def _do_append_values(self, lease: Lease, data: bytes, blobs: dict[str, bytes]) -> None:
        """Append `data` whose lines refer to `blobs`, kept first (adapters with transactions keep both in one)."""
        self._do_keep_values(lease, blobs)
        self._do_append(lease, data)

    def _do_held(self, run_id: str) -> bool:
        raise NotImplementedError

    def _do_append(self, lease: Lease, data: bytes) -> None:
        raise NotImplementedError

    def _do_size(self, run_id: str) -> int:
        raise NotImplementedError

    def _do_rewrite(self, lease: Lease, data: bytes) -> None:
        raise NotImplementedError

    def _do_bind(self, identity: str, run_id: str, expect: str | None) -> bool:
        raise NotImplementedError

    def _do_lookup(self, identity: str) -> str | None:
        raise NotImplementedError

    def _do_lookup_many(self, identities: list[str]) -> list[str | None]:
        raise NotImplementedError

    def _do_create_bound(self, runs: list[NewRun], headers: list[dict[str, Any]]) -> str | None:
        raise NotImplementedError

    def _do_info(self, run_id: str) -> RunInfo | None:
        raise NotImplementedError

    def _do_list_runs(self, limit: int | None, offset: int, where: dict[str, Any]) -> list[RunInfo]:
        raise NotImplementedError

    def _do_delete(self, run_id: str) -> int | None:
        raise NotImplementedError

    def _do_send(self, run_id: str, line: bytes, signal_id: str) -> None:
        raise NotImplementedError

    def _do_inbox(self, run_id: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _do_ack(self, run_id: str, signal_id: str) -> None:
        raise NotImplementedError

    def _do_schedule(self, run_id: str, at: float | None, wait: tuple[str, ...], priority: int | None) -> None:
        raise NotImplementedError

    def _do_join_wait(self, run_id: str, children: tuple[str, ...]) -> bool:
        raise NotImplementedError

    def _do_unschedule(self, run_id: str) -> None:
        raise NotImplementedError

    def _do_wake(self, run_id: str, name: str | None) -> bool:
        raise NotImplementedError

    def _do_entry(self, run_id: str) -> QueueEntry | None:
        raise NotImplementedError

    def _do_due(self, limit: int, now: float | None, skip: tuple[str, ...], workflows: frozenset[str] | None,
                queues: frozenset[str] | None, full: frozenset[str]) -> list[str]:
        raise NotImplementedError

    def _do_claim_due(self, owner: str, ttl: float, limit: int, skip: tuple[str, ...], check: Check | None,
                      workflows: frozenset[str] | None, queues: frozenset[str] | None,
                      full: frozenset[str]) -> list[Lease]:
        raise NotImplementedError

    def _do_queue_stats(self, now: float) -> list[QueueStats]:
        """`queue_stats` at `now` (epoch seconds)."""
        raise NotImplementedError

    def _do_advertise(self, owner: str, line: bytes, ttl: float) -> None:
        raise NotImplementedError

    def _do_retire(self, owner: str) -> None:
        raise NotImplementedError

    def _do_limit(self, key: str, step: LimitStep) -> Any:
        """Run `step` on the bytes stored under `key` in one atomic step and store (or remove) what it returns
        first; return what it returns second."""
        raise NotImplementedError

    def _do_limits(self, prefix: str) -> dict[str, bytes]:
        """The stored bytes of every limit document whose key starts with `prefix`."""
        raise NotImplementedError

    def _do_keep_blob(self, digest: str, data: bytes) -> None:
        """Store `data` under `digest` unless it is there; durable on return."""
        raise NotImplementedError

    def _do_blob(self, digest: str) -> bytes | None:
        """The data stored under `digest`, or None."""
        raise NotImplementedError
