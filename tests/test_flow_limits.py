"""Limits kept by the store, in every mode a run has: resources declared at module level and found by `run()`,
engines and `durably run` processes that share a store, `run(wait=False)` parking on a limit, `TestEngine` on
its fake clock; an undeclared resource's error shows the declaration to write. Worker fleets are in
test_flow_fleet.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from durably_py import (
    Breaker,
    CircuitOpenError,
    RateLimit,
    RunParkedError,
    ValidationError,
    create_engine,
    resource,
    run,
    workflow,
)
from durably_py.testing import TestEngine

starts: list[float] = []

# declared at module level, as users declare them: no engine is told about them
resource("flow-declared", concurrency=1)
resource("flow-rated", rate_limit=RateLimit(1, per=30))
resource("flow-breaker", breaker=Breaker(1.0, window=60, cooldown=60, min_calls=1))


async def call(i: int) -> int:
    starts.append(time.monotonic())
    await asyncio.sleep(0.05)
    return i


@workflow
async def declared_fan(ctx, n):
    results = await ctx.parallel([ctx.step(call, i, name="call", uses="flow-declared") for i in range(n)])
    return [r.value for r in results]


@workflow
async def rated_pair(ctx):
    first = await ctx.step(call, 1, name="first", uses="flow-rated")
    second = await ctx.step(call, 2, name="second", uses="flow-rated")
    return [first, second]


def test_a_resource_declared_at_module_level_is_found_by_an_engine_never_told_of_it(tmp_path: Path) -> None:
    starts.clear()
    engine = create_engine(tmp_path / ".durably")

    async def main():
        return await asyncio.gather(engine.run(declared_fan, 3), engine.run(declared_fan, 2))

    assert asyncio.run(main()) == [[0, 1, 2], [0, 1]]
    gaps = [b - a for a, b in zip(sorted(starts), sorted(starts)[1:], strict=False)]
    assert len(starts) == 5 and min(gaps) >= 0.045  # one at a time across both runs
    assert engine.storage.limits("resource:flow-declared")["resource:flow-declared"]["permits"] == []


def test_an_undeclared_resource_is_an_error_that_shows_the_declaration(tmp_path: Path) -> None:
    @workflow
    async def uses_nothing_declared(ctx):
        return await ctx.step(call, 1, uses="flow-nowhere")

    with pytest.raises(ValidationError) as info:
        run(uses_nothing_declared, dir=tmp_path / ".durably")
    assert "flow-nowhere" in str(info.value) and info.value.docs
    assert "durably_py.resource('flow-nowhere'" in info.value.hint and "--import" in info.value.hint


def test_run_wait_false_parks_on_a_rate_limit_and_says_what_it_waits_for(tmp_path: Path) -> None:
    state = tmp_path / ".durably"
    with pytest.raises(RunParkedError) as parked:
        run(rated_pair, wait=False, dir=state)
    engine = create_engine(state)
    info = asyncio.run(engine.inspect(parked.value.run_id))
    assert info.status == "waiting"
    assert info.steps[-1].output["limit"] == "flow-rated rate limit 1 per 30s"
    assert [s.status for s in info.steps] == ["ok", "waiting"]


def test_test_engine_waits_out_a_rate_limit_on_its_fake_clock() -> None:
    engine = TestEngine()
    parked = engine.sync.run(rated_pair)
    assert parked.status == "waiting"
    engine.clock.advance(31)
    done = engine.sync.resume(parked.run_id)
    assert done.result == [1, 2]
    starts_kept = engine.storage.limits("resource:flow-rated")["resource:flow-rated"]["starts"]
    assert len(starts_kept) == 1 and starts_kept[0] >= engine.clock.now().timestamp() - 1  # virtual time


def test_a_breaker_opened_by_one_engine_fails_fast_in_another_sharing_the_store(tmp_path: Path) -> None:
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        raise ConnectionError("down")

    @workflow
    async def flaky(ctx):
        return await ctx.step(broken, uses="flow-breaker")

    first, second = create_engine(tmp_path / ".durably"), create_engine(tmp_path / ".durably")
    with pytest.raises(ConnectionError):
        asyncio.run(first.run(flaky, key="one"))
    with pytest.raises(CircuitOpenError):
        asyncio.run(second.run(flaky, key="two"))
    assert calls["n"] == 1


SCRIPT = '''
import time
from durably_py import RateLimit, resource, run, workflow

resource("script-api", rate_limit=RateLimit(1, per=2))


def stamp(tag):
    return time.time()


@workflow
async def stamped(ctx, tag):
    return await ctx.step(stamp, tag, uses="script-api")


if __name__ == "__main__":
    import sys
    print(run(stamped, sys.argv[1]))
'''


def test_a_restarted_process_keeps_the_window_of_the_one_before(tmp_path: Path) -> None:
    script = tmp_path / "stamped.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    stamps = []
    for tag in ("a", "b"):
        done = subprocess.run([sys.executable, str(script), tag], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        stamps.append(float(done.stdout.split()[-1]))
    assert stamps[1] - stamps[0] >= 1.95  # the second process waited out the first one's window


CONFIGURED = '''
import os, time
from durably_py import workflow


def hold(i):
    with open(os.environ["CFG_LEDGER"], "a") as f:
        f.write(f"{time.time()} start\\n")
    time.sleep(0.2)
    with open(os.environ["CFG_LEDGER"], "a") as f:
        f.write(f"{time.time()} end\\n")
    return i


@workflow
async def configured(ctx):
    results = await ctx.parallel([ctx.step(hold, i, uses="cfg-api") for i in range(3)])
    return [r.value for r in results]
'''


def test_a_resource_declared_in_the_config_file_takes_effect_through_the_cli(tmp_path: Path) -> None:
    (tmp_path / ".durably").mkdir()
    (tmp_path / ".durably" / "config.toml").write_text(
        '[resources.cfg-api]\nconcurrency = 1\nrate_limit = { max = 10, per = "1m" }\n')
    script = tmp_path / "configured.py"
    script.write_text(CONFIGURED)
    ledger = tmp_path / "ledger.txt"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}, "CFG_LEDGER": str(ledger),
           "XDG_CONFIG_HOME": str(tmp_path / "user")}
    done = subprocess.run([sys.executable, "-m", "durably_py.cli", "run", str(script), "-w", "configured", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    events = sorted(line.split() for line in ledger.read_text().splitlines())
    running = peak = 0
    for _, what in events:
        running += 1 if what == "start" else -1
        peak = max(peak, running)
    assert peak == 1 and len(events) == 6  # the config's concurrency 1 held the three steps to one at a time
    shown = subprocess.run([sys.executable, "-m", "durably_py.cli", "config", "--json"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert json.loads(shown.stdout)["resources"]["cfg-api"]["rate_limit"] == {"max": 10, "per": 60.0,
                                                                              "window": "sliding"}
    (tmp_path / ".durably" / "config.toml").write_text('[resources.cfg-api]\nconcurency = 1\n')
    bad = subprocess.run([sys.executable, "-m", "durably_py.cli", "run", str(script), "-w", "configured"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "resources.cfg-api" in bad.stderr
