"""Step policies: `Retry` (attempts and backoff) and the validation of step options."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from .errors import ValidationError

Backoff = Literal["exponential", "linear", "none"]
_BACKOFFS = ("exponential", "linear", "none")
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
    """How often a failing step runs again and how long it waits between attempts (seconds)."""

    attempts: int = 3
    backoff: Backoff = "exponential"
    base: float = 0.5
    max: float = 60.0
    jitter: bool = False

    def __post_init__(self) -> None:
        if (type(self.attempts) is int and self.attempts >= 1 and self.backoff in _BACKOFFS
                and type(self.base) in _NUMBERS and type(self.max) in _NUMBERS and 0 <= self.base <= self.max):
            return
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValidationError(
                f"Retry(attempts={self.attempts!r}): attempts must be an int >= 1 (it counts the first try)",
                hint="Retry(3) runs a step at most three times; Retry(1) means no retry.",
                docs="docs/policies.md#retry",
            )
        if self.backoff not in ("exponential", "linear", "none"):
            raise ValidationError(
                f"Retry(backoff={self.backoff!r}) is not one of 'exponential', 'linear', 'none'",
                hint="Use backoff='exponential' (base * 2**n), 'linear' (base * n) or 'none'.",
                docs="docs/policies.md#retry",
            )
        _number(self.base, "Retry(base=)")
        _number(self.max, "Retry(max=)")

    def delay(self, failed_attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after attempt number `failed_attempt` (from 1) failed."""
        if self.backoff == "none":
            wait = 0.0
        elif self.backoff == "linear":
            wait = self.base * failed_attempt
        else:
            wait = self.base * (2 ** (failed_attempt - 1))
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
