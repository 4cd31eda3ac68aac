"""Step policies: `Retry` (attempts, backoff, errors that give up at once, a deadline for all attempts) and
the validation of step options."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ValidationError

Backoff = Literal["exponential", "linear", "constant", "none"]
_BACKOFFS = ("exponential", "linear", "constant", "none")
_NUMBERS = (int, float)


def _number(value: object, name: str, *, minimum: float = 0.0, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < minimum:
        raise ValidationError(
            f"{name} must be a number >= {minimum:g}, got {value!r}",
            hint=f"Pass {name} in seconds as a non-negative int or float.",
            docs="docs/policies.md",
        )


@dataclass(frozen=True, slots=True)
class Retry:
    """How often a failing step runs again and how long it waits between attempts (seconds).

    `attempts` counts the first try (None: no limit). `give_up_on` names exception classes that fail the
    step at once, as `NonRetryableError` always does. `deadline` bounds all attempts together: no attempt
    is scheduled to start later than `deadline` seconds after the first one started (recorded, so the
    bound holds across restarts)."""

    attempts: int | None = 3
    backoff: Backoff = "exponential"
    base: float = 0.5
    max: float = 60.0
    jitter: bool = False
    give_up_on: type[BaseException] | tuple[type[BaseException], ...] = field(default=(), kw_only=True)
    deadline: float | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if (type(self.attempts) is int and self.attempts >= 1 and self.backoff in _BACKOFFS
                and type(self.base) in _NUMBERS and type(self.max) in _NUMBERS and 0 <= self.base <= self.max
                and self.give_up_on == () and self.deadline is None):
            return
        if self.attempts is not None and (isinstance(self.attempts, bool) or not isinstance(self.attempts, int)
                                          or self.attempts < 1):
            raise ValidationError(
                f"Retry(attempts={self.attempts!r}): attempts must be an int >= 1 (it counts the first try) "
                "or None (no limit)",
                hint="Retry(3) runs a step at most three times; Retry(1) means no retry; Retry(None, "
                     "deadline=3600) retries for an hour.",
                docs="docs/policies.md#retry",
            )
        if self.backoff not in _BACKOFFS:
            raise ValidationError(
                f"Retry(backoff={self.backoff!r}) is not one of 'exponential', 'linear', 'constant', 'none'",
                hint="Use backoff='exponential' (base * 2**n), 'linear' (base * n), 'constant' (base) or 'none'.",
                docs="docs/policies.md#retry",
            )
        _number(self.base, "Retry(base=)")
        _number(self.max, "Retry(max=)")
        give_up = self.give_up_on if isinstance(self.give_up_on, tuple) else (self.give_up_on,)
        for kind in give_up:
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise ValidationError(
                    f"Retry(give_up_on=...) takes exception classes, got {kind!r}",
                    hint="Retry(5, give_up_on=(ValueError, PermissionError)) fails at once on those errors.",
                    docs="docs/policies.md#errors-that-give-up-at-once",
                )
        object.__setattr__(self, "give_up_on", give_up)
        if self.deadline is not None:
            _number(self.deadline, "Retry(deadline=)")
            if self.deadline == 0:
                raise ValidationError("Retry(deadline=0): the deadline must be > 0 seconds",
                                      hint="Omit deadline= for no limit on the time all attempts take.",
                                      docs="docs/policies.md#retry")

    def gives_up(self, failed_attempt: int, error: BaseException) -> bool:
        """True when attempt `failed_attempt` (from 1) failing with `error` ends the retries under this policy:
        the attempts are used up, or the error is one of `give_up_on` (errors no policy retries, such as
        `NonRetryableError`, the kernel checks for every step)."""
        if self.attempts is not None and failed_attempt >= self.attempts:
            return True
        return bool(self.give_up_on) and isinstance(error, self.give_up_on)

    def delay(self, failed_attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after attempt number `failed_attempt` (from 1) failed."""
        if self.backoff == "none":
            wait = 0.0
        elif self.backoff == "constant":
            wait = self.base
        elif self.backoff == "linear":
            wait = self.base * failed_attempt
        else:
            wait = self.base * (2 ** min(failed_attempt - 1, 1023))
        wait = min(wait, self.max)
        if self.jitter and wait > 0:
            wait = wait * (0.5 + (rng or random).random() / 2)
        return wait


def check_timeout(timeout: object, name: str = "timeout") -> float | None:
    """Validate a `timeout=` option (positive seconds or None)."""
    if timeout is None:
        return None
    _number(timeout, name)
    if timeout == 0:
        raise ValidationError(f"{name} must be > 0 seconds, got 0", hint="Omit timeout= for no limit.",
                              docs="docs/policies.md#timeout")
    return float(timeout)  # type: ignore[arg-type]
