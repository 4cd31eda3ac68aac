"""A compensated step is undone: retrying or re-running a failed run whose compensations ran executes each
compensated step again instead of answering it from the log, in every mode, after real SIGKILLs between the
compensations and the retry, with `--from-step`, in child runs and in loops; a step whose compensation failed
keeps its result. `inspect`, `logs` and `--json` show such steps as `compensated`."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from modes import (
    Effects,
    cli,
    cli_process,
    effects_fixture,
    flows_fixture,
    in_worker,
    kill,
    records,
    serve,
    state_of,
    wait_until,
)

from durably_py import PurityError, create_engine, engine_for, run
from durably_py.testing import TestEngine

FLOWS = '''
import os
import secrets
import time

from durably_py import workflow


def flag(name):
    return os.path.exists(os.path.join(os.environ["CS_FLAGS"], name))


def book(item):
    if flag(f"slow-book-{item}"):
        time.sleep(30)
    ref = f"{item}-{secrets.token_hex(3)}"
    mark("book", ref)
    return {"item": item, "ref": ref}


def cancel(booking):
    if flag(f"slow-cancel-{booking['item']}"):
        time.sleep(30)
    if flag(f"cancel-fails-{booking['item']}"):
        mark("cancel-failed", booking["ref"])
        raise RuntimeError(f"cannot cancel {booking['ref']}")
    mark("cancel", booking["ref"])


def pay(total):
    mark("pay")
    if not flag("pay-ok"):
        raise ValueError("card declined")
    return f"paid {total}"


@workflow
async def cs_trip(ctx, items):
    booked = [await ctx.step(book, item, name=f"book {item}", compensate=cancel) for item in items]
    receipt = await ctx.step(pay, len(items), name="pay")
    return {"refs": [b["ref"] for b in booked], "receipt": receipt}


@workflow
async def cs_body_decides(ctx, items):
    """Fails in its body, not in a step, while flag `body-fails` is set (code that changes between runs)."""
    booked = [await ctx.step(book, item, name=f"book {item}", compensate=cancel) for item in items]
    if flag("body-fails"):
        raise RuntimeError("the body gave up")
    return [b["ref"] for b in booked]


@workflow
async def cs_child_trip(ctx, items):
    return await ctx.join(await ctx.spawn(cs_trip, items))


@workflow
async def cs_loop_trip(ctx, items):
    async def turn(refs, it):
        if it.number == len(items):
            return it.done(refs)
        booking = await it.step(book, items[it.number], name="book", compensate=cancel)
        return refs + [booking["ref"]]

    refs = await ctx.loop([], turn, snapshot_every=1)
    return {"refs": refs, "receipt": await ctx.step(pay, len(items), name="pay")}
'''

ITEMS = ["flight", "car", "hotel"]


flows = flows_fixture("comp_flows", FLOWS)
effects = effects_fixture()


@pytest.fixture
def flags(tmp_path: Path) -> Any:
    folder = tmp_path / "flags"
    folder.mkdir()
    os.environ["CS_FLAGS"] = str(folder)

    def set_flag(name: str, on: bool = True) -> None:
        if on:
            (folder / name).touch()
        else:
            (folder / name).unlink(missing_ok=True)

    return set_flag


def booked(effects: Effects) -> dict[str, list[str]]:
    """Each item's bookings in order, and whether each is still standing (not cancelled)."""
    refs = [line[2] for line in effects.lines() if line[0] == "book"]
    cancelled = {line[2] for line in effects.lines() if line[0] == "cancel"}
    out: dict[str, list[str]] = {}
    for ref in refs:
        out.setdefault(ref.partition("-")[0], []).append("cancelled" if ref in cancelled else "standing")
    return out


def check_trip(result: dict[str, Any], effects: Effects) -> None:
    """The result's bookings are the standing ones: one per item, none of them cancelled."""
    cancelled = {line[2] for line in effects.lines() if line[0] == "cancel"}
    assert not set(result["refs"]) & cancelled, (result, cancelled)
    assert [ref.partition("-")[0] for ref in result["refs"]] == ITEMS
    standing = [line[2] for line in effects.lines() if line[0] == "book" and line[2] not in cancelled]
    assert sorted(standing) == sorted(result["refs"])


