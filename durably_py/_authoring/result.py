"""`Ok` / `Err` results of parallel branches and joined children."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Ok(Generic[T]):
    """A branch that succeeded with `value`."""

    value: T
    ok = True


@dataclass(frozen=True, slots=True)
class Err:
    """A branch that failed with `error`."""

    error: BaseException
    ok = False


Result = Ok[T] | Err


def is_ok(result: Ok[T] | Err) -> bool:
    """True for an `Ok` result."""
    return result.ok


def partition(results: Iterable[Ok[T] | Err]) -> tuple[list[T], list[BaseException]]:
    """Split results into (values, errors), each in the original order."""
    values: list[Any] = []
    errors: list[BaseException] = []
    for result in results:
        if isinstance(result, Ok):
            values.append(result.value)
        else:
            errors.append(result.error)
    return values, errors
