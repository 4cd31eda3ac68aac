"""Pausing and resuming runs: offline and live, in this process and another, from Python and the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import interrupt, invoke, wait_until

from durably_py import (
    Engine,
    FileStorage,
    MemoryStorage,
    RunCancelledError,
    RunNotFoundError,
    RunParkedError,
    ValidationError,
    create_engine,
    workflow,
)
from durably_py.testing import TestEngine

calls: dict[str, int] = {}
broken: set[str] = set()


def work(name: str) -> str:
    calls[name] = calls.get(name, 0) + 1
    if name in broken:
        raise ValueError(f"{name} is broken")
    return name.upper()


async def slow_work(name: str) -> str:
    await asyncio.sleep(0.02)
    return work(name)


@workflow
async def pause_chain(ctx: Any, names: list[str]) -> list[str]:
    return [await ctx.step(work, name, name="work") for name in names]


@workflow
async def pause_slow(ctx: Any, n: int) -> list[str]:
    return [await ctx.step(slow_work, f"s{i}", name="slow") for i in range(n)]


@workflow
async def pause_fanout(ctx: Any, width: int) -> list[int]:
    async def branch(b: int) -> int:
        for i in range(60):
            await ctx.step(slow_work, f"b{b}-{i}", name="slow")
        return b

    results = await ctx.parallel([lambda b=b: branch(b) for b in range(width)])
    return [r.value for r in results]


@workflow
async def pause_gate(ctx: Any) -> Any:
    await ctx.step(work, "before", name="before")
    return await ctx.wait_for("go", timeout=3600)


@pytest.fixture(autouse=True)
def _reset() -> None:
    calls.clear()
    broken.clear()


@pytest.fixture
def engine(state_dir: Path) -> Engine:
    return create_engine(FileStorage(state_dir))


def statuses(engine: Engine, **filters: Any) -> dict[str, str]:
    return {s.run_id: s.status for s in asyncio.run(engine.list(**filters))}


async def until(check: Callable[[], Any], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


# ---- runs no process holds --------------------------------------------------------------------------


def test_pause_an_interrupted_run_then_resume_it(engine: Engine, records: Callable[..., Any]) -> None:
    names = ["a", "b", "c", "d"]
    run_id = interrupt(engine, pause_chain, names, (1,))
    state = asyncio.run(engine.pause(run_id))
    assert state.status == "paused"
    assert records(run_id)[-1]["t"] == "pause"
    assert statuses(engine) == {run_id: "paused"}
    assert statuses(engine, status="paused") == {run_id: "paused"}
    before = records(run_id)
    assert asyncio.run(engine.pause(run_id)).status == "paused"  # already paused: a no-op
    assert records(run_id) == before

    with pytest.raises(RunParkedError) as parked:
        asyncio.run(engine.run(pause_chain, names, wait=False))
    assert parked.value.status == "paused" and parked.value.run_id == run_id
    assert "durably resume" in parked.value.hint
    assert calls == {"a": 1, "b": 1}
    assert statuses(engine) == {run_id: "paused"}  # `list` still sees it paused after that claim
    with pytest.raises(ValidationError, match="paused") as refused:
        asyncio.run(engine.retry(run_id))
    assert "durably resume" in refused.value.hint

    state = asyncio.run(engine.resume(run_id))
    assert state.status == "interrupted"
    assert records(run_id)[-1]["t"] == "resume"
    assert statuses(engine) == {run_id: "interrupted"}
    assert asyncio.run(engine.run(pause_chain, names)) == ["A", "B", "C", "D"]
    assert calls == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert asyncio.run(engine.inspect(run_id)).status == "completed"


def test_a_paused_failed_run_resumes_as_failed(engine: Engine) -> None:
    broken.add("b")
    with pytest.raises(ValueError):
        asyncio.run(engine.run(pause_chain, ["a", "b", "c"]))
    (run_id,) = statuses(engine)
    assert asyncio.run(engine.pause(run_id)).status == "paused"
    assert statuses(engine) == {run_id: "paused"}
    assert asyncio.run(engine.resume(run_id)).status == "failed"
    assert statuses(engine) == {run_id: "failed"}
    asyncio.run(engine.pause(run_id))
    broken.clear()
    with pytest.raises(RunParkedError):  # run() reopens the failed run, then holds it
        asyncio.run(engine.run(pause_chain, ["a", "b", "c"], wait=False))
    assert asyncio.run(engine.inspect(run_id)).status == "paused"
    assert statuses(engine) == {run_id: "paused"}
    assert asyncio.run(engine.resume(run_id)).status == "interrupted"
    assert asyncio.run(engine.retry(run_id)) == ["A", "B", "C"]
    assert calls == {"a": 1, "b": 2, "c": 1}


def test_a_paused_waiting_run_keeps_its_signal_until_resumed(engine: Engine) -> None:
    with pytest.raises(RunParkedError):
        asyncio.run(engine.run(pause_gate, wait=False))
    (run_id,) = statuses(engine)
    asyncio.run(engine.pause(run_id))
    asyncio.run(engine.signal(run_id, "go", 7))
    with pytest.raises(RunParkedError) as parked:
        asyncio.run(engine.run(pause_gate, wait=False))
    assert parked.value.status == "paused"
    assert asyncio.run(engine.resume(run_id)).status == "waiting"
    assert asyncio.run(engine.run(pause_gate)) == 7
    assert calls == {"before": 1}


def test_a_pending_pause_survives_compaction(state_dir: Path, records: Callable[..., Any]) -> None:
    engine = create_engine(FileStorage(state_dir, compact_above_bytes=600))
    names = [f"n{i}" for i in range(12)]
    run_id = interrupt(engine, pause_chain, names, (5,))
    for _ in range(3):  # superseded pause/resume cycles give compaction something to drop
        asyncio.run(engine.pause(run_id))
        asyncio.run(engine.resume(run_id))
    asyncio.run(engine.pause(run_id))
    with pytest.raises(RunParkedError):
        asyncio.run(engine.run(pause_chain, names, wait=False))
    log = records(run_id)
    assert [r["t"] for r in log].count("claim") == 1  # compacted: only the latest claim is kept
    assert [r["t"] for r in log].count("pause") == 1 and log[-1]["t"] == "pause"
    assert asyncio.run(engine.inspect(run_id)).status == "paused"
    asyncio.run(engine.resume(run_id))
    assert asyncio.run(engine.run(pause_chain, names)) == [n.upper() for n in names]
    assert set(calls.values()) == {1}


def test_pause_and_resume_refuse_runs_in_the_wrong_state(state_dir: Path, engine: Engine) -> None:
    asyncio.run(engine.run(pause_chain, ["a"]))
    (done,) = statuses(engine)
    with pytest.raises(ValidationError, match="already completed") as err:
        asyncio.run(engine.pause(done))
    assert "restart" in err.value.hint
    with pytest.raises(ValidationError, match="not paused") as err:
        asyncio.run(engine.resume(done))
    assert "durably pause" in err.value.hint
    interrupted = interrupt(engine, pause_chain, ["x", "y"], (0,))
    with pytest.raises(ValidationError, match="interrupted, not paused"):
        asyncio.run(engine.resume(interrupted))
    with pytest.raises(RunNotFoundError):
        asyncio.run(engine.pause("no-such-run"))
    with pytest.raises(RunNotFoundError):
        asyncio.run(engine.resume("no-such-run"))
    with pytest.raises(ValidationError, match="timeout"):
        asyncio.run(engine.pause(interrupted, timeout=-1))
    asyncio.run(engine.cancel(interrupted))
    with pytest.raises(ValidationError, match="already cancelled"):
        asyncio.run(engine.pause(interrupted))

    where = ("--dir", str(state_dir))
    for args in (("pause", done), ("resume", done), ("pause", "nope"), ("resume", "nope"),
                 ("pause", done, "--timeout", "soon")):
        result = invoke(*args, *where)
        assert result.exit_code == 2, (args, result.stderr)
    assert "hint:" in invoke("pause", done, *where).stderr


def test_pause_and_resume_on_the_command_line(state_dir: Path, engine: Engine) -> None:
    run_id = interrupt(engine, pause_chain, ["a", "b"], (0,))
    where = ("--dir", str(state_dir))
    paused = invoke("pause", run_id, *where, "--json")
    assert paused.exit_code == 0, paused.stderr
    assert json.loads(paused.stdout) == {"run_id": run_id, "status": "paused", "paused": True}
    listed = invoke("list", "--status", "paused", *where, "--json")
    assert [s["run_id"] for s in json.loads(listed.stdout)] == [run_id]
    again = invoke("pause", run_id, *where)
    assert again.exit_code == 0 and f"paused {run_id}" in again.stderr

    no_wait = invoke("retry", run_id, *where)
    assert no_wait.exit_code == 2 and "durably resume" in no_wait.stderr
    resumed = invoke("resume", run_id, *where)
    assert resumed.exit_code == 0, resumed.stderr
    assert f"resumed {run_id}" in resumed.stderr and "durably retry" in resumed.stderr
    assert invoke("list", "--status", "paused", *where, "--json").stdout.strip() == "[]"
    retried = invoke("retry", run_id, *where)
    assert retried.exit_code == 0, retried.stderr
    assert json.loads(retried.stdout) == ["A", "B"]
    assert calls == {"a": 1, "b": 1}


# ---- live runs in this process ----------------------------------------------------------------------


def test_pause_a_live_run_that_does_not_wait_parks_it() -> None:
    engine = create_engine(MemoryStorage())

    async def scenario() -> str:
        started: list[str] = []
        task = asyncio.ensure_future(engine.run(pause_slow, 100, wait=False, on_run=started.append))
        await until(lambda: len(calls) >= 3)
        state = await engine.pause(started[0], timeout=5)
        assert state.status == "paused"
        with pytest.raises(RunParkedError) as parked:
            await task
        assert parked.value.status == "paused"
        return started[0]

    run_id = asyncio.run(scenario())
    ran = len(calls)
    assert 3 <= ran < 100
    assert asyncio.run(engine.inspect(run_id)).status == "paused"
    asyncio.run(engine.resume(run_id))
    assert asyncio.run(engine.run(pause_slow, 100, wait=False)) == [f"S{i}" for i in range(100)]
    assert set(calls.values()) == {1}


def test_pause_holds_every_branch_of_a_fanout_until_resumed() -> None:
    engine = create_engine(MemoryStorage())

    async def scenario() -> list[int]:
        started: list[str] = []
        task = asyncio.ensure_future(engine.run(pause_fanout, 4, on_run=started.append))
        await until(lambda: len(calls) >= 8)
        state = await engine.pause(started[0], timeout=5)
        assert state.status == "paused" and not task.done()
        await asyncio.sleep(0.1)  # steps running when the pause was recorded finish
        frozen = sum(calls.values())
        await asyncio.sleep(0.7)
        assert sum(calls.values()) == frozen < 240
        assert (await engine.inspect(started[0])).status == "paused"
        assert [s.status for s in await engine.list()] == ["paused"]
        assert (await engine.resume(started[0])).status != "paused"
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(scenario()) == [0, 1, 2, 3]
    assert len(calls) == 240 and set(calls.values()) == {1}


def test_run_of_a_paused_run_waits_until_it_is_resumed() -> None:
    engine = create_engine(MemoryStorage())
    run_id = interrupt(engine, pause_chain, ["a", "b", "c"], (0,))
    asyncio.run(engine.pause(run_id))

    async def scenario() -> list[str]:
        task = asyncio.ensure_future(engine.run(pause_chain, ["a", "b", "c"]))
        await until(lambda: engine.storage.held(run_id))
        await asyncio.sleep(0.3)
        assert not task.done() and calls == {"a": 1}
        assert (await engine.inspect(run_id)).status == "paused"
        await engine.resume(run_id)
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(scenario()) == ["A", "B", "C"]
    assert calls == {"a": 1, "b": 1, "c": 1}


def test_test_engine_reports_paused() -> None:
    async def scenario() -> None:
        with TestEngine() as engine:
            first = await engine.run(pause_chain, ["a", "b", "c"], crash_after=(0,))
            assert first.status == "crashed"
            await engine.engine.pause(first.run_id)
            held = await engine.resume(first.run_id)
            assert held.status == "paused" and calls == {"a": 1}
            await engine.engine.resume(first.run_id)
            done = await engine.resume(first.run_id)
            assert done.status == "completed" and done.result == ["A", "B", "C"]
            assert calls == {"a": 1, "b": 1, "c": 1}

    asyncio.run(scenario())


# ---- a run held by another process ------------------------------------------------------------------

CHILD = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from durably_py import RunCancelledError, run, workflow

    HERE = Path(__file__).parent

    def slow(i):
        time.sleep(0.04)
        with (HERE / "done.txt").open("a") as f:
            f.write(f"{i}\\n")
        return i

    @workflow
    async def pause_slow_chain(ctx, n):
        return sum([await ctx.step(slow, i, name="slow") for i in range(n)])

    if __name__ == "__main__":
        try:
            print("result", run(pause_slow_chain, int(sys.argv[2]), dir=sys.argv[1]), flush=True)
        except RunCancelledError:
            print("cancelled", flush=True)
''')


@pytest.fixture
def child(tmp_path: Path, state_dir: Path) -> Iterator[Callable[[int], subprocess.Popen[str]]]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    started: list[subprocess.Popen[str]] = []

    def start(n: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, str(script), str(state_dir), str(n)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def done_lines(tmp_path: Path) -> list[str]:
    done = tmp_path / "done.txt"
    return done.read_text().split() if done.exists() else []


def pause_live(tmp_path: Path, state_dir: Path, engine: Engine, proc: subprocess.Popen[str]) -> tuple[str, int]:
    """Pause the child's run with `durably pause` once a few steps ran; check it stays paused and alive."""
    wait_until(lambda: len(done_lines(tmp_path)) >= 3)
    (run_id,) = statuses(engine)
    began = time.monotonic()
    result = invoke("pause", run_id, "--dir", str(state_dir), "--timeout", "10s")
    assert result.exit_code == 0, result.stderr
    assert time.monotonic() - began < 2.5
    ran = len(done_lines(tmp_path))
    time.sleep(0.7)
    assert len(done_lines(tmp_path)) == ran < 200
    assert proc.poll() is None and engine.storage.held(run_id)
    assert asyncio.run(engine.inspect(run_id)).status == "paused"
    assert statuses(engine) == {run_id: "paused"}
    return run_id, ran


