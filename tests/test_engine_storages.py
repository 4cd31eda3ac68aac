"""The same workflow behaves the same on every storage adapter: run, interrupt, resume, inspect, list."""

import asyncio

import pytest
from helpers import Stop, storage_of

from durably_py import Retry, create_engine, workflow


@pytest.fixture(params=["file", "memory", "sqlite"])
def storage(request, tmp_path):
    return storage_of(request.param, tmp_path)


def test_interrupt_resume_inspect_on_every_adapter(storage) -> None:
    calls: dict[str, int] = {}
    state = {"stop": True, "flaky": 0}

    def work(name):
        calls[name] = calls.get(name, 0) + 1
        return name.upper()

    def flaky():
        state["flaky"] += 1
        if state["flaky"] == 1:
            raise ConnectionError("blip")
        return "ok"

    @workflow
    async def wf(ctx, names):
        first = await ctx.step(work, names[0])
        rest = await ctx.parallel([lambda n=n: ctx.step(work, n) for n in names[1:]])
        if state["stop"]:
            state["stop"] = False
            raise Stop()
        again = await ctx.step(flaky, retry=Retry(2, backoff="none"))
        return [first, *[r.value for r in rest], again]

    engine = create_engine(storage)
    with pytest.raises(Stop):
        asyncio.run(engine.run(wf, ["a", "b", "c"], key="job"))
    assert asyncio.run(engine.run(wf, ["a", "b", "c"], key="job")) == ["A", "B", "C", "ok"]
    assert calls == {"a": 1, "b": 1, "c": 1}
    state_ = asyncio.run(engine.inspect("job"))
    assert state_.status == "completed" and state_.attempt == 2
    assert [s.label for s in state_.steps] == ["work", "work", "work", "flaky"]
    assert state_.steps[-1].attempts == 2
    (listed,) = asyncio.run(engine.list())
    assert (listed.run_id, listed.status, listed.attempt) == (state_.run_id, "completed", 2)
