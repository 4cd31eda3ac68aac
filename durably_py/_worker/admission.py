"""Which due runs a worker may start: the named queues it serves and their limits (`_authoring.queues`).

Before each claim the worker asks for the queues and partitions that are full (`Admission.full`: at their
concurrency or rate limit in the store, or at this worker's `per_worker`), and the storage passes over their
runs (`claim_due(queues=, full=)`), so a full partition never holds up another's runs. A claimed run of a
limited queue then takes its permits atomically (`admit`); one a race left without room is let go at once,
still due. A run keeps its queue permits from its first start to its end, parked or not (`_replay.limits`
keeps them under the holder `[run_id, -1, "$run"]`: live while the run has not ended), so a worker killed
while holding one gives it back to nobody and loses nothing: the run is still open and still holds its place.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from .._authoring.queues import DEFAULT_QUEUE, QUEUES, Queue
from .._authoring.resources import Limit
from .._replay.limits import full, give_back, permits, starts, take

RUN_HOLDER = "$run"  # the path of a run-level permit


def queue_key(name: str, partition: str | None = None) -> str:
    """Where the store keeps a queue's (or one partition's) limit state."""
    return f"queue:{name}" if partition is None else f"queue:{name}/{partition}"


def placed(header: Any) -> tuple[str, str | None]:
    """(queue, partition) of a run, from its header."""
    get = header.get if hasattr(header, "get") else lambda name: getattr(header, name, None)
    queue, partition = get("queue"), get("partition")
    return (queue if isinstance(queue, str) and queue else DEFAULT_QUEUE,
            partition if isinstance(partition, str) and partition else None)


def limits_of(queue: Queue, partition: str | None) -> tuple[Limit, ...]:
    """The store-kept limits a run of `queue` (in `partition`) takes a permit of to start."""
    limits = []
    if queue.concurrency is not None or queue.rate_limit is not None:
        limits.append(Limit(queue_key(queue.name), f"queue {queue.name}", queue.concurrency, queue.rate_limit))
    if partition is not None and queue.partition_concurrency is not None:
        limits.append(Limit(queue_key(queue.name, partition), f"queue {queue.name} partition {partition}",
                            queue.partition_concurrency))
    return tuple(limits)


class Admission:
    """The queues one worker serves (`served`, None: all) and the limits it holds their runs to."""

    def __init__(self, storage: Any, served: frozenset[str] | None = None) -> None:
        self.storage = storage
        self.served = served
        self.running: dict[str, str] = {}  # run id -> queue, of the runs this worker runs now
        self.holding: set[str] = set()  # runs that hold a place in a full queue or partition (`full`)

    def advertised(self) -> dict[str, dict[str, Any]]:
        """The limits of the declared queues this worker serves (what `durably queues` shows of a fleet)."""
        return {name: queue.limits() for name, queue in QUEUES.items()
                if (self.served is None or name in self.served) and queue.limits()}

    def full(self) -> frozenset[str]:
        """The queues ("NAME") and partitions ("NAME/PARTITION") whose runs may not start now."""
        closed = {name for name, queue in QUEUES.items()
                  if queue.per_worker is not None and sum(1 for q in self.running.values() if q == name)
                  >= queue.per_worker}
        limited = {name: queue for name, queue in QUEUES.items() if queue.limited
                   and (self.served is None or name in self.served)}
        self.holding = set()
        if not limited:
            return frozenset(closed)
        for key, doc in self.storage.limits("queue:").items():
            name, _, partition = key[len("queue:"):].partition("/")
            queue = limited.get(name)
            if queue is None or not isinstance(doc, dict):
                continue
            limit = next((lim for lim in limits_of(queue, partition or None) if lim.key == key), None)
            if limit is not None and self._at_limit(limit, doc):
                closed.add(name if not partition else f"{name}/{partition}")
                self.holding.update(p[0] for p in permits(doc) if p[1] < 0)
        return frozenset(closed)

    def orphans(self, skip: Collection[str], workflows: frozenset[str] | None) -> list[str]:
        """The runs holding a place in a full queue or partition (as `full` last found them) that are due and
        held by no process: their worker died, or they woke from a park. The queue being full must not keep
        them out, since they hold its places; a worker claims them by id (of `workflows` only, when given)."""
        storage = self.storage
        now = time.time()
        found = []
        for run_id in sorted(self.holding.difference(skip)):
            entry = storage.entry(run_id)
            if entry is None or entry.at is None or entry.at > now or storage.held(run_id):
                continue
            info = storage.info(run_id) if workflows is not None else None
            if info is None or info.header.get("workflow") in workflows:  # type: ignore[operator]
                found.append(run_id)
        return found

    def _at_limit(self, limit: Limit, doc: dict[str, Any]) -> bool:
        """Whether `limit` lets no run start now: a quick look at its stored state, made exact in the store
        (dropping the permits of runs that ended) before saying so."""
        cap = limit.concurrency
        crowded = cap is not None and len(permits(doc)) >= cap
        rated = limit.rate is not None and len(starts(doc)) >= limit.rate.max
        if not crowded and not rated:
            return False
        return self.storage.limit(limit.key, functools.partial(full, limit=limit))

    def admit(self, run_id: str, header: Any) -> bool:
        """Take the permits a claimed run needs to start (all or none); False: no room, let it go."""
        name, partition = placed(header)
        queue = QUEUES.get(name)
        if queue is None:  # not declared here: no limit to take
            self.running[run_id] = name
            return True
        if queue.per_worker is not None and sum(1 for q in self.running.values() if q == name) >= queue.per_worker:
            return False  # claimed in the same batch as the run that filled this worker's share
        limits = limits_of(queue, partition)
        holder = [run_id, -1, RUN_HOLDER]
        taken: list[Limit] = []
        for limit in limits:
            if self.storage.limit(limit.key, functools.partial(take, limit=limit, holder=holder)) is not None:
                self._give_back(taken, run_id)
                return False
            taken.append(limit)
        self.running[run_id] = name
        return True

    def left(self, run_id: str, header: Any, release: Callable[[], bool]) -> None:
        """A run this worker ran stopped: it no longer counts here, and the permits of a limited queue go back
        when `release()` says so (it ended, or never started); a parked run keeps its place."""
        self.running.pop(run_id, None)
        name, partition = placed(header)
        queue = QUEUES.get(name)
        if queue is None:  # not declared here: no permits were taken
            return
        limits = limits_of(queue, partition)
        if limits and release():
            self._give_back(limits, run_id)

    def _give_back(self, limits: Iterable[Limit], run_id: str) -> None:
        holder = [run_id, -1, RUN_HOLDER]
        for limit in limits:
            self.storage.limit(limit.key, functools.partial(give_back, limit=limit, holder=holder, ok=None))

