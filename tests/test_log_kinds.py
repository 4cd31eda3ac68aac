"""`durably logs` and `durably inspect` read every record kind: a store holding each kind `records.py` defines
(made by real commands, see log_kinds.py) prints a line per record, in text, one JSON document, JSON lines and
--follow, and inspect shows what each kind adds to a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import durably
from log_kinds import make_every_kind

from durably_py import records
from durably_py._view.logtext import LINES

EXPECTED = {  # what the line of each kind says
    "run": "of everything created  input 1",
    "claim": "attempt 1 started by pid ",
    "code": "the workflow's code changed (fingerprint ",
    "budget": "budget set to $10",
    "reopen": "run reopened: its failed and compensated steps run again",
    "reset": "retry from a step: (5,), (6,) run again",
    "pause": "paused",
    "resume": "resumed",
    "cancel": "cancelled: the workflow cleans up until ",
    "stale": "stale: run renamed-",
    "end": "run completed  → 5",
    "ok": "(1,) once  ok",
    "err": "(1,) explode  attempt 1 failed: RuntimeError: no seats",
    "fail": "(0,) stashy  attempt 1 failed: ConnectionError: first try fails  retry at ",
    "start": "(1,) once  attempt 1 started (replay=manual, input [])",
    "resolve": "(0,) charge  resolved by an operator: attempt 1 happened  → \"charged by hand\"",
    "stash": '(0,)  stashed {"done": 1}',
    "wake": "(5,) ctx.sleep  sleeping until ",
    "wait": "(6,) ctx.wait_for  waiting for signal 'go' (no deadline)",
    "awk": "(0,) ctx.awakeable  awakeable 'approval' callback-",
    "park": "parked until 1 child run (napkid-",
    "graph": "(3,) ctx.graph  task graph of 2 tasks: a, b",
    "snap": "(4,) ctx.loop  loop snapshot after iteration 1  state 2",
    "charge": "(2,)  charged $0.25, 10 tokens  (between steps)",
    "comp": "(0,)  compensated",
    "patch": "ctx.patched('v2') takes the new code for good",
    "adopt": "(0,)  adopted: the step now called 'second' here is the recorded 'first'",
    "adv": "advisory [INFO] WAITFOR_NO_TIMEOUT: ",
    "note": 'annotated stage="charged"',
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    project = tmp_path_factory.mktemp("kinds")
    return project, make_every_kind(project)


def lines_of(project: Path, run_id: str, *options: str) -> list[dict]:
    done = durably("logs", run_id, *options, cwd=project)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_every_record_kind_has_a_line() -> None:
    assert set(LINES) == set(records.KINDS) == set(EXPECTED)


def test_logs_prints_every_kind_in_text_json_and_json_lines(store: tuple[Path, dict[str, str]]) -> None:
    project, runs = store
    seen: set[str] = set()
    said: set[str] = set()
    for run_id in durably("list", "-q", cwd=project).stdout.split():
        recs = lines_of(project, run_id, "-o", "jsonl")
        seen |= {rec["t"] for rec in recs}
        if run_id not in runs.values():
            continue
        document = durably("logs", run_id, "--json", cwd=project)
        assert document.returncode == 0 and json.loads(document.stdout) == recs  # one JSON document
        text = durably("logs", run_id, "--follow", cwd=project, COLUMNS="250")  # a parked run: it stops
        assert text.returncode == 0, text.stderr
        assert len(text.stdout.splitlines()) == len(recs) and "Traceback" not in text.stderr
        for rec, line in zip(recs, text.stdout.splitlines(), strict=True):
            if EXPECTED[rec["t"]] in line:
                said.add(rec["t"])
    assert seen == set(records.KINDS), set(records.KINDS) - seen
    assert said == set(EXPECTED), set(EXPECTED) - said


def test_inspect_shows_what_each_kind_adds(store: tuple[Path, dict[str, str]]) -> None:
    project, runs = store
    for run_id in runs.values():
        assert json.loads(durably("inspect", run_id, "--json", cwd=project).stdout)["run_id"] == run_id
    everything = durably("inspect", runs["everything"], cwd=project, COLUMNS="250").stdout
    for needle in ("budget    $0.25 of $10", "· stage   'charged'", "patches   v2: the new code",
                   "[INFO] WAITFOR_NO_TIMEOUT", "(0,) stashy  ok  2 attempts",
                   "attempt 1 failed after", "(4,) ctx.loop  ok", "iteration 1", "(6,) ctx.wait_for  waiting  → waiting for signal"):
        assert needle in everything, (needle, everything)
    saga = durably("inspect", runs["saga"], cwd=project, COLUMNS="250").stdout
    assert "(0,) book  compensated" in saga and "compensated" in saga and "RuntimeError: no seats" in saga
    parent = durably("inspect", runs["parent"], cwd=project, COLUMNS="250").stdout
    assert "completed" in parent and "(1,) ctx.join  ok" in parent
    effect = durably("inspect", runs["effect"], cwd=project, COLUMNS="250").stdout
    assert "completed" in effect and "(0,) charge  ok" in effect and "charged by hand" in effect
    renamed = durably("inspect", runs["renamed"], cwd=project, COLUMNS="250").stdout
    assert "(0,) first  ok" in renamed and "waiting for signal 'later'" in renamed
