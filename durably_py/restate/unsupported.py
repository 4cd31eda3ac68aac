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