def retried(done: Any) -> Any:
    """The result `durably retry --json` printed."""
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["status"] == "completed", outcome
    return outcome["result"]


def statuses(state: Any) -> list[tuple[str, str, str | None]]:
    return [(s.label, s.status, s.compensation) for s in state.steps]


FAILED_TRIP = [("book flight", "compensated", "ok"), ("book car", "compensated", "ok"),
               ("book hotel", "compensated", "ok"), ("pay", "failed", None)]


# ---- every mode ---------------------------------------------------------------------------------------------

def test_a_rerun_in_this_process_books_again(flows: Any, effects: Effects, flags: Any, tmp_path: Path) -> None:
    _, mod = flows
    with pytest.raises(ValueError, match="card declined"):
        run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)
    state = state_of(tmp_path, "trip")
    assert state.status == "failed" and statuses(state) == FAILED_TRIP
    assert booked(effects) == {item: ["cancelled"] for item in ITEMS}
    flags("pay-ok")
    result = run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)
    check_trip(result, effects)
    assert booked(effects) == {item: ["cancelled", "standing"] for item in ITEMS}
    assert statuses(state_of(tmp_path, "trip")) == [(f"book {i}", "ok", None) for i in ITEMS] + [("pay", "ok", None)]


def test_a_retry_without_waiting_books_again(flows: Any, effects: Effects, flags: Any, tmp_path: Path) -> None:
    _, mod = flows
    engine = create_engine(tmp_path)
    with pytest.raises(ValueError):
        asyncio.run(engine.run(mod.cs_trip, ITEMS, key="trip", wait=False))
    flags("pay-ok")
    check_trip(asyncio.run(engine.retry("trip", wait=False)), effects)
    assert booked(effects) == {item: ["cancelled", "standing"] for item in ITEMS}


def test_under_test_engine(flows: Any, effects: Effects, flags: Any) -> None:
    _, mod = flows
    with TestEngine() as engine:
        failed = engine.sync.run(mod.cs_trip, ITEMS)
        assert failed.status == "failed"
        assert [(s.label, s.status, s.compensation) for s in failed.steps] == FAILED_TRIP
        flags("pay-ok")
        done = engine.sync.resume(failed.run_id)
        assert done.status == "completed"
        check_trip(done.result, effects)
        assert all(done.step(f"book {item}").executions == 2 for item in ITEMS)


def test_served_by_a_worker_then_retried(flows: Any, effects: Effects, flags: Any, tmp_path: Path) -> None:
    script, _ = flows
    state_dir = tmp_path / "state"
    state = in_worker(state_dir, script, "cs_trip", ITEMS, key="trip")
    assert state.status == "failed" and statuses(state) == FAILED_TRIP
    flags("pay-ok")
    check_trip(retried(cli("retry", "trip", "--dir", str(state_dir), "--json")), effects)
    assert booked(effects) == {item: ["cancelled", "standing"] for item in ITEMS}


def test_inspect_logs_and_json_say_compensated(flows: Any, effects: Effects, flags: Any, tmp_path: Path) -> None:
    _, mod = flows
    with pytest.raises(ValueError):
        run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)
    shown = cli("inspect", "trip", "--dir", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if "book " in line]
    assert len(lines) == 3 and all("compensated" in line and " ok" not in line for line in lines), shown.stdout
    as_json = json.loads(cli("inspect", "trip", "--dir", str(tmp_path), "--json").stdout)
    assert [(s["status"], s["compensation"]) for s in as_json["steps"]] == [(s, c) for _, s, c in FAILED_TRIP]
    logs = cli("logs", "trip", "--dir", str(tmp_path)).stdout
    assert sum(1 for line in logs.splitlines() if line.rstrip().endswith("compensated")) == 3, logs
    flags("pay-ok")
    cli("retry", "trip", "--dir", str(tmp_path))
    logs = cli("logs", "trip", "--dir", str(tmp_path)).stdout
    assert "run reopened: its failed and compensated steps run again" in logs


