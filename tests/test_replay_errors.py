"""A workflow whose replay no longer matches its log stops without marking the run failed."""

import asyncio

import pytest
from helpers import Stop

from durably_py import MemoryStorage, PurityError, StaleRunError, create_engine
from durably_py._authoring.workflow import Workflow


def test_a_changed_workflow_does_not_fail_or_compensate_the_run() -> None:
    undone: list[str] = []
    stop = {"on": True}

    async def original(ctx):
        await ctx.step(lambda: "held", name="hold", compensate=lambda v: undone.append(v))
        if stop["on"]:
            raise Stop()
        return await ctx.step(lambda: "paid", name="pay")

    async def edited(ctx):
        await ctx.step(lambda: "other", name="something else")
        return "never"

    engine = create_engine(MemoryStorage())
    with pytest.raises(Stop):
        asyncio.run(engine.run(Workflow(original, name="order")))
    with pytest.raises(StaleRunError) as info:
        asyncio.run(engine.run(Workflow(edited, name="order")))
    assert info.value.path == (0,) and info.value.recorded == "hold" and info.value.called == "something else"
    assert undone == []
    (state,) = asyncio.run(engine.list())
    assert state.status == "stale"  # the code no longer matches the log; not failed, not compensated
    stop["on"] = False
    assert asyncio.run(engine.run(Workflow(original, name="order"))) == "paid"


def test_a_swallowed_replay_error_still_stops_the_run() -> None:
    flip = {"branch": "a"}
    stop = {"on": True}

    async def body(ctx):
        try:
            await ctx.step(lambda: 1, name=flip["branch"])
        except PurityError:
            pass
        if stop["on"]:
            raise Stop()
        return "done"

    wf = Workflow(body, name="flaky-shape")
    engine = create_engine(MemoryStorage())
    with pytest.raises(Stop):
        asyncio.run(engine.run(wf))
    flip["branch"] = "b"
    stop["on"] = False
    with pytest.raises(PurityError):
        asyncio.run(engine.run(wf))
    (state,) = asyncio.run(engine.list())
    assert state.status == "interrupted"


def test_on_run_failed_fires_only_for_runs_that_ended_failed() -> None:
    seen: list[tuple[str, str]] = []

    def hook(event):
        seen.append((event["run_id"], type(event["error"]).__name__))
        raise RuntimeError("a broken hook never hides the run's own error")

    def boom():
        raise ValueError("nope")

    async def failing(ctx):
        await ctx.step(boom)

    stop = {"on": True}

    async def shaped(ctx):
        await ctx.step(lambda: 1, name="a" if stop["on"] else "b")
        if stop["on"]:
            raise Stop()

    engine = create_engine(MemoryStorage(), on_run_failed=hook)
    with pytest.raises(ValueError):
        asyncio.run(engine.run(Workflow(failing, name="failing")))
    assert [name for _, name in seen] == ["ValueError"]
    with pytest.raises(Stop):
        asyncio.run(engine.run(Workflow(shaped, name="shaped")))
    stop["on"] = False
    with pytest.raises(PurityError):
        asyncio.run(engine.run(Workflow(shaped, name="shaped")))
    assert [name for _, name in seen] == ["ValueError"]