def test_pause_and_resume_a_run_held_by_another_process(tmp_path: Path, state_dir: Path, engine: Engine,
                                                        child: Any, records: Callable[..., Any]) -> None:
    n = 40
    proc = child(n)
    run_id, ran = pause_live(tmp_path, state_dir, engine, proc)
    result = invoke("resume", run_id, "--dir", str(state_dir), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["resumed"] is True
    out, err = proc.communicate(timeout=20)
    assert out.strip() == f"result {sum(range(n))}", err
    assert done_lines(tmp_path) == [str(i) for i in range(n)]
    log = records(run_id)
    assert [r["t"] for r in log if r["t"] in ("pause", "resume")] == ["pause", "resume"]
    assert sum(1 for r in log if r["t"] == "ok") == n
    assert log[-1]["status"] == "completed"
    assert engine.storage.inbox(run_id) == []


def test_cancel_a_paused_run_held_by_another_process(tmp_path: Path, state_dir: Path, engine: Engine,
                                                     child: Any, records: Callable[..., Any]) -> None:
    proc = child(200)
    run_id, ran = pause_live(tmp_path, state_dir, engine, proc)
    began = time.monotonic()
    assert asyncio.run(engine.cancel(run_id, timeout=10)).status == "cancelled"
    assert time.monotonic() - began < 2
    out, err = proc.communicate(timeout=15)
    assert out.strip() == "cancelled", err
    assert len(done_lines(tmp_path)) == ran
    assert records(run_id)[-1]["status"] == "cancelled"
    with pytest.raises(ValidationError, match="not paused"):
        asyncio.run(engine.resume(run_id))


def test_cancel_a_paused_run_in_this_process_while_it_waits() -> None:
    engine = create_engine(MemoryStorage())
    run_id = interrupt(engine, pause_chain, ["a", "b"], (0,))
    asyncio.run(engine.pause(run_id))

    async def scenario() -> None:
        task = asyncio.ensure_future(engine.run(pause_chain, ["a", "b"]))
        await until(lambda: engine.storage.held(run_id))
        assert (await engine.cancel(run_id, timeout=5)).status == "cancelled"
        with pytest.raises(RunCancelledError):
            await task

    asyncio.run(scenario())
    assert calls == {"a": 1}
