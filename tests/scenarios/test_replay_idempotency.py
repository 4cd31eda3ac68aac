"""Replay and idempotency: what a resumed run answers from its log and what it runs again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from durably_py import Retry, workflow
from durably_py.testing import TestEngine


class PaymentDeclined(Exception):
    """A domain failure the workflow handles itself."""


@pytest.fixture
def engine() -> Iterator[TestEngine]:
    with TestEngine() as eng:
        yield eng


def test_completed_steps_never_run_again_on_resume(engine: TestEngine) -> None:
    effects: list[str] = []

    def charge_card(order: str) -> str:
        effects.append(f"charge {order}")
        return f"receipt-{order}"

    def ship(order: str) -> str:
        effects.append(f"ship {order}")
        return f"parcel-{order}"

    def email(receipt: str, parcel: str) -> str:
        effects.append(f"email {receipt} {parcel}")
        return "sent"

    @workflow
    async def fulfil(ctx, order):
        receipt = await ctx.step(charge_card, order, name="charge")
        parcel = await ctx.step(ship, order, name="ship")
        return await ctx.step(email, receipt, parcel, name="email")

    crashed = engine.sync.run(fulfil, "A1", crash_after="ship")
    assert crashed.status == "crashed"
    assert effects == ["charge A1", "ship A1"]

    done = engine.sync.resume(crashed.run_id)
    assert done.status == "completed" and done.result == "sent"
    assert effects == ["charge A1", "ship A1", "email receipt-A1 parcel-A1"]
    assert [(s.label, s.executions) for s in done.steps] == [("charge", 1), ("ship", 1), ("email", 1)]


def test_resume_reruns_only_unfinished_parallel_branches(engine: TestEngine) -> None:
    async def quick(i: int) -> int:
        return i

    async def slow(i: int) -> int:
        await asyncio.sleep(0.02)
        return i * 10

    @workflow
    async def fan(ctx):
        results = await ctx.parallel([
            lambda: ctx.step(quick, 1, name="quick"),
            lambda: ctx.step(slow, 2, name="slow 2"),
            lambda: ctx.step(slow, 3, name="slow 3"),
        ])
        return [r.value for r in results]

    crashed = engine.sync.run(fan, crash_after="quick")
    assert crashed.status == "crashed"
    assert [(s.path, s.status) for s in crashed.steps] == [
        ((0, 0, 0), "ok"), ((0, 1, 0), "interrupted"), ((0, 2, 0), "interrupted"),
    ]

    done = engine.sync.resume(crashed.run_id)
    assert done.result == [1, 20, 30]
    assert {s.label: s.executions for s in done.steps} == {"quick": 1, "slow 2": 2, "slow 3": 2}


def test_resume_reruns_only_failed_parallel_branches(engine: TestEngine) -> None:
    outage = {"on": True}

    def fetch(page: int) -> str:
        if page == 2 and outage["on"]:
            raise ConnectionError(f"page {page} unreachable")
        return f"page {page}"

    @workflow
    async def crawl(ctx):
        results = await ctx.parallel([lambda p=p: ctx.step(fetch, p, name=f"fetch {p}") for p in range(4)])
        failures = [r.error for r in results if not r.ok]
        if failures:
            raise failures[0]
        return [r.value for r in results]

    failed = engine.sync.run(crawl)
    assert failed.status == "failed" and isinstance(failed.error, ConnectionError)
    assert failed.step("fetch 2").status == "failed"

    outage["on"] = False
    done = engine.sync.resume(failed.run_id)
    assert done.result == ["page 0", "page 1", "page 2", "page 3"]
    assert {s.label: s.executions for s in done.steps} == {"fetch 0": 1, "fetch 1": 1, "fetch 2": 2, "fetch 3": 1}


def test_recorded_failures_reraise_the_same_exception_class(engine: TestEngine) -> None:
    seen: list[tuple[str, str]] = []

    def pay(amount: int) -> str:
        raise PaymentDeclined(f"card declined for {amount}")

    def fallback(amount: int) -> str:
        return f"invoice for {amount}"

    @workflow
    async def checkout(ctx, amount):
        try:
            return await ctx.step(pay, amount, name="pay")
        except PaymentDeclined as exc:
            seen.append((type(exc).__name__, str(exc)))
            note = await ctx.step(fallback, amount, name="fallback")
            await ctx.step(fallback, amount, name="confirm")
            return note

    crashed = engine.sync.run(checkout, 30, crash_after="fallback")
    assert crashed.status == "crashed"
    done = engine.sync.resume(crashed.run_id)
    assert done.result == "invoice for 30"
    assert seen == [("PaymentDeclined", "card declined for 30")] * 3  # live, resume, shadow replay
    assert done.step("pay").executions == 1
    assert isinstance(done.step("pay").error, PaymentDeclined)


def test_failed_run_resumes_at_the_failed_step_with_fresh_attempts(engine: TestEngine) -> None:
    calls = {"upload": 0}

    def prepare() -> str:
        return "blob"

    def upload(blob: str) -> str:
        calls["upload"] += 1
        if calls["upload"] <= 3:
            raise TimeoutError(f"upload try {calls['upload']} timed out")
        return f"stored {blob}"

    @workflow
    async def publish(ctx):
        blob = await ctx.step(prepare, name="prepare")
        return await ctx.step(upload, blob, name="upload", retry=Retry(2, backoff="exponential", base=30))

    failed = engine.sync.run(publish)
    assert failed.status == "failed"
    assert str(failed.error) == "upload try 2 timed out"
    assert failed.step("upload").attempts == 2

    done = engine.sync.resume(failed.run_id)
    assert done.status == "completed" and done.result == "stored blob"
    upload_step = done.step("upload")
    assert (upload_step.executions, upload_step.attempts) == (4, 2)
    assert done.step("prepare").executions == 1


def test_recorded_time_randomness_and_ids_are_stable_across_resume(engine: TestEngine) -> None:
    seen: list[tuple[object, float, str]] = []

    def work(x: int) -> int:
        return x

    @workflow
    async def sample(ctx):
        stamp = ctx.now()
        roll = ctx.random()
        ident = ctx.uuid()
        seen.append((stamp, roll, ident))
        await ctx.step(work, 1, name="one")
        await ctx.step(work, 2, name="two")
        return {"stamp": stamp, "roll": roll, "id": ident}

    crashed = engine.sync.run(sample, crash_after="one")
    engine.clock.advance(3600)
    done = engine.sync.resume(crashed.run_id)
    assert done.status == "completed"
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    stamp, roll, ident = seen[0]
    assert done.result == {"stamp": stamp, "roll": roll, "id": ident}
    assert [s.label for s in done.steps[:3]] == ["ctx.now", "ctx.random", "ctx.uuid"]
