"""Races and asyncio idioms: parking never leaks into user code, and whichever outcome won a race wins on
every replay (TestEngine, run(), run(wait=False)); worker processes and kills are in test_races_workers.py."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import pytest

from durably_py import (
    First,
    Handle,
    MemoryStorage,
    NotDurableError,
    RunCancelledError,
    RunParkedError,
    WaitTimeoutError,
    create_engine,
    run,
    workflow,
)
from durably_py.testing import TestEngine

calls: dict[str, int] = {}


def effect(name: str) -> str:
    calls[name] = calls.get(name, 0) + 1
    return name


async def slow_effect(name: str, seconds: float) -> str:
    await asyncio.sleep(seconds)
    return effect(name)


def boom(name: str) -> str:
    calls[name] = calls.get(name, 0) + 1
    raise RuntimeError(f"{name} failed")


@workflow
async def sleep_or_signal(ctx):
    """The issue's own example: two tasks of ctx calls raced with asyncio.wait."""
    sleep = asyncio.ensure_future(ctx.sleep(3600))
    sig = asyncio.ensure_future(ctx.wait_for("complete", timeout=7200))
    done, _ = await asyncio.wait([sleep, sig], return_when=asyncio.FIRST_COMPLETED)
    return "signal" if sig in done else "slept"


@workflow
async def race_by_create_task(ctx):
    sleep = asyncio.create_task(ctx.sleep(60))
    sig = asyncio.create_task(ctx.wait_for("go"))
    done, pending = await asyncio.wait([sig, sleep], return_when=asyncio.FIRST_COMPLETED)
    for loser in pending:
        loser.cancel()
    winner = "signal" if sig in done else "timer"
    await ctx.step(effect, f"after-{winner}")
    return winner


@workflow
async def race_first(ctx):
    which, value = await ctx.first(approval=ctx.wait_for("approval"), timeout=ctx.sleep(3600))
    await ctx.step(effect, f"first-{which}")
    return [which, value]


def test_a_parked_race_stays_parked_and_leaks_nothing(capfd) -> None:
    engine = TestEngine()
    first = engine.sync.run(sleep_or_signal)
    assert first.status == "waiting"  # not "completed" with "signal": nothing was sent
    assert engine.sync.resume(first.run_id).status == "waiting"
    engine.sync.signal(first.run_id, "complete")
    done = engine.sync.resume(first.run_id)
    assert (done.status, done.result) == ("completed", "signal")
    assert "never retrieved" not in capfd.readouterr().err


def test_a_parked_race_the_timer_wins_when_it_is_due_first() -> None:
    engine = TestEngine()
    first = engine.sync.run(sleep_or_signal)
    engine.clock.advance(3600)
    done = engine.sync.resume(first.run_id)
    assert (done.status, done.result) == ("completed", "slept")


def test_when_both_are_ready_at_resume_the_earlier_event_wins_and_is_recorded() -> None:
    calls.clear()
    engine = TestEngine()
    first = engine.sync.run(race_by_create_task)
    assert first.status == "waiting"
    later = engine.clock.now()
    engine.clock.reach(later + timedelta(seconds=30))  # time passes with no process running the run
    engine.sync.signal(first.run_id, "go")  # at +30 s: before the timer's +60 s
    engine.clock.reach(later + timedelta(seconds=100))  # by now the timer is due as well
    done = engine.sync.resume(first.run_id)
    assert (done.status, done.result) == ("completed", "signal")
    assert calls == {"after-signal": 1}

    second = engine.sync.run(race_by_create_task)
    engine.clock.reach(engine.clock.now() + timedelta(seconds=100))  # the timer is due, only then a signal comes
    engine.sync.signal(second.run_id, "go")
    assert engine.sync.resume(second.run_id).result == "timer"


def test_first_names_the_winner_and_cancels_the_loser_on_record() -> None:
    calls.clear()
    engine = TestEngine()
    parked = engine.sync.run(race_first)
    engine.sync.signal(parked.run_id, "approval", {"ok": True})
    done = engine.sync.resume(parked.run_id)
    assert done.result == ["approval", {"ok": True}]
    records = engine.engine.storage.read(done.run_id).records
    kinds = [(r.get("t"), r.get("l")) for r in records[1:]]
    assert ("err", "ctx.sleep") in kinds  # the losing timer's cancellation is recorded
    timed = engine.sync.run(race_first)
    engine.clock.advance(3600)
    assert engine.sync.resume(timed.run_id).result == ["timeout", None]


