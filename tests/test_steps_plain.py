"""A plain step checks no budget its run does not have, yet a budget the run gets while a process holds it (a
resume with `budget=`, a raise) holds the very next step: the meter's switch follows the budget. Through `run()`
with `wait=False` on files, and `TestEngine`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from durably_py import FileStorage, RunParkedError, create_engine, workflow
from durably_py.testing import TestEngine

CALLS: list[int] = []


def model(i: int) -> dict[str, Any]:
    """A model call's response: 1,000 tokens of usage, charged by the step itself."""
    CALLS.append(i)
    return {"usage": {"input_tokens": 800, "output_tokens": 200}, "text": f"t{i}"}


@workflow
async def spends_after_a_signal(ctx: Any, n: int) -> list[str]:
    out = [(await ctx.step(model, 0))["text"]]
    await ctx.wait_for("go")
    for i in range(1, n):
        out.append((await ctx.step(model, i))["text"])
    return out


@pytest.fixture(autouse=True)
def calls() -> Any:
    CALLS.clear()
    yield
    CALLS.clear()


def test_a_budget_given_on_resume_holds_the_next_plain_step(tmp_path: Path) -> None:
    engine = create_engine(FileStorage(tmp_path / ".durably"))

    async def scenario() -> None:
        with pytest.raises(RunParkedError) as waiting:
            await engine.run(spends_after_a_signal, 5, key="later", wait=False)
        assert waiting.value.status == "waiting" and CALLS == [0]
        run_id = waiting.value.run_id
        await engine.signal(run_id, "go")
        # 1,000 tokens spent with no budget; 2,500 now: steps 1 and 2 fit, step 3 does not start
        with pytest.raises(RunParkedError) as over:
            await engine.run(spends_after_a_signal, 5, key="later", wait=False, budget={"tokens": 2500})
        assert over.value.status == "over_budget" and CALLS == [0, 1, 2]
        state = await engine.inspect(run_id)
        assert state.spent["tokens"] == 3000 and state.budget == {"tokens": 2500}
        done = await engine.raise_budget(run_id, tokens=10_000)
        assert done.status in ("interrupted", "over_budget", "pending")
        result = await engine.run(spends_after_a_signal, 5, key="later", wait=False)
        assert result == [f"t{i}" for i in range(5)] and CALLS == [0, 1, 2, 3, 4]

    asyncio.run(scenario())


def test_testengine_a_budget_given_on_resume_holds_the_next_plain_step() -> None:
    te = TestEngine()
    res = te.sync.run(spends_after_a_signal, 5, key="later")
    assert res.status == "waiting" and CALLS == [0]
    te.sync.signal(res.run_id, "go")
    over = te.sync.run(spends_after_a_signal, 5, key="later", budget={"tokens": 2500})
    assert over.run_id == res.run_id and over.status == "over_budget" and CALLS == [0, 1, 2]
    done = te.sync.raise_budget(res.run_id, tokens=10_000)
    assert done.status == "completed" and done.result == [f"t{i}" for i in range(5)] and CALLS == [0, 1, 2, 3, 4]
    assert te.sync.inspect(res.run_id).spent["tokens"] == 5000
