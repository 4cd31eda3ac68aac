"""Workflows the Restate conformance tests run on Restate and on FileStorage alike (nothing here mentions Restate)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from durably_py import AwakeableTimeoutError, DurablyError, Retry, StepInterruptedError, attempt, workflow

MARKS = Path(os.environ.get("DURABLY_TEST_MARKS", "/tmp/durably-restate-marks"))


def mark(name: str) -> None:
    """Record one execution of a step body (a crash test counts them)."""
    MARKS.mkdir(parents=True, exist_ok=True)
    with open(MARKS / f"{name}.{os.getpid()}", "a") as f:
        f.write("x")


def add(a: int, b: int) -> int:
    return a + b


async def double(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


_flaky: dict[str, int] = {}


def flaky(key: str, fails: int) -> str:
    _flaky[key] = _flaky.get(key, 0) + 1
    if _flaky[key] <= fails:
        raise ConnectionError(f"try {_flaky[key]}")
    return f"{key} ok after {_flaky[key]}"


def lookup(key: str) -> str:
    raise KeyError(key)


async def slow(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "late"


def pause(tag: str, seconds: float) -> str:
    mark(tag)
    time.sleep(seconds)
    return tag


@workflow
async def basics(ctx, n: int) -> dict:
    a = await ctx.step(add, n, 1)
    b = await ctx.step(double, a)
    c = await ctx.step(flaky, f"f{n}", 2, retry=Retry(3, backoff="linear", base=0.05))
    try:
        await ctx.step(lookup, "k")
        failed = None
    except KeyError as exc:
        failed = f"{type(exc).__name__} {exc}"
    try:
        await ctx.step(slow, 5, timeout=0.2)
        timed = None
    except TimeoutError as exc:
        timed = type(exc).__name__
    fan = await ctx.parallel([ctx.step(double, i) for i in range(3)])
    pair = await asyncio.gather(ctx.step(add, 100, 100), ctx.step(double, 200))

    async def branch(i: int) -> list:
        x = await ctx.step(add, i, i)
        y = await ctx.step(double, x)
        return [x, y]

    branches = await ctx.parallel([lambda i=i: branch(i) for i in range(3)])
    await ctx.sleep(0.05)
    u = ctx.uuid()
    r = ctx.random()
    t = ctx.now()
    return {"a": a, "b": b, "c": c, "failed": failed, "timed": timed, "fan": [x.value for x in fan],
            "pair": pair, "branches": [x.value for x in branches], "uuid_len": len(u), "rand_ok": 0 <= r < 1,
            "now_tz": t.tzinfo is not None}


@workflow
async def races(ctx) -> list:
    """Handles as futures: gathered, awaited again, raced with ctx.first and with asyncio.wait."""
    a = ctx.step(add, 1, 2)
    both = await asyncio.gather(a, ctx.step(double, 5))
    again = await a
    which, value = await ctx.first(quick=ctx.step(add, 2, 2), late=ctx.sleep(30))
    sleep = asyncio.ensure_future(ctx.sleep(60))
    sig = asyncio.ensure_future(ctx.wait_for("go", timeout=120))
    done, _ = await asyncio.wait([sleep, sig], return_when=asyncio.FIRST_COMPLETED)
    return [both, again, which, value, "signal" if sig in done else "slept"]


@workflow
async def signals(ctx) -> list:
    got = []
    try:
        await ctx.wait_for("go", timeout=0.3)
    except TimeoutError:
        got.append("timeout")
    got.append(await ctx.wait_for("go"))
    got.append(await ctx.wait_for("go"))
    return got


def note(name: str, value: str) -> str:
    """Tell the test a value the workflow handed out (an awakeable's id)."""
    MARKS.mkdir(parents=True, exist_ok=True)
    (MARKS / name).write_text(value)
    return value


@workflow
async def callback(ctx, n: int) -> dict:
    paid = await ctx.awakeable(timeout=600, name="payment")
    await ctx.step(note, f"awakeable-{n}", paid.id)
    brief = await ctx.awakeable(timeout=0.2)
    try:
        await brief
        late = "resolved"
    except AwakeableTimeoutError as exc:
        late = f"timed out: {exc.awakeable == brief.id}"
    return {"paid": await paid, "again": await paid.result(), "late": late, "name": paid.name,
            "deadline": paid.deadline is not None, "url": paid.url}


@workflow
async def child(ctx, x: int) -> int:
    if x < 0:
        raise ValueError(f"negative {x}")
    return await ctx.step(double, x)


@workflow
async def parent(ctx, xs: list) -> list:
    handles = await ctx.spawn_all([(child, x) for x in xs])
    results = await ctx.join_all(handles)
    return [r.value if r.ok else f"{type(r.error).__name__}: {r.error}" for r in results]


def reserve(item: str) -> str:
    mark(f"reserve-{item}")
    return f"hold-{item}"


def release(hold: str) -> None:
    mark(f"release-{hold}")


def ship(_: str) -> None:
    raise RuntimeError("carrier down")


@workflow
async def saga(ctx) -> str:
    await ctx.step(reserve, "a", compensate=release)
    await ctx.step(reserve, "b", compensate=release)
    await ctx.step(ship, "x")
    return "shipped"


@workflow
async def charge(ctx, seconds: float) -> str:
    try:
        return await ctx.step(pause, "charge", seconds, replay="unsafe")
    except StepInterruptedError as exc:
        return f"interrupted: {type(exc).__name__}"


@workflow
async def seq(ctx, n: int) -> int:
    total = 0
    for i in range(n):
        total += await ctx.step(pause, f"seq{n}-{i}", 0.1) and i
    return total


@workflow
async def fan_branches(ctx, spec: dict) -> list:
    async def branch(b: int) -> list:
        out = []
        for s in range(spec["steps"]):
            tag = f"{spec.get('tag', 'fb')}-{b}-{s}"
            out.append(await ctx.step(pause, tag, 0.005 * ((b * 7 + s * 3) % 10 + 1)))
        return out

    results = await ctx.parallel([lambda b=b: branch(b) for b in range(spec["branches"])])
    return [r.value for r in results]


@workflow
async def budgeted(ctx) -> str:
    ctx.charge(usd=1)
    return "charged"


@workflow
async def chatty(ctx, tag: str) -> int:
    ctx.log(f"before {tag}")
    a = await ctx.step(add, 1, 2)
    ctx.log(f"after {tag}")
    b = await ctx.step(add, a, 3)
    ctx.log(f"end {tag}")
    return b


@dataclass
class Order:
    item: str
    qty: int


@dataclass
class Quote:
    item: str
    total: float


def price(order: Order) -> dict:
    return {"item": order.item, "total": order.qty * 2.5}


def bad_quote(order: Order) -> dict:
    return {"item": order.item}


@workflow(input=Order, output=Quote)
async def typed(ctx, order: Order) -> Quote:
    quote = await ctx.step(price, order, schema=Quote)
    assert isinstance(quote, Quote)
    try:
        await ctx.step(bad_quote, order, schema=Quote)
        bad = None
    except Exception as exc:  # noqa: BLE001 - the schema error's class is part of the result
        bad = type(exc).__name__
    await ctx.sleep_until(ctx.now() + timedelta(seconds=0.05))
    return Quote(f"{quote.item} ({bad})", quote.total)


def stashing() -> str:
    attempt().stash("half")
    return "stashed"


def emitting() -> str:
    attempt().emit("token")
    return "emitted"


async def generating():
    yield "token"


async def turn(state: int, it) -> object:
    return it.done(state) if state >= 2 else state + 1


@workflow
async def features(ctx) -> list:
    """Each optional feature's outcome: its value, or the class and message of the error it raised."""
    tries = {"stash": lambda: ctx.step(stashing),
             "snapshot": lambda: ctx.loop(0, turn, snapshot_every=1),
             "uses": lambda: ctx.step(add, 1, 1, uses="api"),
             "concurrency_key": lambda: ctx.step(add, 1, 1, concurrency_key="k", concurrency_limit=1),
             "graph": lambda: ctx.graph({}),
             "annotate": lambda: ctx.annotate(note=1),
             "emit": lambda: ctx.step(emitting),
             "generator": lambda: ctx.step(generating),
             "transaction": lambda: ctx.transaction(add, 1, 1),
             "reserve": lambda: ctx.step(add, 1, 1, reserve={"usd": 0.1}),
             "charge": lambda: ctx.step(add, 1, 1, charge=lambda r: {"units": 1})}
    out = []
    for name, call in tries.items():
        try:
            value = call()
            out.append([name, await value if value is not None else None])
        except DurablyError as exc:
            out.append([name, f"{type(exc).__name__}: {exc.message}"])
    return out
