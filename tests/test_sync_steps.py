"""Where sync (`def`) steps run, and what still holds when a quick one runs directly on the event loop:
parallel blocking steps overlap, timeouts fire, leases are renewed and cancel requests are seen during a
long step, whichever thread it blocks."""

from __future__ import annotations

import asyncio
import contextvars
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from durably_py import (
    FileStorage,
    LeaseLostError,
    RunCancelledError,
    StepTimeoutError,
    ValidationError,
    attempt,
    create_engine,
    workflow,
)
from durably_py.storage.memory import MemoryStorage

WARM = 5  # quick calls that make a function run on the loop thread (the rule needs 3)


def block(seconds: float) -> str:
    time.sleep(seconds)
    return threading.current_thread().name


def where() -> str:
    return threading.current_thread().name


@workflow
async def sync_warm_then_parallel(ctx: Any, seconds: float) -> list[Any]:
    for _ in range(WARM):
        await ctx.step(block, 0)
    return [r.value for r in await ctx.parallel([ctx.step(block, seconds) for _ in range(4)])]


def test_parallel_blocking_sync_steps_overlap_even_once_the_function_is_quick() -> None:
    engine = create_engine(MemoryStorage())
    began = time.monotonic()
    results = asyncio.run(engine.run(sync_warm_then_parallel, 0.5))
    assert time.monotonic() - began < 1.6  # one after another they would take 2 s
    names = results
    assert len(set(names)) == 4 and threading.main_thread().name not in names


@workflow
async def sync_warm_then_timeout(ctx: Any) -> str:
    for _ in range(WARM):
        await ctx.step(block, 0)
    return await ctx.step(block, 30, timeout=0.3)


def test_a_timeout_fires_on_a_blocking_sync_step_even_once_the_function_is_quick() -> None:
    engine = create_engine(MemoryStorage())
    began = time.monotonic()
    with pytest.raises(StepTimeoutError):
        asyncio.run(engine.run(sync_warm_then_timeout))
    assert time.monotonic() - began < 5


@workflow
async def sync_where(ctx: Any) -> list[str]:
    return [await ctx.step(where) for _ in range(WARM + 1)]


def test_quick_sync_steps_move_to_the_loop_thread_unless_sync_steps_is_thread() -> None:
    main = threading.main_thread().name
    auto = asyncio.run(create_engine(MemoryStorage()).run(sync_where))
    assert auto[0] != main and auto[-1] == main
    threaded = asyncio.run(create_engine(MemoryStorage(), sync_steps="thread").run(sync_where))
    assert main not in threaded
    with pytest.raises(ValidationError, match="sync_steps"):
        create_engine(MemoryStorage(), sync_steps="inline")


SETTING: contextvars.ContextVar[str] = contextvars.ContextVar("setting", default="unset")


def nested_loop(i: int) -> dict[str, Any]:
    SETTING.set("changed by a step")

    async def inner() -> int:
        return i

    return {"value": asyncio.run(inner()), "thread": threading.current_thread().name, "attempt": attempt().number}


@workflow
async def sync_isolated(ctx: Any) -> list[Any]:
    out = [await ctx.step(nested_loop, i) for i in range(WARM + 1)]
    return [out, SETTING.get()]


def test_a_sync_step_on_the_loop_thread_sees_what_it_would_on_a_worker_thread() -> None:
    out, setting = asyncio.run(create_engine(MemoryStorage()).run(sync_isolated))
    assert [o["value"] for o in out] == list(range(WARM + 1))
    assert out[-1]["thread"] == threading.main_thread().name and out[-1]["attempt"] == 1
    assert setting == "unset"  # a context variable set by a step does not leak into the workflow


def loop_of_step(i: int) -> dict[str, Any]:
    try:
        asyncio.get_running_loop()
        running = True
    except RuntimeError:
        running = False
    return {"i": i, "loop running": running, "thread": threading.current_thread().name}