def test_run_wait_false_parks_then_resumes_with_the_right_winner(tmp_path) -> None:
    state = tmp_path / ".durably"
    with pytest.raises(RunParkedError) as parked:
        run(sleep_or_signal, wait=False, dir=state)
    run_id = parked.value.run_id
    engine = create_engine(state)
    asyncio.run(engine.signal(run_id, "complete"))
    assert run(sleep_or_signal, wait=False, dir=state) == "signal"


def test_run_waits_in_place_and_a_signal_from_another_thread_wins(tmp_path) -> None:
    state = tmp_path / ".durably"
    engine = create_engine(state)
    found: list[str] = []

    def send() -> None:
        while not found:
            time.sleep(0.02)
        time.sleep(0.3)
        asyncio.run(engine.signal(found[0], "complete"))

    sender = threading.Thread(target=send)
    sender.start()
    result = asyncio.run(engine.run(sleep_or_signal, on_run=found.append))
    sender.join()
    assert result == "signal"


# ---- handles are futures ---------------------------------------------------------------------------------
@workflow
async def handle_idioms(ctx):
    a = ctx.step(effect, "a")
    b = ctx.step(effect, "b")
    both = await asyncio.gather(a, b)
    again = [await a, await a, await b]  # awaited again after the gather: the same values, nothing runs
    assert isinstance(a, Handle) and a.done() and asyncio.isfuture(a)
    c = ctx.step(slow_effect, "c", 0.05)
    d = ctx.step(slow_effect, "d", 5)
    done, pending = await asyncio.wait([c, d], return_when=asyncio.FIRST_COMPLETED)
    assert done == {c} and pending == {d}
    assert d.cancel() and d.cancelled()
    seen = [await f for f in asyncio.as_completed([ctx.step(effect, "e"), ctx.step(effect, "f")])]
    outcomes = await asyncio.gather(ctx.step(boom, "g"), ctx.step(effect, "h"), return_exceptions=True)
    return [both, again, await c, sorted(seen), [type(o).__name__ if isinstance(o, Exception) else o
                                                  for o in outcomes]]


def test_handles_are_futures_in_every_asyncio_combinator() -> None:
    calls.clear()
    engine = TestEngine()
    done = engine.sync.run(handle_idioms)
    assert done.status == "completed", done.error
    assert done.result == [["a", "b"], ["a", "a", "b"], "c", ["e", "f"], ["RuntimeError", "h"]]
    assert calls == {"a": 1, "b": 1, "c": 1, "e": 1, "f": 1, "g": 1, "h": 1}  # d was cancelled before it ended


@workflow
async def task_group(ctx):
    results: list[str] = []
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(ctx.step(slow_effect, "slow", 10))
            quick = tg.create_task(ctx.step(effect, "quick"))
            tg.create_task(ctx.step(boom, "broken"))
    except* RuntimeError as group:
        results.append(f"failed: {group.exceptions[0]}")
    results.append(quick.result())
    results.append(await ctx.step(effect, "after"))
    return results


def test_a_task_group_of_steps_fails_as_asyncio_says_and_replays() -> None:
    calls.clear()
    engine = TestEngine()
    done = engine.sync.run(task_group)
    assert done.status == "completed", done.error
    assert done.result == ["failed: broken failed", "quick", "after"]
    assert "slow" not in calls  # cut off by the group, recorded as cancelled: never run again on replay


@workflow
async def deadline_around_wait(ctx):
    async with asyncio.timeout(5):
        return await ctx.wait_for("go")


@workflow
async def wait_for_around_wait(ctx):
    return await asyncio.wait_for(ctx.wait_for("go"), timeout=5)


@workflow
async def wait_with_timeout(ctx):
    done, _ = await asyncio.wait([ctx.sleep(60)], timeout=5)
    return len(done)


@pytest.mark.parametrize("wf", [deadline_around_wait, wait_for_around_wait, wait_with_timeout])
def test_a_plain_asyncio_deadline_around_a_durable_wait_is_a_clear_error(wf) -> None:
    engine = TestEngine()
    done = engine.sync.run(wf)
    assert done.status == "failed"
    assert isinstance(done.error, NotDurableError), done.error
    assert "ctx.first" in done.error.hint and done.error.docs


