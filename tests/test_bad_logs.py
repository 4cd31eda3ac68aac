"""Every kind of damaged log is a clear `CorruptLogError` / `LogVersionError`: nothing runs, nothing is written,
no compensation runs, the run is not marked failed, and the other runs are still listed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import durably

from durably_py import CorruptLogError, FileStorage, create_engine, workflow
from durably_py.errors import LogVersionError, ValidationError

CALLS: list[str] = []


def work(name: str) -> str:
    CALLS.append(name)
    return name


def undo(value: str) -> None:
    CALLS.append(f"undo {value}")


@workflow
async def saga(ctx: Any, n: int) -> list[str]:
    first = await ctx.step(work, "a", compensate=undo)
    second = await ctx.step(work, "b", compensate=undo)
    return [first, second]


@workflow
async def other_saga(ctx: Any, n: int) -> str:
    return await ctx.step(work, "other")


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def write_lines(path: Path, records: list[Any], tail: bytes = b"") -> None:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records) + tail)


def interrupted_log(path: Path) -> list[dict[str, Any]]:
    """The records of `path` cut after the first step's ok record: a run interrupted before step b."""
    records = lines_of(path)
    first_ok = next(i for i, r in enumerate(records) if r["t"] == "ok")
    return records[: first_ok + 1]


def damage(case: str, records: list[dict[str, Any]]) -> tuple[list[Any], bytes, int | None, str | None]:
    """(records, tail, line, field) of a log damaged as `case` says, from a good interrupted log."""
    header, *rest = records
    ok_line = len(records)  # the first step's ok record is the last line
    if case == "empty":
        return [], b"", 1, None
    if case == "cut header":
        return [], json.dumps(header).encode()[:25], 1, None
    if case == "header without run id":
        return [{k: v for k, v in header.items() if k != "run_id"}, *rest], b"", 1, "run_id"
    if case == "future version":
        return [{**header, "v": 99}, *rest], b"", 1, "v"
    if case == "missing field":
        bad = {k: v for k, v in rest[-1].items() if k != "p"}
        return [header, *rest[:-1], bad], b"", ok_line, "p"
    if case == "wrong type":
        return [header, *rest[:-1], {**rest[-1], "a": "one"}], b"", ok_line, "a"
    if case == "unknown kind":
        return [header, *rest[:-1], {"t": "bogus", "p": "9"}, rest[-1]], b"", ok_line, "t"
    if case == "not a header first":
        return [*rest, header], b"", 1, "t"
    raise AssertionError(case)


CASES = ["empty", "cut header", "header without run id", "future version", "missing field", "wrong type",
         "unknown kind", "not a header first"]


@pytest.fixture
def state(tmp_path: Path) -> tuple[Any, Path, Path]:
    """An engine whose dir holds a completed neighbour run and a saga run (key "victim") with its log path."""
    CALLS.clear()
    engine = create_engine(FileStorage(tmp_path / "state"))
    asyncio.run(engine.run(other_saga, 1, key="neighbour"))
    asyncio.run(engine.run(saga, 1, key="victim"))
    runs = tmp_path / "state" / "runs"
    victim = next(p for p in runs.glob("*.jsonl") if lines_of(p)[0]["key"] == "victim")
    CALLS.clear()
    return engine, victim, runs


@pytest.mark.parametrize("case", CASES)
def test_bad_log_is_a_clear_error_through_the_api(state: tuple[Any, Path, Path], case: str) -> None:
    engine, victim, _ = state
    records, tail, line, field = damage(case, interrupted_log(victim))
    write_lines(victim, records, tail)
    before = victim.read_bytes()
    run_id = victim.name[:-6]

    with pytest.raises(CorruptLogError) as raised:
        asyncio.run(engine.inspect(run_id))
    error = raised.value
    assert str(victim) in error.message and f"line {line}" in error.message
    assert error.line == line and error.field == field and error.hint
    assert isinstance(error, LogVersionError) == (case == "future version")

    with pytest.raises(CorruptLogError):  # resuming: nothing runs, nothing is written, nothing compensated
        asyncio.run(engine.run(saga, 1, key="victim"))
    assert CALLS == []
    assert victim.read_bytes() == before

    listed = {s.run_id: s for s in asyncio.run(engine.list())}
    assert len(listed) == 2
    neighbour = next(s for s in listed.values() if s.run_id != run_id)
    assert neighbour.status == "completed" and neighbour.workflow == "other_saga"
    if case in ("missing field", "wrong type", "unknown kind"):
        return  # `list` reads a log's first and last records only; this damage sits in between
    flagged = listed[run_id]
    assert flagged.status == "corrupt" and flagged.error is not None and flagged.warnings
    assert [s.run_id for s in asyncio.run(engine.list(status="corrupt"))] == [run_id]