@workflow
async def loop_kept(ctx: Any) -> list[Any]:
    """Plain steps, async and def, then the same under parallel branches: the workflow's own loop and task are
    the same after every one, and a def step never sees a running loop."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    out = []
    for i in range(WARM + 3):
        out.append(await ctx.step(loop_of_step, i))
        out.append(await ctx.step(nested_loop, i))
        assert asyncio.get_running_loop() is loop and asyncio.current_task() is task
    both = await ctx.parallel([lambda: ctx.step(loop_of_step, 100), lambda: ctx.step(loop_of_step, 101)])
    assert asyncio.get_running_loop() is loop and asyncio.current_task() is task
    return [out, [r.value for r in both]]


def test_the_workflow_keeps_its_loop_and_task_across_sync_steps_on_either_thread() -> None:
    out, both = asyncio.run(create_engine(MemoryStorage()).run(loop_kept))
    assert not any(o.get("loop running") for o in out + both)
    assert out[-2]["thread"] == threading.main_thread().name  # quick by then: on the loop thread
    assert [b["thread"] != threading.main_thread().name for b in both] == [True, True]  # parallel: worker threads


def wait_for_cancel(seconds: float, seen: list[bool]) -> str:
    seen.append(attempt().cancelled_event.wait(seconds))
    return "finished"


def cancel_from_another_thread(directory: Path, started: threading.Event, out: list[Any]) -> threading.Thread:
    def cancel() -> None:
        started.wait(10)
        time.sleep(0.2)
        operator = create_engine(FileStorage(directory))
        run_id = asyncio.run(operator.list())[0].run_id
        out.append(asyncio.run(operator.cancel(run_id, timeout=8)))

    thread = threading.Thread(target=cancel)
    thread.start()
    return thread


@pytest.mark.parametrize("placement", ["worker thread", "loop thread"])
def test_cancel_is_seen_during_a_long_sync_step(tmp_path: Path, placement: str) -> None:
    started = threading.Event()
    seen: list[bool] = []

    def mark() -> None:
        started.set()

    @workflow(name="sync_cancelled")
    async def sync_cancelled(ctx: Any) -> str:
        if placement == "loop thread":
            for _ in range(WARM):
                await ctx.step(wait_for_cancel, 0, [])
        await ctx.step(mark)
        return await ctx.step(wait_for_cancel, 20, seen)

    engine = create_engine(FileStorage(tmp_path))
    out: list[Any] = []
    thread = cancel_from_another_thread(tmp_path, started, out)
    began = time.monotonic()
    with pytest.raises(RunCancelledError):
        asyncio.run(engine.run(sync_cancelled))
    assert time.monotonic() - began < 8
    thread.join(10)
    assert out and out[0].status == "cancelled"
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen == [True]  # the step's cancelled flag was set while it waited


def test_a_postgres_lease_is_renewed_during_a_sync_step_twice_as_long_as_the_lease(postgres_storage: Any) -> None:
    store, other = postgres_storage(), postgres_storage()
    engine = create_engine(store, lease=2.0, heartbeat=0.5)
    intruder: list[Any] = []
    names: list[str] = []

    def hold(seconds: float) -> None:
        names.append(threading.current_thread().name)
        if seconds:
            time.sleep(seconds)
            intruder.append(other.claim(run_ids[0], "intruder", 30))
            time.sleep(seconds / 4)

    run_ids: list[str] = []

    @workflow(name="sync_long_lease")
    async def sync_long_lease(ctx: Any) -> str:
        run_ids.append(ctx.run_id)
        for _ in range(WARM):
            await ctx.step(hold, 0)
        await ctx.step(hold, 3.2)  # quick so far: it blocks the event loop itself
        return "done"

    assert asyncio.run(engine.run(sync_long_lease)) == "done"
    assert names[-1] == threading.main_thread().name
    assert intruder == [None]  # 3.2 s into a 2 s lease, nobody else could claim the run


def test_a_lease_is_renewed_while_an_async_step_blocks_the_loop(tmp_path: Path) -> None:
    from durably_py import SqliteStorage

    db = tmp_path / "runs.db"
    engine = create_engine(SqliteStorage(db), lease=2.0, heartbeat=0.5)
    other = SqliteStorage(db)
    intruder: list[Any] = []

    async def hog(run_id: str) -> None:
        time.sleep(2.5)  # a blocking call inside async code: the event loop is stuck
        intruder.append(other.claim(run_id, "intruder", 30))

    @workflow(name="async_hog")
    async def async_hog(ctx: Any) -> str:
        await ctx.step(hog, ctx.run_id)
        return "done"

    try:
        assert asyncio.run(engine.run(async_hog)) == "done"
    except LeaseLostError:  # pragma: no cover - the failure this test exists to catch
        pytest.fail("the lease lapsed while a step blocked the event loop")
    assert intruder == [None]


CTRL_C = textwrap.dedent('''
    import sys
    from durably_py import run, workflow

    def tick(i):
        return i

    @workflow
    async def sync_ticks(ctx, n):
        total = 0
        for i in range(n):
            total += await ctx.step(tick, i)
            if i == 50:
                print("started", flush=True)
        return total

    if __name__ == "__main__":
        run(sync_ticks, 10_000_000, dir=sys.argv[1])
''')


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_one_ctrl_c_stops_a_run_of_quick_sync_steps_on_the_loop_thread(tmp_path: Path, kind: str) -> None:
    """Steps that never suspend (quick `def` steps on the loop thread, `async def` ones that never await)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "ticks.py"
    script.write_text(CTRL_C.replace("def tick(", f"{kind} tick("))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "state")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            pytest.fail("one Ctrl-C did not stop the run")
    assert "KeyboardInterrupt" in proc.stderr.read() or proc.returncode != 0
