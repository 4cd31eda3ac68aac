"""The test engine itself: statuses, crash injection, resume, step reports, fake clock, shadow replay, fixture."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from durably_py import (
    BudgetExceededError,
    FakeClock,
    PurityError,
    Retry,
    RunNotFoundError,
    StepEvent,
    ValidationError,
    attempt,
    workflow,
)
from durably_py.testing import ShadowReplayError, SyncTestEngine, TestEngine, TestRunResult


class Boom(Exception):
    """A step failure the tests raise on purpose."""


def add(x: int, y: int) -> int:
    return x + y


def double(x: int) -> int:
    return x * 2


@workflow
async def arithmetic(ctx, n):
    a = await ctx.step(add, n, 1)
    b = await ctx.step(double, a)
    c = await ctx.step(add, b, 10)
    return {"a": a, "b": b, "c": c}


@pytest.fixture
def engine() -> Iterator[TestEngine]:
    with TestEngine() as eng:
        yield eng


# ---- statuses ------------------------------------------------------------------------------------

def test_completed_run_reports_result_and_steps(engine: TestEngine) -> None:
    res = engine.sync.run(arithmetic, 4)
    assert isinstance(res, TestRunResult)
    assert res.status == "completed"
    assert res.result == {"a": 5, "b": 10, "c": 20}
    assert res.error is None
    assert [(s.path, s.label, s.status, s.executions, s.attempts, s.output) for s in res.steps] == [
        ((0,), "add", "ok", 1, 1, 5),
        ((1,), "double", "ok", 1, 1, 10),
        ((2,), "add", "ok", 1, 1, 20),
    ]
    assert res.step(("add", 2)).output == 20
    assert res.step((1,)).label == "double"
    assert res.executions == {"add": 2, "double": 1}


def test_failed_run_reports_the_exception_and_the_failed_step(engine: TestEngine) -> None:
    def explode() -> None:
        raise Boom("no luck")

    @workflow
    async def wf(ctx):
        await ctx.step(add, 1, 1, name="first")
        await ctx.step(explode, name="explode")

    res = engine.sync.run(wf)
    assert res.status == "failed"
    assert isinstance(res.error, Boom) and str(res.error) == "no luck"
    assert res.result is None
    step = res.step("explode")
    assert (step.path, step.status, step.executions, step.attempts) == ((1,), "failed", 1, 1)
    assert isinstance(step.error, Boom)
    assert res.step("first").error is None


def test_errors_before_a_run_exists_are_raised(engine: TestEngine) -> None:
    with pytest.raises(ValidationError):
        engine.sync.run(lambda ctx: None)
    with pytest.raises(RunNotFoundError):
        engine.sync.resume("nope-20260101-00000000")


# ---- crash injection -----------------------------------------------------------------------------

def test_crash_after_path_records_nothing_after_it(engine: TestEngine) -> None:
    res = engine.sync.run(arithmetic, 1, crash_after=(1,))
    assert res.status == "crashed"
    assert res.result is None and res.error is None
    assert [(s.path, s.status, s.executions) for s in res.steps] == [((0,), "ok", 1), ((1,), "ok", 1)]
    state = engine.sync.inspect(res.run_id)
    assert state.status == "interrupted"

    resumed = engine.sync.resume(res.run_id)
    assert resumed.run_id == res.run_id
    assert resumed.status == "completed"
    assert resumed.result == {"a": 2, "b": 4, "c": 14}
    assert [s.executions for s in resumed.steps] == [1, 1, 1]


def test_crash_after_label_stops_at_its_first_occurrence(engine: TestEngine) -> None:
    res = engine.sync.run(arithmetic, 1, crash_after="add")
    assert res.status == "crashed"
    assert [s.path for s in res.steps] == [(0,)]
    assert engine.sync.resume(res.run_id).result == {"a": 2, "b": 4, "c": 14}


def test_crash_after_label_and_nth(engine: TestEngine) -> None:
    @workflow
    async def counter(ctx, n):
        total = 0
        for i in range(n):
            total = await ctx.step(add, total, i, name="inc")
        return total

    res = engine.sync.run(counter, 5, crash_after=("inc", 3))
    assert res.status == "crashed"
    assert [s.output for s in res.steps] == [0, 1, 3]
    done = engine.sync.resume(res.run_id)
    assert done.result == 10
    assert [s.executions for s in done.steps] == [1, 1, 1, 1, 1]


def test_crash_after_nested_path_in_a_parallel_branch(engine: TestEngine) -> None:
    @workflow
    async def fan(ctx):
        results = await ctx.parallel([
            lambda: ctx.step(add, 0, 1, name="b0"),
            lambda: ctx.step(add, 0, 2, name="b1"),
        ])
        return [r.value for r in results]

    res = engine.sync.run(fan, crash_after=(0, 1, 0))
    assert res.status == "crashed"
    assert res.step((0, 1, 0)).status == "ok"
    done = engine.sync.resume(res.run_id)
    assert done.result == [1, 2]
    assert done.step((0, 1, 0)).executions == 1


def test_crash_in_step_runs_the_function_but_records_nothing(engine: TestEngine) -> None:
    calls: list[int] = []

    def effect(x: int) -> int:
        calls.append(x)
        return x

    @workflow
    async def wf(ctx):
        await ctx.step(add, 1, 2, name="before")
        return await ctx.step(effect, 7, name="effect")

    res = engine.sync.run(wf, crash_in_step="effect")
    assert res.status == "crashed"
    assert calls == [7]
    interrupted = res.step("effect")
    assert (interrupted.path, interrupted.status, interrupted.executions) == ((1,), "interrupted", 1)

    done = engine.sync.resume(res.run_id)
    assert done.status == "completed" and done.result == 7
    assert calls == [7, 7]
    assert done.step("effect").executions == 2
    assert done.step("before").executions == 1


def test_resume_can_crash_again(engine: TestEngine) -> None:
    first = engine.sync.run(arithmetic, 0, crash_after=(0,))
    second = engine.sync.resume(first.run_id, crash_after=(1,))
    assert second.status == "crashed"
    assert [s.path for s in second.steps] == [(0,), (1,)]
    third = engine.sync.resume(first.run_id)
    assert third.status == "completed"
    assert [s.executions for s in third.steps] == [1, 1, 1]


def test_a_second_run_with_the_same_input_resumes_the_crashed_run(engine: TestEngine) -> None:
    first = engine.sync.run(arithmetic, 3, crash_after=(0,))
    again = engine.sync.run(arithmetic, 3)
    assert again.run_id == first.run_id
    assert [s.executions for s in again.steps] == [1, 1, 1]
    fresh = engine.sync.run(arithmetic, 3)
    assert fresh.run_id != first.run_id


def test_keyed_runs_resume_by_key(engine: TestEngine) -> None:
    first = engine.sync.run(arithmetic, 3, key="job-1", crash_after=(1,))
    again = engine.sync.run(arithmetic, 3, key="job-1")
    assert again.run_id == first.run_id and again.status == "completed"
    assert engine.sync.inspect(first.run_id).key == "job-1"


# ---- resume of failed runs, step reports -------------------------------------------------------

def test_failed_run_resumes_at_the_failed_step(engine: TestEngine) -> None:
    broken = {"on": True}

    def fragile(x: int) -> int:
        if broken["on"]:
            raise Boom("down")
        return x + 100

    @workflow
    async def wf(ctx):
        a = await ctx.step(add, 1, 1, name="a")
        return await ctx.step(fragile, a, name="fragile")

    failed = engine.sync.run(wf)
    assert failed.status == "failed" and isinstance(failed.error, Boom)
    broken["on"] = False
    done = engine.sync.resume(failed.run_id)
    assert done.status == "completed" and done.result == 102
    assert done.step("a").executions == 1
    fragile_step = done.step("fragile")
    assert (fragile_step.executions, fragile_step.attempts, fragile_step.status) == (2, 1, "ok")


def test_steps_report_attempts_stash_and_error(engine: TestEngine) -> None:
    def chunked() -> None:
        att = attempt()
        done = (att.stashed or 0) + 1
        att.stash(done)
        raise Boom(f"attempt {att.number} failed after chunk {done}")

    @workflow
    async def wf(ctx):
        await ctx.step(chunked, name="chunked", retry=Retry(3, backoff="none"))

    res = engine.sync.run(wf)
    assert res.status == "failed"
    step = res.step("chunked")
    assert (step.status, step.executions, step.attempts, step.stashed) == ("failed", 3, 3, 3)
    assert isinstance(step.error, Boom) and str(step.error) == "attempt 3 failed after chunk 3"


def test_on_step_listener_sees_every_event(engine: TestEngine) -> None:
    events: list[StepEvent] = []
    res = engine.sync.run(arithmetic, 1, crash_after=(1,), on_step=events.append)
    assert [(e.path, e.status) for e in events] == [
        ((0,), "running"), ((0,), "ok"), ((1,), "running"), ((1,), "ok"),
    ]
    events.clear()
    engine.sync.resume(res.run_id, on_step=events.append)
    assert [(e.path, e.status) for e in events] == [
        ((0,), "replayed"), ((1,), "replayed"), ((2,), "running"), ((2,), "ok"),
    ]


def test_budget_option_and_advisories_are_reported(engine: TestEngine) -> None:
    @workflow
    async def spender(ctx):
        for _ in range(3):
            await ctx.step(add, 0, 0, name="call")
            ctx.charge(usd=1)

    res = engine.sync.run(spender, budget={"usd": 1.5})
    assert res.status == "over_budget" and res.error is None  # parked until its budget is raised
    assert [s.label for s in res.steps] == ["call", "call"]
    engine.engine.on_exhausted = "raise"  # the opt-in to the error instead
    try:
        res = engine.sync.run(spender, budget={"usd": 1.5}, key="raising")
    finally:
        engine.engine.on_exhausted = "park"
    assert res.status == "failed" and isinstance(res.error, BudgetExceededError)

    @workflow
    async def chatty(ctx):
        for i in range(100):
            await ctx.step(add, i, 0, name="tiny")

    res = engine.sync.run(chatty, advisories="silent")
    assert res.status == "completed"
    assert [a.code for a in res.advisories] == ["LOOP_SUGGESTED"]


# ---- fake clock ----------------------------------------------------------------------------------

def test_an_hour_of_backoff_takes_milliseconds(engine: TestEngine) -> None:
    tries: list[int] = []

    def flaky() -> str:
        tries.append(attempt().number)
        if len(tries) < 3:
            raise Boom("try again later")
        return "ok"

    @workflow
    async def wf(ctx):
        start = ctx.now()
        out = await ctx.step(flaky, name="flaky", retry=Retry(3, backoff="linear", base=3600, max=7200))
        return {"out": out, "waited": (ctx.now() - start).total_seconds()}

    before = engine.clock.now()
    started = time.perf_counter()
    res = engine.sync.run(wf)
    assert time.perf_counter() - started < 1.0
    assert res.status == "completed"
    assert res.result == {"out": "ok", "waited": 3 * 3600}
    assert tries == [1, 2, 3]
    assert engine.clock.now() - before >= timedelta(hours=2)
    assert res.step("flaky").attempts == 3


def test_clock_advance_moves_virtual_time() -> None:
    @workflow
    async def when(ctx):
        return ctx.now()

    clock = FakeClock()
    with TestEngine(clock=clock) as eng:
        t0 = eng.clock.now()
        eng.clock.advance(90)
        res = eng.sync.run(when)
        assert res.result == t0 + timedelta(seconds=90)
        assert eng.sync.clock is clock


# ---- shadow replay -------------------------------------------------------------------------------

_flips = {"n": 0}


def cheap() -> str:
    return "cheap"


def premium() -> str:
    return "premium"


@workflow
async def impure(ctx):
    _flips["n"] += 1
    if _flips["n"] % 2:
        return await ctx.step(cheap)
    return await ctx.step(premium)


def test_shadow_replay_catches_a_branch_chosen_outside_a_step(engine: TestEngine) -> None:
    _flips["n"] = 0
    with pytest.raises(ShadowReplayError) as caught:
        engine.sync.run(impure)
    err = caught.value
    assert isinstance(err, PurityError)
    message = str(err)
    assert err.run_id in message
    assert "(0,)" in message and "'cheap'" in message and "'premium'" in message
    assert "result recorded: 'cheap'" in message
    assert "ctx.now()" in err.hint


@workflow
async def impure_result(ctx):
    _flips["n"] += 1
    value = await ctx.step(cheap)
    return f"{value}-{_flips['n']}"


def test_shadow_replay_compares_the_result(engine: TestEngine) -> None:
    _flips["n"] = 0
    with pytest.raises(ShadowReplayError) as caught:
        engine.sync.run(impure_result)
    assert "result recorded: 'cheap-1'" in str(caught.value)
    assert "result replayed: 'cheap-2'" in str(caught.value)
    assert caught.value.divergence is None


@workflow
async def impure_extra(ctx):
    _flips["n"] += 1
    await ctx.step(cheap)
    if _flips["n"] > 1:
        await ctx.step(premium)


def test_shadow_replay_catches_a_step_that_would_run_again(engine: TestEngine) -> None:
    _flips["n"] = 0
    with pytest.raises(ShadowReplayError) as caught:
        engine.sync.run(impure_extra)
    assert "'premium' at path (1,) ran again" in str(caught.value)


def test_shadow_replay_can_be_turned_off() -> None:
    _flips["n"] = 0
    with TestEngine(shadow=False) as eng:
        assert eng.sync.run(impure).result == "cheap"


def test_deterministic_workflows_pass_shadow_replay_after_crashes(engine: TestEngine) -> None:
    @workflow
    async def tidy(ctx, n):
        stamp = ctx.now()
        token = ctx.uuid()
        picks = await ctx.parallel([lambda i=i: ctx.step(add, i, n, name=f"item {i}") for i in range(3)])
        roll = ctx.random()
        return {"stamp": stamp, "token": token, "picks": [p.value for p in picks], "roll": roll}

    first = engine.sync.run(tidy, 5, crash_after=(2, 1, 0))
    done = engine.sync.resume(first.run_id)
    assert done.status == "completed"
    assert done.result["picks"] == [5, 6, 7]
    engine.sync.verify(done.run_id)


# ---- async use, sync facade, fixture ---------------------------------------------------------------

def test_async_api_runs_inside_an_event_loop() -> None:
    async def scenario() -> tuple[str, str]:
        with TestEngine() as eng:
            crashed = await eng.run(arithmetic, 2, crash_after="double")
            with pytest.raises(ValidationError):
                eng.sync.run(arithmetic, 2)
            done = await eng.resume(crashed.run_id)
            await eng.verify(done.run_id)
            return crashed.status, done.status

    assert asyncio.run(scenario()) == ("crashed", "completed")


def test_pytest_fixture_gives_a_fresh_engine(durably_engine: TestEngine) -> None:
    assert isinstance(durably_engine, TestEngine)
    assert isinstance(durably_engine.sync, SyncTestEngine)
    res = durably_engine.sync.run(arithmetic, 1, crash_in_step="double")
    assert durably_engine.sync.resume(res.run_id).step("double").executions == 2
