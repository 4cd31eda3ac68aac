"""Checked by mypy in CI (`.ci/run`), not run by pytest: `ctx.step` returns the step function's result type."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from typing import Any, assert_type

from durably_py import WorkflowContext, attempt, workflow


def count(text: str) -> int:
    return len(text)


async def fetch(url: str) -> dict[str, str]:
    return {"url": url}


@workflow
async def typed(ctx: WorkflowContext, url: str) -> int:
    page = await ctx.step(fetch, url)
    assert_type(page, dict[str, str])
    n = await ctx.step(count, page["url"], name="count", retry=None)
    assert_type(n, int)
    converted = await ctx.step(fetch, url, schema=dict)
    assert_type(converted, Any)
    return n


@workflow
async def knows_itself(ctx: WorkflowContext) -> None:
    from datetime import datetime

    from durably_py import EngineAPI, NonRetryableError, Retry

    assert_type(ctx.scheduled_at, datetime | None)
    assert_type(ctx.engine, EngineAPI)
    await ctx.step(count, "x", retry=Retry(None, backoff="constant", give_up_on=NonRetryableError, deadline=60))


async def tokens(prompt: str) -> AsyncGenerator[str, None]:
    yield prompt


def rows(n: int) -> Iterator[dict[str, int]]:
    yield {"n": n}


def emitting(text: str) -> str:
    attempt().emit(text)
    partials: list[Any] = attempt().partials
    return text + str(len(partials))


@workflow
async def streams(ctx: WorkflowContext) -> None:
    joined = await ctx.step(tokens, "hi", keep_partials=True)
    assert_type(joined, Any)  # a str when every chunk is one, else the list of chunks
    assert_type(await ctx.step(rows, 2), Any)
    assert_type(await ctx.step(emitting, "x", keep_partials=False), str)


def reserve(conn: Any, sku: str) -> int:
    return len(sku)


async def reserve_async(conn: Any, sku: str) -> list[int]:
    return [len(sku)]


@workflow
async def transactional(ctx: WorkflowContext, sku: str) -> int:
    left = await ctx.transaction(reserve, sku, name="reserve")
    assert_type(left, int)
    many = await ctx.transaction(reserve_async, sku, retry=None)
    assert_type(many, list[int])
    return left + len(many)


@workflow
async def metered(ctx: WorkflowContext, url: str) -> None:
    reserved = await ctx.step(fetch, url, reserve={"usd": 0.2}, charge=lambda r: {"units": 1})
    assert_type(reserved, dict[str, str])  # budget options keep the step's result type
    assert_type(await ctx.step(count, url, charge=False), int)
