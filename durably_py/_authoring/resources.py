"""Shared limits on steps across every run of an engine: concurrency keys and named resources
(rate limit, circuit breaker, concurrency)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import CircuitOpenError, ValidationError


def _positive(value: object, what: str, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise ValidationError(f"{what} must be a {'whole ' if integer else ''}number > 0, got {value!r}",
                              hint="Durations are seconds; counts are whole numbers.",
                              docs="docs/policies.md#resources")


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most `max` step attempts start in any `per` seconds."""

    max: int
    per: float

    def __post_init__(self) -> None:
        _positive(self.max, "RateLimit(max=)", integer=True)
        _positive(self.per, "RateLimit(per=)")


@dataclass(frozen=True, slots=True)
class Breaker:
    """Opens for `cooldown` seconds once `failure_rate` of the attempts in the last `window` seconds failed."""

    failure_rate: float
    window: float
    cooldown: float
    min_calls: int = 5

    def __post_init__(self) -> None:
        if isinstance(self.failure_rate, bool) or not isinstance(self.failure_rate, int | float) or not (
            0 < self.failure_rate <= 1
        ):
            raise ValidationError(f"Breaker(failure_rate={self.failure_rate!r}) must be in (0, 1]",
                                  hint="failure_rate=0.5 opens the breaker when half the calls fail.",
                                  docs="docs/policies.md#resources")
        _positive(self.window, "Breaker(window=)")
        _positive(self.cooldown, "Breaker(cooldown=)")
        _positive(self.min_calls, "Breaker(min_calls=)", integer=True)


@dataclass(frozen=True)
class Resource:
    """A named external dependency whose limits every step with `uses=name` shares."""

    name: str
    rate_limit: RateLimit | None = None
    breaker: Breaker | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValidationError(f"a resource needs a non-empty name, got {self.name!r}",
                                  hint="resource('openai', concurrency=8)", docs="docs/policies.md#resources")
        if self.concurrency is not None:
            _positive(self.concurrency, "resource concurrency=", integer=True)


def resource(name: str, *, rate_limit: RateLimit | None = None, breaker: Breaker | None = None,
             concurrency: int | None = None) -> Resource:
    """Declare a shared resource; pass it to `create_engine(resources=[...])` and name it in `ctx.step(uses=...)`."""
    return Resource(name, rate_limit, breaker, concurrency)


@dataclass
class Gate:
    """The live state behind one concurrency key or resource: slots, recent starts, breaker outcomes."""

    name: str
    limit: int | None = None
    rate: RateLimit | None = None
    breaker: Breaker | None = None
    active: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)
    starts: deque[float] = field(default_factory=deque)
    outcomes: deque[tuple[float, bool]] = field(default_factory=deque)
    open_until: float = 0.0

    async def acquire(self) -> None:
        """Wait for a slot and the rate limit; raise `CircuitOpenError` while the breaker is open."""
        if self.breaker is not None and time.monotonic() < self.open_until:
            raise CircuitOpenError(
                f"resource {self.name!r} is failing; its breaker stays open for "
                f"{self.open_until - time.monotonic():.1f}s more",
                resource=self.name)
        while self.limit is not None and self.active >= self.limit:
            fut = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self.waiters:
                    self.waiters.remove(fut)
        self.active += 1
        if self.rate is not None:
            while True:
                now = time.monotonic()
                while self.starts and self.starts[0] <= now - self.rate.per:
                    self.starts.popleft()
                if len(self.starts) < self.rate.max:
                    self.starts.append(now)
                    break
                await asyncio.sleep(self.starts[0] + self.rate.per - now)

    def release(self, ok: bool | None) -> None:
        """Free the slot; `ok` feeds the breaker (None: the attempt neither succeeded nor failed)."""
        self.active -= 1
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                break
        if self.breaker is None or ok is None:
            return
        now = time.monotonic()
        self.outcomes.append((now, ok))
        while self.outcomes and self.outcomes[0][0] <= now - self.breaker.window:
            self.outcomes.popleft()
        failed = sum(1 for _, good in self.outcomes if not good)
        if len(self.outcomes) >= self.breaker.min_calls and failed / len(self.outcomes) >= self.breaker.failure_rate:
            self.open_until = now + self.breaker.cooldown
            self.outcomes.clear()


class Gates:
    """Every gate of one engine, by concurrency key and by resource name."""

    def __init__(self, resources: list[Resource] | tuple[Resource, ...] = ()) -> None:
        self.resources: dict[str, Resource] = {}
        for res in resources:
            if not isinstance(res, Resource):
                raise ValidationError(f"resources= takes resource(...) values, got {res!r}",
                                      hint="create_engine(resources=[resource('openai', concurrency=8)])",
                                      docs="docs/policies.md#resources")
            self.resources[res.name] = res
        self.keys: dict[str, Gate] = {}
        self.named: dict[str, Gate] = {
            r.name: Gate(r.name, r.concurrency, r.rate_limit, r.breaker) for r in self.resources.values()
        }

    def for_step(self, concurrency_key: str | None, concurrency_limit: int | None,
                 uses: str | None) -> list[Gate]:
        """The gates a step attempt must pass, in a fixed order (resource first, then key)."""
        gates = []
        if uses is not None:
            gate = self.named.get(uses)
            if gate is None:
                raise ValidationError(
                    f"step uses={uses!r}, but the engine has no such resource "
                    f"(known: {', '.join(sorted(self.named)) or 'none'})",
                    hint="Declare it: create_engine(resources=[resource(name, ...)]).",
                    docs="docs/policies.md#resources")
            gates.append(gate)
        if concurrency_key is not None:
            gate = self.keys.get(concurrency_key)
            if gate is None:
                gate = self.keys[concurrency_key] = Gate(concurrency_key)
            if concurrency_limit is not None:
                gate.limit = concurrency_limit
            gates.append(gate)
        return gates
