"""`ctx.annotate` is recorded once per change: a replayed call appends nothing, so what readers see never goes
backwards while a run resumes, in every mode and across a real SIGKILL."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from modes import Effects, cli_process, effects_fixture, flows_fixture, in_worker, kill, records, state_of, wait_until

from durably_py import create_engine, run
from durably_py.testing import TestEngine

FLOWS = '''
import time

from durably_py import workflow


def work(i, pause):
    mark("work", i)
    time.sleep(pause)
    return i


@workflow
async def an_stages(ctx, spec):
    for i in range(spec["n"]):
        ctx.annotate(stage=i, of=spec["n"])
        ctx.annotate(stage=i, of=spec["n"])  # the same values again: nothing to record
        await ctx.step(work, i, spec["pause"], name=f"work {i}")
    ctx.annotate(stage=spec["n"], done=True)
    return spec["n"]


@workflow
async def an_napper(ctx, seconds):
    ctx.annotate(phase="before")
    await ctx.step(work, 0, 0, name="first")
    ctx.annotate(phase="napping")
    await ctx.sleep(seconds)
    ctx.annotate(phase="after")
    await ctx.step(work, 1, 0, name="second")
    return "ok"


@workflow
async def an_branches(ctx, n):
    async def branch(i):
        ctx.annotate(**{f"b{i}": "started"})
        await ctx.step(work, i, 0, name=f"branch {i}")
        ctx.annotate(**{f"b{i}": "done"})
        return i

    done = await ctx.parallel([lambda i=i: branch(i) for i in range(n)])
    ctx.annotate(branches=len(done))
    return [r.value for r in done]


def progress(i):
    from durably_py import attempt

    mark("progress", i, attempt().number)
    return i


@workflow
async def an_loop(ctx, n):
    async def turn(total, it):
        if it.number == n:
            return it.done(total)
        ctx.annotate(turn=it.number)
        return total + await it.step(work, it.number, 0, name="turn")

    return await ctx.loop(0, turn, snapshot_every=2)
'''


flows = flows_fixture("note_flows", FLOWS)
effects = effects_fixture()


def notes(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["n"] for r in recs if r["t"] == "note"]


def stages(recs: list[dict[str, Any]]) -> list[Any]:
    return [n["stage"] for n in notes(recs) if "stage" in n]


def test_a_resumed_run_appends_only_the_annotations_it_had_not_made(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        crashed = engine.sync.run(mod.an_stages, {"n": 5, "pause": 0}, crash_after="work 2")
        assert crashed.status == "crashed"
        recs = asyncio.run(engine.engine.records(crashed.run_id))
        assert stages(recs) == [0, 1, 2]
        again = engine.sync.run(mod.an_stages, {"n": 5, "pause": 0}, crash_after="work 3")
        assert again.status == "crashed" and stages(asyncio.run(engine.engine.records(crashed.run_id))) == [0, 1, 2, 3]
        done = engine.sync.resume(crashed.run_id)
        assert done.status == "completed"
        assert stages(asyncio.run(engine.engine.records(crashed.run_id))) == [0, 1, 2, 3, 4, 5]
        state = engine.sync.inspect(crashed.run_id)
        assert state.annotations == {"stage": 5, "of": 5, "done": True}


def test_a_run_parked_in_a_sleep_does_not_annotate_again(flows: Any, effects: Effects, tmp_path: Path) -> None:
    _, mod = flows
    with TestEngine() as engine:
        parked = engine.sync.run(mod.an_napper, 60)
        assert parked.status == "sleeping"
        assert engine.sync.inspect(parked.run_id).annotations == {"phase": "napping"}
        engine.clock.advance(60)
        assert engine.sync.resume(parked.run_id).status == "completed"
        assert [n["phase"] for n in notes(asyncio.run(engine.engine.records(parked.run_id)))] == \
            ["before", "napping", "after"]
    engine2 = create_engine(tmp_path / "nowait")
    with pytest.raises(Exception, match="sleeping"):
        asyncio.run(engine2.run(mod.an_napper, 0.3, key="nap", wait=False))
    time.sleep(0.35)
    assert asyncio.run(engine2.run(mod.an_napper, 0.3, key="nap", wait=False)) == "ok"
    assert [n["phase"] for n in notes(records(tmp_path / "nowait", "nap"))] == ["before", "napping", "after"]


def test_in_a_worker_that_parks_the_run(flows: Any, effects: Effects, tmp_path: Path) -> None:
    script, _ = flows
    state = in_worker(tmp_path / "state", script, "an_napper", 0.5, key="nap")
    assert state.status == "completed" and state.annotations == {"phase": "after"}
    recs = records(tmp_path / "state", "nap")
    assert sum(1 for r in recs if r["t"] == "claim") >= 2  # the worker parked it in its sleep and claimed it again
    assert [n["phase"] for n in notes(recs)] == ["before", "napping", "after"]


def test_run_again_in_this_process(flows: Any, effects: Effects, tmp_path: Path) -> None:
    _, mod = flows
    assert run(mod.an_branches, 3, dir=tmp_path, key="b") == [0, 1, 2]
    assert run(mod.an_branches, 3, dir=tmp_path, key="b") == [0, 1, 2]  # completed: answered, nothing written
    recs = records(tmp_path, "b")
    assert len(notes(recs)) == 7 and state_of(tmp_path, "b").annotations == {
        "b0": "done", "b1": "done", "b2": "done", "branches": 3}


def test_branches_and_loop_turns_annotate_once_each(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        crashed = engine.sync.run(mod.an_branches, 4, crash_after="branch 2")
        done = engine.sync.resume(crashed.run_id)
        assert done.status == "completed" and done.result == [0, 1, 2, 3]
        written = notes(asyncio.run(engine.engine.records(crashed.run_id)))
        assert sorted(json.dumps(n) for n in written) == sorted(
            [json.dumps({f"b{i}": s}) for i in range(4) for s in ("started", "done")] + ['{"branches": 4}'])
        looped = engine.sync.run(mod.an_loop, 7, crash_after=("turn", 5))
        assert engine.sync.resume(looped.run_id).result == 21
        turns = [n["turn"] for n in notes(asyncio.run(engine.engine.records(looped.run_id)))]
        assert turns == list(range(7))


def test_readers_never_see_an_annotation_go_back_across_a_sigkill(flows: Any, effects: Effects,
                                                                  tmp_path: Path) -> None:
    """Killed after its fourth step, the run is resumed by `durably run` while this test reads its annotations
    as fast as it can: the stage only ever moves forward, and every stage is recorded once."""
    script, _ = flows
    state_dir = tmp_path / "state"
    args = ("run", str(script), "--workflow", "an_stages", "--input", json.dumps({"n": 10, "pause": 0.05}),
            "--key", "stages", "--dir", str(state_dir))
    first = cli_process(*args)
    wait_until(lambda: effects.count("work") >= 4 or first.poll() is not None)
    kill(first)
    before = stages(records(state_dir, "stages"))
    assert before and before[-1] < 10
    second = cli_process(*args)
    seen: list[int] = []
    while second.poll() is None:
        stage = state_of(state_dir, "stages").annotations.get("stage")
        if stage is not None and (not seen or seen[-1] != stage):
            seen.append(stage)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert json.loads(out) == 10
    assert seen == sorted(seen) and seen[0] >= before[-1], (before, seen)
    assert stages(records(state_dir, "stages")) == list(range(11))
    print(f"annotations across a SIGKILL: {len(before)} stages before it, readers saw {seen}")


def test_a_compacted_log_keeps_which_calls_it_recorded() -> None:
    from durably_py import records as log
    from durably_py._state.history import History

    header = log.Header(v=log.LOG_VERSION, run_id="r-1", workflow="w")
    recs = [header, log.Note(notes={"a": 1}, strand="", index=0), log.Note(notes={"a": 2}, strand="", index=3),
            log.Note(notes={"t": 0}, strand="0.0.", index=0), log.Note(notes={"t": 5}, strand="0.5.", index=0),
            log.Snap(path="0", iteration=3, state=0), log.Note(notes={"old": True})]
    history = History(recs)
    assert history.noted == {"": 3, "0.0.": 0, "0.5.": 0}
    again = History(history.compacted())
    assert again.notes == history.notes == {"a": 2, "t": 5, "old": True}
    assert again.noted == {"": 3, "0.5.": 0}  # iteration 0 is under the snapshot: it never runs again
    assert log.load_one({"t": "note", "n": {"x": 1}}) == log.Note(notes={"x": 1})  # an older record still loads
