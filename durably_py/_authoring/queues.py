"""Named queues: where an enqueued run waits, and the limits every worker sharing the store holds it to.

A queue is declared once, at module level beside its workflows (`queue("emails", concurrency=10)`), so every
process that imports them (`durably worker --import MODULE`, an engine's `start()`) knows its limits. A run
names its queue when it is enqueued (`enqueue(..., queue="emails")`, else its workflow's
`@workflow(queue=...)`, else "default") and may name a partition of it (`partition="tenant-a"`): workers serve
chosen queues (`durably worker --queue emails`), take due runs round-robin across a queue's partitions, and
start a run only while its queue and partition have room.

A queue's `concurrency` and `partition_concurrency` count the runs that started and have not ended, parked
ones included (a run waiting a day for an approval keeps its place, as in DBOS); `per_worker` counts the runs
one worker is running now; `rate_limit` counts run starts. Limits on what runs at one moment, a step at a
time, are resources and concurrency keys (`resources.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ValidationError
from .resources import RateLimit

DEFAULT_QUEUE = "default"
QUEUE_DOCS = "docs/deploying.md#flow-control"

QUEUES: dict[str, Queue] = {}
"""Every queue this process declared (`queue(...)`), by name; the latest declaration of a name wins."""


def check_queue_name(name: object, what: str = "queue") -> str:
    """A queue or partition name: non-empty text of at most 100 characters, without "/" or control characters
    (a partition's limits are kept under "QUEUE/PARTITION")."""
    if (not isinstance(name, str) or not name or len(name) > 100 or "/" in name
            or any(ord(c) < 32 for c in name) or not name.isprintable()):
        raise ValidationError(f"{what} name must be printable text of 1 to 100 characters without '/', got "
                              f"{name!r}", hint='queue="emails", partition="tenant-42"', docs=QUEUE_DOCS)
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ValidationError(f"{what} name {name!r} is not valid text", hint='queue="emails"',
                              docs=QUEUE_DOCS) from None
    return name


def _count(value: object, what: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValidationError(f"queue {what}= must be a whole number >= 1, got {value!r}",
                              hint=f"{what}=10; omit it for no limit.", docs=QUEUE_DOCS)
    return value


@dataclass(frozen=True, slots=True)
class Queue:
    """A named queue and its limits (each None: none). See the module's docstring for what each counts."""

    name: str
    concurrency: int | None = None
    per_worker: int | None = None
    rate_limit: RateLimit | None = None
    partition_concurrency: int | None = None

    def __post_init__(self) -> None:
        check_queue_name(self.name)
        _count(self.concurrency, "concurrency")
        _count(self.per_worker, "per_worker")
        _count(self.partition_concurrency, "partition_concurrency")
        if self.rate_limit is not None and not isinstance(self.rate_limit, RateLimit):
            raise ValidationError(f"queue rate_limit= takes a RateLimit, got {self.rate_limit!r}",
                                  hint="rate_limit=RateLimit(100, per=60)", docs=QUEUE_DOCS)

    def limits(self) -> dict[str, Any]:
        """The limits it sets, as `durably queues` and a worker's advertisement show them."""
        rate = self.rate_limit
        return {k: v for k, v in (
            ("concurrency", self.concurrency), ("per_worker", self.per_worker),
            ("rate_limit", None if rate is None else {"max": rate.max, "per": rate.per, "window": rate.window}),
            ("partition_concurrency", self.partition_concurrency)) if v is not None}

    @property
    def limited(self) -> bool:
        """Whether a run of this queue needs a permit from the store to start."""
        return (self.concurrency is not None or self.rate_limit is not None
                or self.partition_concurrency is not None)


def queue(name: str, *, concurrency: int | None = None, per_worker: int | None = None,
          rate_limit: RateLimit | None = None, partition_concurrency: int | None = None) -> Queue:
    """Declare a named queue at module level, beside the workflows enqueued on it.

    `concurrency`: runs of the queue started and not ended at once, across every worker sharing the store;
    `per_worker`: runs of it one worker runs at once; `rate_limit`: run starts (`RateLimit(100, per=60)`);
    `partition_concurrency`: like `concurrency`, per partition (`enqueue(..., partition="tenant-a")`); with 1,
    a partition's runs run one after another, the singleton of a key that queues newcomers."""
    declared = Queue(name, concurrency, per_worker, rate_limit, partition_concurrency)
    QUEUES[name] = declared
    return declared


def find_queue(name: str) -> Queue:
    """The queue declared as `name` in this process, or a queue of that name with no limits."""
    return QUEUES.get(name) or Queue(name)