def test_a_damaged_last_record_is_flagged_by_list(state: tuple[Any, Path, Path]) -> None:
    engine, victim, _ = state
    records = interrupted_log(victim)
    write_lines(victim, [*records, {"t": "end", "status": 3}])
    run_id = victim.name[:-6]
    flagged = {s.run_id: s for s in asyncio.run(engine.list())}[run_id]
    assert flagged.status == "corrupt" and "line" in flagged.warnings[0]


def test_header_only_log_is_a_run_that_never_started(state: tuple[Any, Path, Path]) -> None:
    """A log holding only its header (created, never claimed) is valid: it runs from the start."""
    engine, victim, _ = state
    write_lines(victim, interrupted_log(victim)[:1])
    run_id = victim.name[:-6]
    assert asyncio.run(engine.inspect(run_id)).status == "pending"
    assert asyncio.run(engine.run(saga, 1, key="victim")) == ["a", "b"]
    assert CALLS == ["a", "b"]


def test_resuming_with_another_workflow_is_refused_before_writing(state: tuple[Any, Path, Path]) -> None:
    engine, victim, _ = state
    write_lines(victim, interrupted_log(victim))
    before = victim.read_bytes()
    with pytest.raises(ValidationError, match="belongs to workflow 'saga', not 'other_saga'") as raised:
        asyncio.run(engine.run(other_saga, 1, key="victim"))
    assert raised.value.hint and "durably retry" in raised.value.hint
    assert CALLS == [] and victim.read_bytes() == before
    assert asyncio.run(engine.run(saga, 1, key="victim")) == ["a", "b"]
    assert CALLS == ["b"]


def test_record_validation_names_the_field_of_a_mistyped_record() -> None:
    from durably_py import records

    with pytest.raises(CorruptLogError) as raised:
        records.load([{"t": "run", "v": 1, "run_id": "r", "workflow": "w"}, {"t": "fail", "p": "0", "l": "x",
                                                                            "a": 1, "e": {}, "next": 5}], "log.jsonl")
    assert raised.value.line == 2 and raised.value.field == "next"
    assert "log.jsonl, line 2" in raised.value.message


def test_older_log_versions_are_migrated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The migration path: a version-0 log is migrated record by record before it is validated."""
    from durably_py import records

    def rename_path(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "v": 1} if r["t"] == "run" else {("p" if k == "path" else k): v for k, v in r.items()}
                for r in raw]

    monkeypatch.setitem(records.MIGRATIONS, 0, rename_path)
    old = [{"t": "run", "v": 0, "run_id": "r", "workflow": "w"},
           {"t": "ok", "path": "0", "l": "step", "v": 3, "a": 1}]
    header, ok = records.load(old, "old.jsonl")
    assert isinstance(header, records.Header) and header.v == 1
    assert isinstance(ok, records.Ok) and ok.path == "0" and ok.value == 3
    with pytest.raises(CorruptLogError, match="does not exist"):
        records.load([{"t": "run", "v": -1, "run_id": "r", "workflow": "w"}], "old.jsonl")


# ---- through the CLI, in real processes ----------------------------------------------------------------------
SCRIPT = """
import sys
from pathlib import Path
from durably_py import run, workflow

MARK = Path(sys.argv[1])

def work(name):
    with MARK.open("a") as f:
        f.write(name + "\\n")
    return name

def undo(value):
    with MARK.open("a") as f:
        f.write("undo " + value + "\\n")

@workflow
async def cli_saga(ctx, n):
    await ctx.step(work, "a", compensate=undo)
    return await ctx.step(work, "b", compensate=undo)

if __name__ == "__main__":
    print(run(cli_saga, 1, key=sys.argv[2]))
