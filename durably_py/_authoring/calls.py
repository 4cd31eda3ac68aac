"""What a `ctx` call's arguments mean, the same in every mode (local and Restate): step options and labels, the
checks of sleep times, signal names and handles, and the control-flow values a workflow raises or returns
(`Complete`, `LoopDone`). Replay depends on these being one implementation."""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from .._state.history import BUDGET_KINDS
from ..errors import (
    ArgumentError,
    BudgetExceededError,
    NonRetryableError,
    PurityError,
    SerializationError,
    StepInterruptedError,
    ValidationError,
)
from ..storage.base import validate_name
from .policies import Retry, check_timeout
from .schema import compile_schema
from .workflow import Workflow, as_workflow

CO_COROUTINE = inspect.CO_COROUTINE


NOT_RETRYABLE = (ValidationError, SerializationError, PurityError, BudgetExceededError, StepInterruptedError,
                 NonRetryableError)


class Complete(BaseException):  # noqa: N818 - control flow, not an error
    """`ctx.complete(value)`: unwinds to the top of the workflow with its result."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


class Attempt(Protocol):
    """What the kernel needs of the object `attempt()` returns inside a step (`context.AttemptContext`)."""

    kernel: Any
    path: str
    did_stash: bool
    number: int
    label: str  # set by the kernel as the attempt starts

    @property
    def cancelled(self) -> bool: ...

    def cancel(self) -> None: ...


class LoopDone:
    """What a loop reducer returns to end the loop with `value` (`it.done(value)`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


current_attempt: contextvars.ContextVar[Attempt] = contextvars.ContextVar("durably_attempt")


LABELS: dict[Any, str] = {}


def label_of(fn: Callable[..., Any]) -> str:
    """The default step label: the callable's qualified name, without the enclosing function's."""
    try:
        return LABELS[fn]
    except (KeyError, TypeError):
        pass
    target = getattr(fn, "func", fn)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    label: str = name.rpartition("<locals>.")[2]
    if callable(fn):  # `RunKernel.step` takes a label found here as proof that `fn` is callable
        try:
            if len(LABELS) >= 4096:
                LABELS.clear()
            LABELS[fn] = label
        except TypeError:  # an unhashable callable: computed every time
            pass
    return label


def not_callable(fn: Any) -> ValidationError:
    """`ctx.step` of something that is not a function."""
    return ValidationError(f"ctx.step needs a callable, got {fn!r}",
                           hint="Pass the function itself: ctx.step(fetch, url), not ctx.step(fetch(url)).",
                           docs="docs/authoring.md#steps")


def check_wake_time(when: Any) -> None:
    """`ctx.sleep_until`'s argument: a timezone-aware datetime."""
    if not isinstance(when, datetime) or when.tzinfo is None:
        raise ValidationError(f"ctx.sleep_until needs a timezone-aware datetime, got {when!r}",
                              hint="Use ctx.now() + timedelta(...) or datetime(..., tzinfo=UTC).",
                              docs="docs/authoring.md#parking")


def check_signal_name(name: Any) -> None:
    """`ctx.wait_for`'s signal name: 1-200 characters, not starting with '$'."""
    if not isinstance(name, str) or not name or len(name) > 200 or name.startswith("$"):
        raise ValidationError(f"a signal name is 1-200 characters not starting with '$', got {name!r}",
                              hint="Name what you wait for, e.g. ctx.wait_for('approval').",
                              docs="docs/authoring.md#parking")
    validate_name(name)


def check_handle(handle: Any) -> None:
    """`ctx.join`'s argument: the `RunHandle` that `ctx.spawn` returned."""
    if not isinstance(handle, RunHandle):
        raise ValidationError(f"ctx.join takes the RunHandle that ctx.spawn returned, got {handle!r}",
                              hint="handle = await ctx.spawn(child, input); value = await ctx.join(handle)",
                              docs="docs/authoring.md#child-runs")


def spawn_pairs(definitions: Iterable[Any]) -> list[tuple[Workflow, Any]]:
    """`ctx.spawn_all`'s argument as `(workflow, input)` pairs."""
    pairs = []
    for i, item in enumerate(definitions):
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ValidationError(f"ctx.spawn_all item {i} is {item!r}, not a (workflow, input) pair",
                                  hint="ctx.spawn_all([(summarize, url) for url in urls])",
                                  docs="docs/authoring.md#child-runs")
        pairs.append((as_workflow(item[0]), item[1]))
    return pairs


def check_budget_kind(kind: Any) -> str:
    """A budget kind (`usd`, `tokens`, `units`), as `budget=`, `ctx.charge` and `ctx.budget` take it."""
    if kind not in BUDGET_KINDS:
        raise ValidationError(f"unknown budget kind {kind!r}", hint=f"Use one of {', '.join(BUDGET_KINDS)}.",
                              docs="docs/policies.md#budgets")
    return kind


def is_async_callable(fn: Callable[..., Any]) -> bool:
    code = getattr(fn, "__code__", None)
    if code is not None:
        return bool(code.co_flags & CO_COROUTINE)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


@dataclass(frozen=True, slots=True)
class RunHandle:
    """A child run: its id, and the workflow that runs it (so a resumed parent can restart it)."""

    run_id: str
    workflow: Workflow | None = field(default=None, compare=False, repr=False)


class StepOptions:
    """Validated options of one `ctx.step` call."""

    __slots__ = ("retry", "timeout", "compensate", "concurrency_key", "concurrency_limit", "uses", "schema", "unsafe",
                 "on_interrupt", "keep_partials", "transactional", "reserve",
                 "charge")

    def __init__(self, label: str, retry: Any, timeout: Any, compensate: Any, concurrency_key: Any,
                 concurrency_limit: Any, uses: Any, schema: Any, replay: Any, on_interrupt: Any = None,
                 keep_partials: Any = False) -> None:
        if retry is not None and not isinstance(retry, Retry):
            raise ValidationError(f"retry= of step {label!r} must be a Retry(...), got {retry!r}",
                                  hint="Use retry=Retry(3, backoff='exponential').", docs="docs/policies.md#retry")
        if compensate is not None and not callable(compensate):
            raise ValidationError(f"compensate= of step {label!r} must be callable, got {compensate!r}",
                                  hint="Pass a function that takes the step's output and undoes it.",
                                  docs="docs/policies.md#compensation")
        if replay not in REPLAY_POLICIES:
            raise ValidationError(f"replay= of step {label!r} must be 'safe', 'idempotent', 'manual' or 'unsafe', "
                                  f"got {replay!r}",
                                  hint="replay='manual' (or 'unsafe') stops a resumed run from re-running an "
                                       "interrupted step: the run needs an operator's attention instead.",
                                  docs="docs/policies.md#replay")
        if on_interrupt not in (None, "attention", "raise"):
            raise ValidationError(f"on_interrupt= of step {label!r} must be 'attention' or 'raise', got "
                                  f"{on_interrupt!r}",
                                  hint="on_interrupt='raise' gives the workflow StepInterruptedError for a cut-off "
                                       "unsafe step; 'attention' (the default) leaves the run needs_attention.",
                                  docs="docs/policies.md#replay")
        if on_interrupt is not None and replay not in ("manual", "unsafe"):
            raise ValidationError(f"on_interrupt= of step {label!r} applies to replay='manual' (or 'unsafe') "
                                  f"steps, not replay={replay!r}",
                                  hint="A safe or idempotent step that was cut off simply runs again; add "
                                       "replay='manual' for a step that must not.", docs="docs/policies.md#replay")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValidationError(f"concurrency_limit= of step {label!r} must be an int >= 1",
                                  hint="concurrency_limit caps the steps sharing a concurrency_key.",
                                  docs="docs/policies.md#concurrency-keys")
        if concurrency_limit is not None and concurrency_key is None:
            raise ValidationError(f"step {label!r} sets concurrency_limit= without concurrency_key=",
                                  hint="Name the shared key, e.g. concurrency_key=host, concurrency_limit=5.",
                                  docs="docs/policies.md#concurrency-keys")
        self.retry = retry
        self.timeout = check_timeout(timeout, f"timeout= of step {label!r}")
        self.compensate = compensate
        self.concurrency_key = concurrency_key
        self.concurrency_limit = concurrency_limit
        self.uses = uses
        self.schema = compile_schema(schema, f"schema of step {label!r}")
        self.unsafe = replay in ("manual", "unsafe")
        self.on_interrupt = on_interrupt  # None: the mode's default ("attention" here; Restate raises)
        if not isinstance(keep_partials, bool):
            raise ValidationError(f"keep_partials= of step {label!r} must be True or False, got {keep_partials!r}",
                                  hint="keep_partials=True keeps a streamed step's chunks after it completes.",
                                  docs="docs/authoring.md#streamed-steps")
        self.keep_partials = keep_partials  # a streamed step's partials stay in the store after it completes
        self.transactional = False  # `ctx.transaction`: the attempt runs in the storage's transaction
        self.reserve: dict[str, float] | None = None  # budget held while the step runs (`check_reserve`)
        self.charge: Any = None  # None: charged from its result's usage; False: never; a callable: its answer


def check_reserve(reserve: Any, label: str) -> dict[str, float] | None:
    """`ctx.step(reserve=)`: the budget a step holds while it runs, kind -> non-negative amount."""
    if reserve is None:
        return None
    if not isinstance(reserve, dict) or not reserve:
        raise ValidationError(f"reserve= of step {label!r} must be a dict like {{'usd': 0.2}}, got {reserve!r}",
                              hint="reserve={'usd': 0.2, 'tokens': 4000} holds that much of the budget while the "
                                   "step runs.", docs="docs/policies.md#reservations")
    for kind, amount in reserve.items():
        check_budget_kind(kind)
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not 0 <= amount < float("inf"):
            raise ValidationError(f"reserve {kind}={amount!r} of step {label!r} must be a finite number >= 0",
                                  hint="reserve={'usd': 0.2}", docs="docs/policies.md#reservations")
    return {k: float(v) for k, v in reserve.items()}


def check_charge(charge: Any, label: str) -> Any:
    """`ctx.step(charge=)`: False (never charge the step's result), True (the default reading) or a callable of
    the step's result returning its charges."""
    if charge is None or charge is True or charge is False or callable(charge):
        return charge
    raise ValidationError(f"charge= of step {label!r} must be a function of the step's result, True or False, got "
                          f"{charge!r}", hint="charge=lambda r: {'tokens': r['tokens_used']}",
                          docs="docs/policies.md#budgets")


REPLAY_POLICIES = ("safe", "idempotent", "manual", "unsafe")
"""`ctx.step(replay=)`: what a resumed run does with a step its process was cut off in. "safe" and "idempotent"
run it again (the same `attempt().operation_id`: "idempotent" says the service deduplicates by it); "manual" and
its older name "unsafe" record the start first and never run it again on their own."""

PLAIN = StepOptions("", None, None, None, None, None, None, None, "safe")


_OPTIONS: dict[tuple[Any, ...], StepOptions] = {}  # validated options by call shape: repeated steps skip validation


def step_options(fn: Callable[..., Any], /, name: str | None = None, retry: Any = None, timeout: float | None = None,
                 compensate: Callable[[Any], Any] | None = None, concurrency_key: str | None = None,
                 concurrency_limit: int | None = None, uses: str | None = None, schema: Any = None,
                 replay: str = "safe", on_interrupt: str | None = None, keep_partials: bool = False,
                 reserve: Any = None, charge: Any = None,
                 **unknown: Any) -> tuple[str | None, StepOptions]:
    """The step name and validated options of a `ctx.step` call with keywords (validated once per call shape)."""
    if unknown:
        raise ArgumentError(
            f"ctx.step() got unknown keyword argument(s) {', '.join(map(repr, unknown))}",
            hint="Arguments for the step function are positional: ctx.step(fn, a, b); to pass keywords, "
                 "wrap it: ctx.step(functools.partial(fn, x=1)) or a lambda.", docs="docs/errors.md#argumenterror")
    if (retry is None and timeout is None and compensate is None and concurrency_key is None
            and concurrency_limit is None and uses is None and schema is None and replay in ("safe", "idempotent")
            and on_interrupt is None and keep_partials is False and reserve is None and charge is None):
        return name, PLAIN
    label = name or label_of(fn)
    if reserve is not None or charge is not None:  # neither is hashable for sure: validated every call
        metered = StepOptions(label, retry, timeout, compensate, concurrency_key, concurrency_limit, uses, schema,
                              replay, on_interrupt, keep_partials)
        metered.reserve, metered.charge = check_reserve(reserve, label), check_charge(charge, label)
        return name, metered
    key = (label, retry, timeout, compensate, concurrency_key, concurrency_limit, uses, schema, replay, on_interrupt,
           keep_partials)
    try:
        opts = _OPTIONS.get(key)
    except TypeError:
        key, opts = None, None  # type: ignore[assignment]
    if opts is None:
        opts = StepOptions(label, retry, timeout, compensate, concurrency_key, concurrency_limit, uses, schema,
                           replay, on_interrupt, keep_partials)
        if key is not None and compensate is None:
            if len(_OPTIONS) >= 4096:
                _OPTIONS.clear()
            _OPTIONS[key] = opts
    return name, opts
