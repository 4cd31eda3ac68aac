"""What an enqueue of a key does while a run with the key is open: debounce (a burst of enqueues gives one run,
with the last input, and every superseded run names the run that took its place), `on_conflict` (use the
existing run, fail, or cancel it for the newcomer) and `fresh=True`; the same through `durably enqueue`; each
option's mistakes are clear errors that enqueue nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_until

from durably_py import (
    KeyConflictError,
    RunCancelledError,
    RunParkedError,
    ValidationError,
    create_engine,
    workflow,
)

seen: list[object] = []


def note(value: object) -> object:
    seen.append(value)
    return value


@workflow(queue="indexing")
async def reindex(ctx, doc):
    return await ctx.step(note, doc)


@workflow
async def approve(ctx, doc):
    await ctx.wait_for("approved", timeout=3600)
    return doc


def _status(engine, run_id: str) -> str:
    return asyncio.run(engine.inspect(run_id)).status


def test_a_burst_of_fifty_debounced_enqueues_runs_once_with_the_last_input(tmp_path: Path) -> None:
    seen.clear()
    engine = create_engine(tmp_path / ".durably")

    async def main():
        await engine.start(poll=0.05)
        handles = [await engine.enqueue(reindex, {"rev": i}, key="doc-7", debounce=0.4) for i in range(50)]
        result = await engine.join(handles[-1])
        await engine.stop()
        return handles, result

    handles, result = asyncio.run(main())
    assert result == {"rev": 49} and seen == [{"rev": 49}]
    assert len({h.run_id for h in handles}) == 50
    for earlier, later in zip(handles, handles[1:], strict=False):
        state = asyncio.run(engine.inspect(earlier.run_id))
        assert state.status == "cancelled" and f"superseded by run {later.run_id}" in state.error["message"]
    with pytest.raises(RunCancelledError, match="superseded"):
        asyncio.run(engine.join(handles[0]))
    header = engine.storage.read(handles[-1].run_id).records[0]
    assert header["queue"] == "indexing"  # the workflow's queue


def test_a_debounced_enqueue_of_a_key_whose_run_started_queues_a_new_run(tmp_path: Path) -> None:
    engine = create_engine(tmp_path / ".durably")
    first = asyncio.run(engine.enqueue(approve, "a", key="approval-1"))
    with pytest.raises(RunParkedError):  # it starts here and parks, waiting for its approval
        asyncio.run(engine.run(approve, "a", key="approval-1", wait=False))
    second = asyncio.run(engine.enqueue(approve, "b", key="approval-1", debounce=1))
    assert second.run_id != first.run_id
    assert _status(engine, first.run_id) == "waiting"  # the started run goes on; it is not superseded
    assert _status(engine, second.run_id) == "pending"


@pytest.mark.parametrize("policy", ["use_existing", "fail", "cancel_existing"])
def test_on_conflict_decides_what_a_newcomer_does_to_an_open_run(tmp_path: Path, policy: str) -> None:
    engine = create_engine(tmp_path / ".durably")
    with pytest.raises(RunParkedError):  # it parks waiting for its approval: an open run that started
        asyncio.run(engine.run(approve, "old", key="deal-1", wait=False))
    old = asyncio.run(engine.list(workflow="approve"))[0].run_id
    if policy == "fail":
        with pytest.raises(KeyConflictError) as info:
            asyncio.run(engine.enqueue(approve, "old", key="deal-1", on_conflict="fail"))
        assert old in str(info.value) and info.value.hint
        return
    new = asyncio.run(engine.enqueue(approve, "new", key="deal-1", on_conflict=policy))
    if policy == "use_existing":
        assert new.run_id == old
        return
    assert new.run_id != old
    wait_until(lambda: _status(engine, old) == "cancelled", 30)
    assert _status(engine, new.run_id) == "pending"


def test_cancel_existing_supersedes_a_run_that_never_started(tmp_path: Path) -> None:
    engine = create_engine(tmp_path / ".durably")
    old = asyncio.run(engine.enqueue(approve, "old", key="deal-2"))
    new = asyncio.run(engine.enqueue(approve, "new", key="deal-2", on_conflict="cancel_existing"))
    state = asyncio.run(engine.inspect(old.run_id))
    assert state.status == "cancelled" and new.run_id in state.error["message"]
    assert state.attempt == 0  # never claimed: nothing of it ran


def test_fresh_makes_a_new_run_where_the_same_input_names_one(tmp_path: Path) -> None:
    engine = create_engine(tmp_path / ".durably")
    first = asyncio.run(engine.enqueue(reindex, {"rev": 1}))
    assert asyncio.run(engine.enqueue(reindex, {"rev": 1})).run_id == first.run_id  # the identity rule
    again = asyncio.run(engine.enqueue(reindex, {"rev": 1}, fresh=True))
    assert again.run_id != first.run_id
    assert _status(engine, first.run_id) == _status(engine, again.run_id) == "pending"


@pytest.mark.parametrize("options, words", [
    ({"debounce": 1}, "needs key="),
    ({"on_conflict": "use_existing"}, "needs key="),
    ({"key": "k", "on_conflict": "replace"}, "on_conflict= must be one of"),
    ({"key": "k", "debounce": 0}, "debounce= must be seconds > 0"),
    ({"key": "k", "debounce": 1, "fresh": True}, "does not go with"),
    ({"queue": "a/b"}, "without '/'"),
    ({"partition": ""}, "partition name"),
])
def test_enqueue_option_mistakes_are_clear_errors_that_enqueue_nothing(tmp_path: Path, options, words) -> None:
    engine = create_engine(tmp_path / ".durably")
    with pytest.raises(ValidationError) as info:
        asyncio.run(engine.enqueue(reindex, {"rev": 1}, **options))
    assert words in str(info.value) and info.value.hint and info.value.docs
    assert asyncio.run(engine.list()) == []


SCRIPT = '''
from durably_py import workflow


@workflow
async def deploy(ctx, target):
    return target
'''


def test_durably_enqueue_takes_queue_partition_fresh_debounce_and_on_conflict(tmp_path: Path) -> None:
    script = tmp_path / "deploys.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}

    def enqueue(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "durably_py.cli", "enqueue", str(script), "-w", "deploy",
                               "--json", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    first = enqueue("-i", '"eu"', "--key", "deploy-eu", "--queue", "deploys", "--partition", "eu",
                    "--debounce", "30s")
    assert first.returncode == 0, first.stderr
    first_id = json.loads(first.stdout)["run_id"]
    second = enqueue("-i", '"eu-2"', "--key", "deploy-eu", "--debounce", "30")
    second_id = json.loads(second.stdout)["run_id"]
    engine = create_engine(tmp_path / ".durably")
    superseded = asyncio.run(engine.inspect(first_id))
    assert superseded.status == "cancelled" and second_id in superseded.error["message"]
    header = engine.storage.read(first_id).records[0]
    assert (header["queue"], header["partition"]) == ("deploys", "eu")
    placed = enqueue("-i", '"us"', "--queue", "deploys", "--partition", "us")
    placed_id = json.loads(placed.stdout)["run_id"]
    shown = subprocess.run([sys.executable, "-m", "durably_py.cli", "inspect", placed_id], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert "queue deploys (partition us)" in shown.stdout, shown.stdout
    refused = enqueue("-i", '"eu-2"', "--key", "deploy-eu", "--on-conflict", "fail")
    assert refused.returncode == 2 and second_id in refused.stderr
    kept = enqueue("-i", '"eu-3"', "--key", "deploy-eu", "--on-conflict", "use_existing")
    assert json.loads(kept.stdout)["run_id"] == second_id
    fresh = enqueue("-i", '"eu-2"', "--key", "deploy-eu-2", "--fresh")
    again = enqueue("-i", '"eu-2"', "--key", "deploy-eu-2", "--fresh")
    assert json.loads(fresh.stdout)["run_id"] != json.loads(again.stdout)["run_id"]
    wrong = enqueue("-i", '"x"', "--debounce", "5")
    assert wrong.returncode == 2 and "needs key=" in wrong.stderr