# ---- what "compensated" means ------------------------------------------------------------------------------

def test_a_step_whose_compensation_failed_keeps_its_result(flows: Any, effects: Effects, flags: Any,
                                                          tmp_path: Path) -> None:
    """The car could not be cancelled, so it is still booked: each retry keeps that booking (and books the
    flight and hotel again), and each failure tries to cancel the car once more; once that works, the
    next retry books the car again too."""
    _, mod = flows
    flags("cancel-fails-car")
    with pytest.raises(ValueError) as err:
        run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)
    assert any("compensation of step 'book car'" in note for note in err.value.__notes__)
    assert statuses(state_of(tmp_path, "trip"))[1] == ("book car", "ok", "failed")
    assert booked(effects) == {"flight": ["cancelled"], "car": ["standing"], "hotel": ["cancelled"]}
    with pytest.raises(ValueError):
        run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)  # fails again: the car is kept, its cancel tried again
    assert booked(effects) == {"flight": ["cancelled"] * 2, "car": ["standing"], "hotel": ["cancelled"] * 2}
    assert effects.count("cancel-failed") == 2
    flags("cancel-fails-car", False)
    with pytest.raises(ValueError):
        run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)  # and once more: now the car's cancel works
    assert booked(effects) == {"flight": ["cancelled"] * 3, "car": ["cancelled"], "hotel": ["cancelled"] * 3}
    flags("pay-ok")
    check_trip(run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path), effects)
    assert booked(effects) == {"flight": ["cancelled"] * 3 + ["standing"], "car": ["cancelled", "standing"],
                               "hotel": ["cancelled"] * 3 + ["standing"]}


def test_a_failed_compensation_is_not_rerun_when_the_retry_succeeds(flows: Any, effects: Effects, flags: Any,
                                                                   tmp_path: Path) -> None:
    _, mod = flows
    flags("cancel-fails-car")
    with pytest.raises(ValueError):
        run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)
    car = next(line[2] for line in effects.lines() if line[0] == "book" and line[2].startswith("car"))
    flags("pay-ok")
    result = run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)
    assert result["refs"][1] == car and effects.count("book") == 3 + 2  # the car was answered from the log
    assert statuses(state_of(tmp_path, "trip"))[1] == ("book car", "ok", None)


def test_retry_from_a_step_reruns_the_compensated_steps_too(flows: Any, effects: Effects, flags: Any,
                                                            tmp_path: Path) -> None:
    _, mod = flows
    with pytest.raises(ValueError):
        run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)
    flags("pay-ok")
    check_trip(retried(cli("retry", "trip", "--from-step", "pay", "--dir", str(tmp_path), "--json")), effects)
    assert effects.count("book") == 6 and effects.count("pay") == 2


def test_a_failed_child_is_retried_with_its_parent_and_books_again(flows: Any, effects: Effects, flags: Any,
                                                                  tmp_path: Path) -> None:
    _, mod = flows
    with pytest.raises(ValueError):
        run(mod.cs_child_trip, ITEMS, key="parent", dir=tmp_path)
    [child] = state_of(tmp_path, "parent").children
    assert statuses(state_of(tmp_path, child)) == FAILED_TRIP
    flags("pay-ok")
    check_trip(asyncio.run(engine_for(tmp_path).retry("parent")), effects)
    assert booked(effects) == {item: ["cancelled", "standing"] for item in ITEMS}


def test_a_loop_runs_its_compensated_iterations_again(flows: Any, effects: Effects, flags: Any,
                                                      tmp_path: Path) -> None:
    """The loop's snapshots say its bookings happened; their compensations undid them, so the retried loop
    starts over and books each again (a snapshot is no answer for an undone step)."""
    _, mod = flows
    with pytest.raises(ValueError):
        run(mod.cs_loop_trip, ITEMS, key="loop", dir=tmp_path, advisories="silent")
    assert booked(effects) == {item: ["cancelled"] for item in ITEMS}
    flags("pay-ok")
    check_trip(run(mod.cs_loop_trip, ITEMS, key="loop", dir=tmp_path, advisories="silent"), effects)
    assert booked(effects) == {item: ["cancelled", "standing"] for item in ITEMS}


