"""Step policies under the test engine: retries, timeouts, stash, compensation, budgets, unsafe replay, limits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from durably_py import (
    BudgetExceededError,
    Retry,
    StepEvent,
    StepInterruptedError,
    StepTimeoutError,
    attempt,
    workflow,
)
from durably_py.testing import Crash, TestEngine


class Flaky(Exception):
    """A transient failure."""


class OrderRejected(Exception):
    """The failure that triggers compensation."""


@pytest.fixture
def engine() -> Iterator[TestEngine]:
    with TestEngine() as eng:
        yield eng


# ---- retries -------------------------------------------------------------------------------------

def test_retries_count_attempts_and_back_off_on_the_fake_clock(engine: TestEngine) -> None:
    starts: list[tuple[int, datetime]] = []

    def call_api() -> str:
        starts.append((attempt().number, engine.clock.now()))
        if len(starts) < 4:
            raise Flaky(f"503 on try {len(starts)}")
        return "200"

    @workflow
    async def wf(ctx):
        return await ctx.step(call_api, name="api", retry=Retry(4, backoff="exponential", base=10))

    events: list[tuple[str, int]] = []
    res = engine.sync.run(wf, on_step=lambda e: events.append((e.status, e.attempt)))
    assert res.status == "completed" and res.result == "200"
    assert [n for n, _ in starts] == [1, 2, 3, 4]
    gaps = [(b - a).total_seconds() for (_, a), (_, b) in zip(starts, starts[1:], strict=False)]
    assert gaps == [10, 20, 40]
    assert events == [("running", 1), ("retrying", 1), ("running", 2), ("retrying", 2),
                      ("running", 3), ("retrying", 3), ("running", 4), ("ok", 4)]
    step = res.step("api")
    assert (step.attempts, step.executions) == (4, 4)


def test_exhausted_retries_fail_the_run_with_the_last_error(engine: TestEngine) -> None:
    def always() -> None:
        raise Flaky(f"try {attempt().number}")

    @workflow
    async def wf(ctx):
        await ctx.step(always, name="always", retry=Retry(3, backoff="linear", base=60))

    res = engine.sync.run(wf)
    assert res.status == "failed" and str(res.error) == "try 3"
    assert (res.step("always").attempts, res.step("always").executions) == (3, 3)


def test_a_crash_between_attempts_resumes_at_the_next_attempt(engine: TestEngine) -> None:
    tries: list[int] = []

    async def flaky() -> str:
        tries.append(attempt().number)
        if len(tries) == 1:
            raise Flaky("first try fails")
        return "done"

    async def slow() -> str:
        await asyncio.sleep(0.02)
        return "slow"

    @workflow
    async def wf(ctx):
        results = await ctx.parallel([
            lambda: ctx.step(flaky, name="flaky", retry=Retry(3, backoff="linear", base=600)),
            lambda: ctx.step(slow, name="slow"),
        ])
        return [r.value for r in results]

    crashed = engine.sync.run(wf, crash_after="slow")
    assert crashed.status == "crashed"
    assert tries == [1]
    waiting = crashed.step("flaky")
    assert (waiting.status, waiting.attempts) == ("retrying", 1)

    done = engine.sync.resume(crashed.run_id)
    assert done.result == ["done", "slow"]
    assert tries == [1, 2]
    assert (done.step("flaky").attempts, done.step("flaky").executions) == (2, 2)
    assert done.step("slow").executions == 1


# ---- timeouts ------------------------------------------------------------------------------------

def test_timeouts_fail_async_and_sync_steps_without_blocking_other_branches(engine: TestEngine) -> None:
    finished: dict[str, float] = {}

    async def hang_async() -> None:
        await asyncio.sleep(30)

    def hang_sync() -> None:
        deadline = time.monotonic() + 30
        while not attempt().cancelled and time.monotonic() < deadline:
            time.sleep(0.005)

    async def quick(i: int) -> int:
        await asyncio.sleep(0.005)
        finished[f"quick {i}"] = time.monotonic()
        return i

    async def quick_chain(ctx) -> int:
        total = 0
        for i in range(3):
            total += await ctx.step(quick, i, name=f"quick {i}")
        return total

    @workflow
    async def wf(ctx):
        results = await ctx.parallel([
            lambda: ctx.step(hang_async, name="hang async", timeout=0.3),
            lambda: ctx.step(hang_sync, name="hang sync", timeout=0.3),
            lambda: quick_chain(ctx),
        ])
        finished["parallel"] = time.monotonic()
        return [type(r.error).__name__ if not r.ok else r.value for r in results]

    def on_step(event: StepEvent) -> None:
        if event.status == "failed":
            finished.setdefault("first timeout", time.monotonic())

    started = time.monotonic()
    res = engine.sync.run(wf, on_step=on_step)
    assert res.result == ["StepTimeoutError", "StepTimeoutError", 3]
    assert finished["quick 2"] < finished["first timeout"] < finished["parallel"]
    assert finished["parallel"] - started < 5.0
    for label in ("hang async", "hang sync"):
        step = res.step(label)
        assert step.status == "failed" and isinstance(step.error, StepTimeoutError)
        assert step.error.timeout == 0.3


def test_a_timed_out_attempt_is_retried(engine: TestEngine) -> None:
    async def sometimes_slow() -> str:
        if attempt().number == 1:
            await asyncio.sleep(30)
        return "fast enough"

    @workflow
    async def wf(ctx):
        return await ctx.step(sometimes_slow, name="call", timeout=0.05, retry=Retry(2, backoff="none"))

    res = engine.sync.run(wf)
    assert res.result == "fast enough"
    assert res.step("call").attempts == 2


# ---- stash ---------------------------------------------------------------------------------------

def test_stash_is_restored_after_a_crash_in_the_step(engine: TestEngine) -> None:
    starts: list[object] = []

    def download() -> int:
        att = attempt()
        starts.append(att.stashed)
        offset = att.stashed or {"bytes": 0}
        for _ in range(3):
            offset = {"bytes": offset["bytes"] + 100}
            att.stash(offset)
        return offset["bytes"]

    @workflow
    async def wf(ctx):
        return await ctx.step(download, name="download")

    crashed = engine.sync.run(wf, crash_in_step="download")
    assert crashed.status == "crashed"
    assert crashed.step("download").stashed == {"bytes": 300}

    done = engine.sync.resume(crashed.run_id)
    assert starts == [None, {"bytes": 300}]
    assert done.result == 600
    assert done.step("download").executions == 2


# ---- compensation --------------------------------------------------------------------------------

def test_compensations_run_in_reverse_completion_order(engine: TestEngine) -> None:
    undone: list[str] = []

    async def book(thing: str, delay: float) -> str:
        await asyncio.sleep(delay)
        return thing

    async def cancel(thing: str) -> None:
        undone.append(thing)

    def confirm() -> None:
        raise OrderRejected("the card was declined")

    @workflow
    async def trip(ctx):
        await ctx.step(book, "taxi", 0, name="taxi", compensate=cancel)
        await ctx.parallel([
            lambda: ctx.step(book, "flight", 0.03, name="flight", compensate=cancel),
            lambda: ctx.step(book, "hotel", 0, name="hotel", compensate=cancel),
        ])
        await ctx.step(confirm, name="confirm")

    res = engine.sync.run(trip)
    assert res.status == "failed" and isinstance(res.error, OrderRejected)
    assert undone == ["flight", "hotel", "taxi"]
    assert {s.label: s.compensation for s in res.steps} == {
        "taxi": "ok", "flight": "ok", "hotel": "ok", "confirm": None,
    }


def test_a_crash_during_compensation_resumes_the_unfinished_ones(engine: TestEngine) -> None:
    calls: list[str] = []

    def reserve(thing: str) -> str:
        return thing

    async def release(thing: str) -> None:
        calls.append(thing)
        if thing == "b" and calls.count("b") == 1:
            raise Crash()

    def fail() -> None:
        raise OrderRejected("out of stock")

    @workflow
    async def order(ctx):
        for thing in ("a", "b", "c"):
            await ctx.step(reserve, thing, name=thing, compensate=release)
        await ctx.step(fail, name="fail")

    crashed = engine.sync.run(order)
    assert crashed.status == "crashed"
    assert calls == ["c", "b"]
    assert crashed.step("c").compensation == "ok"
    assert crashed.step("b").compensation is None

    done = engine.sync.resume(crashed.run_id)
    assert done.status == "failed" and isinstance(done.error, OrderRejected)
    assert calls == ["c", "b", "b", "a"]
    assert done.step("fail").executions == 1
    assert [done.step(t).compensation for t in "abc"] == ["ok", "ok", "ok"]


# ---- budgets -------------------------------------------------------------------------------------

def test_budget_charges_and_the_error_before_the_next_step(engine: TestEngine) -> None:
    engine.engine.on_exhausted = "raise"  # the opt-in; by default the run parks over_budget
    seen: list[tuple[float, float]] = []

    def model_call(prompt: str) -> str:
        return prompt.upper()

    @workflow
    async def agent(ctx):
        for turn in range(3):
            await ctx.step(model_call, f"turn {turn}", name=f"turn {turn}")
            ctx.charge(usd=0.6, tokens=1000)
            seen.append((ctx.budget.spent("usd"), ctx.budget.remaining("usd")))

    res = engine.sync.run(agent, budget={"usd": 1.0})
    assert res.status == "failed"
    assert isinstance(res.error, BudgetExceededError)
    assert (res.error.kind, res.error.spent, res.error.limit) == ("usd", 1.2, 1.0)
    assert seen == [(0.6, pytest.approx(0.4)), (1.2, pytest.approx(-0.2))]
    assert [s.label for s in res.steps] == ["turn 0", "turn 1"]
    state = engine.sync.inspect(res.run_id)
    assert state.spent == {"usd": 1.2, "tokens": 2000.0, "units": 0.0}


def test_replayed_charges_are_not_counted_twice(engine: TestEngine) -> None:
    def work(i: int) -> int:
        return i

    @workflow
    async def wf(ctx):
        await ctx.step(work, 1, name="one")
        ctx.charge(usd=0.3)
        await ctx.step(work, 2, name="two")
        ctx.charge(usd=0.3)
        await ctx.step(work, 3, name="three")
        return ctx.budget.spent("usd"), ctx.budget.remaining("usd")

    crashed = engine.sync.run(wf, budget={"usd": 1.0}, crash_after="two")
    assert engine.sync.inspect(crashed.run_id).spent["usd"] == 0.3
    done = engine.sync.resume(crashed.run_id)
    assert done.result[0] == pytest.approx(0.6)
    assert done.result[1] == pytest.approx(0.4)


def test_charges_inside_a_step_are_real_spend_each_execution(engine: TestEngine) -> None:
    @workflow
    async def wf(ctx):
        def metered() -> str:
            ctx.charge(tokens=500)
            return "answer"

        await ctx.step(metered, name="metered")
        return ctx.budget.spent("tokens")

    crashed = engine.sync.run(wf, crash_in_step="metered")
    done = engine.sync.resume(crashed.run_id)
    assert done.result == 1000
    assert done.step("metered").executions == 2


# ---- unsafe replay, operation ids ------------------------------------------------------------------

def test_unsafe_step_interrupted_by_a_crash_needs_attention(engine: TestEngine) -> None:
    sent: list[str] = []

    def send_wire(amount: int) -> str:
        sent.append(attempt().operation_id)
        return f"sent {amount}"

    @workflow
    async def transfer(ctx, amount):
        await ctx.step(send_wire, amount, name="prepare")
        return await ctx.step(send_wire, amount, name="send", replay="unsafe")

    crashed = engine.sync.run(transfer, 500, crash_in_step="send")
    assert crashed.status == "crashed"
    assert crashed.step("send").status == "needs_attention"

    resumed = engine.sync.resume(crashed.run_id)
    assert resumed.status == "needs_attention"
    assert resumed.step("send").status == "needs_attention"
    assert sent == [f"{crashed.run_id}/0", f"{crashed.run_id}/1"]

    asyncio.run(engine.engine.resolve_effect(crashed.run_id, (1,), value="sent 500 (verified)", here=False))
    done = engine.sync.resume(crashed.run_id)
    assert done.status == "completed" and done.result == "sent 500 (verified)"
    assert sent == [f"{crashed.run_id}/0", f"{crashed.run_id}/1"]  # not sent again


def test_unsafe_step_that_raises_on_interrupt_is_not_run_again(engine: TestEngine) -> None:
    sent: list[str] = []

    def send_wire(amount: int) -> str:
        sent.append(attempt().operation_id)
        return f"sent {amount}"

    @workflow
    async def transfer(ctx, amount):
        await ctx.step(send_wire, amount, name="prepare")
        return await ctx.step(send_wire, amount, name="send", replay="unsafe", on_interrupt="raise")

    crashed = engine.sync.run(transfer, 500, crash_in_step="send")
    assert crashed.status == "crashed"
    assert crashed.step("send").status == "interrupted"

    resumed = engine.sync.resume(crashed.run_id)
    assert resumed.status == "failed"
    error = resumed.error
    assert isinstance(error, StepInterruptedError)
    assert (error.path, error.label, error.operation_id) == ([1], "send", f"{crashed.run_id}/1")
    assert sent == [f"{crashed.run_id}/0", f"{crashed.run_id}/1"]
    assert resumed.step("send").executions == 1
    assert resumed.step("send").status == "failed"


def test_operation_id_is_the_same_across_retries_and_resumes(engine: TestEngine) -> None:
    ids: list[str] = []

    def charge() -> str:
        ids.append(attempt().operation_id)
        if len(ids) == 1:
            raise Flaky("gateway hiccup")
        return "charged"

    @workflow
    async def pay(ctx):
        await ctx.step(lambda: "cart", name="cart")
        return await ctx.step(charge, name="charge", retry=Retry(3, backoff="none"))

    crashed = engine.sync.run(pay, crash_in_step="charge")
    done = engine.sync.resume(crashed.run_id)
    assert done.result == "charged"
    assert ids == [f"{crashed.run_id}/1"] * 3
    assert done.step("charge").executions == 3


# ---- concurrency keys ----------------------------------------------------------------------------

def test_concurrency_key_caps_steps_running_at_once(engine: TestEngine) -> None:
    active = {"now": 0, "peak": 0}

    async def hit(i: int) -> int:
        active["now"] += 1
        active["peak"] = max(active["peak"], active["now"])
        await asyncio.sleep(0.01)
        active["now"] -= 1
        return i

    @workflow
    async def scrape(ctx):
        results = await ctx.parallel([
            lambda i=i: ctx.step(hit, i, name=f"hit {i}", concurrency_key="api", concurrency_limit=2)
            for i in range(6)
        ])
        return [r.value for r in results]

    res = engine.sync.run(scrape)
    assert res.result == [0, 1, 2, 3, 4, 5]
    assert active["peak"] == 2
    assert all(s.executions == 1 for s in res.steps)

