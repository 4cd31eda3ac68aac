"""Retention: `engine.prune`, `durably prune` and `retention=` delete ended runs and everything pointing at
them, and never an unfinished run, a run a process holds, or a child of an unfinished parent."""

from __future__ import annotations

import asyncio
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import durably as run_cli
from helpers import storage_of

from durably_py import Engine, create_engine, workflow
from durably_py.errors import RunNotFoundError, RunParkedError, ValidationError
from durably_py.storage import FileStorage


def work(name: str) -> str:
    if name == "bad":
        raise ValueError("broken on purpose")
    return name.upper()


@workflow
async def prune_job(ctx: Any, name: str) -> str:
    out = await ctx.step(work, name)
    if name == "gate":
        return str(await ctx.wait_for("go", timeout=3600))
    return out


@workflow
async def prune_parent(ctx: Any, name: str) -> str:
    handle = await ctx.spawn(prune_job, name)
    done = await ctx.join(handle)
    await ctx.wait_for("go", timeout=3600)  # unfinished, with a finished child
    return str(done)


def a_mix(engine: Engine) -> dict[str, str]:
    """key -> run id of: done (completed), failed, cancelled, waiting, and a waiting parent with a child."""
    asyncio.run(engine.run(prune_job, "ok", key="done"))
    with pytest.raises(ValueError):
        asyncio.run(engine.run(prune_job, "bad", key="failed"))
    for key in ("waiting", "cancelled"):
        with pytest.raises(RunParkedError):
            asyncio.run(engine.run(prune_job, "gate", key=key, wait=False))
    asyncio.run(engine.cancel("cancelled"))
    with pytest.raises(RunParkedError):
        asyncio.run(engine.run(prune_parent, "kid", key="parent", wait=False))
    runs = {key: engine.resolve(key) for key in ("done", "failed", "cancelled", "waiting", "parent")}
    (child,) = asyncio.run(engine.inspect("parent")).children
    runs["child"] = child
    assert asyncio.run(engine.inspect(child)).status == "completed"
    return runs


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_prune_deletes_ended_runs_only(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    engine = Engine(storage_of(kind, tmp_path, request))
    runs = a_mix(engine)
    assert asyncio.run(engine.prune(older_than=3600)).runs == []  # everything ended just now

    plan = asyncio.run(engine.prune(older_than=0, status=["completed", "cancelled"], dry_run=True))
    assert sorted(plan.runs) == sorted([runs["done"], runs["cancelled"]])
    assert plan.bytes > 0 and plan.kept == {runs["child"]: f"its parent {runs['parent']} has not ended"}
    assert asyncio.run(engine.count()) == 6  # a dry run deletes nothing

    report = asyncio.run(engine.prune(older_than=0))
    assert sorted(report.runs) == sorted([runs["done"], runs["failed"], runs["cancelled"]])
    assert report.bytes >= plan.bytes and runs["child"] in report.kept
    listed = {s.run_id for s in asyncio.run(engine.list())}
    assert listed == {runs["waiting"], runs["parent"], runs["child"]}
    for key in ("done", "failed", "cancelled"):
        with pytest.raises(RunNotFoundError):
            asyncio.run(engine.inspect(runs[key]))
        assert engine.storage.entry(runs[key]) is None
    assert engine.storage.lookup("key:done") is None
    due = engine.storage.due(100, time.time() + 7200)
    assert not {runs["done"], runs["failed"], runs["cancelled"]} & set(due)
    assert asyncio.run(engine.run(prune_job, "ok", key="done")) == "OK"  # the key starts a new run

    asyncio.run(engine.signal("parent", "go", 1))
    assert asyncio.run(engine.run(prune_parent, "kid", key="parent")) == "KID"
    again = asyncio.run(engine.prune(older_than=0, workflow="prune_job", status="completed"))
    assert runs["child"] in again.runs and runs["parent"] not in again.runs  # the parent ended: its child may go


def test_prune_arguments_are_checked(tmp_path: Path) -> None:
    engine = Engine(FileStorage(tmp_path / "state"))
    for bad in [{"older_than": -1}, {"older_than": "30d"}, {"older_than": 1, "status": "waiting"},
                {"older_than": 1, "dry_run": "yes"}]:
        with pytest.raises(ValidationError):
            asyncio.run(engine.prune(**bad))
    with pytest.raises(ValidationError):
        create_engine(tmp_path / "state", retention=0)


def test_a_worker_with_retention_prunes_on_its_own(tmp_path: Path) -> None:
    engine = create_engine(FileStorage(tmp_path / "state"), retention=0.3)
    runs = a_mix(engine)

    async def serve() -> None:
        await engine.start(poll=0.05)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if await engine.count(status="completed") <= 1:
                break
            await asyncio.sleep(0.1)
        await engine.stop()

    time.sleep(0.4)
    asyncio.run(serve())
    left = {s.run_id: s.status for s in asyncio.run(engine.list())}
    assert set(left) == {runs["waiting"], runs["parent"], runs["child"]}


durably = partial(run_cli, timeout=120, pythonpath=False)


def test_durably_prune_on_the_command_line(tmp_path: Path) -> None:
    state = tmp_path / ".durably"
    engine = Engine(FileStorage(state))
    runs = a_mix(engine)
    plan = durably("prune", "--older-than", "0s", "--status", "failed", "--dry-run", "--json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["runs"] == [runs["failed"]] and json.loads(plan.stdout)["dry_run"] is True
    assert durably("prune", "--older-than", "30d", cwd=tmp_path).stdout.startswith("deleted 0 ended runs")
    done = durably("prune", "--older-than", "0s", "--workflow", "prune_job", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deleted 3 ended runs") and "kept 1 that matched" in done.stdout
    listed = durably("list", "-q", cwd=tmp_path).stdout.split()
    assert sorted(listed) == sorted([runs["waiting"], runs["parent"], runs["child"]])
    bad = durably("prune", "--older-than", "1d", "--status", "running", cwd=tmp_path)
    assert bad.returncode == 2 and "not an end status" in bad.stderr
