"""Limits that hold across every process sharing a store: a step attempt takes a permit of each limit it names
(`uses=`, `concurrency_key=`) before it starts, and gives it back when it ends.

A limit's state is one small document the storage keeps under the limit's key (`Storage.limit`, changed
atomically against every process sharing the store), so a fleet of workers shares it and a restart never
resets it:

    {"limit": 2,                                   the concurrency limit last declared for the key
     "permits": [[run_id, epoch, path], ...],      attempts running now, each under its run's lease
     "starts": [t, ...],                           a rate limit's recent starts (the store's clock)
     "outcomes": [[t, ok], ...], "open_until": t,  a circuit breaker's recent outcomes, and until when it is open
     "waiters": [run_id, ...]}                     runs waiting for a permit, woken in turn as permits come back

A permit is live while the lease it was taken under is (`live(run_id, epoch)`): a SIGKILLed worker's permits
come back when its lease lapses, with no clean-up of anyone's. A run that waits for a permit rests on it
(`Control.limited`): in its own process it waits there, woken at once by a permit given back in this process;
served by a worker it parks, holding no worker slot, due again when a permit given back wakes it (the
signal `$limit:KEY`), when a rate limit's window lets it start, or after `RECHECK` seconds at the latest.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._authoring.resources import Limit
from ..errors import CircuitOpenError, RunNotFoundError

if TYPE_CHECKING:
    from ..storage.base import Storage
    from .control import Control

RECHECK = 5.0
"""Seconds after which a run parked for a concurrency permit looks again should no permit given back wake it
(a holder killed with its permit wakes nobody; its permit comes back when its lease lapses)."""

WAITERS_MAX = 1000  # runs a limit's document remembers as waiting (beyond that they find out at RECHECK)
SIGNAL = "$limit:"  # + the limit's key: the wake-up a run parked for a permit waits for

Live = Callable[[str, int], bool]


class Denied:
    """Why a limit did not let an attempt start: `reason` as people read it, and in how many seconds to try
    again (`wait`: a rate limit's window; None: when a permit comes back); `open_for` when a breaker is open."""

    __slots__ = ("reason", "wait", "open_for")

    def __init__(self, reason: str, wait: float | None, open_for: float | None = None) -> None:
        self.reason = reason
        self.wait = wait
        self.open_for = open_for


def _live_permits(doc: dict[str, Any], live: Live, holder: list[Any]) -> list[list[Any]]:
    """The document's permits still held under a live lease, without `holder`'s own."""
    return [p for p in doc.get("permits", ()) if p != holder and live(p[0], p[1])]


def window(limit: Limit, doc: dict[str, Any], now: float) -> list[float]:
    """The starts that count against the rate limit at `now`."""
    rate = limit.rate
    assert rate is not None
    since = now - rate.per if rate.window == "sliding" else now - now % rate.per
    return [t for t in doc.get("starts", ()) if t > since or (rate.window == "fixed" and t == since)]


def take(doc: Any, now: float, live: Live, limit: Limit, holder: list[Any]) -> tuple[Any, Denied | None]:
    """Let an attempt of `holder` ([run_id, epoch, path]) start under `limit`, atomically in the store: record
    its permit and its start (None), or say why not, noting its run as waiting (a `Denied`)."""
    doc = dict(doc) if isinstance(doc, dict) else {}
    if holder in doc.get("permits", ()) and live(holder[0], holder[1]):
        return doc, None  # it holds one already (a run's queue permit, taken again as it resumes)
    breaker = limit.breaker
    if breaker is not None and doc.get("open_until", 0) > now:
        return doc, Denied(f"{limit.label} circuit breaker open", None, doc["open_until"] - now)
    if limit.concurrency is not None:
        doc["limit"] = limit.concurrency
    permits = _live_permits(doc, live, holder)
    cap = doc.get("limit")
    denied = None
    if cap is not None and len(permits) >= cap:
        denied = Denied(f"{limit.label} concurrency {len(permits)}/{cap}", None)
    starts: list[float] = []
    if denied is None and limit.rate is not None:
        starts = window(limit, doc, now)
        if len(starts) >= limit.rate.max:
            rate = limit.rate
            again = min(starts) + rate.per if rate.window == "sliding" else now - now % rate.per + rate.per
            denied = Denied(f"{limit.label} rate limit {rate.max} per {rate.per:g}s", max(again - now, 0.001))
    waiters = [w for w in doc.get("waiters", ()) if w != holder[0]]
    if denied is not None:
        if len(waiters) < WAITERS_MAX:
            waiters.append(holder[0])
        doc["permits"], doc["waiters"] = permits, waiters
        return doc, denied
    if cap is not None:
        permits.append(holder)
    if limit.rate is not None:
        starts.append(now)
        doc["starts"] = starts
    doc["permits"], doc["waiters"] = permits, waiters
    return doc, None


def full(doc: Any, now: float, live: Live, limit: Limit) -> tuple[Any, bool]:
    """Whether `limit` would let no attempt start now (its live permits at the limit, or its rate window
    full), keeping only its live permits and the starts in its window; nothing is taken."""
    doc = dict(doc) if isinstance(doc, dict) else {}
    permits = [p for p in doc.get("permits", ()) if live(p[0], p[1])]
    doc["permits"] = permits
    cap = limit.concurrency if limit.concurrency is not None else doc.get("limit")
    if cap is not None and len(permits) >= cap:
        return doc, True
    if limit.rate is not None:
        doc["starts"] = window(limit, doc, now)
        return doc, len(doc["starts"]) >= limit.rate.max
    return doc, False


def give_back(doc: Any, now: float, live: Live, limit: Limit, holder: list[Any],
              ok: bool | None) -> tuple[Any, list[str]]:
    """Return `holder`'s permit, feed `ok` to the breaker (None: the attempt neither succeeded nor failed), and
    take as many waiting runs off the list as permits are free now: the runs to wake."""
    doc = dict(doc) if isinstance(doc, dict) else {}
    permits = _live_permits(doc, live, holder)
    doc["permits"] = permits
    breaker = limit.breaker
    if breaker is not None and ok is not None:
        outcomes = [o for o in doc.get("outcomes", ()) if o[0] > now - breaker.window]
        outcomes.append([now, ok])
        failed = sum(1 for _, good in outcomes if not good)
        if len(outcomes) >= breaker.min_calls and failed / len(outcomes) >= breaker.failure_rate:
            doc["open_until"] = now + breaker.cooldown
            outcomes = []
        doc["outcomes"] = outcomes
    waiters = list(doc.get("waiters", ()))
    cap = doc.get("limit")
    free = 0 if cap is None else max(cap - len(permits), 0)  # a rate limit's waiters wake at their time
    doc["waiters"] = waiters[free:]
    return doc, waiters[:free]


def permits(doc: Any) -> list[list[Any]]:
    """The permits a stored limit document lists (`[run_id, epoch, path]` each; not checked for liveness)."""
    return list(doc.get("permits", ())) if isinstance(doc, dict) else []


def starts(doc: Any) -> list[float]:
    """The rate-limit starts a stored limit document keeps (pruned to the window at its last change)."""
    return list(doc.get("starts", ())) if isinstance(doc, dict) else []


def missed_wakeup(storage: Storage, run_id: str, names: tuple[str, ...]) -> None:
    """Wake a run just parked on limits' signals (`SIGNAL` + key, among `names`) whose wake-up it missed: a
    permit given back took it off a limit's waiting list before its park was queued."""
    for name in names:
        if name.startswith(SIGNAL):
            key = name[len(SIGNAL):]
            doc = storage.limits(key).get(key)
            waiters = doc.get("waiters", []) if isinstance(doc, dict) else []
            if run_id not in waiters and len(waiters) < WAITERS_MAX:
                storage.wake(run_id, name)


class Releases:
    """Permits given back in this process, per storage and key: a run of this process waiting for one is woken
    at once (other processes' give-backs reach it through the store: its wake-up signal, or its next look)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: weakref.WeakKeyDictionary[Any, dict[str, set[asyncio.Future[None]]]] = (
            weakref.WeakKeyDictionary())

    def future(self, storage: Any, key: str) -> asyncio.Future[None]:
        """A future done when a permit of `key` is next given back in this process."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self.lock:
            self.waiting.setdefault(storage, {}).setdefault(key, set()).add(fut)
        fut.add_done_callback(lambda f: self._forget(storage, key, f))
        return fut

    def _forget(self, storage: Any, key: str, fut: asyncio.Future[None]) -> None:
        with self.lock:
            self.waiting.get(storage, {}).get(key, set()).discard(fut)

    def notify(self, storage: Any, key: str) -> None:
        """A permit of `key` was given back: wake this process's waiters for it (from any thread)."""
        with self.lock:
            futures = list(self.waiting.get(storage, {}).get(key, ()))
        for fut in futures:
            fut.get_loop().call_soon_threadsafe(_done, fut)


def _done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


RELEASES = Releases()


class Limiter:
    """The permits one execution of a run takes and gives back (`Steps` asks it around every attempt of a step
    with `uses=` or `concurrency_key=`)."""

    def __init__(self, storage: Storage, run_id: str, epoch: int, control: Control) -> None:
        self.storage = storage
        self.run_id = run_id
        self.epoch = epoch
        self.control = control

    async def enter(self, limits: tuple[Limit, ...], path: str, label: str) -> None:
        """Take a permit of every limit in `limits`, all or none: on a limit that says no, give back those taken,
        rest until it may say yes, and start over. `CircuitOpenError` while a breaker is open."""
        holder = [self.run_id, self.epoch, path]
        storage = self.storage
        while True:
            taken = 0
            for limit in limits:
                released = RELEASES.future(storage, limit.key)
                try:
                    denied = storage.limit(limit.key, functools.partial(take, limit=limit, holder=holder))
                except BaseException:
                    released.cancel()
                    raise
                if denied is None:
                    released.cancel()
                    taken += 1
                    continue
                self.leave(limits[:taken], path, None)
                if denied.open_for is not None:
                    released.cancel()
                    raise CircuitOpenError(f"resource {limit.label!r} is failing; its breaker stays open for "
                                           f"{denied.open_for:.1f}s more", resource=limit.label)
                try:
                    await self.control.limited(path, label, denied.reason, denied.wait, SIGNAL + limit.key,
                                               released, RECHECK)
                finally:
                    released.cancel()
                break
            else:
                return

    def leave(self, limits: tuple[Limit, ...], path: str, ok: bool | None) -> None:
        """Give back the permits of `limits` taken for the attempt at `path` (`ok` feeds breakers), and wake the
        runs waiting for them."""
        holder = [self.run_id, self.epoch, path]
        storage = self.storage
        for limit in limits:
            woken = storage.limit(limit.key, functools.partial(give_back, limit=limit, holder=holder, ok=ok))
            for run_id in woken:
                if run_id != self.run_id:
                    try:
                        storage.wake(run_id, SIGNAL + limit.key)
                    except RunNotFoundError:
                        pass  # it was deleted meanwhile
            RELEASES.notify(storage, limit.key)
