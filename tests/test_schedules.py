"""Schedules: each cron tick starts exactly once across processes, never before registration, one catch-up."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta

import pytest
from helpers import durably

import durably_py
from durably_py import FakeClock, FileStorage, MemoryStorage, ValidationError, create_engine, workflow
from durably_py._worker.schedules import SCHEDULES, fire_due, states

T0 = datetime(2026, 3, 2, 10, 2, 30, tzinfo=UTC)


@workflow
async def report(ctx, who):
    return f"report for {who}"


@pytest.fixture(autouse=True)
def _no_leftover_schedules():
    SCHEDULES.clear()
    yield
    SCHEDULES.clear()


def fire(engine, at):
    """Move the engine's clock to `at`, fire what is due, and let the queue run it."""
    engine.clock.advance((at - engine.clock.now()).total_seconds())

    async def go():
        fired = await fire_due(engine)
        await engine.drain()
        return fired
    return asyncio.run(go())


def engine_at(storage):
    return create_engine(storage, clock=FakeClock(T0, auto=False))


def test_ticks_fire_once_never_before_registration_and_catch_up_at_most_one(tmp_path) -> None:
    engine = engine_at(FileStorage(tmp_path))
    engine.schedule(report, "*/5 * * * *", input="ops", name="ops-report")
    assert fire(engine, T0) == []                                   # registered 10:02:30: the 10:00 tick is older
    assert fire(engine, T0 + timedelta(minutes=1)) == []
    first = fire(engine, T0 + timedelta(minutes=2, seconds=40))     # 10:05:10
    assert len(first) == 1
    assert fire(engine, T0 + timedelta(minutes=3)) == []             # 10:05:30: same tick, already fired
    later = fire(engine, T0 + timedelta(minutes=48))                 # down from 10:06 to 10:50:30
    assert len(later) == 1
    runs = {r.key: r for r in asyncio.run(engine.list())}
    assert set(runs) == {"ops-report@2026-03-02T10:05:00+00:00", "ops-report@2026-03-02T10:50:00+00:00"}
    assert all(r.status == "completed" for r in runs.values())
    assert asyncio.run(engine.inspect("ops-report@2026-03-02T10:50:00+00:00")).result == "report for ops"
    assert fire(engine, T0 + timedelta(minutes=48, seconds=20)) == []


def test_registration_is_durable_across_processes_and_restarts(tmp_path) -> None:
    first = engine_at(FileStorage(tmp_path))
    first.schedule(report, "0 * * * *", input="x", name="hourly")
    assert fire(first, T0) == []
    second = engine_at(FileStorage(tmp_path))                        # a worker restarted hours later
    second.schedule(report, "0 * * * *", input="x", name="hourly")
    assert len(fire(second, T0 + timedelta(hours=3))) == 1           # 13:00 only, not 11:00 and 12:00
    assert [r.key for r in asyncio.run(second.list())] == ["hourly@2026-03-02T13:00:00+00:00"]


def test_module_level_schedules_and_the_listing(tmp_path) -> None:
    item = durably_py.schedule(report, "30 2 * * 1-5", input="nightly", name="nightly")
    assert SCHEDULES["nightly"] is item
    engine = create_engine(MemoryStorage())
    [state] = states(engine, T0)
    assert state.name == "nightly" and state.cron == "30 2 * * 1-5" and state.last_tick is None
    assert state.next_tick == datetime(2026, 3, 3, 2, 30, tzinfo=UTC)


@pytest.mark.parametrize("cron, message", [
    ("* * * *", "five fields"), ("0 0 * * * *", "five fields"), ("61 * * * *", "invalid"),
    ("@daily", "five fields"), (None, "five fields"),
])
def test_bad_cron_expressions_fail_at_declaration(cron, message) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        durably_py.schedule(report, cron)
    assert info.value.hint and info.value.docs
    assert not SCHEDULES


def test_bad_schedule_names_fail() -> None:
    with pytest.raises(ValidationError, match="schedule name"):
        durably_py.schedule(report, "* * * * *", name="has space")


RACER = textwrap.dedent('''
    import asyncio, os, sys
    from datetime import datetime, timedelta, UTC
    import durably_py
    from durably_py import FakeClock, FileStorage, create_engine, workflow
    from durably_py._worker.schedules import fire_due

    @workflow
    async def tick_work(ctx, who):
        def mark():
            with open(sys.argv[2], "a") as f:
                f.write(ctx.run_id + "\\n")
            return who
        return await ctx.step(mark)

    durably_py.schedule(tick_work, "*/2 * * * *", input="racer", name="race")

    async def main():
        clock = FakeClock(datetime(2026, 3, 2, 10, 0, 5, tzinfo=UTC), auto=False)
        engine = create_engine(FileStorage(sys.argv[1]), clock=clock)
        open(sys.argv[2] + ".ready." + sys.argv[3], "w").close()
        while not os.path.exists(sys.argv[2] + ".go"):   # all three start polling together
            await asyncio.sleep(0.002)
        for step in range(40):     # ten simulated minutes, every process polling every 15 s
            await fire_due(engine)
            clock.advance(15)
            await asyncio.sleep(0.005)
        await engine.drain()

    asyncio.run(main())
''')


def test_three_processes_racing_start_each_tick_once(tmp_path) -> None:
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    marks = tmp_path / "marks.txt"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "state"), str(marks), str(n)], env=env)
             for n in range(3)]
    deadline = time.monotonic() + 30
    while not all(os.path.exists(f"{marks}.ready.{n}") for n in range(3)) and time.monotonic() < deadline:
        time.sleep(0.01)
    open(f"{marks}.go", "w").close()
    assert [p.wait(60) for p in procs] == [0, 0, 0]
    engine = create_engine(FileStorage(tmp_path / "state"))
    runs = asyncio.run(engine.list())
    keys = sorted(r.key for r in runs)
    assert keys == [f"race@2026-03-02T10:{m:02d}:00+00:00" for m in (2, 4, 6, 8, 10)]
    assert all(r.status == "completed" for r in runs)
    lines = marks.read_text().split()
    assert sorted(lines) == sorted(r.run_id for r in runs)           # every tick's step ran exactly once


def test_durably_schedules_lists_the_imported_schedules(tmp_path) -> None:
    script = tmp_path / "jobs.py"
    script.write_text(textwrap.dedent('''
        import durably_py
        from durably_py import workflow

        @workflow
        async def cleanup(ctx, days):
            return days

        durably_py.schedule(cleanup, "15 3 * * *", input=30, name="cleanup")
    '''))
    at = {"cwd": tmp_path, "pythonpath": False, "PYTHONPATH": os.getcwd()}
    out = durably("schedules", "--import", str(script), "--dir", str(tmp_path / "state"), "--json", **at)
    assert out.returncode == 0, out.stderr
    [listed] = json.loads(out.stdout)
    assert listed["name"] == "cleanup" and listed["cron"] == "15 3 * * *" and listed["input"] == 30
    next_tick = datetime.fromisoformat(listed["next_tick"])
    assert next_tick > datetime.now(UTC) and (next_tick.hour, next_tick.minute) == (3, 15)
    table = durably("schedules", "--import", str(script), "--dir", str(tmp_path / "state"), **at)
    assert table.returncode == 0 and "cleanup" in table.stdout and "15 3 * * *" in table.stdout
    bad = durably("schedules", "--import", "no_such_mod_xyz", "--dir", str(tmp_path / "state"), **at)
    assert bad.returncode == 2 and "no_such_mod_xyz" in bad.stderr
