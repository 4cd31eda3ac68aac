"""Forks: a new run from a recorded step of another run (`engine.fork`, `durably fork`), its output optionally
replaced; the original untouched, the lineage shown both ways."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import check_error, durably, go, storage_of, wait_until

from durably_py import Engine, RunNotFoundError, ValidationError, workflow
from durably_py.testing import TestEngine

CALLS: Counter[str] = Counter()
MODEL = {"answer": "approve"}
BROKEN = {"deny": False}


def fetch(doc_id: int) -> dict[str, Any]:
    CALLS["fetch"] += 1
    return {"id": doc_id}


def model(doc: dict[str, Any]) -> str:
    CALLS["model"] += 1
    return MODEL["answer"]


def approve(doc: dict[str, Any]) -> str:
    CALLS["approve"] += 1
    return f"approved {doc['id']}"


def deny(doc: dict[str, Any]) -> str:
    CALLS["deny"] += 1
    if BROKEN["deny"]:
        raise RuntimeError("the deny service is down")
    return f"denied {doc['id']}"


def notify(outcome: str) -> str:
    CALLS["notify"] += 1
    return f"told: {outcome}"


@workflow(name="fork_review")
async def review(ctx: Any, doc_id: int) -> dict[str, Any]:
    doc = await ctx.step(fetch, doc_id, name="fetch")
    answer = await ctx.step(model, doc, name="model")
    if answer == "approve":
        outcome = await ctx.step(approve, doc, name="approve")
    else:
        outcome = await ctx.step(deny, doc, name="deny")
    told = await ctx.step(notify, outcome, name="notify")
    return {"answer": answer, "outcome": outcome, "told": told}


@pytest.fixture(autouse=True)
def fresh_calls() -> None:
    CALLS.clear()
    MODEL["answer"] = "approve"
    BROKEN["deny"] = False
    RETRIED.clear()
    FLAKY["broken"] = True


def _engine(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Engine:
    return Engine(storage_of(kind, tmp_path, request))


def _run(engine: Engine, doc_id: int = 7) -> str:
    started: list[str] = []
    go(lambda: engine.run(review, doc_id, on_run=started.append))
    return started[0]


def _fork(engine: Engine, run: str, **options: Any) -> tuple[str, Any]:
    forks: list[str] = []
    value = go(lambda: engine.fork(run, on_run=forks.append, **options))
    return forks[0], value


def _records(engine: Engine, run_id: str) -> list[dict[str, Any]]:
    return go(lambda: engine.records(run_id))


# ---- the proof: an edited output takes the other branch -----------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "sqlite", "memory", "postgres"])
def test_a_fork_with_an_edited_output_takes_the_other_branch(kind: str, tmp_path: Path,
                                                             request: pytest.FixtureRequest) -> None:
    engine = _engine(kind, tmp_path, request)
    original = _run(engine)
    assert CALLS == {"fetch": 1, "model": 1, "approve": 1, "notify": 1}
    before = _records(engine, original)
    log = tmp_path / "state" / "runs" / f"{original}.jsonl"
    raw = log.read_bytes() if kind == "file" else b""

    fork_id, value = _fork(engine, original, from_step="model", set_output="deny")

    assert value == {"answer": "deny", "outcome": "denied 7", "told": "told: denied 7"}
    # fetch and model replayed from the copied history (model's output was set, so it never ran); deny and
    # notify ran live
    assert CALLS == {"fetch": 1, "model": 1, "approve": 1, "deny": 1, "notify": 2}
    assert fork_id != original
    assert _records(engine, original) == before
    if kind == "file":
        assert log.read_bytes() == raw
    fork = go(lambda: engine.inspect(fork_id))
    assert fork.status == "completed" and fork.workflow == "fork_review" and fork.input == 7
    assert fork.forked_from == {"run": original, "path": [1], "label": "model", "edited": True}
    assert fork.key == f"fork:{original}:1"
    assert [(s.path, s.label, s.output) for s in fork.steps] == [
        ((0,), "fetch", {"id": 7}), ((1,), "model", "deny"), ((2,), "deny", "denied 7"),
        ((3,), "notify", "told: denied 7")]
    origin = go(lambda: engine.inspect(original))
    assert origin.status == "completed" and origin.result["answer"] == "approve"
    assert origin.forks == [fork_id] and origin.forked_from is None
    # the original keeps its identity (its workflow and input still name it); the fork has a key of its own
    assert engine.storage.lookup(before[0]["identity"]) == original
    assert engine.storage.lookup(f"key:fork:{original}:1") == fork_id


def test_a_fork_copies_only_the_history_up_to_the_step(tmp_path: Path) -> None:
    engine = Engine(storage_of("file", tmp_path))
    original = _run(engine)
    fork_id, _ = _fork(engine, original, from_step=(1,), set_output="deny")
    kinds = [(r["t"], r.get("p")) for r in _records(engine, fork_id)]
    assert kinds[:3] == [("run", None), ("ok", "0"), ("ok", "1")]  # no claim, no end of the original's
    assert ("ok", "2") in kinds[3:] and kinds[-1] == ("end", None)
    header = _records(engine, fork_id)[0]
    assert header["forked_from"] == {"run": original, "path": "1", "label": "model", "edited": True}
    assert header["key"] == f"fork:{original}:1" and header["identity"] == f"key:fork:{original}:1"


def test_a_fork_without_an_output_replays_up_to_the_step_and_runs_the_rest(tmp_path: Path) -> None:
    engine = Engine(storage_of("sqlite", tmp_path))
    original = _run(engine)
    fork_id, value = _fork(engine, original, from_step="1")  # a path as a string, as inspect prints it
    assert value["outcome"] == "approved 7"
    assert CALLS == {"fetch": 1, "model": 1, "approve": 2, "notify": 2}
    # from the first step: the model answers again, now otherwise (what a live model may well do)
    MODEL["answer"] = "deny"
    second, value = _fork(engine, original, from_step=(0,))
    assert value["answer"] == "deny"
    assert CALLS == {"fetch": 1, "model": 2, "approve": 2, "deny": 1, "notify": 3}
    assert go(lambda: engine.inspect(original)).forks == [fork_id, second]
    assert go(lambda: engine.inspect(second)).forked_from == {"run": original, "path": [0], "label": "fetch",
                                                              "edited": False}


def test_a_failed_run_forked_before_its_failure_completes_with_fixed_code(tmp_path: Path) -> None:
    engine = Engine(storage_of("file", tmp_path))
    MODEL["answer"] = "deny"
    BROKEN["deny"] = True
    started: list[str] = []
    with pytest.raises(RuntimeError, match="deny service is down"):
        go(lambda: engine.run(review, 3, on_run=started.append))
    original = started[0]
    before = _records(engine, original)
    BROKEN["deny"] = False  # the fix
    fork_id, value = _fork(engine, original, from_step="model")
    assert value == {"answer": "deny", "outcome": "denied 3", "told": "told: denied 3"}
    assert CALLS == {"fetch": 1, "model": 1, "deny": 2, "notify": 1}  # deny: the original's failure, the fork's
    assert go(lambda: engine.inspect(original)).status == "failed"
    assert _records(engine, original) == before
    # the failed step itself, forked with an output, counts as completed with it
    BROKEN["deny"] = True
    third, value = _fork(engine, original, from_step="deny", set_output="denied by hand")
    assert value["outcome"] == "denied by hand" and CALLS["deny"] == 2
    assert go(lambda: engine.inspect(third)).forked_from["edited"] is True


RETRIED: Counter[str] = Counter()
FLAKY = {"broken": True}


def flaky() -> str:
    RETRIED["flaky"] += 1
    if FLAKY["broken"]:
        raise ValueError("flaky")
    return "fine"


def last() -> str:
    RETRIED["last"] += 1
    if FLAKY["broken"]:
        raise RuntimeError("last is broken")
    return "done"


@workflow(name="fork_retried")
async def retried(ctx: Any) -> list[str]:
    try:
        first = await ctx.step(flaky, name="flaky")
    except ValueError:
        first = "caught"
    middle = await ctx.step(fetch, 1, name="fetch")
    return [first, str(middle["id"]), await ctx.step(last, name="last")]


def test_a_run_retried_from_a_step_after_it_failed_forks_as_it_replays(tmp_path: Path) -> None:
    engine = Engine(storage_of("file", tmp_path))
    started: list[str] = []
    with pytest.raises(RuntimeError, match="last is broken"):
        go(lambda: engine.run(retried, on_run=started.append))
    original = started[0]
    FLAKY["broken"] = False
    assert go(lambda: engine.retry(original, from_step="last")) == ["fine", "1", "done"]
    assert RETRIED == {"flaky": 2, "last": 2}
    fork_id, value = _fork(engine, original, from_step="last")
    assert value == ["fine", "1", "done"] and RETRIED == {"flaky": 2, "last": 2} and CALLS["fetch"] == 1
    kinds = [r["t"] for r in _records(engine, fork_id)]
    assert "end" not in kinds[:-1] and kinds.index("reopen") < kinds.index("reset")  # the failed end reopened it


PARALLEL_CALLS: Counter[str] = Counter()


async def quick() -> str:
    PARALLEL_CALLS["quick"] += 1
    return "quick"


async def slow() -> str:
    PARALLEL_CALLS["slow"] += 1
    await asyncio.sleep(0.2)
    return "slow"


def after(values: list[str]) -> str:
    PARALLEL_CALLS["after"] += 1
    return "+".join(values)


@workflow(name="fork_branches")
async def branches(ctx: Any) -> str:
    values = await asyncio.gather(ctx.step(slow, name="slow"), ctx.step(quick, name="quick"))
    return await ctx.step(after, list(values), name="after")


def test_parallel_branches_are_cut_where_the_step_completed(tmp_path: Path) -> None:
    PARALLEL_CALLS.clear()
    engine = Engine(storage_of("file", tmp_path))
    started: list[str] = []
    assert go(lambda: engine.run(branches, on_run=started.append)) == "slow+quick"
    original = started[0]
    # quick (path 1) completed first, while slow (path 0) still ran: a fork from quick runs slow again
    fork_id, value = _fork(engine, original, from_step="quick", set_output="QUICK")
    assert value == "slow+QUICK"
    assert PARALLEL_CALLS == {"slow": 2, "quick": 1, "after": 2}
    # a fork from slow has both: quick completed before it
    _, value = _fork(engine, original, from_step="slow")
    assert value == "slow+quick" and PARALLEL_CALLS == {"slow": 2, "quick": 1, "after": 3}
    paths = [r.get("p") for r in _records(engine, fork_id) if r["t"] == "ok"]
    assert paths[0] == "1"  # the fork's copied history: quick alone, then what it ran


# ---- bad input: a clear error, nothing created ----------------------------------------------------------------


@workflow(name="fork_gate")
async def gate(ctx: Any) -> str:
    await ctx.step(fetch, 1, name="fetch")
    return await ctx.wait_for("go")


def test_bad_input_is_refused_with_a_hint_and_creates_nothing(tmp_path: Path) -> None:
    engine = Engine(storage_of("file", tmp_path))
    original = _run(engine)
    started: list[str] = []
    with pytest.raises(Exception, match="waiting"):
        go(lambda: engine.run(gate, on_run=started.append, wait=False))
    waiting = started[0]
    count = go(lambda: engine.count())
    cases: list[tuple[str, dict[str, Any], type[Exception], str]] = [
        ("nope-0000", {"from_step": "model"}, RunNotFoundError, "no run"),
        (original, {"from_step": (9,)}, ValidationError, "matches no step"),
        (original, {"from_step": "nosuch"}, ValidationError, "matches no step"),
        (original, {"from_step": ()}, ValidationError, "not a step selector"),
        (original, {"from_step": "model", "set_output": object()}, ValidationError, "cannot be recorded"),
        (waiting, {"from_step": (1,)}, ValidationError, "has not completed step 1"),
        (waiting, {"from_step": (2,)}, ValidationError, "matches no step"),
    ]
    for run, options, error, text in cases:
        with pytest.raises(error, match=text) as caught:
            go(lambda run=run, options=options: engine.fork(run, **options))
        check_error(caught.value)
    assert go(lambda: engine.count()) == count
    assert go(lambda: engine.inspect(original)).forks == []


@workflow(name="fork_kid")
async def kid(ctx: Any) -> str:
    return str(await ctx.wait_for("kid-go"))


@workflow(name="fork_mom")
async def mom(ctx: Any) -> str:
    await ctx.spawn(kid)
    await ctx.step(fetch, 2, name="fetch")
    return str(await ctx.wait_for("mom-go"))


def test_a_step_after_a_child_that_has_not_ended_is_not_forked(tmp_path: Path) -> None:
    engine = Engine(storage_of("sqlite", tmp_path))
    started: list[str] = []
    with pytest.raises(Exception, match="waiting"):
        go(lambda: engine.run(mom, on_run=started.append, wait=False))
    count = go(lambda: engine.count())
    with pytest.raises(ValidationError, match="have not ended") as caught:
        go(lambda: engine.fork(started[0], from_step="fetch"))
    check_error(caught.value)
    assert go(lambda: engine.count()) == count
    with pytest.raises(ValidationError, match="cannot be set"):
        go(lambda: engine.fork(started[0], from_step=(0,), set_output={"run_id": "other"}))


def test_test_engine_forks_and_counts_the_forks_executions() -> None:
    with TestEngine() as test:
        first = test.sync.run(review, 5)
        assert first.status == "completed" and first.step("approve").executions == 1
        fork = test.sync.fork(first.run_id, from_step="model", set_output="deny")
        assert fork.status == "completed" and fork.run_id != first.run_id
        assert fork.result["outcome"] == "denied 5"
        assert fork.step("fetch").executions == 0 and fork.step("model").executions == 0
        assert fork.step("deny").executions == 1 and fork.step("notify").executions == 1
        assert test.sync.inspect(first.run_id).forks == [fork.run_id]
        # a fork of the fork: its lineage names the fork, whose own lineage names the first run
        again = test.sync.fork(fork.run_id, from_step="deny", set_output="denied twice")
        assert again.result["told"] == "told: denied twice" and again.step("deny").executions == 0
        assert test.sync.inspect(again.run_id).forked_from["run"] == fork.run_id
        assert test.sync.inspect(fork.run_id).forks == [again.run_id]
        assert test.sync.inspect(first.run_id).forks == [fork.run_id]


# ---- the command line, in real subprocesses ---------------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    import os, time
    from pathlib import Path
    from durably_py import run, workflow

    HERE = Path(__file__).parent

    def mark(name):
        with (HERE / "executions.txt").open("a") as f:
            f.write(name + "\\n")

    def fetch(doc_id):
        mark("fetch")
        return {"id": doc_id}

    def model(doc):
        mark("model")
        return "approve"

    def decide(answer, doc):
        mark(answer)
        return f"{answer} {doc['id']}"

    def notify(outcome):
        mark("notify-start")
        if os.environ.get("HOLD_NOTIFY"):
            deadline = time.monotonic() + 60
            while not (HERE / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        mark("notify")
        return f"told: {outcome}"

    @workflow
    async def cli_review(ctx, doc_id):
        doc = await ctx.step(fetch, doc_id, name="fetch")
        answer = await ctx.step(model, doc, name="model")
        outcome = await ctx.step(decide, answer, doc, name=answer)
        told = await ctx.step(notify, outcome, name="notify")
        return {"answer": answer, "outcome": outcome, "told": told}

    @workflow
    async def cli_gate(ctx):
        await ctx.step(fetch, 1, name="fetch")
        return await ctx.wait_for("go")

    if __name__ == "__main__":
        print(run(cli_review, 7))
''')


def _cli(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return durably(*args, cwd=root, unset=("DURABLY_*",), **env)


def _project(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(SCRIPT)
    return tmp_path


def _executions(root: Path) -> list[str]:
    path = root / "executions.txt"
    return path.read_text().splitlines() if path.exists() else []


def _original(root: Path, *where: str) -> str:
    done = _cli(root, "run", "job.py", *where)
    assert done.returncode == 0, done.stderr
    runs = json.loads(_cli(root, "list", "--json", *where).stdout)
    assert len(runs) == 1
    return str(runs[0]["run_id"])


@pytest.mark.parametrize("where", [(), ("--storage", "sqlite:state.db")], ids=["files", "sqlite"])
def test_the_cli_forks_and_inspect_shows_the_lineage_both_ways(tmp_path: Path, where: tuple[str, ...]) -> None:
    root = _project(tmp_path)
    original = _original(root, *where)
    assert _executions(root) == ["fetch", "model", "approve", "notify-start", "notify"]

    done = _cli(root, "fork", original, "--from-step", "model", "--set-output", '"deny"', "--json", *where)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    fork_id = out["run_id"]
    assert out["status"] == "completed" and out["result"]["outcome"] == "deny 7"
    assert out["forked_from"] == {"run": original, "path": [1], "label": "model", "edited": True}
    assert _executions(root)[5:] == ["deny", "notify-start", "notify"]  # fetch and model did not run again

    text = _cli(root, "inspect", fork_id, *where)
    assert text.returncode == 0, text.stderr
    assert f"forked from {original} at step 1 (model, output set)" in " ".join(text.stdout.split())
    shown = json.loads(_cli(root, "inspect", fork_id, "--json", *where).stdout)
    assert shown["forked_from"] == {"run": original, "path": [1], "label": "model", "edited": True}
    assert shown["key"] == f"fork:{original}:1"

    origin = json.loads(_cli(root, "inspect", original, "--json", *where).stdout)
    assert origin["forks"] == [fork_id] and origin["forked_from"] is None
    assert origin["result"]["answer"] == "approve"
    text = _cli(root, "inspect", original, *where).stdout
    assert "forks" in text and fork_id in text

    # plain text: the new run's id on stderr, its result on stdout; a fork without --set-output
    again = _cli(root, "fork", original, "--from-step", "1", *where)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["outcome"] == "approve 7"
    assert f"forked {original} at step 1 (model) as " in again.stderr
    assert len(json.loads(_cli(root, "inspect", original, "--json", *where).stdout)["forks"]) == 2


def test_a_killed_fork_resumes_with_retry_without_running_its_steps_again(tmp_path: Path) -> None:
    root = _project(tmp_path)
    original = _original(root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HOLD_NOTIFY": "1"}
    for name in [n for n in env if n.startswith("DURABLY_")]:
        del env[name]
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "fork", original, "--from-step", "model",
                             "--set-output", '"deny"'], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        wait_until(lambda: _executions(root)[-1:] == ["notify-start"] and len(_executions(root)) > 5, 60)
        os.kill(proc.pid, signal.SIGKILL)  # after its first live step (deny) completed, inside notify
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert _executions(root)[5:] == ["deny", "notify-start"]
    forks = json.loads(_cli(root, "inspect", original, "--json").stdout)["forks"]
    assert len(forks) == 1
    fork_id = forks[0]
    assert json.loads(_cli(root, "inspect", fork_id, "--json").stdout)["status"] == "interrupted"

    (root / "go").write_text("")
    done = _cli(root, "retry", fork_id, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == {"answer": "deny", "outcome": "deny 7", "told": "told: deny 7"}
    # deny ran once in the fork (its completed record replayed on the retry); only notify ran again
    assert _executions(root)[5:] == ["deny", "notify-start", "notify-start", "notify"]
    shown = json.loads(_cli(root, "inspect", fork_id, "--json").stdout)
    assert shown["forked_from"]["run"] == original and shown["status"] == "completed"


def test_bad_input_on_the_command_line_exits_2_and_creates_nothing(tmp_path: Path) -> None:
    root = _project(tmp_path)
    original = _original(root)
    parked = _cli(root, "run", "job.py", "--workflow", "cli_gate", "--no-wait")
    assert parked.returncode == 3, parked.stderr
    gate_id = next(r["run_id"] for r in json.loads(_cli(root, "list", "--json").stdout)
                   if r["workflow"] == "cli_gate")
    logs = sorted(p.name for p in (root / ".durably" / "runs").glob("*.jsonl"))
    (root / "bad.json").write_text("{not json")
    cases = [
        (("fork", "no-such-run", "--from-step", "1"), "no run with id or key"),
        (("fork", original, "--from-step", "9"), "matches no step"),
        (("fork", original, "--from-step", "model", "--set-output", "deny"), "is not valid JSON"),
        (("fork", original, "--from-step", "model", "--set-output", "@bad.json"), "is not valid JSON"),
        (("fork", original, "--from-step", "model", "--set-output", "@missing.json"), "cannot read"),
        (("fork", gate_id, "--from-step", "1"), "has not completed step 1"),
        (("fork", gate_id, "--from-step", "2"), "matches no step"),
        (("fork", original), "--from-step"),
    ]
    for args, text in cases:
        done = _cli(root, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert text in " ".join(done.stderr.split()), (args, done.stderr)
        if args[-1] != original:
            assert "hint:" in done.stderr, (args, done.stderr)
    assert sorted(p.name for p in (root / ".durably" / "runs").glob("*.jsonl")) == logs
    assert json.loads(_cli(root, "inspect", original, "--json").stdout)["forks"] == []
    refused = _cli(root, "fork", original, "--from-step", "1", "--restate", "http://127.0.0.1:9")
    assert refused.returncode == 2 and "NotSupportedError" in refused.stderr


def test_fork_is_listed_in_the_help() -> None:
    done = durably("fork", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for option in ("--from-step", "--set-output", "--no-wait", "--json"):
        assert option in text