@workflow
async def wait_with_durable_timeout(ctx):
    try:
        return await ctx.wait_for("go", timeout=5)
    except WaitTimeoutError:
        return "timed out"


def test_the_durable_deadline_is_the_supported_form() -> None:
    engine = TestEngine()
    parked = engine.sync.run(wait_with_durable_timeout)
    engine.clock.advance(6)
    assert engine.sync.resume(parked.run_id).result == "timed out"


@workflow
async def gather_first_error(ctx):
    try:
        await asyncio.gather(ctx.step(slow_effect, "late", 0.2), ctx.step(boom, "early"))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_gather_raises_the_error_that_came_first_on_every_replay() -> None:
    engine = TestEngine()
    done = engine.sync.run(gather_first_error)
    assert done.result == "early failed"  # shadow replay (TestEngine) checks the replay gives the same


@workflow
async def first_exception(ctx):
    slow = ctx.step(slow_effect, "slow-fx", 10)
    wait = asyncio.ensure_future(ctx.wait_for("never", timeout=3600))
    broken = ctx.step(boom, "broken-fx")
    done, pending = await asyncio.wait([slow, wait, broken], return_when=asyncio.FIRST_EXCEPTION)
    for loser in pending:
        loser.cancel()
    return [[str(f.exception()) for f in done], len(pending), await ctx.step(effect, "after-fx")]


def test_first_exception_returns_the_failure_and_the_cancelled_losers_stay_cancelled(tmp_path) -> None:
    calls.clear()
    engine = TestEngine()
    done = engine.sync.run(first_exception)
    assert done.status == "completed", done.error
    assert done.result == [["broken-fx failed"], 2, "after-fx"]
    assert "slow-fx" not in calls and calls["broken-fx"] == 1
    calls.clear()
    state = tmp_path / ".durably"
    assert run(first_exception, dir=state) == [["broken-fx failed"], 2, "after-fx"]
    assert calls == {"broken-fx": 1, "after-fx": 1}


def test_first_refuses_what_it_cannot_race() -> None:
    @workflow
    async def nothing(ctx):
        return await ctx.first()

    engine = TestEngine()
    done = engine.sync.run(nothing)
    assert done.status == "failed" and "at least one" in str(done.error)
    assert First("x", 1) == ("x", 1)


def test_memory_storage_engine_runs_a_race_in_place() -> None:
    engine = create_engine(MemoryStorage())

    async def main() -> str:
        task = asyncio.ensure_future(engine.run(race_first))
        await asyncio.sleep(0.3)
        run_id = engine.storage.list_runs()[0].run_id
        await engine.signal(run_id, "approval", "yes")
        return await task

    assert asyncio.run(main()) == ["approval", "yes"]


def test_an_engine_worker_parks_a_race_until_its_signal(tmp_path) -> None:
    """`engine.start()` in the application's own loop: the race parks (no slot held), a signal wins it."""
    engine = create_engine(tmp_path / ".durably")

    async def main() -> str:
        handle = await engine.enqueue(sleep_or_signal)
        await engine.start(poll=0.05)
        try:
            for _ in range(200):
                if (await engine.inspect(handle.run_id)).status == "waiting":
                    break
                await asyncio.sleep(0.05)
            assert (await engine.inspect(handle.run_id)).status == "waiting"
            await engine.signal(handle.run_id, "complete")
            return await asyncio.wait_for(engine.join(handle), 20)
        finally:
            await engine.stop()

    assert asyncio.run(main()) == "signal"


async def begin_cleanup() -> None:
    calls["cleanup-began"] = calls.get("cleanup-began", 0) + 1
    await asyncio.sleep(3600)


@workflow
async def slow_cleanup(ctx):
    try:
        return await ctx.step(slow_effect, "work", 3600)
    except RunCancelledError:
        await ctx.step(begin_cleanup)
        raise


