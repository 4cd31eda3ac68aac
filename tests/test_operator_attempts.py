"""An operator's pause, resume, cancel or retry --from-step of a run no process holds appends its record without
claiming the run, so it never counts as a workflow attempt (`inspect` and `list` show the attempts the workflow
really made), on every storage adapter and through the real CLI."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import durably, storage_of

from durably_py import RunParkedError, create_engine, workflow

WF = textwrap.dedent('''
    from durably_py import workflow

    def add_one(x):
        return x + 1

    @workflow
    async def gate(ctx):
        await ctx.step(add_one, 1)
        return await ctx.wait_for("approval", timeout=3600)
''')


def as_json(proc: Any) -> Any:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_pause_then_resume_of_an_unheld_parked_run_keeps_its_attempt_count_through_the_cli(tmp_path: Path) -> None:
    (tmp_path / "wf.py").write_text(WF)
    parked = durably("run", "wf.py", "--workflow", "gate", "--no-wait", "--key", "g", cwd=tmp_path)
    assert parked.returncode == 3, parked.stderr
    before = as_json(durably("inspect", "g", "--json", cwd=tmp_path))
    assert before["status"] == "waiting" and before["attempt"] == 1
    assert as_json(durably("pause", "g", "--json", cwd=tmp_path))["status"] == "paused"
    assert as_json(durably("resume", "g", "--json", cwd=tmp_path))["status"] == "waiting"
    after = as_json(durably("inspect", "g", "--json", cwd=tmp_path))
    assert after["status"] == "waiting" and after["attempt"] == before["attempt"] == 1
    (listed,) = as_json(durably("list", "--json", cwd=tmp_path))
    assert listed["attempt"] == 1
    log = (tmp_path / ".durably" / "runs" / f"{before['run_id']}.jsonl").read_text().splitlines()
    assert [json.loads(r)["t"] for r in log].count("claim") == 1


@workflow
async def attempt_gate(ctx: Any) -> Any:
    await ctx.step(lambda: 1, name="one")
    return await ctx.wait_for("approval", timeout=3600)


@pytest.fixture(params=["file", "memory", "sqlite", "postgres"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    return storage_of(request.param, tmp_path, request)


def test_operations_on_an_unheld_run_are_not_attempts_on_every_adapter(storage: Any) -> None:
    engine = create_engine(storage)

    async def main() -> None:
        with pytest.raises(RunParkedError):
            await engine.run(attempt_gate, key="k", wait=False)
        run_id = engine.resolve("k")
        assert (await engine.inspect("k")).attempt == 1
        for _ in range(3):
            assert (await engine.pause("k")).status == "paused"
            assert (await engine.resume("k")).status == "waiting"
        assert (await engine.inspect("k")).attempt == 1
        (listed,) = await engine.list()
        assert listed.attempt == 1
        assert storage.entry(run_id) is not None and storage.entry(run_id).at is not None  # due again once resumed
        with pytest.raises(RunParkedError):
            await engine.run(attempt_gate, key="k", wait=False)
        assert (await engine.inspect("k")).attempt == 2
        assert (await engine.cancel("k")).status == "cancelled"
        state = await engine.inspect("k")  # the cancel ran the workflow here to clean up: that is its one attempt
        assert state.status == "cancelled" and state.attempt == 3
        assert storage.entry(run_id) is None

    asyncio.run(main())
