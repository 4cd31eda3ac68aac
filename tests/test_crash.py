"""Durability under real process death: children are SIGKILLed at random moments and the same command resumes."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from crashkit import Sandbox, chaos, sandbox

import durably_py

SEQ = {"n": 40, "pause": 0.005}
SEQ_RESULT = sum(i * i for i in range(40))
FAN = {"head": 6, "width": 4, "depth": 7, "tail": 6, "pause": 0.005}
FAN_STEPS = FAN["head"] + FAN["width"] * FAN["depth"] + FAN["tail"]
FAN_RESULT = {"head": list(range(6)), "branches": [sum(b * 100 + j for j in range(7)) for b in range(4)],
              "tail": [-i for i in range(6)]}


def check_chaos(box: Sandbox, report: Any, labels: list[str], result: Any, per_kill: int) -> None:
    """The invariants of a chaos run: correct result, every step ran, finished steps never re-ran, whole log."""
    assert report.outcome == {"ok": True, "result": result}
    effects = box.effects()
    counts = box.counts(effects)
    assert set(counts) == set(labels)
    assert all(counts[label] >= 1 for label in labels)
    for at, finished in report.kills:
        again = {e.label for e in effects[at:]} & finished
        assert not again, f"steps finished before a kill ran again: {sorted(again)}"
    duplicates = sum(n - 1 for n in counts.values())
    assert duplicates <= per_kill * len(report.kills), (duplicates, report.kills)
    data = box.log().read_bytes()
    assert data.endswith(b"\n")
    records = [json.loads(line) for line in data.split(b"\n")[:-1]]
    assert records[0]["t"] == "run"
    assert records[-1]["t"] == "end" and records[-1]["status"] == "completed"
    assert {r["l"] for r in records if r["t"] == "ok"} == set(labels)
    claims = [r for r in records if r["t"] == "claim"]
    assert [c["epoch"] for c in claims] == list(range(1, len(claims) + 1))


def seeds(count: int, default: int) -> list[Any]:
    """Seeds 0..count-1: the first `default` in the default suite, the rest under `-m slow`."""
    return [pytest.param(seed, marks=[pytest.mark.slow] if seed >= default else []) for seed in range(count)]


def seq_labels() -> list[str]:
    return [f"s{i}" for i in range(SEQ["n"])]


def fan_labels() -> list[str]:
    return ([f"h{i}" for i in range(FAN["head"])] + [f"t{i}" for i in range(FAN["tail"])]
            + [f"b{b}.{j}" for b in range(FAN["width"]) for j in range(FAN["depth"])])


@pytest.mark.parametrize("seed", seeds(15, default=5))
def test_random_kills_sequential(tmp_path: Path, seed: int) -> None:
    with sandbox(tmp_path) as box:
        report = chaos(box, "sequential", SEQ, SEQ["n"], seed, max_kills=3)
        check_chaos(box, report, seq_labels(), SEQ_RESULT, per_kill=1)


@pytest.mark.parametrize("seed", seeds(8, default=3))
def test_random_kills_parallel(tmp_path: Path, seed: int) -> None:
    with sandbox(tmp_path) as box:
        report = chaos(box, "fanout", FAN, FAN_STEPS, 1000 + seed, max_kills=3)
        check_chaos(box, report, fan_labels(), FAN_RESULT, per_kill=FAN["width"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(200))
def test_random_kills_soak(tmp_path: Path, seed: int) -> None:
    with sandbox(tmp_path / "seq") as box:
        report = chaos(box, "sequential", SEQ, SEQ["n"], 5000 + seed, max_kills=6)
        check_chaos(box, report, seq_labels(), SEQ_RESULT, per_kill=1)
    with sandbox(tmp_path / "fan") as box:
        report = chaos(box, "fanout", FAN, FAN_STEPS, 9000 + seed, max_kills=6)
        check_chaos(box, report, fan_labels(), FAN_RESULT, per_kill=FAN["width"])


@pytest.fixture
def box(tmp_path: Path) -> Any:
    with sandbox(tmp_path) as b:
        yield b


def test_kill_during_retry_backoff_resumes_at_next_attempt(box: Sandbox) -> None:
    proc = box.spawn("retrying")
    assert box.wait_for(proc, lambda: any(r["t"] == "fail" and r["a"] == 2 for r in box.records()))
    time.sleep(0.6)
    box.kill(proc)
    killed_at = time.time()
    fail = [r for r in box.records() if r["t"] == "fail"][-1]
    wake = datetime.fromisoformat(fail["next"]).timestamp()
    full_wait = 2.0
    assert wake - killed_at > 0.8

    code, outcome, err = box.finish(box.spawn("retrying"))
    assert code == 0, (outcome, err)
    assert outcome == {"ok": True, "result": 3}
    flaky = [e for e in box.effects() if e.label == "flaky"]
    assert [int(e.fields[0]) for e in flaky] == [1, 2, 3]
    resumed_pid = flaky[2].pid
    assert flaky[0].pid == flaky[1].pid != resumed_pid
    body = [e for e in box.effects() if e.label == "body" and e.pid == resumed_pid]
    waited = float(flaky[2].fields[1]) - float(body[0].fields[0])
    assert waited < full_wait - 0.5
    assert float(flaky[2].fields[1]) >= wake - 0.05
    ok = [r for r in box.records() if r["t"] == "ok"]
    assert len(ok) == 1 and ok[0]["a"] == 3
    assert (box.root / "effects.txt.count").read_text() == "3"


def test_kill_inside_stashing_step_resumes_from_stash(box: Sandbox) -> None:
    spec = {"n": 20, "pause": 0.01}

    def stash_reached() -> bool:
        return any(r["t"] == "stash" and r["v"]["i"] >= 5 for r in box.records())

    proc = box.spawn("stashing", spec)
    assert box.wait_for(proc, stash_reached)
    box.kill(proc)
    last = [r["v"] for r in box.records() if r["t"] == "stash"][-1]
    assert 5 <= last["i"] < 19

    code, outcome, err = box.finish(box.spawn("stashing", spec))
    assert code == 0, (outcome, err)
    assert outcome == {"ok": True, "result": {"sum": sum(i * i for i in range(20))}}
    effects = box.effects()
    resumes = [json.loads(e.fields[0]) for e in effects if e.label == "resume"]
    assert resumes == [None, last]
    counts = box.counts(effects)
    for i in range(20):
        assert counts[f"item{i}"] in ({1, 2} if i == last["i"] + 1 else {1}), i
    second = effects[[e.label for e in effects].index("resume", 1):]
    assert [e.label for e in second[1:]] == [f"item{i}" for i in range(last["i"] + 1, 20)]

    run_id = box.log().stem
    state = asyncio.run(durably_py.engine_for(box.dir).inspect(run_id))
    assert state.status == "completed"
    assert [(s.label, s.status, s.attempts, s.stashed) for s in state.steps] == [("crunch", "ok", 1, None)]


def test_kill_half_way_through_compensations(box: Sandbox) -> None:
    spec = {"n": 4}

    def two_undone() -> bool:
        undone = sum(1 for e in box.effects() if e.label.startswith("undo"))
        return undone >= 2 and sum(1 for r in box.records() if r["t"] == "comp") >= 2

    proc = box.spawn("saga", spec)
    assert box.wait_for(proc, two_undone)
    box.kill(proc)
    assert [r["p"] for r in box.records() if r["t"] == "comp"] == ["3", "2"]

    code, outcome, err = box.finish(box.spawn("saga", spec))
    assert code == 1, err
    assert outcome["type"] == "ValueError" and outcome["message"] == "card declined"
    effects = box.effects()
    assert [e.label for e in effects] == ["book0", "book1", "book2", "book3", "charge",
                                          "undo3", "undo2", "undo1", "undo0"]
    assert effects[5].pid == effects[6].pid != effects[7].pid == effects[8].pid
    records = box.records()
    assert [(r["p"], r["ok"]) for r in records if r["t"] == "comp"] == [("3", True), ("2", True), ("1", True),
                                                                         ("0", True)]
    assert records[-1]["t"] == "end" and records[-1]["status"] == "failed"
    assert records[-1]["error"]["message"] == "card declined"


def test_kill_inside_unsafe_step_raises_step_interrupted(box: Sandbox) -> None:
    proc = box.spawn("mailer")
    assert box.wait_for(proc, lambda: "send" in box.counts())
    box.kill(proc)
    assert [r["t"] for r in box.records() if r.get("p") == "1"] == ["start"]

    code, outcome, err = box.finish(box.spawn("mailer"))
    assert code == 0, (outcome, err)
    status = outcome["result"]["status"]
    assert status["reconciled"] is True
    assert status["path"] == [1] and status["label"] == "send"
    assert status["operation_id"] == f"{status['run_id']}/1"
    assert outcome["result"]["after"] == 2
    assert box.counts() == {"prepare": 1, "send": 1, "after": 1}
    err_rec = [r for r in box.records() if r.get("p") == "1" and r["t"] == "err"]
    assert err_rec and err_rec[0]["e"]["type"].endswith("StepInterruptedError")


def test_second_process_joins_a_live_run(box: Sandbox) -> None:
    spec = {"n": 5, "pause": 0.5}  # A outlives B's start-up even on a loaded machine
    a = box.spawn("slow", spec)
    assert box.wait_for(a, lambda: len(box.effects()) >= 1)
    b = box.spawn("slow", spec, announce=True)
    code_b, out_b, err_b = box.finish(b)
    code_a, out_a, err_a = box.finish(a)
    assert code_a == code_b == 0, (err_a, err_b)
    assert out_a == out_b == {"ok": True, "result": [0, 10, 20, 30, 40]}
    effects = box.effects()
    assert {e.pid for e in effects if e.label != "joining"} == {a.pid}
    assert box.counts() == {"joining": 1, **{f"w{i}": 1 for i in range(5)}}
    assert len(box.logs()) == 1


def test_waiting_process_takes_over_when_the_owner_is_killed(box: Sandbox) -> None:
    spec = {"n": 6, "pause": 0.25}
    a = box.spawn("slow", spec)
    assert box.wait_for(a, lambda: len(box.effects()) >= 1)
    b = box.spawn("slow", spec, announce=True)
    assert box.wait_for(b, lambda: "joining" in box.counts())
    assert box.wait_for(a, lambda: len([e for e in box.effects() if e.label != "joining"]) >= 3)
    time.sleep(0.05)
    assert b.poll() is None
    box.kill(a)
    finished_by_a = box.done_labels()
    assert len(finished_by_a) >= 2

    code, outcome, err = box.finish(b)
    assert code == 0, (outcome, err)
    assert outcome == {"ok": True, "result": [0, 10, 20, 30, 40, 50]}
    effects = [e for e in box.effects() if e.label != "joining"]
    by_b = {e.label for e in effects if e.pid == b.pid}
    assert by_b and not by_b & finished_by_a
    assert {e.label for e in effects} == {f"w{i}" for i in range(6)}
    assert sum(box.counts(effects).values()) <= 7
    claims = [r for r in box.records() if r["t"] == "claim"]
    assert len(claims) == 2
    records = box.records()
    assert records[-1]["status"] == "completed"


def interrupted_sequential(box: Sandbox, spec: dict[str, Any], after: int) -> set[str]:
    proc = box.spawn("sequential", spec)
    assert box.wait_for(proc, lambda: len(box.effects()) >= after)
    box.kill(proc)
    return box.done_labels()


def test_torn_tail_is_dropped_and_the_run_resumes(box: Sandbox) -> None:
    spec = {"n": 10, "pause": 0.05}
    finished = interrupted_sequential(box, spec, 4)
    log = box.log()
    with open(log, "ab") as f:
        f.write(b'{"t":"ok","p":"9","l":"s9","v":81,"a"')
    code, outcome, err = box.finish(box.spawn("sequential", spec))
    assert code == 0, (outcome, err)
    assert outcome == {"ok": True, "result": sum(i * i for i in range(10))}
    assert "torn" in err and log.name in err
    effects = box.effects()
    first_pid = effects[0].pid
    assert not {e.label for e in effects if e.pid != first_pid} & finished
    assert set(box.counts(effects)) == {f"s{i}" for i in range(10)}
    data = log.read_bytes()
    assert b'"a"{' not in data and data.endswith(b"\n")
    assert all(json.loads(line) for line in data.split(b"\n")[:-1])


def test_corrupt_middle_line_fails_without_touching_the_log(box: Sandbox) -> None:
    spec = {"n": 10, "pause": 0.05}
    interrupted_sequential(box, spec, 4)
    log = box.log()
    lines = log.read_bytes().split(b"\n")
    assert len(lines) >= 5
    lines[2] = b'{"t":"ok","p":' + b"\xff" * 5 + b"}"
    log.write_bytes(b"\n".join(lines))
    before = log.read_bytes()
    executed = len(box.effects())

    code, outcome, err = box.finish(box.spawn("sequential", spec))
    assert code != 0
    assert outcome["type"] == "CorruptLogError"
    assert str(log) in outcome["message"] and "line 3" in outcome["message"]
    assert outcome["details"]["line"] == 3 and outcome["details"]["path"] == str(log)
    assert log.read_bytes() == before
    assert len(box.effects()) == executed