"""




@pytest.mark.parametrize("case", ["empty", "cut header", "header without run id", "future version",
                                  "missing field", "unknown kind"])
def test_bad_log_through_the_cli(tmp_path: Path, case: str) -> None:
    script = tmp_path / "saga.py"
    script.write_text(textwrap.dedent(SCRIPT))
    mark = tmp_path / "mark.txt"
    state = tmp_path / "state"
    assert durably("run", str(script), str(mark), "victim", "--dir", str(state), cwd=tmp_path).returncode == 0
    assert durably("run", str(script), str(mark) + ".2", "neighbour", "--dir", str(state), cwd=tmp_path).returncode == 0
    logs = sorted((state / "runs").glob("*.jsonl"), key=lambda p: lines_of(p)[0]["key"])
    assert len(logs) == 2
    neighbour, victim = logs
    records, tail, line, field = damage(case, interrupted_log(victim))
    write_lines(victim, records, tail)
    before, marks = victim.read_bytes(), mark.read_text()
    run_id = victim.name[:-6]

    inspected = durably("inspect", run_id, "--dir", str(state), cwd=tmp_path)
    assert inspected.returncode == 1
    assert "Traceback" not in inspected.stderr
    assert str(victim) in inspected.stderr and f"line {line}" in inspected.stderr and "hint:" in inspected.stderr

    listed = durably("list", "--dir", str(state), "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    states = {s["run_id"]: s for s in json.loads(listed.stdout)}
    assert states[neighbour.name[:-6]]["status"] == "completed"
    if case not in ("missing field", "unknown kind"):
        assert states[run_id]["status"] == "corrupt"
    table = durably("list", "--dir", str(state), cwd=tmp_path)
    assert table.returncode == 0 and neighbour.name[:-6] in table.stdout

    resumed = durably("run", str(script), str(mark), "victim", "--dir", str(state), cwd=tmp_path)
    assert resumed.returncode != 0 and "Traceback" not in resumed.stderr
    assert "CorruptLogError" in resumed.stderr or "LogVersionError" in resumed.stderr
    assert victim.read_bytes() == before and mark.read_text() == marks


# ---- a log never decides what code is imported ---------------------------------------------------------------
PLANTED = """
from pathlib import Path
Path(__file__).with_name("planted-was-imported").write_text("yes")

class Boom(Exception):
    pass
"""


def plant(tmp_path: Path, name: str) -> Path:
    """A module on sys.path whose import leaves a marker file; returns the marker path."""
    folder = tmp_path / "planted"
    folder.mkdir()
    (folder / f"{name}.py").write_text(PLANTED)
    return folder / "planted-was-imported"


def with_recorded_error(victim: Path, type_name: str) -> None:
    """Rewrite the victim's log so its first step failed for good with an error of class `type_name`."""
    header, *rest = interrupted_log(victim)
    ok = rest[-1]
    err = {"t": "err", "p": ok["p"], "l": ok["l"], "a": 1, "ts": ok["ts"],
           "e": {"type": type_name, "message": "planted", "traceback": "", "attrs": {}, "args": ["planted"]}}
    write_lines(victim, [header, *rest[:-1], err])


def test_a_recorded_error_never_imports_its_module(state: tuple[Any, Path, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from durably_py.errors import StepFailedError

    engine, victim, _ = state
    marker = plant(tmp_path, "durably_planted_api")
    monkeypatch.syspath_prepend(str(marker.parent))
    with_recorded_error(victim, "durably_planted_api:Boom")
    run_id = victim.name[:-6]

    assert asyncio.run(engine.inspect(run_id)).steps[0].error["type"] == "durably_planted_api:Boom"
    assert any(s.run_id == run_id for s in asyncio.run(engine.list()))
    with pytest.raises(StepFailedError) as raised:  # the replayed failure, not the planted class
        asyncio.run(engine.run(saga, 1, key="victim"))
    assert raised.value.type_name == "durably_planted_api:Boom"
    assert not marker.exists() and "durably_planted_api" not in sys.modules
    assert CALLS == []


def test_a_recorded_error_of_an_imported_module_is_rebuilt(state: tuple[Any, Path, Path]) -> None:
    engine, victim, _ = state
    with_recorded_error(victim, "builtins:KeyError")
    with pytest.raises(KeyError):
        asyncio.run(engine.run(saga, 1, key="victim"))


def test_cli_never_imports_a_module_a_log_names(tmp_path: Path) -> None:
    script = tmp_path / "saga.py"
    script.write_text(textwrap.dedent(SCRIPT))
    state = tmp_path / "state"
    assert durably("run", str(script), str(tmp_path / "mark.txt"), "victim", "--dir", str(state), cwd=tmp_path).returncode == 0
    (victim,) = (state / "runs").glob("*.jsonl")
    marker = plant(tmp_path, "durably_planted_cli")
    with_recorded_error(victim, "durably_planted_cli:Boom")
    run_id = victim.name[:-6]
    env_path = str(marker.parent)

    def cli_planted(*args: str) -> subprocess.CompletedProcess[str]:
        return durably(*args, "--dir", str(state), cwd=tmp_path, PYTHONPATH=os.pathsep.join([env_path, *sys.path]))

    assert cli_planted("inspect", run_id).returncode == 0
    assert cli_planted("list").returncode == 0
    resumed = cli_planted("run", str(script), str(tmp_path / "mark.txt"), "victim")
    assert resumed.returncode == 1 and "durably_planted_cli:Boom" in resumed.stderr
    assert not marker.exists()
