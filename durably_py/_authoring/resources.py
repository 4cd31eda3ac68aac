"""Shared limits on steps across every run and every process sharing a store: concurrency keys and named
resources (rate limit, circuit breaker, concurrency), declared where the workflows are."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ValidationError


def _positive(value: object, what: str, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise ValidationError(f"{what} must be a {'whole ' if integer else ''}number > 0, got {value!r}",
                              hint="Durations are seconds; counts are whole numbers.",
                              docs="docs/policies.md#resources")


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most `max` step attempts start in any `per` seconds (`window="sliding"`), or in each `per`-second
    window counted from the epoch (`window="fixed"`: cheaper to reason about, allows a burst at a boundary)."""

    max: int
    per: float
    window: str = "sliding"

    def __post_init__(self) -> None:
        _positive(self.max, "RateLimit(max=)", integer=True)
        _positive(self.per, "RateLimit(per=)")
        if self.window not in ("sliding", "fixed"):
            raise ValidationError(f"RateLimit(window=) must be 'sliding' or 'fixed', got {self.window!r}",
                                  hint="RateLimit(60, per=60) is sliding: at most 60 starts in any minute.",
                                  docs="docs/policies.md#resources")


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
    """Declare a shared resource, at module level beside the workflows that name it in `ctx.step(uses=name)`.

    Its limits live in the storage, so they hold across every run and every process sharing the store (a
    fleet of `durably worker`s included); every process that imports the module knows the resource. Passing
    it to `create_engine(resources=[...])` as well is allowed (the engine's own list wins over declarations)."""
    declared = Resource(name, rate_limit, breaker, concurrency)
    RESOURCES[name] = declared
    return declared


RESOURCES: dict[str, Resource] = {}
"""Every resource this process declared (`resource(...)`), by name: where the workflows are declared, so
`run()`, `engine.start()` and `durably worker --import MODULE` all find them. The latest declaration of a
name wins (a module imported again declares its resources again)."""


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit a step attempt must pass, kept in the storage under `key` so that every process sharing the
    store enforces it: a resource's (`uses=`) or a concurrency key's (`concurrency_key=`)."""

    key: str  # where the storage keeps its state: "resource:NAME" or "key:KEY"
    label: str  # what `list`, `inspect` and the console call it: the resource's name, or the key
    concurrency: int | None = None  # None: the limit stored by an earlier step with this key, if any
    rate: RateLimit | None = None
    breaker: Breaker | None = None


def undeclared(name: str, known: Iterable[str]) -> ValidationError:
    """The error of a step that names a resource nobody declared, with the declaration to write."""
    return ValidationError(
        f"step uses={name!r}, but no resource {name!r} is declared in this process "
        f"(declared: {', '.join(sorted(known)) or 'none'})",
        hint=f"Declare it at module level, beside your workflows, so every process that imports them knows "
             f"it: `{name.replace('-', '_').replace('.', '_')} = durably_py.resource({name!r}, concurrency=8, "
             f"rate_limit=durably_py.RateLimit(60, per=60))`. `durably worker --import MODULE` then finds it.",
        docs="docs/policies.md#resources")


class Gates:
    """The limits of one engine's steps: the resources given to `create_engine(resources=...)`, then those
    declared in this process (`resource(...)`), and concurrency keys. The limits' state lives in the storage
    (see `_replay.limits`); this only says which limits a step must pass."""

    def __init__(self, resources: list[Resource] | tuple[Resource, ...] = ()) -> None:
        self.resources: dict[str, Resource] = {}
        for res in resources:
            if not isinstance(res, Resource):
                raise ValidationError(f"resources= takes resource(...) values, got {res!r}",
                                      hint="create_engine(resources=[resource('openai', concurrency=8)])",
                                      docs="docs/policies.md#resources")
            self.resources[res.name] = res

    def find(self, name: str) -> Resource:
        """The resource `name`: the engine's own, else the one declared in this process."""
        found = self.resources.get(name) or RESOURCES.get(name)
        if found is None:
            raise undeclared(name, {*self.resources, *RESOURCES})
        return found

    def for_step(self, concurrency_key: str | None, concurrency_limit: int | None,
                 uses: str | None) -> tuple[Limit, ...]:
        """The limits a step attempt must pass, in a fixed order (resource first, then key)."""
        limits: list[Limit] = []
        if uses is not None:
            res = self.find(uses)
            limits.append(Limit(f"resource:{res.name}", res.name, res.concurrency, res.rate_limit, res.breaker))
        if concurrency_key is not None:
            limits.append(Limit(f"key:{concurrency_key}", concurrency_key, concurrency_limit))
        return tuple(limits)