# ---- SIGKILL between the compensations and the retry -----------------------------------------------------------

def start_trip(state_dir: Path, script: Path, key: str = "trip", workflow: str = "cs_trip") -> Any:
    return cli_process("run", str(script), "--workflow", workflow, "--input", json.dumps(ITEMS), "--key", key,
                       "--dir", str(state_dir))


def comps(state_dir: Path, key: str = "trip") -> list[str]:
    try:
        return [r["p"] for r in records(state_dir, key) if r["t"] == "comp"]
    except Exception:  # noqa: BLE001 - the run does not exist yet
        return []


def kill_while_compensating(state_dir: Path, script: Path, flags: Any, key: str = "trip",
                            workflow: str = "cs_trip") -> None:
    """Run the trip; SIGKILL it once the hotel and the car are cancelled, while the flight's cancel hangs."""
    flags("slow-cancel-flight")
    proc = start_trip(state_dir, script, key, workflow)
    wait_until(lambda: comps(state_dir, key) == ["2", "1"] or proc.poll() is not None)
    kill(proc)
    flags("slow-cancel-flight", False)
    assert comps(state_dir, key) == ["2", "1"]
    assert records(state_dir, key)[-1]["t"] == "comp"  # no end: the run was failing when it died


def test_sigkill_while_compensating_then_retry(flows: Any, effects: Effects, flags: Any, tmp_path: Path) -> None:
    """The hotel and car were cancelled, the flight never was: the retry books the hotel and car again and
    keeps the flight (its compensation never ran, so it still stands); nothing is cancelled twice."""
    script, _ = flows
    state_dir = tmp_path / "state"
    kill_while_compensating(state_dir, script, flags)
    assert state_of(state_dir, "trip").status == "interrupted"
    flags("pay-ok")
    check_trip(retried(cli("retry", "trip", "--dir", str(state_dir), "--json")), effects)
    assert booked(effects) == {"flight": ["standing"], "car": ["cancelled", "standing"],
                               "hotel": ["cancelled", "standing"]}
    print(f"retry after a SIGKILL mid-compensation: bookings {booked(effects)}")


def test_sigkill_while_compensating_then_resume_finishes_the_failure(flows: Any, effects: Effects, flags: Any,
                                                                     tmp_path: Path) -> None:
    """Running the same command again resumes the failure: the flight is cancelled, the run ends failed, and a
    retry after that books all three again."""
    script, _ = flows
    state_dir = tmp_path / "state"
    kill_while_compensating(state_dir, script, flags)
    resumed = start_trip(state_dir, script)
    _, err = resumed.communicate(timeout=60)
    assert resumed.returncode == 1 and "card declined" in err
    assert booked(effects) == {item: ["cancelled"] for item in ITEMS} and effects.count("cancel") == 3
    flags("pay-ok")
    check_trip(retried(cli("retry", "trip", "--dir", str(state_dir), "--json")), effects)
    assert booked(effects) == {item: ["cancelled", "standing"] for item in ITEMS}


def test_sigkill_while_a_child_compensates_then_retry_the_parent(flows: Any, effects: Effects, flags: Any,
                                                                 tmp_path: Path) -> None:
    """The child was killed half way through its compensations: retrying the parent retries the child the
    same way (its cancelled bookings are made again, its flight kept)."""
    script, _ = flows
    state_dir = tmp_path / "state"
    flags("slow-cancel-flight")
    proc = start_trip(state_dir, script, key="parent", workflow="cs_child_trip")

    def child_comps() -> list[str]:
        try:
            children = state_of(state_dir, "parent").children
        except Exception:  # noqa: BLE001 - the parent does not exist yet
            return []
        return comps(state_dir, children[0]) if children else []

    wait_until(lambda: child_comps() == ["2", "1"] or proc.poll() is not None)
    kill(proc)
    flags("slow-cancel-flight", False)
    flags("pay-ok")
    check_trip(retried(cli("retry", "parent", "--dir", str(state_dir), "--json")), effects)
    assert booked(effects) == {"flight": ["standing"], "car": ["cancelled", "standing"],
                               "hotel": ["cancelled", "standing"]}


