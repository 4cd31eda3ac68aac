"""Durable sleeps and signals: wake times and signals count without a live process."""

import asyncio
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from datetime import timedelta

import pytest
from helpers import durably

from durably_py import (
    FileStorage,
    RunParkedError,
    ValidationError,
    WaitTimeoutError,
    create_engine,
    run,
    workflow,
)
from durably_py.testing import TestEngine


@dataclass
class Approval:
    ok: bool
    by: str


calls: dict[str, int] = {}


def effect(name: str) -> str:
    calls[name] = calls.get(name, 0) + 1
    return name


@workflow
async def approval_flow(ctx, amount):
    await ctx.step(effect, "draft")
    decision = await ctx.wait_for("approval", Approval, timeout=3600)
    if not decision.ok:
        return f"rejected by {decision.by}"
    await ctx.sleep(600)
    await ctx.step(effect, "pay")
    return f"paid {amount} after {decision.by} approved"


def test_wait_for_parks_until_a_signal_then_sleep_parks_until_the_wake_time() -> None:
    calls.clear()
    engine = TestEngine()
    first = engine.sync.run(approval_flow, 40)
    assert first.status == "waiting"
    assert engine.sync.resume(first.run_id).status == "waiting"
    engine.sync.signal(first.run_id, "approval", {"ok": True, "by": "ana"})
    second = engine.sync.resume(first.run_id)
    assert second.status == "sleeping"
    engine.clock.advance(599)
    assert engine.sync.resume(first.run_id).status == "sleeping"
    engine.clock.advance(1)
    done = engine.sync.resume(first.run_id)
    assert done.status == "completed"
    assert done.result == "paid 40 after ana approved"
    assert calls == {"draft": 1, "pay": 1}


def test_a_signal_sent_before_the_wait_is_kept_in_the_inbox() -> None:
    engine = TestEngine()

    @workflow
    async def late(ctx):
        await ctx.step(effect, "first")
        return await ctx.wait_for("go")

    first = engine.sync.run(late, crash_after="effect")
    assert first.status == "crashed"
    engine.sync.signal(first.run_id, "go", [1, 2])
    assert engine.sync.resume(first.run_id).result == [1, 2]


def test_wait_timeout_is_catchable_and_durable() -> None:
    engine = TestEngine()

    @workflow
    async def reminder(ctx):
        try:
            return await ctx.wait_for("answer", timeout=60)
        except WaitTimeoutError as exc:
            return f"no answer: {exc.name}"

    first = engine.sync.run(reminder)
    assert first.status == "waiting"
    engine.clock.advance(61)
    done = engine.sync.resume(first.run_id)
    assert done.result == "no answer: answer"


def test_signals_are_consumed_once_in_order() -> None:
    engine = TestEngine()

    @workflow
    async def collect(ctx):
        return [await ctx.wait_for("item") for _ in range(3)]

    first = engine.sync.run(collect)
    for payload in ("a", "b", "c", "d"):
        engine.sync.signal(first.run_id, "item", payload)
    assert engine.sync.resume(first.run_id).result == ["a", "b", "c"]
    assert [s["payload"] for s in engine.storage.inbox(first.run_id)] == ["d"]


def test_a_payload_that_fails_the_schema_raises_in_the_workflow() -> None:
    engine = TestEngine()

    @workflow
    async def strict(ctx):
        try:
            return (await ctx.wait_for("approval", Approval)).by
        except ValidationError as exc:
            return f"bad payload at {exc.path}"

    first = engine.sync.run(strict)
    engine.sync.signal(first.run_id, "approval", {"ok": "maybe"})
    done = engine.sync.resume(first.run_id)
    assert done.status == "completed"
    assert done.result.startswith("bad payload at signal 'approval'")


def test_bad_signals_are_refused() -> None:
    engine = TestEngine()

    @workflow
    async def quick(ctx):
        return 1

    done = engine.sync.run(quick)
    with pytest.raises(ValidationError) as info:
        engine.sync.signal(done.run_id, "go", 1)
    assert "completed" in str(info.value) and info.value.hint
    with pytest.raises(ValidationError):
        engine.sync.signal(done.run_id, "", 1)
    with pytest.raises(ValidationError):
        engine.sync.signal(done.run_id, "$cancel", 1)
    from durably_py import RunNotFoundError, SerializationError

    with pytest.raises(RunNotFoundError):
        engine.sync.signal("no-such-run", "go", 1)
    first = engine.sync.run(approval_flow, 1)
    with pytest.raises(SerializationError) as bad:
        engine.sync.signal(first.run_id, "approval", {1, 2})
    assert bad.value.path == "payload"


def test_bad_sleep_and_wait_arguments() -> None:
    engine = TestEngine()

    @workflow
    async def naive(ctx):
        import datetime

        await ctx.sleep_until(datetime.datetime(2030, 1, 1))

    @workflow
    async def negative(ctx):
        await ctx.sleep(-1)

    @workflow
    async def unnamed(ctx):
        await ctx.wait_for("")

    for wf in (naive, negative, unnamed):
        failed = engine.sync.run(wf)
        assert failed.status == "failed"
        assert isinstance(failed.error, ValidationError) and failed.error.hint


def test_inspect_and_list_show_parked_runs(tmp_path) -> None:
    engine = create_engine(FileStorage(tmp_path))

    @workflow
    async def nap(ctx):
        await ctx.sleep_until(ctx.now() + timedelta(hours=1))

    with pytest.raises(RunParkedError) as info:
        asyncio.run(engine.run(nap, wait=False))
    assert info.value.status == "sleeping" and info.value.hint
    state = asyncio.run(engine.inspect(info.value.run_id))
    assert state.status == "sleeping"
    assert [(s.label, s.status) for s in state.steps][-1] == ("ctx.sleep", "sleeping")
    assert [r.status for r in asyncio.run(engine.list())] == ["sleeping"]


def test_a_real_sleep_survives_a_restart(tmp_path) -> None:
    @workflow
    async def short_nap(ctx):
        await ctx.sleep(1.5)
        return "awake"

    with pytest.raises(RunParkedError):
        run(short_nap, dir=tmp_path, wait=False)
    time.sleep(0.5)
    started = time.monotonic()
    assert run(short_nap, dir=tmp_path) == "awake"
    assert time.monotonic() - started < 1.4  # a sleep that restarted would take 1.5 s


SCRIPT = textwrap.dedent("""
    import sys
    from durably_py import run, workflow

    @workflow
    async def gate(ctx):
        print("waiting", flush=True)
        answer = await ctx.wait_for("open", timeout=30)
        return f"opened by {answer}"

    print(run(gate, dir=sys.argv[1]), flush=True)
""")


def test_a_signal_from_another_process_reaches_a_waiting_process(tmp_path) -> None:
    script = tmp_path / "gate.py"
    script.write_text(SCRIPT)
    state = tmp_path / "state"
    waiter = subprocess.Popen([sys.executable, str(script), str(state)], stdout=subprocess.PIPE, text=True)
    try:
        assert waiter.stdout.readline().strip() == "waiting"
        engine = create_engine(FileStorage(state))
        deadline = time.monotonic() + 10
        while not [r for r in asyncio.run(engine.list()) if r.status == "waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (parked,) = asyncio.run(engine.list())
        cli = durably("signal", parked.run_id, "open", '"bo"', "--dir", str(state), timeout=30, pythonpath=False)
        assert cli.returncode == 0, cli.stderr
        out, _ = waiter.communicate(timeout=15)
        assert out.strip() == "opened by bo"
        assert waiter.returncode == 0
    finally:
        waiter.kill()