def test_the_engines_cleanup_window_stops_a_clean_up_that_runs_too_long(tmp_path) -> None:
    calls.clear()
    engine = create_engine(tmp_path / ".durably", cleanup=0.5)

    async def main() -> str:
        ran = asyncio.ensure_future(engine.run(slow_cleanup))
        while not engine.storage.list_runs():
            await asyncio.sleep(0.02)
        run_id = engine.storage.list_runs()[0].run_id
        began = time.monotonic()
        state = await engine.cancel(run_id, timeout=10)
        with pytest.raises(RunCancelledError):
            await ran
        assert time.monotonic() - began < 5
        return state.status

    assert asyncio.run(main()) == "cancelled"
    assert calls == {"cleanup-began": 1}


STOP_AFTER_STEPS = {"on": False}


@workflow
async def replayed_idioms(ctx):
    a, b, c = ctx.step(effect, "ra"), ctx.step(effect, "rb"), ctx.step(effect, "rc")
    second = await b  # awaited out of call order
    first = await a
    again = [await a, await b, await a]  # awaited again: the same values
    both = await asyncio.gather(a, c)  # one already awaited, one not yet
    d = ctx.step(effect, "rd")
    done, _ = await asyncio.wait([d], return_when=asyncio.FIRST_COMPLETED)
    out = {"x": 1}
    mine = await ctx.step(dict, out)
    mine["x"] = 2  # the workflow's own copy: the recorded value stays as it was
    if STOP_AFTER_STEPS["on"]:
        raise RuntimeError("stop")
    return [first, second, again, both, [h.result() for h in done], mine, await ctx.step(dict, out)]


@pytest.mark.parametrize("mode", ["test-engine", "memory", "file"])
def test_replayed_handles_behave_as_the_live_ones(mode: str, tmp_path) -> None:
    """Recorded steps delivered on replay (a direct await in their turn takes no coroutine) are futures as live
    ones are: awaited again, out of call order, gathered after an await, waited on; each ran once."""
    calls.clear()
    expected = ["ra", "rb", ["ra", "rb", "ra"], ["ra", "rc"], ["rd"], {"x": 2}, {"x": 1}]
    STOP_AFTER_STEPS["on"] = True  # the first run fails after its steps; running it again resumes it
    try:
        if mode == "test-engine":
            engine = TestEngine()
            assert engine.sync.run(replayed_idioms, key="ri").status == "failed"
            STOP_AFTER_STEPS["on"] = False
            again = engine.sync.run(replayed_idioms, key="ri")
            assert again.status == "completed" and again.result == expected, again.error
        else:
            real = create_engine(MemoryStorage() if mode == "memory" else tmp_path)
            with pytest.raises(RuntimeError, match="stop"):
                asyncio.run(real.run(replayed_idioms, key="ri"))
            STOP_AFTER_STEPS["on"] = False
            assert asyncio.run(real.run(replayed_idioms, key="ri")) == expected
    finally:
        STOP_AFTER_STEPS["on"] = False
    assert calls == {"ra": 1, "rb": 1, "rc": 1, "rd": 1}


@workflow
async def replayed_race(ctx):
    first = await ctx.step(effect, "qa")  # a direct await: answered in its turn on replay
    c = ctx.step(slow_effect, "qc", 0.05)
    d = ctx.step(slow_effect, "qd", 5)
    done, pending = await asyncio.wait([c, d], return_when=asyncio.FIRST_COMPLETED)
    assert done == {c} and pending == {d}
    d.cancel()
    last = await ctx.step(effect, "qe")
    if STOP_AFTER_STEPS["on"]:
        raise RuntimeError("stop")
    return [first, c.result(), d.cancelled(), last]


@pytest.mark.parametrize("mode", ["memory", "file"])
def test_a_race_after_a_replayed_await_replays_as_recorded(mode: str, tmp_path) -> None:
    """A step answered by a direct await on replay leaves the race after it to the recorded order: the same
    winner, the loser cancelled again, nothing run twice."""
    calls.clear()
    real = create_engine(MemoryStorage() if mode == "memory" else tmp_path)
    STOP_AFTER_STEPS["on"] = True
    try:
        with pytest.raises(RuntimeError, match="stop"):
            asyncio.run(real.run(replayed_race, key="rr"))
    finally:
        STOP_AFTER_STEPS["on"] = False
    started = time.monotonic()
    assert asyncio.run(real.run(replayed_race, key="rr")) == ["qa", "qc", True, "qe"]
    assert time.monotonic() - started < 4  # the loser is not waited for again
    assert calls == {"qa": 1, "qc": 1, "qe": 1}
