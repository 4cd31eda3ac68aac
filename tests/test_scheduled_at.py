"""A scheduled run knows the tick it serves: `ctx.scheduled_at` (DBOS's `scheduled_time`) is the tick, the same
in every process, on replay and after a SIGKILL of its worker; under `TestEngine` schedules fire on the fake
clock with `fire_schedules()`; a run no schedule started has none."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from modes import Effects, cli_process, kill, load, serve, state_of, wait_until, write_script

from durably_py import FakeClock, FileStorage, create_engine, run
from durably_py import records as log
from durably_py._worker.schedules import SCHEDULES, fire_due
from durably_py.testing import TestEngine

FLOWS = '''
import time

import durably_py
from durably_py import workflow


def bill(team, tick):
    mark("bill", team, tick)
    time.sleep(float(os.environ.get("SA_PAUSE", "0")))
    return f"billed {team} for {tick}"


@workflow
async def sa_billing(ctx, team):
    """DBOS: @DBOS.scheduled(cron) def billing(scheduled_time, actual_time)."""
    tick = ctx.scheduled_at
    receipt = await ctx.step(bill, team, tick.isoformat() if tick else None)
    return {"tick": tick.isoformat() if tick else None, "receipt": receipt}


durably_py.schedule(sa_billing, "* * * * *", input="ops", name="sa-billing")
'''


@pytest.fixture(scope="module")
def flows(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("tick_flows")
    script = write_script(folder, "tick_flows", "import os\n" + FLOWS)
    module = load(script)
    SCHEDULES.pop("sa-billing", None)  # declared for the worker processes; this process declares its own
    return script, module


@pytest.fixture
def effects(tmp_path: Path) -> Effects:
    return Effects(tmp_path / "effects.txt")


def test_under_test_engine_each_tick_runs_with_its_own_time(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        engine.sync.schedule(mod.sa_billing, "*/5 * * * *", input="ops", name="billing")
        [first] = engine.sync.fire_schedules()
        assert first.status == "completed"
        assert first.result == {"tick": "2026-01-01T00:00:00+00:00", "receipt": "billed ops for 2026-01-01T00:00:00+00:00"}
        assert engine.sync.fire_schedules() == []  # the same tick fires once
        engine.clock.advance(7 * 60)
        [second] = engine.sync.fire_schedules()
        assert second.result["tick"] == "2026-01-01T00:05:00+00:00"
        assert engine.sync.inspect(second.run_id).key == "billing@2026-01-01T00:05:00+00:00"
        manual = engine.sync.run(mod.sa_billing, "ops")
        assert manual.result == {"tick": None, "receipt": "billed ops for None"}


def test_the_tick_is_recorded_and_survives_a_resume_in_this_process(flows: Any, effects: Effects,
                                                                    tmp_path: Path) -> None:
    _, mod = flows
    clock = FakeClock(datetime(2026, 3, 2, 10, 2, 30, tzinfo=UTC), auto=False)
    engine = create_engine(FileStorage(tmp_path), clock=clock)
    engine.schedule(mod.sa_billing, "*/5 * * * *", input="ops", name="billing")
    assert asyncio.run(fire_due(engine)) == []  # registered 10:02:30: the 10:00 tick is older
    clock.advance(5 * 60)
    [run_id] = asyncio.run(fire_due(engine))
    header = log.load_one(asyncio.run(engine.records(run_id))[0])
    assert isinstance(header, log.Header) and header.scheduled_at == "2026-03-02T10:05:00+00:00"
    clock.advance(3600)  # whenever it runs, it serves the 10:05 tick
    result = asyncio.run(engine.run(mod.sa_billing, run_id=run_id, wait=False))
    assert result["tick"] == "2026-03-02T10:05:00+00:00"
    assert run(mod.sa_billing, "ops", dir=tmp_path / "manual")["tick"] is None


def test_a_header_without_the_field_still_loads() -> None:
    old = {"t": "run", "v": 1, "run_id": "r-1", "workflow": "w", "key": "w@2026-01-01T00:00:00+00:00"}
    header = log.load_one(old)
    assert isinstance(header, log.Header) and header.scheduled_at is None


def test_in_a_worker_process_across_a_sigkill(flows: Any, effects: Effects, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker fires the current minute's tick and is killed inside the run's step; another worker takes the
    run over: both attempts saw the same tick, the minute the run's key names."""
    script, _ = flows
    state_dir = tmp_path / "state"
    storage = FileStorage(state_dir)
    since = int(time.time()) - 3600  # declared an hour ago: the current minute's tick is due at once
    assert storage.bind("schedule:sa-billing:* * * * *", f"since-{since}", expect=None)
    monkeypatch.setenv("SA_PAUSE", "30")
    worker = cli_process("worker", "--import", str(script), "--dir", str(state_dir), "--poll", "0.02", "-q")
    wait_until(lambda: effects.count("bill") == 1 or worker.poll() is not None)
    kill(worker)
    [first] = [line for line in effects.lines() if line[0] == "bill"]
    monkeypatch.setenv("SA_PAUSE", "0")
    [info] = storage.list_runs()
    key = info.header["key"]
    state = serve(state_dir, script, info.run_id)
    tick = key.partition("@")[2]
    assert state.status == "completed" and state.result["tick"] == tick == first[3]
    assert datetime.fromisoformat(tick) <= datetime.now(UTC) < datetime.fromisoformat(tick) + timedelta(minutes=2)
    assert sum(1 for line in effects.lines() if line[0] == "bill" and line[3] == tick) == 2
    assert state_of(state_dir, key).attempt == 2
