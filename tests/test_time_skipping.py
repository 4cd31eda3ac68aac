"""Time skipping under `TestEngine`: `clock.advance(span)` fires every timer due in the span in order, each at
its own instant (a loop of 30-day sleeps goes through three periods in `advance(90 days)`), from plain and from
async tests; and what a workflow asks of its own run (`ctx.engine.inspect(ctx.run_id)`) works under TestEngine
as it does in `run()` and in a worker."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from modes import Effects, effects_fixture, flows_fixture, in_worker

from durably_py import run
from durably_py.testing import TestEngine

DAY = 86400

FLOWS = '''
from durably_py import WaitTimeoutError, workflow


def bill(who, when):
    mark("bill", who, when)
    return when


@workflow
async def ts_monthly(ctx, spec):
    """Bill every `days` days, `times` times (a Temporal-style subscription loop)."""
    billed = []
    for _ in range(spec["times"]):
        billed.append(await ctx.step(bill, spec["who"], ctx.now().isoformat(), name="bill"))
        await ctx.sleep(spec["days"] * 86400)
    return billed


@workflow
async def ts_reminder(ctx, days):
    try:
        return await ctx.wait_for("paid", timeout=days * 86400)
    except WaitTimeoutError:
        return await ctx.step(bill, "reminder", ctx.now().isoformat(), name="remind")


@workflow
async def ts_self(ctx, seconds):
    async def inspect_me():
        state = await ctx.engine.inspect(ctx.run_id)
        return {"status": state.status, "steps": [s.label for s in state.steps], "notes": state.annotations}

    ctx.annotate(stage="checking")
    await ctx.step(bill, "self", "first", name="first")
    seen = await ctx.step(inspect_me, name="inspect me")
    await ctx.sleep(seconds)
    again = await ctx.step(inspect_me, name="inspect me again")
    return {"before": seen, "after": again}
'''


flows = flows_fixture("skip_flows", FLOWS)
effects = effects_fixture()


def bills(effects: Effects) -> list[tuple[str, str]]:
    return [(line[2], line[3]) for line in effects.lines() if line[0] == "bill"]


def test_a_30_day_sleep_loop_advances_three_periods_in_one_call(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        t0 = engine.clock.now()
        first = engine.sync.run(mod.ts_monthly, {"who": "ana", "days": 30, "times": 6})
        assert first.status == "sleeping"
        engine.clock.advance(90 * DAY)
        assert engine.clock.now() == t0 + timedelta(days=90)
        assert [when for _, when in bills(effects)] == [(t0 + timedelta(days=30 * n)).isoformat() for n in range(4)]
        assert engine.sync.inspect(first.run_id).status == "sleeping"  # in its fourth sleep, due at day 120
        engine.clock.advance(29 * DAY)
        assert len(bills(effects)) == 4
        engine.clock.advance(DAY + 90 * DAY)
        done = engine.sync.resume(first.run_id)
        assert done.status == "completed"
        assert done.result == [(t0 + timedelta(days=30 * n)).isoformat() for n in range(6)]
        assert done.step(("bill", 6)).executions == 1  # every bill ran once


def test_from_an_async_test(flows: Any, effects: Effects) -> None:
    _, mod = flows

    async def main() -> Any:
        with TestEngine() as engine:
            t0 = engine.clock.now()
            first = await engine.run(mod.ts_monthly, {"who": "bo", "days": 30, "times": 3})
            engine.clock.advance(90 * DAY)  # fires from inside the test's running event loop
            state = await engine.inspect(first.run_id)
            return t0, state.status, (await engine.resume(first.run_id)).result

    t0, status, result = asyncio.run(main())
    assert status == "completed"
    assert result == [(t0 + timedelta(days=30 * n)).isoformat() for n in range(3)]


def test_timers_of_several_runs_fire_in_time_order(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        t0 = engine.clock.now()
        engine.sync.run(mod.ts_monthly, {"who": "a", "days": 10, "times": 5})
        engine.sync.run(mod.ts_monthly, {"who": "b", "days": 25, "times": 3})
        late = engine.sync.run(mod.ts_reminder, 33)
        assert late.status == "waiting"
        engine.clock.advance(40 * DAY)
        fired = bills(effects)
        assert fired == sorted(fired, key=lambda b: b[1])  # each at its own instant, earliest first
        assert [(who, (datetime.fromisoformat(when) - t0).days) for who, when in fired] == [
            ("a", 0), ("b", 0), ("a", 10), ("a", 20), ("b", 25), ("a", 30), ("reminder", 33), ("a", 40)]
        assert engine.sync.inspect(late.run_id).status == "completed"


def test_a_run_that_got_its_signal_is_not_fired_by_the_clock(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        parked = engine.sync.run(mod.ts_reminder, 5)
        engine.sync.signal(parked.run_id, "paid", "yes")
        assert engine.sync.resume(parked.run_id).result == "yes"
        engine.clock.advance(10 * DAY)
        assert bills(effects) == []


def test_a_workflow_inspects_its_own_run_under_test_engine(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        parked = engine.sync.run(mod.ts_self, 60)
        assert parked.status == "sleeping"
        engine.clock.advance(60)
        done = engine.sync.inspect(parked.run_id)
        assert done.status == "completed"
        check_self(done.result)


def check_self(result: dict[str, Any]) -> None:
    assert result["before"] == {"status": "running", "steps": ["first"], "notes": {"stage": "checking"}}
    assert result["after"]["status"] == "running"
    assert result["after"]["steps"] == ["first", "inspect me", "ctx.sleep"]


def test_a_workflow_inspects_its_own_run_in_every_mode(flows: Any, effects: Effects, tmp_path: Path) -> None:
    script, mod = flows
    check_self(run(mod.ts_self, 0.2, dir=tmp_path / "run"))
    state = in_worker(tmp_path / "worker", script, "ts_self", 0.2, key="self")
    check_self(state.result)