def test_sigkill_of_a_worker_while_compensating(flows: Any, effects: Effects, flags: Any, tmp_path: Path) -> None:
    """A second worker takes the run over and finishes its failure; the retry then books everything again."""
    script, _ = flows
    state_dir = tmp_path / "state"
    flags("slow-cancel-flight")
    assert cli("enqueue", str(script), "--workflow", "cs_trip", "--input", json.dumps(ITEMS), "--key", "trip",
               "--dir", str(state_dir)).returncode == 0
    worker = cli_process("worker", "--import", str(script), "--dir", str(state_dir), "--poll", "0.02", "-q")
    wait_until(lambda: comps(state_dir) == ["2", "1"] or worker.poll() is not None)
    kill(worker)
    flags("slow-cancel-flight", False)
    state = serve(state_dir, script, "trip")
    assert state.status == "failed" and statuses(state) == FAILED_TRIP
    flags("pay-ok")
    check_trip(retried(cli("retry", "trip", "--dir", str(state_dir), "--json")), effects)
    assert booked(effects) == {item: ["cancelled", "standing"] for item in ITEMS}


def test_sigkill_during_the_retry(flows: Any, effects: Effects, flags: Any, tmp_path: Path) -> None:
    """Killed again once the retry booked the flight anew (while it books the car): the next run keeps that
    flight and books the car and hotel; every cancelled booking was booked again exactly once."""
    script, _ = flows
    state_dir = tmp_path / "state"
    first = start_trip(state_dir, script)
    first.communicate(timeout=60)
    assert first.returncode == 1
    flags("pay-ok")
    flags("slow-book-car")

    def flight_rebooked() -> bool:
        kinds = [(r["t"], r.get("l")) for r in records(state_dir, "trip")]
        return ("reopen", None) in kinds and ("ok", "book flight") in kinds[kinds.index(("reopen", None)):]

    retry = cli_process("retry", "trip", "--dir", str(state_dir))
    wait_until(lambda: flight_rebooked() or retry.poll() is not None)
    kill(retry)
    flags("slow-book-car", False)
    rest = start_trip(state_dir, script)
    out, err = rest.communicate(timeout=60)
    assert rest.returncode == 0, err
    check_trip(json.loads(out), effects)
    assert booked(effects) == {item: ["cancelled", "standing"] for item in ITEMS}


def test_a_failing_run_whose_replay_no_longer_fails_ends_failed(flows: Any, effects: Effects, flags: Any,
                                                                tmp_path: Path) -> None:
    """Killed while compensating a failure of its body; resumed with code whose body no longer fails, the run
    would return the refs of cancelled bookings. It ends failed instead (the flight's compensation runs as
    well), and a retry books everything again."""
    script, _ = flows
    state_dir = tmp_path / "state"
    flags("body-fails")
    kill_while_compensating(state_dir, script, flags, workflow="cs_body_decides")
    flags("body-fails", False)
    resumed = start_trip(state_dir, script, workflow="cs_body_decides")
    _, err = resumed.communicate(timeout=60)
    assert resumed.returncode == 1 and "PurityError" in err and "undid step(s)" in err, err
    state = state_of(state_dir, "trip")
    assert state.status == "failed" and state.error["type"] == f"{PurityError.__module__}:PurityError"
    assert booked(effects) == {item: ["cancelled"] for item in ITEMS}
    check_trip({"refs": retried(cli("retry", "trip", "--dir", str(state_dir), "--json"))}, effects)


def test_the_console_shows_compensated_steps(flows: Any, effects: Effects, flags: Any, tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from starlette.testclient import TestClient

    from durably_py import Engine, FileStorage
    from durably_py.ui import create_app

    _, mod = flows
    with pytest.raises(ValueError):
        run(mod.cs_trip, ITEMS, key="trip", dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client = TestClient(create_app(Engine(FileStorage(tmp_path))))
        shown = client.get("/api/runs/trip").json()
    assert [(s["label"], s["status"], s["compensation"]) for s in shown["steps"]] == FAILED_TRIP
