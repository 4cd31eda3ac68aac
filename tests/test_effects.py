"""Effects that need attention: a `replay="unsafe"` (manual) step cut off by a killed process leaves its run
`needs_attention` (not failed, no compensation), and an operator resolves it with a verified value, a rerun
or a failure: through the CLI in real subprocesses, `Engine.resolve_effect`, a worker process and the console's
JSON API. `on_interrupt="raise"` keeps the old behaviour (the workflow gets `StepInterruptedError`)."""

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
from helpers import check_error, durably, wait_until

from durably_py import (
    EffectFailedError,
    Engine,
    FileStorage,
    MemoryStorage,
    RunParkedError,
    SerializationError,
    StepInterruptedError,
    ValidationError,
    create_engine,
    workflow,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SHOP = textwrap.dedent('''
    import os, pathlib, time
    from durably_py import EffectFailedError, workflow

    HERE = pathlib.Path(os.environ["EFFECTS"])

    def note(what):
        with open(HERE / "effects.log", "a") as out:
            out.write(what + "\\n")

    def book(order):
        note("book")
        return {"booking": order}

    def unbook(booking):
        note("unbook")

    def charge(order, cents):
        note("charge")
        if (HERE / "hang").exists():
            time.sleep(600)
        return {"charged": cents}

    def ship(charged):
        note("ship")
        return {"shipped": charged}

    @workflow
    async def checkout(ctx, order):
        await ctx.step(book, order, compensate=unbook)
        try:
            charged = await ctx.step(charge, order, 4200, replay="unsafe")
        except EffectFailedError as exc:
            note(f"saw {type(exc).__name__}: {exc}")
            raise
        return await ctx.step(ship, charged)
''')


@pytest.fixture
def shop(tmp_path: Path) -> Path:
    (tmp_path / "shop.py").write_text(SHOP)
    (tmp_path / "hang").write_text("")
    return tmp_path


def cli(project: Path, *args: str, code: int | None = 0) -> subprocess.CompletedProcess[str]:
    done = durably(*args, cwd=project, EFFECTS=str(project), COLUMNS="250")
    assert code is None or done.returncode == code, (args, done.returncode, done.stdout, done.stderr)
    return done


def effects(project: Path) -> list[str]:
    log = project / "effects.log"
    return log.read_text().splitlines() if log.exists() else []


def spawn(project: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "EFFECTS": str(project)}
    return subprocess.Popen([sys.executable, "-m", "durably_py.cli", *args], cwd=project, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill_when_charging(project: Path, proc: subprocess.Popen[str]) -> None:
    """SIGKILL `proc` once it is inside the unsafe `charge` step."""
    try:
        wait_until(lambda: "charge" in effects(project) or proc.poll() is not None, seconds=60)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def cut_off(project: Path) -> str:
    """A real `durably run` killed inside the unsafe step; its run id."""
    kill_when_charging(project, spawn(project, "run", "shop.py", "-w", "checkout", "-i", '"A1"'))
    return cli(project, "list", "-q").stdout.split()[0]


def log_lines(project: Path, run_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in cli(project, "logs", run_id, "-o", "jsonl").stdout.splitlines()]


# ---- the CLI, with real processes -------------------------------------------------------------------------


def test_a_killed_run_needs_attention_and_a_verified_value_continues_it(shop: Path) -> None:
    run_id = cut_off(shop)
    assert effects(shop) == ["book", "charge"]

    listed = json.loads(cli(shop, "list", "--json").stdout)
    assert [(r["run_id"], r["status"]) for r in listed] == [(run_id, "needs_attention")]
    assert cli(shop, "list", "-q", "--status", "needs_attention").stdout.split() == [run_id]
    assert "needs_attention" in cli(shop, "list").stdout

    state = json.loads(cli(shop, "inspect", run_id, "--json").stdout)
    assert state["status"] == "needs_attention" and state["error"] is None
    [effect] = state["attention"]
    assert effect["path"] == [1] and effect["label"] == "charge"
    assert effect["operation_id"] == f"{run_id}/1"
    assert effect["input"] == ["A1", 4200] and effect["policy"] == "manual" and effect["attempt"] == 1
    assert effect["started_at"]
    step = next(s for s in state["steps"] if s["path"] == [1])
    assert step["status"] == "needs_attention" and step["effect"]["operation_id"] == f"{run_id}/1"
    text = cli(shop, "inspect", run_id).stdout
    for needle in ("needs_attention", f"operation id  {run_id}/1", 'input         ["A1", 4200]', "started       ",
                   f"durably resolve {run_id} --path 1"):
        assert needle in text, (needle, text)

    # running it again stops before the step: exit 3 (parked), nothing runs, nothing is compensated
    again = cli(shop, "run", "shop.py", "-w", "checkout", "-i", '"A1"', code=3)
    assert "needs attention" in again.stderr and "durably resolve" in again.stderr
    assert effects(shop) == ["book", "charge"]
    assert not any(rec["t"] in ("end", "comp", "err") for rec in log_lines(shop, run_id))

    done = cli(shop, "resolve", run_id, "--path", "1", "--value", '{"charged": 4200, "by": "hand"}', "--yes")
    assert json.loads(done.stdout) == {"shipped": {"charged": 4200, "by": "hand"}}
    assert effects(shop) == ["book", "charge", "ship"]  # not charged again
    resolved = [rec for rec in log_lines(shop, run_id) if rec["t"] == "resolve"]
    assert resolved == [{"t": "resolve", "p": "1", "l": "charge", "a": 1, "d": "value",
                         "v": {"charged": 4200, "by": "hand"}, "ts": resolved[0]["ts"]}]
    assert "resolved by an operator: attempt 1 happened" in cli(shop, "logs", run_id).stdout
    final = json.loads(cli(shop, "inspect", run_id, "--json").stdout)
    assert final["status"] == "completed" and final["attention"] == []
    assert next(s for s in final["steps"] if s["path"] == [1])["effect"]["resolved"]["decision"] == "value"
    # resolving twice, or a run that does not need attention: refused, nothing written
    before = log_lines(shop, run_id)
    twice = cli(shop, "resolve", run_id, "--path", "1", "--rerun", "--yes", code=2)
    assert "is completed, not needs_attention" in twice.stderr and "hint:" in twice.stderr
    assert log_lines(shop, run_id) == before


def test_rerun_runs_the_step_again_once(shop: Path) -> None:
    run_id = cut_off(shop)
    (shop / "hang").unlink()
    done = cli(shop, "resolve", run_id, "--path", "1", "--rerun", "--yes", "--json")
    outcome = json.loads(done.stdout)
    assert outcome["status"] == "completed" and outcome["result"] == {"shipped": {"charged": 4200}}
    assert effects(shop) == ["book", "charge", "charge", "ship"]
    starts = [rec["a"] for rec in log_lines(shop, run_id) if rec["t"] == "start" and rec.get("fx")]
    assert starts == [1, 2]  # the rerun is a new attempt


def test_fail_fails_the_step_and_the_run_compensates(shop: Path) -> None:
    run_id = cut_off(shop)
    done = cli(shop, "resolve", run_id, "--path", "1", "--fail", "--message", "the provider has no such charge",
               "--yes", code=1)
    assert "the provider has no such charge" in done.stderr
    assert effects(shop) == ["book", "charge", "saw EffectFailedError: the provider has no such charge", "unbook"]
    state = json.loads(cli(shop, "inspect", run_id, "--json").stdout)
    assert state["status"] == "failed" and state["error"]["type"].endswith("EffectFailedError")


def test_bad_resolutions_are_refused_and_change_nothing(shop: Path) -> None:
    run_id = cut_off(shop)
    before = log_lines(shop, run_id)
    refusals = [
        ((), "one decision about the step"),
        (("--value", "1", "--rerun"), "one decision about the step"),
        (("--rerun", "--fail"), "one decision about the step"),
        (("--value", "{not json"), "is not valid JSON"),
        (("--message", "why", "--rerun"), "--message goes with --fail"),
    ]
    for extra, words in refusals:
        done = cli(shop, "resolve", run_id, "--path", "1", *extra, "--yes", code=2)
        assert words in done.stderr and "hint:" in done.stderr and "docs:" in done.stderr, (extra, done.stderr)
    for path, words in (("0", "not a cut-off step"), ("7", "not a cut-off step"), ("x", "not a step path")):
        done = cli(shop, "resolve", run_id, "--path", path, "--rerun", "--yes", code=2)
        assert words in done.stderr and "hint:" in done.stderr, done.stderr
    unconfirmed = cli(shop, "resolve", run_id, "--path", "1", "--rerun", "--json", code=2)  # no terminal to ask on
    assert json.loads(unconfirmed.stdout)["confirmed"] is False and "nothing was touched" in unconfirmed.stderr
    assert cli(shop, "resolve", "no-such-run", "--path", "1", "--rerun", "--yes", code=2).returncode == 2
    assert log_lines(shop, run_id) == before
    assert json.loads(cli(shop, "inspect", run_id, "--json").stdout)["status"] == "needs_attention"
    assert effects(shop) == ["book", "charge"]


def test_a_worker_leaves_a_run_that_needs_attention_alone_and_finishes_it_once_resolved(shop: Path) -> None:
    run_id = cli(shop, "enqueue", "shop.py", "-w", "checkout", "-i", '"W1"').stdout.strip()
    kill_when_charging(shop, spawn(shop, "worker", "--import", "shop.py"))
    worker = spawn(shop, "worker", "--import", "shop.py")
    try:
        def claims() -> int:
            return sum(rec["t"] == "claim" for rec in log_lines(shop, run_id))

        wait_until(lambda: claims() == 2, seconds=60)  # the second worker took the run over, and parked it
        wait_until(lambda: json.loads(cli(shop, "inspect", run_id, "--json").stdout)["status"] == "needs_attention")
        time.sleep(1.5)
        assert claims() == 2 and effects(shop) == ["book", "charge"]  # no spinning, no second charge
        entry = FileStorage(shop / ".durably").entry(run_id)
        assert entry is not None and entry.at is None  # out of the due set: parked until an operator acts
        done = cli(shop, "resolve", run_id, "--path", "1", "--value", '{"charged": 4200}', "--for-worker", "--yes",
                   "--json")
        assert json.loads(done.stdout)["resolved"] is True
        wait_until(lambda: json.loads(cli(shop, "inspect", run_id, "--json").stdout)["status"] == "completed",
                   seconds=60)
        assert effects(shop) == ["book", "charge", "ship"]
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)


# ---- the Python API ---------------------------------------------------------------------------------------

ran: list[str] = []


def reserve(order: str) -> str:
    ran.append("reserve")
    return f"held {order}"


def release(hold: str) -> None:
    ran.append("release")


async def pay(order: str, cents: int) -> dict[str, Any]:
    ran.append("pay")
    if "hang" in ran:
        await asyncio.sleep(600)
    return {"paid": cents}


@workflow
async def order_flow(ctx: Any, order: str) -> Any:
    await ctx.step(reserve, order, compensate=release)
    try:
        paid = await ctx.step(pay, order, 990, replay="manual")
    except EffectFailedError as exc:
        ran.append(f"saw {exc.operation_id}")
        raise
    return paid


@workflow
async def catching_flow(ctx: Any, order: str) -> Any:
    try:
        return await ctx.step(pay, order, 990, replay="unsafe", on_interrupt="raise")
    except StepInterruptedError as exc:
        return f"reconcile {exc.operation_id}"


def cut_in_process(engine: Engine, wf: Any, order: str) -> str:
    """Run `wf` until it is inside `pay`, then cut it off as a killed process would be; the run id."""
    ran.clear()
    ran.append("hang")
    started: list[str] = []

    async def die() -> None:
        task = asyncio.ensure_future(engine.run(wf, order, on_run=started.append))
        while "pay" not in ran:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(die())
    ran.clear()
    return started[0]


@pytest.fixture(params=["file", "memory"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Engine:
    return create_engine(FileStorage(tmp_path / "state") if request.param == "file" else MemoryStorage())


def test_resolve_effect_with_a_value(engine: Engine) -> None:
    run_id = cut_in_process(engine, order_flow, "A")
    with pytest.raises(RunParkedError) as parked:
        asyncio.run(engine.run(order_flow, "A"))
    assert parked.value.status == "needs_attention" and f"durably resolve {run_id} --path 1" in parked.value.hint
    assert ran == []  # replayed from the log: nothing ran again
    assert asyncio.run(engine.resolve_effect(run_id, (1,), value={"paid": 990})) == {"paid": 990}
    assert "pay" not in ran and "release" not in ran


def test_resolve_effect_rerun_and_fail(engine: Engine) -> None:
    rerun_id = cut_in_process(engine, order_flow, "B")
    assert asyncio.run(engine.resolve_effect(rerun_id, "1", rerun=True)) == {"paid": 990}
    assert ran == ["pay"]

    fail_id = cut_in_process(engine, order_flow, "C")
    with pytest.raises(EffectFailedError) as failed:
        asyncio.run(engine.resolve_effect(fail_id, [1], fail="declined by the bank"))
    assert str(failed.value) == "declined by the bank" and failed.value.operation_id == f"{fail_id}/1"
    assert ran == [f"saw {fail_id}/1", "release"]
    assert asyncio.run(engine.inspect(fail_id)).status == "failed"


def test_resolve_effect_refusals(engine: Engine) -> None:
    run_id = cut_in_process(engine, order_flow, "D")
    before = asyncio.run(engine.records(run_id))
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({}, ValidationError, "one decision"),
        ({"value": 1, "fail": True}, ValidationError, "one decision"),
        ({"rerun": "yes"}, ValidationError, "one decision"),
        ({"fail": 3}, ValidationError, "fail= must be True or a message"),
        ({"value": object()}, SerializationError, ""),
    ]
    for options, kind, words in bad:
        with pytest.raises(kind) as refused:
            asyncio.run(engine.resolve_effect(run_id, (1,), **options))
        check_error(refused.value)
        assert words in str(refused.value)
    for path in ((0,), "2", "nope"):
        with pytest.raises(ValidationError) as refused:
            asyncio.run(engine.resolve_effect(run_id, path, rerun=True))
        check_error(refused.value)
    assert asyncio.run(engine.records(run_id)) == before
    assert asyncio.run(engine.resolve_effect(run_id, (1,), value=None)) is None
    with pytest.raises(ValidationError, match="is completed, not needs_attention"):
        asyncio.run(engine.resolve_effect(run_id, (1,), value=None))


def test_cancel_ends_a_run_that_needs_attention(engine: Engine) -> None:
    run_id = cut_in_process(engine, order_flow, "F")
    assert asyncio.run(engine.cancel(run_id, timeout=5)).status == "cancelled"
    assert ran == []  # no compensation unless asked, and the step did not run
    with pytest.raises(ValidationError, match="is cancelled, not needs_attention"):
        asyncio.run(engine.resolve_effect(run_id, (1,), rerun=True))


def test_on_interrupt_raise_keeps_the_old_behaviour(engine: Engine) -> None:
    run_id = cut_in_process(engine, catching_flow, "E")
    assert asyncio.run(engine.inspect(run_id)).status == "interrupted"
    assert asyncio.run(engine.run(catching_flow, "E")) == f"reconcile {run_id}/0"
    assert ran == []


def test_a_safe_or_idempotent_step_cut_off_runs_again(engine: Engine) -> None:
    calls: list[str] = []

    async def send(n: int) -> int:
        calls.append("send")
        if len(calls) == 1:
            await asyncio.sleep(600)
        return n

    @workflow
    async def idem(ctx: Any, n: int) -> int:
        return await ctx.step(send, n, replay="idempotent")

    async def die() -> None:
        task = asyncio.ensure_future(engine.run(idem, 3))
        while not calls:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(die())
    assert asyncio.run(engine.run(idem, 3)) == 3 and calls == ["send", "send"]


# ---- the console ------------------------------------------------------------------------------------------


def test_console_resolves_with_confirmed_operations(tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from starlette.testclient import TestClient

    from durably_py.ui import create_app

    engine = create_engine(FileStorage(tmp_path / "state"))
    run_id = cut_in_process(engine, order_flow, "UI")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client = TestClient(create_app(engine))
    state = client.get(f"/api/runs/{run_id}").json()
    assert state["status"] == "needs_attention"
    assert state["attention"][0]["operation_id"] == f"{run_id}/1" and state["attention"][0]["input"] == ["UI", 990]
    assert [r["run_id"] for r in client.get("/api/runs", params={"status": "needs_attention"}).json()] == [run_id]
    for body, words in (({}, "needs the path"), ({"path": "1"}, "one decision"),
                        ({"path": "0", "rerun": True}, "not a cut-off step"),
                        ({"path": "1", "value": 1, "rerun": True}, "one decision")):
        refused = client.post(f"/api/runs/{run_id}/resolve", json=body)
        assert refused.status_code == 400 and words in refused.json()["message"], refused.json()
        assert refused.json()["hint"] and refused.json()["docs"]
    done = client.post(f"/api/runs/{run_id}/resolve", json={"path": "1", "value": {"paid": 1}})
    assert done.status_code == 200 and done.json()["started"] is True
    wait_until(lambda: client.get(f"/api/runs/{run_id}").json()["status"] == "completed")
    assert client.get(f"/api/runs/{run_id}").json()["result"] == {"paid": 1}
    again = client.post(f"/api/runs/{run_id}/resolve", json={"path": "1", "rerun": True})
    assert again.status_code == 400 and "not needs_attention" in again.json()["message"]
    js = (Path(__file__).parent.parent / "durably_py" / "ui" / "static" / "app.js").read_text()
    for needle in ('"resolve-value"', '"resolve-rerun"', '"resolve-fail"', "needs_attention"):
        assert needle in js
