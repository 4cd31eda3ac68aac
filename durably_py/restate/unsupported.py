"""The durably features Restate mode cannot provide, each failing loudly at its call."""

from __future__ import annotations

from ..errors import NotSupportedError

MODE = "restate"


def unsupported(feature: str, why: str, hint: str | None = None) -> NotSupportedError:
    """A `NotSupportedError` naming the feature and the mode, for the caller to raise."""
    return NotSupportedError(
        f"{feature} is not supported in Restate mode: {why}",
        hint=hint or "Run this workflow on FileStorage, SQLite or PostgreSQL to use it, or do without it here.",
        docs="docs/restate.md#what-does-not-map", feature=feature, mode=MODE)


def no_awakeables() -> NotSupportedError:
    """`ctx.awakeable` on Restate: not mapped to Restate's awakeables yet; `ctx.wait_for` is the alternative."""
    return unsupported("ctx.awakeable", "awakeables are not mapped to Restate's awakeables yet; an answer from outside "
                       "the run arrives through ctx.wait_for(name) and `durably signal` instead",
                       "Wait for the outside answer with ctx.wait_for(name, timeout=...) (a Restate durable promise) "
                       "and have the outside system resolve it with `durably signal RUN NAME JSON`, or run this "
                       "workflow on FileStorage, SQLite or PostgreSQL to use ctx.awakeable.")
