"""Workflows the console's tests run for real (with `durably run tests/ui_flows.py --workflow NAME`)."""

from __future__ import annotations

import os
import time
from typing import Any

from durably_py import Retry, Task, attempt, workflow


def fetch(i: int) -> dict[str, int]:
    """A fetch that takes a moment; every third page fails its first two attempts."""
    time.sleep(0.04 + 0.02 * (i % 4))
    if i % 3 == 1 and attempt().number < 3:
        raise ConnectionError(f"page {i}: connection reset")
    return {"page": i, "words": 100 + i}


def total(pages: list[dict[str, int]]) -> int:
    return sum(p["words"] for p in pages)


@workflow
async def fanout(ctx: Any, n: int) -> int:
    """Parallel fetches with retries and backoff, a durable sleep, then a sum."""
    pages = await ctx.parallel([ctx.step(fetch, i, name=f"fetch {i}", retry=Retry(4, base=0.15)) for i in range(n)],
                               concurrency=4)
    await ctx.sleep(0.3)
    return await ctx.step(total, [p.value for p in pages], name="total")


def tick(i: int, delay: float) -> int:
    time.sleep(delay)
    return i


@workflow
async def slow(ctx: Any, spec: dict[str, Any]) -> int:
    """`n` steps of `delay` seconds each: a run to watch live, or to cancel half way."""
    done = 0
    for i in range(spec["n"]):
        await ctx.step(tick, i, spec["delay"], name=f"tick {i}")
        done += 1
    return done


def pay(amount: float, approver: str) -> str:
    return f"paid {amount:.2f}, approved by {approver}"


@workflow
async def approval(ctx: Any, amount: float) -> str:
    """Wait for the signal "approval" ({"ok": bool, "by": str}), then pay."""
    await ctx.step(tick, 0, 0.01, name="draft report")
    decision = await ctx.wait_for("approval", timeout=600)
    if not decision["ok"]:
        return f"rejected by {decision['by']}"
    return await ctx.step(pay, amount, decision["by"], name="pay out")


@workflow
async def stage(ctx: Any, name: str) -> str:
    """One stage of the pipeline graph, run as a child run."""
    await ctx.step(tick, 0, 0.02, name=f"{name} work")
    return name


@workflow
async def pipeline(ctx: Any, _: Any = None) -> list[str]:
    """A static task graph of child runs."""
    results = await ctx.graph({
        "extract": Task(stage, "extract"),
        "clean": Task(stage, "clean", depends_on=["extract"]),
        "features": Task(stage, "features", depends_on=["extract"]),
        "train": Task(stage, "train", depends_on=["clean", "features"]),
        "report": Task(stage, "report", depends_on=["train"]),
    })
    return [r.value for r in results.values()]


@workflow
async def many(ctx: Any, n: int) -> int:
    """`n` tiny sequential steps (for the first paint of a big run page)."""
    for i in range(n):
        await ctx.step(tick, i, 0, name="step")
    return n


def charge(amount: float) -> str:
    raise RuntimeError(f"card declined for {amount:.2f}")


@workflow
async def checkout(ctx: Any, amount: float) -> str:
    """A run that fails: its charge is declined on every attempt."""
    await ctx.step(tick, 0, 0.01, name="reserve stock")
    return await ctx.step(charge, amount, name="charge card", retry=Retry(2, base=0.05))


async def leg(ctx: Any, i: int) -> int:
    """One branch of `nested`: two steps of its own."""
    a = await ctx.step(tick, i, 0.01, name=f"leg {i} start")
    return await ctx.step(tick, a, 0.01, name=f"leg {i} end")


@workflow
async def nested(ctx: Any, n: int) -> int:
    """`n` parallel branches of two steps each (paths 0.i.0 and 0.i.1), then one step (path 1)."""
    legs = await ctx.parallel([leg(ctx, i) for i in range(n)])
    return await ctx.step(total, [{"words": r.value} for r in legs], name="merge")


def talk(spec: dict[str, Any]) -> str:
    """Emit `n` words as the step's stream, then wait for the file `gate` before it completes."""
    for i in range(spec["n"]):
        attempt().emit(f"word{i} ")
    while not os.path.exists(spec["gate"]):
        time.sleep(0.02)
    return "talked"


@workflow
async def chatter(ctx: Any, spec: dict[str, Any]) -> str:
    """One streamed step whose live output a test watches."""
    return await ctx.step(talk, spec)
