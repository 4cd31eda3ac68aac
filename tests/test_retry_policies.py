"""Retry semantics in every mode: errors that give up at once (`NonRetryableError`, `Retry(give_up_on=)`),
unlimited attempts, constant backoff, and a deadline for all attempts that holds across a SIGKILL."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from modes import Effects, cli_process, effects_fixture, flows_fixture, in_worker, kill, records, state_of, wait_until

from durably_py import NonRetryableError, Retry, ValidationError, create_engine, run
from durably_py._codec import from_iso
from durably_py.testing import TestEngine

FLOWS = '''
from durably_py import NonRetryableError, Retry, attempt, workflow


class Declined(NonRetryableError):
    """A card the gateway refused: retrying cannot help."""


def charge(card):
    mark("charge")
    raise Declined(f"card {card} declined", card=card)


def upload(name):
    mark("upload")
    raise PermissionError(f"{name}: forbidden")


def flaky(fails):
    mark("flaky", attempt().number)
    if attempt().number <= fails:
        raise ConnectionError(f"try {attempt().number}")
    return attempt().number


def down():
    mark("down")
    raise ConnectionError("still down")


@workflow
async def rp_declined(ctx, card):
    try:
        await ctx.step(charge, card, retry=Retry(5, backoff="none"))
    except Declined as exc:
        return {"declined": exc.card, "type": type(exc).__name__}


@workflow
async def rp_forbidden(ctx, name):
    try:
        await ctx.step(upload, name, retry=Retry(5, backoff="none", give_up_on=PermissionError))
    except PermissionError as exc:
        return str(exc)


@workflow
async def rp_forever(ctx, spec):
    return await ctx.step(flaky, spec["fails"], retry=Retry(None, backoff="constant", base=spec["base"]))


@workflow
async def rp_deadline(ctx, spec):
    policy = Retry(None, backoff="constant", base=spec["base"], deadline=spec["deadline"])
    try:
        await ctx.step(down, retry=policy)
    except ConnectionError as exc:
        notes = getattr(exc, "__notes__", [])
        return {"gave_up": str(exc), "noted": any(f"Retry(deadline={spec['deadline']:g})" in n for n in notes)}
'''


flows = flows_fixture("retry_flows", FLOWS)
effects = effects_fixture()


def steps(state: Any) -> list[tuple[str, str, int]]:
    return [(s.label, s.status, s.attempts) for s in state.steps]


# ---- the policy object ------------------------------------------------------------------------------------

def test_retry_keeps_its_spelling_and_checks_the_new_options() -> None:
    assert Retry(3, "linear", 1, 10, True) == Retry(attempts=3, backoff="linear", base=1, max=10, jitter=True)
    assert Retry(give_up_on=KeyError).give_up_on == (KeyError,)
    assert Retry(give_up_on=(KeyError, OSError)).give_up_on == (KeyError, OSError)
    assert hash(Retry(None, give_up_on=KeyError, deadline=5)) == hash(Retry(None, give_up_on=(KeyError,), deadline=5))
    assert [Retry(backoff="constant", base=2, max=3).delay(n) for n in (1, 2, 5)] == [2, 2, 2]
    assert Retry(None).delay(5000) == 60  # unlimited attempts: the exponential wait stays capped, never overflows
    for bad, match in [({"attempts": 0}, "attempts must be an int >= 1"), ({"give_up_on": "KeyError"}, "exception"),
                       ({"give_up_on": (KeyError, 3)}, "exception classes"), ({"deadline": 0}, "deadline"),
                       ({"deadline": -1}, "deadline"), ({"backoff": "fixed"}, "'constant'")]:
        with pytest.raises(ValidationError, match=match) as err:
            Retry(**bad)
        assert err.value.hint and err.value.docs


def test_a_failed_attempt_record_written_before_deadlines_existed_still_loads() -> None:
    from durably_py import records as log

    old = {"t": "fail", "p": "0", "l": "s", "a": 1, "e": {"type": "builtins:OSError", "message": "x"},
           "next": "2026-01-01T00:00:01Z", "ms": 2.0, "ts": 1.0}
    loaded = log.load_one(old)
    assert isinstance(loaded, log.Fail) and loaded.first is None
    assert b'"first"' not in log.encode(loaded)


# ---- giving up at once --------------------------------------------------------------------------------------

def test_non_retryable_error_fails_the_step_at_once_in_process(flows: Any, effects: Effects, tmp_path: Path) -> None:
    _, mod = flows
    assert run(mod.rp_declined, "4242", dir=tmp_path / "a") == {"declined": "4242", "type": "Declined"}
    assert effects.count("charge") == 1
    engine = create_engine(tmp_path / "b")
    assert asyncio.run(engine.run(mod.rp_declined, "1111", wait=False)) == {"declined": "1111", "type": "Declined"}
    assert effects.count("charge") == 2
    state = state_of(tmp_path / "b", asyncio.run(engine.list())[0].run_id)
    assert steps(state) == [("charge", "failed", 1)]
    assert state.steps[0].error["type"].endswith(":Declined")


def test_give_up_on_fails_the_step_at_once_and_other_errors_still_retry(flows: Any, effects: Effects,
                                                                        tmp_path: Path) -> None:
    _, mod = flows
    assert run(mod.rp_forbidden, "report.csv", dir=tmp_path) == "report.csv: forbidden"
    assert effects.count("upload") == 1
    assert run(mod.rp_forever, {"fails": 2, "base": 0}, dir=tmp_path) == 3  # ConnectionError is not given up on
    assert effects.count("flaky") == 3


def test_giving_up_under_test_engine(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        done = engine.sync.run(mod.rp_declined, "9")
        assert done.status == "completed" and done.result == {"declined": "9", "type": "Declined"}
        assert done.step("charge").executions == 1 and done.step("charge").attempts == 1
        assert isinstance(done.step("charge").error, NonRetryableError)
        forbidden = engine.sync.run(mod.rp_forbidden, "x")
        assert forbidden.result == "x: forbidden" and forbidden.step("upload").executions == 1


def test_giving_up_in_a_worker_process(flows: Any, effects: Effects, tmp_path: Path) -> None:
    script, _ = flows
    state = in_worker(tmp_path / "state", script, "rp_declined", "77", key="declined-77")
    assert state.status == "completed" and state.result == {"declined": "77", "type": "Declined"}
    assert steps(state) == [("charge", "failed", 1)]
    state = in_worker(tmp_path / "state", script, "rp_forbidden", "f", key="forbidden-f")
    assert state.result == "f: forbidden" and steps(state) == [("upload", "failed", 1)]
    assert effects.count("charge") == 1 and effects.count("upload") == 1


# ---- unlimited attempts, constant backoff ---------------------------------------------------------------------

def test_unlimited_attempts_with_a_constant_backoff_under_test_engine(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        start = engine.clock.now()
        done = engine.sync.run(mod.rp_forever, {"fails": 40, "base": 30}, advisories="silent")
        assert done.status == "completed" and done.result == 41
        assert done.step("flaky").executions == 41 and done.step("flaky").attempts == 41
        waits = [from_iso(r["next"]) for r in asyncio.run(engine.engine.records(done.run_id)) if r["t"] == "fail"]
        assert waits == [start + timedelta(seconds=30 * n) for n in range(1, 41)]  # 30 s after each failure


def test_unlimited_attempts_in_each_mode(flows: Any, effects: Effects, tmp_path: Path) -> None:
    script, mod = flows
    assert run(mod.rp_forever, {"fails": 12, "base": 0.001}, dir=tmp_path / "run", advisories="silent") == 13
    engine = create_engine(tmp_path / "nowait")
    assert asyncio.run(engine.run(mod.rp_forever, {"fails": 7, "base": 0.001}, wait=False, advisories="silent")) == 8
    state = in_worker(tmp_path / "worker", script, "rp_forever", {"fails": 9, "base": 0.001}, key="forever")
    assert state.result == 10 and steps(state) == [("flaky", "ok", 10)]
    assert effects.count("flaky") == 13 + 8 + 10


# ---- a deadline for all attempts ------------------------------------------------------------------------------

def test_deadline_bounds_every_attempt_under_test_engine(flows: Any, effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        done = engine.sync.run(mod.rp_deadline, {"base": 60, "deadline": 310}, advisories="silent")
        # attempts start at 0, 60, ... 300 s; the next would start at 360 s, past the deadline
        assert done.status == "completed" and done.step("down").attempts == 6
        assert done.result == {"gave_up": "still down", "noted": True}
        fails = [r for r in asyncio.run(engine.engine.records(done.run_id)) if r["t"] == "fail"]
        assert len({r["first"] for r in fails}) == 1 and len(fails) == 5


def test_deadline_in_each_mode(flows: Any, effects: Effects, tmp_path: Path) -> None:
    """Attempts 50 ms apart within 0.4 s: more than one, at most nine, in every mode."""
    script, mod = flows
    spec = {"base": 0.05, "deadline": 0.4}
    counts = []
    assert run(mod.rp_deadline, spec, dir=tmp_path / "run", advisories="silent") == {"gave_up": "still down",
                                                                                    "noted": True}
    counts.append(effects.count("down"))
    engine = create_engine(tmp_path / "nowait")
    assert asyncio.run(engine.run(mod.rp_deadline, spec, wait=False, advisories="silent"))["noted"] is True
    counts.append(effects.count("down") - sum(counts))
    state = in_worker(tmp_path / "worker", script, "rp_deadline", spec, key="deadline")
    assert state.result == {"gave_up": "still down", "noted": True}
    counts.append(effects.count("down") - sum(counts))
    assert counts[-1] == state.steps[0].attempts
    assert all(1 < n <= 9 for n in counts), counts


def test_deadline_is_measured_from_the_first_recorded_attempt_across_a_sigkill(flows: Any, effects: Effects,
                                                                               tmp_path: Path) -> None:
    """Attempts start at 0, 1.5, 3 s; the process is killed in the backoff after the second and the run is
    resumed once the 4 s deadline has passed: its third attempt (due at 3 s) runs at once and is the last.
    Measured from the resumed process's first attempt instead, the run would go on for four more."""
    script, _ = flows
    state_dir = tmp_path / "state"
    args = ("run", str(script), "--workflow", "rp_deadline", "--input", json.dumps({"base": 1.5, "deadline": 4}),
            "--key", "dl", "--dir", str(state_dir))
    first = cli_process(*args)
    wait_until(lambda: sum(1 for r in _records(state_dir) if r["t"] == "fail") >= 2, 30)
    kill(first)
    fails = [r for r in _records(state_dir) if r["t"] == "fail"]
    assert len(fails) == 2 and fails[0]["first"] == fails[1]["first"]
    began = from_iso(fails[0]["first"])
    time.sleep(max(0.0, 4.3 - (time.time() - began.timestamp())))
    second = cli_process(*args)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert json.loads(out) == {"gave_up": "still down", "noted": True}
    assert effects.count("down") == 3
    state = state_of(state_dir, "dl")
    assert steps(state) == [("down", "failed", 3)]
    print(f"deadline across a SIGKILL: 3 attempts, the last {time.time() - began.timestamp():.1f} s after the first")


def _records(state_dir: Path) -> list[dict[str, Any]]:
    try:
        return records(state_dir, "dl")
    except Exception:  # noqa: BLE001 - the run does not exist yet
        return []
