"""The replay kernel's rules, exercised in-process through the public API.

An interruption is simulated by a workflow raising `Stop` (a BaseException), which escapes `run()` the way a
killed process would: nothing is recorded after it and the run's lease is released, so a second `run()` resumes.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from helpers import Stop, check_error, go

from durably_py import (
    Engine,
    Err,
    FakeClock,
    MemoryStorage,
    Ok,
    PurityError,
    Retry,
    StaleRunError,
    StepEvent,
    StepFailedError,
    ValidationError,
    Workflow,
    attempt,
    create_engine,
    is_ok,
    partition,
    run,
    workflow,
)


class Boom(Exception):
    """A step failure whose class can be rebuilt from the log."""


class Picky(Exception):
    """A step failure whose class cannot be rebuilt from its recorded message or args."""

    def __init__(self, *, code: int) -> None:
        super().__init__(f"code {code}")


def fetch() -> str:
    return "page"


def parse() -> str:
    return "parsed"


def new_engine(clock: FakeClock | None = None) -> Engine:
    return create_engine(MemoryStorage(), clock=clock or FakeClock())


async def interrupted(engine: Engine, wf: Workflow, input: Any = None) -> None:
    """Run `wf` until it raises Stop."""
    with pytest.raises(Stop):
        await engine.run(wf, input)


# ---- steps: shapes of fn, args, labels ----------------------------------------------------------


def test_sync_and_async_steps_with_args_and_name() -> None:
    calls: list[Any] = []

    def add(a: int, b: int) -> int:
        calls.append(("add", a, b))
        return a + b

    async def mul(a: int, b: int) -> int:
        calls.append(("mul", a, b))
        return a * b

    @workflow
    async def wf(ctx: Any, n: int) -> list[int]:
        x = await ctx.step(add, n, 2)
        y = await ctx.step(mul, x, 10, name="times ten")
        return [x, y]

    async def main() -> None:
        engine = new_engine()
        assert await engine.run(wf, 1) == [3, 30]
        state = (await engine.list())[0]
        steps = (await engine.inspect(state.run_id)).steps
        assert [(s.path, s.label, s.output) for s in steps] == [
            ((0,), "add", 3),
            ((1,), "times ten", 30),
        ]

    go(main)
    assert calls == [("add", 1, 2), ("mul", 3, 10)]


def test_unknown_step_option_is_a_type_error() -> None:
    calls = []

    @workflow
    async def wf(ctx: Any) -> None:
        await ctx.step(calls.append, 1, retries=3)

    async def main() -> None:
        with pytest.raises(TypeError, match="retries"):
            await new_engine().run(wf)

    go(main)
    assert calls == []


def test_step_of_a_call_result_is_a_validation_error_with_hint() -> None:
    calls = []

    def double(x: int) -> int:
        calls.append(x)
        return 2 * x

    @workflow
    async def wf(ctx: Any) -> None:
        await ctx.step(double(4))

    async def main() -> None:
        with pytest.raises(ValidationError) as info:
            await new_engine().run(wf)
        check_error(info.value)
        assert "needs a callable, got 8" in str(info.value)
        assert "not ctx.step(fetch(url))" in info.value.hint

    go(main)
    assert calls == [4]


# ---- paths ----------------------------------------------------------------------------------


def test_gather_of_steps_gets_paths_in_call_order_and_replays() -> None:
    finished: list[str] = []
    stop = [True]

    async def slow() -> str:
        await asyncio.sleep(0.02)
        finished.append("slow")
        return "s"

    async def fast() -> str:
        finished.append("fast")
        return "f"

    @workflow
    async def wf(ctx: Any) -> list[str]:
        a, b = await asyncio.gather(ctx.step(slow), ctx.step(fast))
        if stop[0]:
            raise Stop()
        return [a, b, await ctx.step(fast, name="after")]

    async def main() -> None:
        engine = new_engine()
        await interrupted(engine, wf)
        assert finished == ["fast", "slow"]
        stop[0] = False
        assert await engine.run(wf) == ["s", "f", "f"]
        run_id = (await engine.list())[0].run_id
        steps = (await engine.inspect(run_id)).steps
        assert [(s.path, s.label) for s in steps] == [
            ((0,), "slow"), ((1,), "fast"), ((2,), "after"),
        ]

    go(main)
    assert finished == ["fast", "slow", "fast"]


def test_parallel_mixes_awaitables_and_callables_and_returns_results_in_order() -> None:
    calls: list[str] = []
    seen: list[list[Any]] = []
    stop = [True]

    async def ok(x: int) -> int:
        calls.append(f"ok{x}")
        return x * 10

    def bad() -> None:
        calls.append("bad")
        raise Boom("branch failed")

    @workflow
    async def wf(ctx: Any) -> list[Any]:
        async def two_steps() -> int:
            return await ctx.step(ok, 4) + await ctx.step(ok, 5)

        results = await ctx.parallel([ctx.step(ok, 1), lambda: ctx.step(bad), lambda: ctx.step(ok, 3), two_steps])
        seen.append(results)
        if stop[0]:
            raise Stop()
        values, errors = partition(results)
        return [values, [str(e) for e in errors]]

    async def main() -> None:
        engine = new_engine()
        await interrupted(engine, wf)
        assert sorted(calls) == ["bad", "ok1", "ok3", "ok4", "ok5"]
        stop[0] = False
        assert await engine.run(wf) == [[10, 30, 90], ["branch failed"]]
        steps = (await engine.inspect((await engine.list())[0].run_id)).steps
        assert [(s.path, s.status) for s in steps] == [
            ((0,), "ok"), ((1, 1, 0), "failed"), ((1, 2, 0), "ok"), ((1, 3, 0), "ok"), ((1, 3, 1), "ok"),
        ]

    go(main)
    assert sorted(calls) == ["bad", "ok1", "ok3", "ok4", "ok5"]
    for results in seen:
        assert [type(r) for r in results] == [Ok, Err, Ok, Ok]
        assert [is_ok(r) for r in results] == [True, False, True, True]
        values, errors = partition(results)
        assert values == [10, 30, 90]
        assert [type(e) for e in errors] == [Boom] and str(errors[0]) == "branch failed"


@pytest.mark.parametrize("concurrency, expected", [(2, 2), (1, 1), (None, 6)])
def test_parallel_concurrency_caps_running_branches(concurrency: int | None, expected: int) -> None:
    active = [0]
    peak = [0]

    async def work(i: int) -> int:
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        await asyncio.sleep(0.005)
        active[0] -= 1
        return i

    @workflow
    async def wf(ctx: Any) -> list[int]:
        results = await ctx.parallel([lambda i=i: ctx.step(work, i) for i in range(6)], concurrency=concurrency)
        return partition(results)[0]

    assert go(lambda: new_engine().run(wf)) == list(range(6))
    assert peak[0] == expected


def test_parallel_concurrency_caps_awaitables_too() -> None:
    active = [0]
    peak = [0]

    async def work(i: int) -> int:
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        await asyncio.sleep(0.005)
        active[0] -= 1
        return i

    @workflow
    async def wf(ctx: Any) -> list[int]:
        return partition(await ctx.parallel([ctx.step(work, i) for i in range(5)], concurrency=2))[0]

    assert go(lambda: new_engine().run(wf)) == list(range(5))
    assert peak[0] == 2



@pytest.mark.parametrize("how", ["cancelled", "a branch raised Stop"])
def test_a_torn_down_fan_out_leaves_no_coroutine_unawaited(how: str) -> None:
    import gc
    import warnings

    ran: list[int] = []

    async def work(i: int) -> int:
        ran.append(i)
        await asyncio.sleep(0.01)
        if how != "cancelled" and i == 1 and ran.count(1) == 1:
            raise Stop
        return i

    @workflow
    async def wf(ctx: Any) -> list[int]:
        return partition(await ctx.parallel([ctx.step(work, i) for i in range(8)], concurrency=1))[0]

    engine = new_engine()

    async def tear_down() -> None:
        task = asyncio.ensure_future(engine.run(wf))
        if how == "cancelled":
            await asyncio.sleep(0.03)
            task.cancel()
        with pytest.raises((asyncio.CancelledError, Stop)):
            await task

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        go(tear_down)
        gc.collect()
    assert 0 < len(ran) < 8  # branches were still waiting for their turn when the fan-out ended
    assert [str(w.message) for w in said if "never awaited" in str(w.message)] == []
    assert go(lambda: engine.run(wf)) == list(range(8))  # the run resumes with every branch
@pytest.mark.parametrize("spawn", ["create_task", "gather"])
def test_step_from_an_unowned_task_is_a_purity_error_naming_parallel(spawn: str) -> None:
    calls = []

    @workflow
    async def wf(ctx: Any) -> Any:
        async def strand() -> Any:
            return await ctx.step(calls.append, 1)

        if spawn == "create_task":
            return await asyncio.create_task(strand())
        return await asyncio.gather(strand(), strand())

    async def main() -> None:
        with pytest.raises(PurityError) as info:
            await new_engine().run(wf)
        check_error(info.value)
        assert "ctx.parallel" in info.value.hint
        assert "create_task" in str(info.value)

    go(main)
    assert calls == []


# ---- replay ---------------------------------------------------------------------------------------


def test_replayed_steps_do_not_call_fn() -> None:
    counts = {"a": 0, "b": 0, "c": 0}
    stop = [True]

    def step(name: str) -> str:
        counts[name] += 1
        return name.upper()

    @workflow
    async def wf(ctx: Any) -> list[str]:
        out = [await ctx.step(step, "a", name="a"), await ctx.step(step, "b", name="b")]
        if stop[0]:
            raise Stop()
        out.append(await ctx.step(step, "c", name="c"))
        return out

    async def main() -> None:
        engine = new_engine()
        await interrupted(engine, wf)
        assert counts == {"a": 1, "b": 1, "c": 0}
        stop[0] = False
        assert await engine.run(wf) == ["A", "B", "C"]

    go(main)
    assert counts == {"a": 1, "b": 1, "c": 1}


def test_recorded_failure_is_reraised_as_its_class_without_calling_fn() -> None:
    calls = []
    seen: list[BaseException] = []
    stop = [True]

    def explode() -> None:
        calls.append(1)
        raise Boom("disk on fire")

    @workflow
    async def wf(ctx: Any) -> str:
        try:
            await ctx.step(explode)
        except Boom as exc:
            seen.append(exc)
        if stop[0]:
            raise Stop()
        return "handled"

    async def main() -> None:
        engine = new_engine()
        await interrupted(engine, wf)
        stop[0] = False
        assert await engine.run(wf) == "handled"

    go(main)
    assert calls == [1]
    assert [type(e) for e in seen] == [Boom, Boom]
    assert str(seen[1]) == "disk on fire"
    assert seen[0] is not seen[1]


def test_unrebuildable_failure_replays_as_step_failed_error() -> None:
    calls = []
    seen: list[BaseException] = []
    stop = [True]

    def explode() -> None:
        calls.append(1)
        raise Picky(code=7)

    @workflow
    async def wf(ctx: Any) -> str:
        try:
            await ctx.step(explode)
        except Exception as exc:  # noqa: BLE001 - the test inspects what replay hands back
            seen.append(exc)
        if stop[0]:
            raise Stop()
        return "handled"

    async def main() -> None:
        engine = new_engine()
        await interrupted(engine, wf)
        stop[0] = False
        assert await engine.run(wf) == "handled"

    go(main)
    assert calls == [1]
    assert type(seen[0]) is Picky
    replayed = seen[1]
    assert isinstance(replayed, StepFailedError)
    check_error(replayed)
    assert replayed.type_name == f"{__name__}:Picky"
    assert replayed.original_message == "code 7"
    assert "Picky: code 7" in str(replayed)
    assert "Traceback" in replayed.traceback and "in explode" in replayed.traceback


def test_changed_step_at_a_recorded_path_is_a_purity_error() -> None:
    phase = [1]

    @workflow
    async def wf(ctx: Any) -> str:
        if phase[0] == 1:
            await ctx.step(fetch)
            raise Stop()
        return await ctx.step(parse)

    async def main() -> None:
        engine = new_engine()
        await interrupted(engine, wf)
        run_id = (await engine.list())[0].run_id
        phase[0] = 2
        with pytest.raises(PurityError) as info:
            await engine.run(wf)
        err = info.value
        check_error(err)
        assert (err.run_id, err.path, err.recorded, err.called) == (run_id, (0,), "fetch", "parse")
        assert "step path (0,): recorded as 'fetch', now called 'parse'" in str(err)

    go(main)


def test_changed_workflow_code_is_a_stale_run_error() -> None:
    calls: list[str] = []

    async def v1(ctx: Any) -> None:
        calls.append(await ctx.step(fetch))
        raise Stop()

    async def v2(ctx: Any) -> str:
        return await ctx.step(parse)

    async def v3(ctx: Any) -> list[str]:
        return [await ctx.step(fetch), await ctx.step(parse)]

    old, new, compatible = (Workflow(fn, name="shared") for fn in (v1, v2, v3))
    assert len({old.fingerprint, new.fingerprint, compatible.fingerprint}) == 3

    async def main() -> None:
        engine = new_engine()
        await interrupted(engine, old)
        run_id = (await engine.list())[0].run_id
        with pytest.raises(StaleRunError) as info:
            await engine.run(new)
        err = info.value
        check_error(err)
        assert (err.run_id, err.path, err.recorded, err.called) == (run_id, (0,), "fetch", "parse")
        assert "'shared'" in str(err) and "recorded as 'fetch', now called 'parse'" in str(err)
        assert "fresh=True" in err.hint
        assert await engine.run(compatible) == ["page", "parsed"]
        assert [r.run_id for r in await engine.list()] == [run_id]

    go(main)
    assert calls == ["page"]


def test_now_random_uuid_are_recorded_across_resume() -> None:
    seen: list[list[Any]] = []
    stop = [True]

    @workflow
    async def wf(ctx: Any) -> list[Any]:
        values = [ctx.now(), ctx.random(), ctx.uuid()]
        seen.append(values)
        if stop[0]:
            raise Stop()
        return values

    async def main() -> None:
        clock = FakeClock(datetime(2030, 5, 1, tzinfo=UTC))
        engine = new_engine(clock)
        await interrupted(engine, wf)
        clock.advance(3600)
        stop[0] = False
        assert await engine.run(wf) == seen[0]
        steps = (await engine.inspect((await engine.list())[0].run_id)).steps
        assert [s.label for s in steps] == ["ctx.now", "ctx.random", "ctx.uuid"]

    go(main)
    first, second = seen
    assert first == second
    assert first[0] == datetime(2030, 5, 1, tzinfo=UTC)
    assert 0 <= first[1] < 1 and len(first[2]) == 36


def test_log_prints_live_but_not_on_replay(capsys: pytest.CaptureFixture[str]) -> None:
    stop = [True]

    @workflow
    async def wf(ctx: Any) -> str:
        ctx.log("before fetch")
        await ctx.step(fetch)
        ctx.log("between", "steps", sep="-")
        if stop[0]:
            raise Stop()
        await ctx.step(parse)
        ctx.log("after parse")
        return "done"

    async def main() -> None:
        engine = new_engine()
        await interrupted(engine, wf)
        assert capsys.readouterr().err == "before fetch\nbetween-steps\n"
        stop[0] = False
        await engine.run(wf)
        assert capsys.readouterr().err == "between-steps\nafter parse\n"

    go(main)


def test_complete_ends_the_workflow_early() -> None:
    calls: list[str] = []

    def finish_if(ctx: Any, value: str) -> None:
        if value == "page":
            ctx.complete({"early": value})

    @workflow
    async def wf(ctx: Any) -> str:
        value = await ctx.step(fetch)
        for _ in range(3):
            finish_if(ctx, value)
        calls.append("after")
        await ctx.step(parse)
        return "late"

    async def main() -> None:
        engine = new_engine()
        assert await engine.run(wf) == {"early": "page"}
        state = await engine.inspect((await engine.list())[0].run_id)
        assert state.status == "completed" and state.result == {"early": "page"}
        assert [s.label for s in state.steps] == ["fetch"]

    go(main)
    assert calls == []


def test_run_id_and_workflow_attempt() -> None:
    seen: list[tuple[str, int]] = []
    stop = [True]

    @workflow
    async def wf(ctx: Any) -> None:
        seen.append((ctx.run_id, ctx.attempt))
        if stop[0]:
            raise Stop()

    async def main() -> str:
        engine = new_engine()
        await interrupted(engine, wf)
        stop[0] = False
        await engine.run(wf)
        return (await engine.list())[0].run_id

    run_id = go(main)
    assert seen == [(run_id, 1), (run_id, 2)]


def test_attempt_number_and_operation_id_across_retries_and_resume() -> None:
    seen: list[tuple[int, str]] = []
    stop = [True]

    async def flaky() -> str:
        att = attempt()
        seen.append((att.number, att.operation_id))
        if att.number == 1:
            raise Boom("first try fails")
        if stop[0]:
            raise Stop()
        return "ok"

    def sync_step() -> int:
        return attempt().number

    @workflow
    async def wf(ctx: Any) -> list[Any]:
        return [await ctx.step(flaky, retry=Retry(3, backoff="none")), await ctx.step(sync_step)]

    async def main() -> str:
        engine = new_engine()
        await interrupted(engine, wf)
        stop[0] = False
        assert await engine.run(wf) == ["ok", 1]
        return (await engine.list())[0].run_id

    run_id = go(main)
    op = f"{run_id}/0"
    assert seen == [(1, op), (2, op), (2, op)]


def test_attempt_outside_a_step_is_a_validation_error() -> None:
    with pytest.raises(ValidationError) as info:
        attempt()
    check_error(info.value)
    assert "ctx.step" in info.value.hint

    @workflow
    async def wf(ctx: Any) -> str:
        try:
            attempt()
        except ValidationError as exc:
            return str(exc)
        return "no error"

    assert go(lambda: new_engine().run(wf)) == "attempt() was called outside a running step"


# ---- on_step events ---------------------------------------------------------------------------------


def shape(events: list[StepEvent]) -> list[tuple[str, tuple[int, ...], str, int, int]]:
    return [(e.status, e.path, e.label, e.attempt, e.executions) for e in events]


def test_on_step_events_live_replayed_retrying_failed() -> None:
    events: list[StepEvent] = []
    tries = {"flaky": 0, "doomed": 0}
    stop = [True]

    def flaky() -> str:
        tries["flaky"] += 1
        if tries["flaky"] < 3:
            raise Boom(f"try {tries['flaky']}")
        return "finally"

    def doomed() -> None:
        tries["doomed"] += 1
        raise Boom("never works")

    @workflow
    async def wf(ctx: Any) -> None:
        await ctx.step(fetch)
        if stop[0]:
            raise Stop()
        await ctx.step(flaky, name="flaky", retry=Retry(3, backoff="none"))
        await ctx.step(doomed, name="doomed", retry=Retry(2, backoff="none"))

    async def main() -> None:
        engine = new_engine()
        with pytest.raises(Stop):
            await engine.run(wf, on_step=events.append)
        assert shape(events) == [("running", (0,), "fetch", 1, 1), ("ok", (0,), "fetch", 1, 1)]
        assert events[0].ms is None and events[1].ms is not None and events[1].ms >= 0
        recorded_ms = events[1].ms
        events.clear()
        stop[0] = False
        with pytest.raises(Boom, match="never works"):
            await engine.run(wf, on_step=events.append)

        assert shape(events) == [
            ("replayed", (0,), "fetch", 1, 0),
            ("running", (1,), "flaky", 1, 1),
            ("retrying", (1,), "flaky", 1, 1),
            ("running", (1,), "flaky", 2, 2),
            ("retrying", (1,), "flaky", 2, 2),
            ("running", (1,), "flaky", 3, 3),
            ("ok", (1,), "flaky", 3, 3),
            ("running", (2,), "doomed", 1, 1),
            ("retrying", (2,), "doomed", 1, 1),
            ("running", (2,), "doomed", 2, 2),
            ("failed", (2,), "doomed", 2, 2),
        ]
        assert events[0].ms == recorded_ms
        run_ids = {e.run_id for e in events}
        assert run_ids == {(await engine.list())[0].run_id}
        for e in events:
            if e.status in ("retrying", "failed"):
                assert isinstance(e.error, Boom) and isinstance(e.ms, float)
            else:
                assert e.error is None
        assert [str(e.error) for e in events if e.error] == ["try 1", "try 2", "never works", "never works"]

    go(main)
    assert tries == {"flaky": 3, "doomed": 2}


def test_a_raising_listener_never_fails_the_run() -> None:
    heard: list[str] = []

    def listener(event: StepEvent) -> None:
        heard.append(event.status)
        raise RuntimeError("listener bug")

    @workflow
    async def wf(ctx: Any) -> list[str]:
        return [await ctx.step(fetch), await ctx.step(parse)]

    assert go(lambda: new_engine().run(wf, on_step=listener)) == ["page", "parsed"]
    assert heard == ["running", "ok", "running", "ok"]


# ---- values ---------------------------------------------------------------------------------------


def test_live_value_equals_replayed_value() -> None:
    when = datetime(2024, 3, 1, 12, 30, 15, 123456, tzinfo=timezone(timedelta(hours=2)))
    seen: list[list[Any]] = []
    stop = [True]

    def pair() -> tuple[int, str]:
        return (1, "two")

    def stamp() -> dict[str, Any]:
        return {"when": when, "nested": [(when,)]}

    @workflow
    async def wf(ctx: Any) -> list[Any]:
        values = [await ctx.step(pair), await ctx.step(stamp)]
        seen.append(values)
        if stop[0]:
            raise Stop()
        return values

    async def main() -> None:
        engine = new_engine()
        await interrupted(engine, wf)
        stop[0] = False
        await engine.run(wf)

    go(main)
    live, replayed = seen
    assert live == replayed == [[1, "two"], {"when": when, "nested": [[when]]}]
    for values in seen:
        assert type(values[0]) is list and type(values[1]["nested"][0]) is list
        assert values[1]["when"].utcoffset() == timedelta(hours=2)


def test_file_backed_run_resumes_through_run(state_dir: Any) -> None:
    counts = {"fetch": 0, "parse": 0}
    stop = [True]

    def counted_fetch() -> str:
        counts["fetch"] += 1
        return "page"

    def counted_parse(page: str) -> str:
        counts["parse"] += 1
        return page + "!"

    @workflow
    async def wf(ctx: Any, url: str) -> str:
        page = await ctx.step(counted_fetch)
        if stop[0]:
            raise Stop()
        return await ctx.step(counted_parse, page)

    with pytest.raises(Stop):
        run(wf, "http://x", dir=state_dir)
    stop[0] = False
    assert run(wf, "http://x", dir=state_dir) == "page!"
    assert counts == {"fetch": 1, "parse": 1}
