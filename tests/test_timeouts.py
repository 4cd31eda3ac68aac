"""Step timeouts: each attempt is cut off at its own deadline, and only its own."""

import asyncio
import time

import pytest

from durably_py import MemoryStorage, StepTimeoutError, attempt, create_engine, workflow


def run(wf, *args):
    return asyncio.run(create_engine(MemoryStorage()).run(wf, *args))


async def nap(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


def test_concurrent_steps_time_out_at_their_own_deadlines() -> None:
    ended: dict[str, float] = {}

    @workflow
    async def race(ctx):
        started = time.monotonic()

        async def branch(name, seconds, timeout):
            try:
                return await ctx.step(nap, seconds, name=name, timeout=timeout)
            except StepTimeoutError:
                return "timed out"
            finally:
                ended[name] = time.monotonic() - started

        results = await ctx.parallel([
            lambda: branch("short", 5, 0.1),
            lambda: branch("long", 5, 0.3),
            lambda: branch("quick", 0.05, 0.2),
            lambda: branch("untimed", 0.4, None),
        ])
        return [r.value for r in results]

    assert run(race) == ["timed out", "timed out", 0.05, 0.4]
    assert 0.08 <= ended["short"] < 0.25
    assert 0.28 <= ended["long"] < 0.45
    assert ended["untimed"] >= 0.4


def test_a_finished_step_is_never_cancelled_by_its_old_deadline() -> None:
    @workflow
    async def sequence(ctx):
        first = await ctx.step(nap, 0.01, name="fast", timeout=0.1)
        second = await ctx.step(nap, 0.3, name="slow without timeout")
        return [first, second]

    assert run(sequence) == [0.01, 0.3]


def test_a_timed_out_sync_step_sees_its_cancelled_flag() -> None:
    seen = {}

    def spin():
        att = attempt()
        deadline = time.monotonic() + 2
        while not att.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["cancelled"] = att.cancelled
        seen["event"] = att.cancelled_event.is_set()

    @workflow
    async def wf(ctx):
        with pytest.raises(StepTimeoutError):
            await ctx.step(spin, timeout=0.1)
        await asyncio.sleep(0.1)
        return "ok"

    assert run(wf) == "ok"
    assert seen == {"cancelled": True, "event": True}


def test_outside_cancellation_is_not_turned_into_a_timeout() -> None:
    @workflow
    async def wf(ctx):
        return await ctx.step(nap, 5, timeout=10)

    async def main():
        task = asyncio.ensure_future(create_engine(MemoryStorage()).run(wf))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_an_abandoned_sync_step_does_not_hold_up_the_process_exit(tmp_path) -> None:
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from durably_py import StepTimeoutError, run, workflow

        def stuck():
            time.sleep(30)

        @workflow
        async def wf(ctx):
            try:
                await ctx.step(stuck, timeout=0.2)
            except StepTimeoutError:
                return "gave up"

        print(run(wf, dir={str(tmp_path / "state")!r}))
    """))
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gave up"
    assert time.monotonic() - started < 10
