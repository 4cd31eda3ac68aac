"""A child id collision is loud, always: a spawn whose looked-up run was created for another identity is an error
on every adapter (files, memory, SQLite, PostgreSQL), on the first resume and every one after, in this process,
under TestEngine and in a worker process; the parent never binds two spawns to one child."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import storage_of
from modes import Effects, cli, flows_fixture, serve, state_of

import durably_py._ids as engine_module
from durably_py import ValidationError, create_engine
from durably_py.testing import TestEngine

FLOWS = '''
from durably_py import workflow


@workflow
async def ci_kid(ctx, n):
    return await ctx.step(lambda: n, name="n")


@workflow
async def ci_pair(ctx):
    first = await ctx.spawn(ci_kid, 1)
    second = await ctx.spawn(ci_kid, 2)
    return [await ctx.join(first), await ctx.join(second)]


@workflow
async def ci_batch(ctx):
    handles = await ctx.spawn_all([(ci_kid, n) for n in (1, 2, 3)])
    return [r.value for r in await ctx.join_all(handles)]


@workflow
async def ci_later(ctx):
    first = await ctx.join(await ctx.spawn(ci_kid, 1))
    await ctx.wait_for("go")
    return [first, await ctx.join(await ctx.spawn(ci_kid, 2))]
'''


flows = flows_fixture("identity_flows", FLOWS)


@contextlib.contextmanager
def one_child_id() -> Iterator[None]:
    """Every child run gets the same id (as a collision of its random bits would give)."""
    real = engine_module.new_run_id
    engine_module.new_run_id = lambda name: "ci_kid-collidedcollided" if name == "ci_kid" else real(name)
    try:
        yield
    finally:
        engine_module.new_run_id = real


@pytest.mark.parametrize("kind", ["file", "memory", "sqlite", "postgres"])
@pytest.mark.parametrize("workflow", ["ci_pair", "ci_batch"])
def test_a_collision_is_an_error_on_every_resume(flows: Any, tmp_path: Path, request: pytest.FixtureRequest,
                                                  kind: str, workflow: str) -> None:
    _, mod = flows
    engine = create_engine(storage_of(kind, tmp_path, request))
    wf = getattr(mod, workflow)
    with one_child_id():
        for attempt in range(3):  # the first run and each retry after it
            with pytest.raises(ValidationError) as err:
                asyncio.run(engine.run(wf, key="pair"))
            said = str(err.value)
            assert "already exists" in said or "two runs were given one id" in said or "twice in one batch" in said, \
                attempt
            assert err.value.hint and err.value.docs
    parent = asyncio.run(engine.inspect("pair"))
    assert parent.status == "failed" and len(parent.children) <= 1
    restarted = asyncio.run(engine.restart("pair"))  # ids are unique again: a fresh run spawns distinct children
    assert restarted == ([1, 2] if workflow == "ci_pair" else [1, 2, 3])


def test_under_test_engine(flows: Any) -> None:
    _, mod = flows
    with TestEngine() as engine, one_child_id():
        first = engine.sync.run(mod.ci_pair)
        assert first.status == "failed" and isinstance(first.error, ValidationError)
        again = engine.sync.resume(first.run_id)
        assert again.status == "failed" and "two runs were given one id" in str(again.error)


def later_bound_to_first(storage: Any, parent: str) -> None:
    """Point the second spawn's identity (path 3) at the first child, as a collision would have."""
    [first] = [r.run_id for r in storage.list_runs(parent=parent)]
    assert storage.bind(f"child:{parent}:3", first, expect=None)


@pytest.mark.parametrize("kind", ["file", "memory", "sqlite", "postgres"])
def test_a_spawn_finding_another_childs_run_is_an_error(flows: Any, tmp_path: Path, request: pytest.FixtureRequest,
                                                        kind: str) -> None:
    _, mod = flows
    storage = storage_of(kind, tmp_path, request)
    engine = create_engine(storage)
    with pytest.raises(Exception, match="waiting"):
        asyncio.run(engine.run(mod.ci_later, key="later", wait=False))
    parent = asyncio.run(engine.inspect("later")).run_id
    later_bound_to_first(storage, parent)
    asyncio.run(engine.signal("later", "go"))
    for _ in range(2):
        with pytest.raises(ValidationError, match=f"child:{parent}:3 points at run ci_kid-"):
            asyncio.run(engine.run(mod.ci_later, key="later"))


def test_in_a_worker_process(flows: Any, tmp_path: Path) -> None:
    script, mod = flows
    Effects(tmp_path / "effects.txt")
    state_dir = tmp_path / "state"
    assert cli("enqueue", str(script), "--workflow", "ci_later", "--key", "later", "--dir",
               str(state_dir)).returncode == 0
    waiting = serve(state_dir, script, "later", until=("waiting",))
    engine = create_engine(state_dir)
    later_bound_to_first(engine.storage, waiting.run_id)
    assert cli("signal", "later", "go", "--dir", str(state_dir)).returncode == 0
    failed = serve(state_dir, script, "later")
    assert failed.status == "failed" and "two runs were given one id" in failed.error["message"]
    again = cli("retry", "later", "--dir", str(state_dir), "--json")
    assert again.returncode == 1 and "two runs were given one id" in again.stderr
    assert json.loads(cli("inspect", "later", "--dir", str(state_dir), "--json").stdout)["status"] == "failed"
    assert state_of(state_dir, "later").result is None


def test_a_top_level_run_found_under_another_identity_is_an_error(flows: Any, tmp_path: Path) -> None:
    _, mod = flows
    engine = create_engine(tmp_path)
    first = asyncio.run(engine.run(mod.ci_kid, 1, key="one"))
    assert first == 1
    one = asyncio.run(engine.inspect("one")).run_id
    with pytest.raises(ValidationError, match="already exists"):  # forced: the second run's id is the first's
        real = engine_module.new_run_id
        engine_module.new_run_id = lambda name: one
        try:
            asyncio.run(engine.run(mod.ci_kid, 2))
        finally:
            engine_module.new_run_id = real
    with pytest.raises(ValidationError, match="two runs were given one id"):
        asyncio.run(engine.run(mod.ci_kid, 2))  # it used to return 1, the other run's result
