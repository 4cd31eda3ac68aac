"""Retry-policy workflows the Restate tests run on Restate and on FileStorage alike."""

from __future__ import annotations

import os
from pathlib import Path

from durably_py import NonRetryableError, NotSupportedError, Retry, attempt, workflow

MARKS = Path(os.environ.get("DURABLY_TEST_MARKS", "/tmp/durably-restate-marks"))


def mark(name: str) -> None:
    """Record one execution of a step body."""
    MARKS.mkdir(parents=True, exist_ok=True)
    with open(MARKS / f"{name}.{os.getpid()}", "a") as f:
        f.write("x")


class Declined(NonRetryableError):
    """A refusal no retry can change."""


def charge(tag: str) -> None:
    mark(tag)
    raise Declined(f"{tag}: declined", tag=tag)


def forbidden(tag: str) -> None:
    mark(tag)
    raise PermissionError(f"{tag}: forbidden")


def terminal(tag: str) -> None:
    from restate import TerminalError

    mark(tag)
    raise TerminalError(f"{tag}: refused by the remote side", 422)


def flaky(tag: str, fails: int) -> int:
    mark(tag)
    if attempt().number <= fails:
        raise ConnectionError(f"{tag}: try {attempt().number}")
    return attempt().number


def down(tag: str) -> None:
    mark(tag)
    raise ConnectionError(f"{tag}: still down")


@workflow
async def rs_declined(ctx, tag: str) -> dict:
    try:
        await ctx.step(charge, tag, retry=Retry(5, backoff="none"))
    except Declined as exc:
        return {"type": type(exc).__name__, "tag": exc.tag}
    return {}


@workflow
async def rs_forbidden(ctx, tag: str) -> str:
    try:
        await ctx.step(forbidden, tag, retry=Retry(5, backoff="none", give_up_on=PermissionError))
    except PermissionError as exc:
        return str(exc)
    return ""


@workflow
async def rs_terminal(ctx, tag: str) -> str:
    try:
        await ctx.step(terminal, tag, retry=Retry(5, backoff="none"))
    except Exception as exc:  # noqa: BLE001 - the workflow reports what came back
        return f"{type(exc).__name__}: {exc}"
    return ""


@workflow
async def rs_forever(ctx, tag: str) -> int:
    return await ctx.step(flaky, tag, 6, retry=Retry(None, backoff="constant", base=0.05))


@workflow
async def rs_deadline(ctx, tag: str) -> str:
    try:
        await ctx.step(down, tag, retry=Retry(None, backoff="constant", base=0.2, deadline=1.0))
    except ConnectionError as exc:
        return str(exc)
    return ""


@workflow
async def rs_fails(ctx, tag: str) -> None:
    await ctx.step(charge, tag, retry=Retry(5, backoff="none"))


@workflow
async def rs_self(ctx, tag: str) -> dict:
    """What a run knows of itself: no schedule started it; its engine where it has one."""
    try:
        ctx.engine  # noqa: B018 - the attribute is the check
    except NotSupportedError:
        return {"tick": ctx.scheduled_at, "engine": "unsupported"}
    return {"tick": ctx.scheduled_at, "engine": "available"}
