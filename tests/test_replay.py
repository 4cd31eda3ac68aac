"""Replaying recorded histories against new code: `Engine.export` / `durably export`, `TestEngine.replay`,
`assert_replays` and `durably replay-check`, through the API and real subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import check_error, durably, interrupt, log_files

from durably_py import CorruptLogError, ReplayDivergenceError, create_engine, workflow
from durably_py.testing import TestEngine, assert_replays, replay_check

calls: list[str] = []


def reserve(order: str) -> str:
    calls.append("reserve")
    return f"reserved {order}"


def charge(order: str) -> str:
    calls.append("charge")
    return f"charged {order}"


def ship(order: str) -> str:
    calls.append("ship")
    return f"shipped {order}"


def notify(order: str) -> str:
    calls.append("notify")
    return f"notified {order}"


@workflow(name="order")
async def order_v1(ctx, order):
    return [await ctx.step(reserve, order), await ctx.step(charge, order), await ctx.step(ship, order)]


@workflow(name="order")
async def order_reordered(ctx, order):
    return [await ctx.step(charge, order), await ctx.step(reserve, order), await ctx.step(ship, order)]


@workflow(name="order")
async def order_longer(ctx, order):
    done = [await ctx.step(reserve, order), await ctx.step(charge, order), await ctx.step(ship, order)]
    return [*done, await ctx.step(notify, order)]


@workflow(name="order")
async def order_branching(ctx, order):
    first = await ctx.step(reserve, order)
    if ctx.now().year > 1999:  # a ctx call where the history recorded a step
        await ctx.step(notify, order)
    return [first, await ctx.step(charge, order)]


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    calls.clear()


def exported(tmp_path: Path, *, finish: bool) -> Path:
    """Record a run of `order_v1` on files (to its end, or killed after its second step) and export it."""
    engine = create_engine(tmp_path / ".durably")
    if finish:
        asyncio.run(engine.run(order_v1, "A7"))
        (state,) = asyncio.run(engine.list())
        run_id = state.run_id
    else:
        run_id = interrupt(engine, order_v1, "A7", after=(1,))
    path = tmp_path / "run.jsonl"
    path.write_bytes(asyncio.run(engine.export(run_id)))
    calls.clear()
    return path


def test_an_exported_history_replays_green_against_unchanged_code(tmp_path: Path) -> None:
    history = exported(tmp_path, finish=True)
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert lines[0]["t"] == "run" and lines[0]["workflow"] == "order" and lines[0]["input"] == "A7"
    assert [r["l"] for r in lines if r["t"] == "ok"] == ["reserve", "charge", "ship"]

    with TestEngine() as engine:
        report = engine.sync.replay(history, order_v1)
    assert report.ok and report.status == "completed" and report.frontier is None
    assert report.result == ["reserved A7", "charged A7", "shipped A7"]
    assert calls == []  # every step answered from the history


def test_reordered_steps_fail_with_the_path_and_both_labels(tmp_path: Path) -> None:
    history = exported(tmp_path, finish=True)
    with TestEngine() as engine, pytest.raises(ReplayDivergenceError) as caught:
        engine.sync.replay(history, order_reordered)
    err = caught.value
    check_error(err)
    assert isinstance(err, AssertionError)
    assert err.path == (0,) and err.recorded == "reserve" and err.called == "charge"
    assert "diverged at path (0,): recorded 'reserve', now 'charge'" in str(err)
    assert str(history) in str(err)
    assert calls == []


def test_new_code_may_go_past_the_recorded_frontier(tmp_path: Path) -> None:
    history = exported(tmp_path, finish=False)  # reserve and charge recorded, ship not yet
    report = assert_replays(history, order_v1)
    assert report.ok and report.status == "interrupted"
    assert report.frontier == (2,) and report.frontier_label == "ship"
    report = assert_replays(history, order_longer)
    assert report.ok and report.frontier == (2,)
    with pytest.raises(ReplayDivergenceError) as caught:
        assert_replays(history, order_reordered)
    assert caught.value.path == (0,)
    assert calls == []


def test_a_ctx_call_where_a_step_was_recorded_diverges(tmp_path: Path) -> None:
    history = exported(tmp_path, finish=True)
    with pytest.raises(ReplayDivergenceError) as caught:
        assert_replays(history.read_bytes(), order_branching)
    assert caught.value.path == (1,) and caught.value.recorded == "charge" and caught.value.called == "ctx.now"


@pytest.mark.parametrize(("damage", "line"), [
    (lambda lines: lines[:1] + [b'{"t": "ok", "path": "0"'] + lines[1:], 2),  # a cut record mid-file
    (lambda lines: lines[:2] + [b'{"t": "ok", "path": 0, "label": "x", "attempt": 1}'] + lines[2:], 3),
    (lambda lines: [b'{"t": "teleport"}'] + lines[1:], 1),
    (lambda lines: lines + [b'{"t": "ok", "path": "9"'], None),  # cut last line
])
def test_a_history_that_does_not_decode_is_a_corrupt_log_error(tmp_path: Path, damage: Any, line: int | None) -> None:
    history = exported(tmp_path, finish=True)
    lines = history.read_bytes().splitlines()
    history.write_bytes(b"\n".join(damage(lines)) + b"\n")
    with pytest.raises(CorruptLogError) as caught:
        assert_replays(history, order_v1)
    check_error(caught.value)
    assert str(history) in str(caught.value)
    assert caught.value.line == (line if line is not None else len(lines) + 1)
    assert calls == []


def test_replay_refuses_another_workflows_history(tmp_path: Path) -> None:
    history = exported(tmp_path, finish=True)

    @workflow(name="not-order")
    async def other(ctx, order):
        return await ctx.step(reserve, order)

    with pytest.raises(Exception) as caught:
        assert_replays(history, other)
    check_error(caught.value)
    assert "'order'" in str(caught.value) and "'not-order'" in str(caught.value)


def test_replay_check_covers_every_unfinished_run_of_a_store(tmp_path: Path) -> None:
    engine = create_engine(tmp_path / ".durably")
    unfinished = [interrupt(engine, order_v1, f"U{i}", after=(0,)) for i in range(2)]
    asyncio.run(engine.run(order_v1, "done"))
    calls.clear()
    reports = asyncio.run(replay_check(engine, order_v1))
    assert sorted(r.run_id for r in reports) == sorted(unfinished) and all(r.ok for r in reports)
    reports = asyncio.run(replay_check(engine, order_reordered, status=["interrupted", "completed"]))
    assert len(reports) == 3 and not any(r.ok for r in reports)
    assert {r.line().split(": ", 1)[1] for r in reports} == {"diverged at path (0,): recorded 'reserve', now 'charge'"}
    assert calls == []


def test_replay_check_reports_a_damaged_log_and_checks_the_others(tmp_path: Path) -> None:
    engine = create_engine(tmp_path / ".durably")
    healthy = interrupt(engine, order_v1, "H", after=(1,))
    broken = interrupt(engine, order_v1, "B", after=(1,))
    log = tmp_path / ".durably" / "runs" / f"{broken}.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(lines[0] + b'{"t": "ok", "p": \n' + b"".join(lines[1:]))
    calls.clear()
    reports = {r.run_id: r for r in asyncio.run(replay_check(engine, order_v1))}
    assert reports[healthy].ok and reports[healthy].frontier == (2,)
    assert reports[broken].damaged and not reports[broken].ok
    assert "CorruptLogError" in reports[broken].line() and "line 2" in reports[broken].line()
    assert calls == []


SCRIPT = '''
import time
from durably_py import workflow

def reserve(order):
    return f"reserved {order}"

def charge(order):
    return f"charged {order}"

def hang(order):
    time.sleep(600)

@workflow
async def order(ctx, order):
    STEPS
    TAIL
'''
WAIT = 'return [a, b, await ctx.wait_for("approval")]'
HANG = "await ctx.step(hang, order)"


def script(tmp_path: Path, name: str, steps: str, tail: str = WAIT) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(SCRIPT).replace("STEPS", steps).replace("TAIL", tail))
    return path


def test_export_and_replay_check_as_commands(tmp_path: Path) -> None:
    v1 = script(tmp_path, "v1.py", "a = await ctx.step(reserve, order); b = await ctx.step(charge, order)")
    v2 = script(tmp_path, "v2.py", "b = await ctx.step(charge, order); a = await ctx.step(reserve, order)")
    for order in ("A1", "A2"):
        started = durably("run", str(v1), "--workflow", "order", "--input", json.dumps(order), "--no-wait",
                          cwd=tmp_path)
        assert started.returncode == 3, started.stderr
    listed = durably("list", "--json", cwd=tmp_path)
    runs = [r["run_id"] for r in json.loads(listed.stdout)]
    assert len(runs) == 2

    export = durably("export", runs[0], cwd=tmp_path)
    assert export.returncode == 0, export.stderr
    history = tmp_path / "run.jsonl"
    history.write_text(export.stdout)
    assert json.loads(export.stdout.splitlines()[0])["workflow"] == "order"
    assert "wait" in [json.loads(line)["t"] for line in export.stdout.splitlines()]

    same = durably("replay-check", str(v1), "--workflow", "order", cwd=tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr
    assert sorted(line.split(":")[0] for line in same.stdout.splitlines()[:2]) == sorted(runs)
    assert all(": ok (" in line and "ctx.wait_for" in line for line in same.stdout.splitlines()[:2])

    changed = durably("replay-check", str(v2), "--workflow", "order", cwd=tmp_path)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    assert all(line.endswith("diverged at path (0,): recorded 'reserve', now 'charge'")
               for line in changed.stdout.splitlines()[:2]), changed.stdout
    assert "2 diverged" in changed.stdout

    as_json = durably("replay-check", str(v2), "--workflow", "order", "--json", cwd=tmp_path)
    assert as_json.returncode == 1
    body = json.loads(as_json.stdout)
    assert body["checked"] == 2 and body["diverged"] == 2
    assert {(tuple(r["path"]), r["recorded"], r["called"]) for r in body["runs"]} == {((0,), "reserve", "charge")}

    none = durably("replay-check", str(v2), "--workflow", "order", "--status", "completed", cwd=tmp_path)
    assert none.returncode == 0 and "0 run(s)" in none.stdout

    missing = durably("export", "no-such-run", cwd=tmp_path)
    assert missing.returncode == 2 and "hint" in missing.stderr and "Traceback" not in missing.stderr


def test_an_exported_file_checked_against_reordered_code_through_the_api(tmp_path: Path) -> None:
    v1 = script(tmp_path, "v1.py", "a = await ctx.step(reserve, order); b = await ctx.step(charge, order)")
    started = durably("run", str(v1), "--workflow", "order", "--input", '"B1"', "--no-wait", cwd=tmp_path)
    assert started.returncode == 3, started.stderr
    run_id = json.loads(durably("list", "--json", cwd=tmp_path).stdout)[0]["run_id"]
    history = tmp_path / "b1.jsonl"
    history.write_text(durably("export", run_id, cwd=tmp_path).stdout)

    @workflow(name="order")
    async def same(ctx, order):
        a = await ctx.step(reserve, order, name="reserve")
        b = await ctx.step(charge, order, name="charge")
        return [a, b, await ctx.wait_for("approval")]

    @workflow(name="order")
    async def swapped(ctx, order):
        b = await ctx.step(charge, order, name="charge")
        a = await ctx.step(reserve, order, name="reserve")
        return [a, b, await ctx.wait_for("approval")]

    report = assert_replays(history, same)
    assert report.ok and report.frontier == (2,) and report.frontier_label == "ctx.wait_for"
    with pytest.raises(ReplayDivergenceError) as caught:
        assert_replays(history, swapped)
    assert (caught.value.path, caught.value.recorded, caught.value.called) == ((0,), "reserve", "charge")
    assert calls == []


@workflow(name="replay-child")
async def child(ctx, order):
    return await ctx.step(ship, order)


@workflow(name="replay-parent")
async def parent(ctx, orders):
    handles = await ctx.spawn_all([(child, o) for o in orders])
    results = await ctx.join_all(handles)
    picked = await ctx.parallel([ctx.step(reserve, o) for o in orders])
    return [r.value for r in results] + [p.value for p in picked]


@workflow(name="replay-parent")
async def parent_parallel_swapped(ctx, orders):
    handles = await ctx.spawn_all([(child, o) for o in orders])
    results = await ctx.join_all(handles)
    picked = await ctx.parallel([ctx.step(charge, o) for o in orders])
    return [r.value for r in results] + [p.value for p in picked]


def test_a_parent_replays_from_its_own_history_without_its_children(tmp_path: Path) -> None:
    engine = create_engine(tmp_path / ".durably")
    assert asyncio.run(engine.run(parent, ["P1", "P2"])) == ["shipped P1", "shipped P2", "reserved P1", "reserved P2"]
    (state,) = asyncio.run(engine.list(workflow="replay-parent"))
    history = asyncio.run(engine.export(state.run_id))
    assert len(asyncio.run(engine.list(workflow="replay-child"))) == 2  # runs of their own, with their own logs
    assert all(json.loads(line).get("workflow") != "replay-child" for line in history.splitlines())
    calls.clear()
    report = assert_replays(history, parent)
    assert report.ok and report.result == ["shipped P1", "shipped P2", "reserved P1", "reserved P2"]
    with pytest.raises(ReplayDivergenceError) as caught:
        assert_replays(history, parent_parallel_swapped)
    assert caught.value.path == (2,) and caught.value.recorded == "reserve" and caught.value.called == "charge"
    assert calls == []


def test_replay_check_of_a_run_killed_with_sigkill(tmp_path: Path) -> None:
    v1 = script(tmp_path, "v1.py", "a = await ctx.step(reserve, order); b = await ctx.step(charge, order)", HANG)
    v2 = script(tmp_path, "v2.py", "b = await ctx.step(charge, order); a = await ctx.step(reserve, order)", HANG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", str(v1), "--workflow", "order",
                             "--input", '"K1"'], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            logs = log_files(tmp_path / ".durably")
            if logs and logs[0].read_text().count('"t":"ok"') >= 2:
                break
            assert time.monotonic() < deadline, "the run never recorded its first two steps"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    same = durably("replay-check", str(v1), "--workflow", "order", "--json", cwd=tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr
    (run,) = json.loads(same.stdout)["runs"]
    assert run["result"] == "ok" and run["frontier"] == [2] and run["frontier_label"] == "hang"
    changed = durably("replay-check", str(v2), "--workflow", "order", cwd=tmp_path)
    assert changed.returncode == 1
    assert "diverged at path (0,): recorded 'reserve', now 'charge'" in changed.stdout


class Declined(Exception):
    """A step failure the recorded run ended with."""


def decline(order: str) -> str:
    calls.append("decline")
    raise Declined(f"card declined for {order}")


@workflow(name="declined-order")
async def declined_order(ctx, order):
    await ctx.step(reserve, order)
    return await ctx.step(decline, order)


def test_a_failed_run_replays_green_and_imports_nothing_its_history_names(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = create_engine(tmp_path / ".durably")
    with pytest.raises(Declined):
        asyncio.run(engine.run(declined_order, "D1"))
    (state,) = asyncio.run(engine.list(workflow="declined-order"))
    history = asyncio.run(engine.export(state.run_id))
    calls.clear()
    report = assert_replays(history, declined_order)
    assert report.ok and report.status == "failed"

    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "planted_side_effect.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\nclass Declined(Exception):\n    pass\n")
    monkeypatch.syspath_prepend(str(planted))
    crafted = history.replace(f"{__name__}:Declined".encode(), b"planted_side_effect:Declined")
    assert crafted != history
    report = assert_replays(crafted, declined_order)  # replayed as StepFailedError naming the recorded type
    assert report.ok
    assert not (tmp_path / "imported").exists() and "planted_side_effect" not in sys.modules
    assert calls == []


@workflow(name="order")
async def order_inserted(ctx, order):
    first = await ctx.step(reserve, order)
    checked = [await ctx.step(notify, order)]  # a step inserted before recorded ones
    return [first, *checked, await ctx.step(charge, order), await ctx.step(ship, order)]


@workflow(name="order")
async def order_patched(ctx, order):
    first = await ctx.step(reserve, order)
    checked = [await ctx.step(notify, order)] if ctx.patched("notify-first") else []
    return [first, *checked, await ctx.step(charge, order), await ctx.step(ship, order)]


def test_an_inserted_step_diverges_unless_it_is_behind_ctx_patched(tmp_path: Path) -> None:
    history = exported(tmp_path, finish=False)
    with pytest.raises(ReplayDivergenceError) as caught:
        assert_replays(history, order_inserted)
    assert (caught.value.path, caught.value.recorded, caught.value.called) == ((1,), "charge", "notify")
    report = assert_replays(history, order_patched)  # the recorded run keeps its old branch
    assert report.ok and report.frontier == (2,) and report.frontier_label == "ship"
    assert calls == []
