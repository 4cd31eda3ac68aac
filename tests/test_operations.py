"""Operating runs by id: cancel, retry (from a step), restart, and finding an old run's workflow code."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import interrupt, invoke, wait_until

from durably_py import (
    Engine,
    FileStorage,
    MemoryStorage,
    RunCancelledError,
    RunNotFoundError,
    RunParkedError,
    ValidationError,
    create_engine,
    workflow,
)
from durably_py.cli import parse_step

calls: dict[str, int] = {}
broken: set[str] = set()
undone: list[str] = []


def work(name: str) -> str:
    calls[name] = calls.get(name, 0) + 1
    if name in broken:
        raise ValueError(f"{name} is broken")
    return name.upper()


def undo(value: str) -> None:
    undone.append(value)


@workflow
async def ops_chain(ctx: Any, names: list[str]) -> list[str]:
    return [await ctx.step(work, name, name="work", compensate=undo) for name in names]


@workflow
async def ops_labelled(ctx: Any, n: int) -> list[str]:
    first = await ctx.step(work, "load", name="load")
    rest = [await ctx.step(work, f"item-{i}", name="item") for i in range(n)]
    return [first, *rest, await ctx.step(work, "save", name="save")]


@pytest.fixture(autouse=True)
def _reset() -> None:
    calls.clear()
    broken.clear()
    undone.clear()


@pytest.fixture
def engine(state_dir: Path) -> Engine:
    return create_engine(FileStorage(state_dir))


def only_run(engine: Engine) -> str:
    (state,) = asyncio.run(engine.list())
    return state.run_id


# ---- cancel -------------------------------------------------------------------------------------


def test_cancel_an_interrupted_run_then_run_starts_fresh(engine: Engine, records: Callable[..., Any]) -> None:
    run_id = interrupt(engine, ops_chain, ["a", "b", "c"], (1,))
    assert asyncio.run(engine.inspect(run_id)).status == "interrupted"

    state = asyncio.run(engine.cancel(run_id))
    assert state.status == "cancelled"
    assert state.error is not None and state.error["type"].endswith("RunCancelledError")
    end = records(run_id)[-1]
    assert end["t"] == "end" and end["status"] == "cancelled"
    assert undone == []
    assert asyncio.run(engine.cancel(run_id)).status == "cancelled"  # a second cancel is a no-op
    assert records(run_id)[-1] == end

    assert asyncio.run(engine.run(ops_chain, ["a", "b", "c"])) == ["A", "B", "C"]
    assert calls == {"a": 2, "b": 2, "c": 1}
    runs = asyncio.run(engine.list())
    assert len(runs) == 2 and {r.status for r in runs} == {"cancelled", "completed"}


def test_cancel_a_failed_run_and_a_completed_run(engine: Engine) -> None:
    broken.add("b")
    with pytest.raises(ValueError):
        asyncio.run(engine.run(ops_chain, ["a", "b"]))
    failed = only_run(engine)
    assert asyncio.run(engine.cancel(failed)).status == "cancelled"
    broken.clear()
    asyncio.run(engine.run(ops_chain, ["x"]))
    done = next(r.run_id for r in asyncio.run(engine.list()) if r.status == "completed")
    with pytest.raises(ValidationError, match="already completed") as err:
        asyncio.run(engine.cancel(done))
    assert "restart" in err.value.hint
    with pytest.raises(RunNotFoundError):
        asyncio.run(engine.cancel("no-such-run"))
    with pytest.raises(ValidationError, match="timeout"):
        asyncio.run(engine.cancel(failed, timeout=-1))


def test_cancel_a_live_run_in_this_process_stops_it_without_compensation() -> None:
    hook: list[dict[str, Any]] = []
    engine = create_engine(MemoryStorage(), on_run_failed=hook.append)

    async def tick(i: int) -> int:
        await asyncio.sleep(0.02)
        return i

    @workflow
    async def ops_ticker(ctx: Any) -> int:
        for i in range(500):
            await ctx.step(tick, i, compensate=undo)
        return 500

    async def scenario() -> tuple[Any, str]:
        started: list[str] = []
        task = asyncio.ensure_future(engine.run(ops_ticker, on_run=started.append))
        while not started:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        state = await engine.cancel(started[0], timeout=5)
        with pytest.raises(RunCancelledError):
            await task
        return state, started[0]

    began = time.monotonic()
    state, run_id = asyncio.run(scenario())
    assert time.monotonic() - began < 3
    assert state.status == "cancelled"
    assert 0 < len(state.steps) < 500
    assert undone == [] and hook == []
    with pytest.raises(ValidationError, match="cancelled") as err:
        asyncio.run(engine.retry(run_id))
    assert "restart" in err.value.hint


def test_the_inbox_is_not_listed_on_every_step() -> None:
    class Counting(MemoryStorage):
        listed = 0

        def inbox(self, run_id: str) -> list[dict[str, Any]]:
            Counting.listed += 1
            return super().inbox(run_id)

    engine = create_engine(Counting())
    asyncio.run(engine.run(ops_chain, [f"s{i}" for i in range(300)]))
    assert Counting.listed <= 3


CHILD = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from durably_py import RunCancelledError, run, workflow

    HERE = Path(__file__).parent

    def slow(i):
        time.sleep(0.05)
        with (HERE / "done.txt").open("a") as f:
            f.write(f"{i}\\n")
        return i

    def undo(value):
        (HERE / "compensated.txt").write_text("yes")

    def mark(name):
        return name

    @workflow
    async def ops_slow_chain(ctx, n):
        for i in range(n):
            await ctx.step(slow, i, name="slow", compensate=undo)
        return n

    @workflow
    async def ops_gate(ctx):
        await ctx.step(mark, "before", compensate=undo)
        return await ctx.wait_for("go", timeout=3600)

    if __name__ == "__main__":
        wf = ops_gate if sys.argv[2] == "gate" else ops_slow_chain
        try:
            print("result", run(wf, *([] if sys.argv[2] == "gate" else [int(sys.argv[2])]), dir=sys.argv[1]))
        except RunCancelledError:
            print("cancelled", flush=True)
''')


@pytest.fixture
def child(tmp_path: Path, state_dir: Path) -> Callable[[str], subprocess.Popen[str]]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    started: list[subprocess.Popen[str]] = []

    def start(arg: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, str(script), str(state_dir), arg], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cancel_a_run_held_by_another_process(tmp_path: Path, engine: Engine, child: Any,
                                              records: Callable[..., Any]) -> None:
    proc = child("200")
    done = tmp_path / "done.txt"
    wait_until(lambda: done.exists() and len(done.read_text().splitlines()) >= 3)
    run_id = only_run(engine)
    assert asyncio.run(engine.inspect(run_id)).status == "running"

    began = time.monotonic()
    state = asyncio.run(engine.cancel(run_id, timeout=10))
    assert time.monotonic() - began < 2.5
    assert state.status == "cancelled"
    out, err = proc.communicate(timeout=15)
    assert out.strip() == "cancelled", err
    ran = len(done.read_text().splitlines())
    assert ran < 200
    log = records(run_id)
    assert log[-1]["t"] == "end" and log[-1]["status"] == "cancelled"
    assert sum(1 for r in log if r["t"] == "ok") in (ran, ran - 1)
    assert not [r for r in log if r["t"] == "comp"]
    assert not (tmp_path / "compensated.txt").exists()


def test_cancel_a_run_parked_on_wait_for_in_another_process(tmp_path: Path, state_dir: Path, engine: Engine,
                                                           child: Any, records: Callable[..., Any]) -> None:
    proc = child("gate")
    wait_until(lambda: any(r.status == "waiting" for r in asyncio.run(engine.list())))
    run_id = only_run(engine)
    assert engine.storage.held(run_id)

    began = time.monotonic()
    result = invoke("cancel", run_id, "--dir", str(state_dir), "--timeout", "10s")
    assert result.exit_code == 0, result.stderr
    assert f"cancelled {run_id}" in result.stderr
    assert time.monotonic() - began < 2
    out, err = proc.communicate(timeout=15)
    assert out.strip() == "cancelled", err
    assert records(run_id)[-1]["status"] == "cancelled"
    assert not (tmp_path / "compensated.txt").exists()
    assert engine.storage.inbox(run_id) == []


def test_cancel_cli_errors_and_json(state_dir: Path, engine: Engine) -> None:
    asyncio.run(engine.run(ops_chain, ["a"]))
    run_id = only_run(engine)
    done = invoke("cancel", run_id, "--dir", str(state_dir))
    assert done.exit_code == 2 and "already completed" in done.stderr and "hint:" in done.stderr
    assert invoke("cancel", "nope", "--dir", str(state_dir)).exit_code == 2
    assert invoke("cancel", run_id, "--dir", str(state_dir), "--timeout", "soon").exit_code == 2
    interrupted = interrupt(engine, ops_chain, ["b", "c"], (0,))
    out = invoke("cancel", interrupted, "--dir", str(state_dir), "--json")
    assert out.exit_code == 0
    assert json.loads(out.stdout) == {"run_id": interrupted, "status": "cancelled", "cancelled": True}


# ---- retry ----------------------------------------------------------------------------------------


def test_retry_a_failed_run_after_fixing_the_cause(engine: Engine, records: Callable[..., Any]) -> None:
    broken.add("c")
    with pytest.raises(ValueError):
        asyncio.run(engine.run(ops_chain, ["a", "b", "c", "d"]))
    run_id = only_run(engine)
    assert undone == ["B", "A"]
    with pytest.raises(ValueError, match="c is broken"):
        asyncio.run(engine.retry(run_id))
    assert calls == {"a": 2, "b": 2, "c": 2}  # the compensated steps ran again, as a resumed failed run does
    broken.clear()
    undone.clear()
    assert asyncio.run(engine.retry(run_id)) == ["A", "B", "C", "D"]
    assert calls == {"a": 3, "b": 3, "c": 3, "d": 1}
    assert undone == []
    assert asyncio.run(engine.inspect(run_id)).status == "completed"
    with pytest.raises(ValidationError, match="nothing to retry") as err:
        asyncio.run(engine.retry(run_id))
    assert "--from-step" in err.value.hint


@workflow
async def ops_plain(ctx: Any, names: list[str]) -> list[str]:
    return [await ctx.step(work, name, name=name) for name in names]


def test_retry_resumes_a_failed_run_at_its_failed_step(engine: Engine) -> None:
    broken.add("c")
    with pytest.raises(ValueError):
        asyncio.run(engine.run(ops_plain, ["a", "b", "c", "d"]))
    broken.clear()
    assert asyncio.run(engine.retry(only_run(engine))) == ["A", "B", "C", "D"]
    assert calls == {"a": 1, "b": 1, "c": 2, "d": 1}


def test_retry_from_step_reruns_the_selected_and_later_steps(engine: Engine, records: Callable[..., Any]) -> None:
    assert asyncio.run(engine.run(ops_labelled, 3)) == ["LOAD", "ITEM-0", "ITEM-1", "ITEM-2", "SAVE"]
    run_id = only_run(engine)
    counts = {"load": 1, "item-0": 1, "item-1": 1, "item-2": 1, "save": 1}
    assert calls == counts

    asyncio.run(engine.retry(run_id, from_step=(3,)))
    counts.update({"item-2": 2, "save": 2})
    assert calls == counts
    reset = [r for r in records(run_id) if r["t"] == "reset"]
    assert reset[-1]["paths"] == ["3", "4"]

    asyncio.run(engine.retry(run_id, from_step=("item", 2)))
    counts.update({"item-1": 2, "item-2": 3, "save": 3})
    assert calls == counts

    assert asyncio.run(engine.retry(run_id, from_step="item")) == ["LOAD", "ITEM-0", "ITEM-1", "ITEM-2", "SAVE"]
    counts.update({"item-0": 2, "item-1": 3, "item-2": 4, "save": 4})
    assert calls == counts
    state = asyncio.run(engine.inspect(run_id))
    assert state.status == "completed" and [s.label for s in state.steps] == ["load", "item", "item", "item", "save"]


async def turn(state: int, it: Any) -> Any:
    if state >= 2:
        return it.done(state)
    await it.step(work, f"turn-{state}", name="turn")
    return state + 1


@workflow
async def ops_nested(ctx: Any) -> Any:
    fanned = await ctx.parallel([lambda i=i: ctx.step(work, f"branch-{i}", name="branch") for i in range(2)])
    total = await ctx.loop(0, turn)
    return [r.value for r in fanned], total


def test_retry_from_step_reruns_the_steps_nested_under_the_selected_one(engine: Engine) -> None:
    assert asyncio.run(engine.run(ops_nested)) == [["BRANCH-0", "BRANCH-1"], 2]
    run_id = only_run(engine)
    assert calls == {"branch-0": 1, "branch-1": 1, "turn-0": 1, "turn-1": 1}
    asyncio.run(engine.retry(run_id, from_step=(1,)))  # the loop: its iterations and snapshots are dropped too
    assert calls == {"branch-0": 1, "branch-1": 1, "turn-0": 2, "turn-1": 2}
    asyncio.run(engine.retry(run_id, from_step=(1, 1, 0)))  # inside the loop: its result is invalidated as well
    assert calls == {"branch-0": 1, "branch-1": 1, "turn-0": 2, "turn-1": 3}
    asyncio.run(engine.retry(run_id, from_step=("branch", 2)))
    assert calls == {"branch-0": 1, "branch-1": 2, "turn-0": 3, "turn-1": 4}


def test_a_stale_cancel_request_does_not_cancel_a_retried_completed_run(engine: Engine) -> None:
    asyncio.run(engine.run(ops_chain, ["a", "b"]))
    run_id = only_run(engine)
    engine.storage.send(run_id, json.dumps({"id": "late", "name": "$cancel"}).encode() + b"\n")
    assert asyncio.run(engine.retry(run_id, from_step=(0,))) == ["A", "B"]
    assert calls == {"a": 2, "b": 2}
    assert engine.storage.inbox(run_id) == []


def test_a_pending_cancel_request_stops_an_interrupted_run_when_it_resumes(engine: Engine) -> None:
    run_id = interrupt(engine, ops_chain, ["a", "b", "c"], (0,))
    engine.storage.send(run_id, json.dumps({"id": "pending", "name": "$cancel"}).encode() + b"\n")
    with pytest.raises(RunCancelledError):
        asyncio.run(engine.retry(run_id))
    assert calls == {"a": 1}
    assert asyncio.run(engine.inspect(run_id)).status == "cancelled"


@pytest.mark.parametrize("selector", ["nope", (9,), ("item", 5), ("item", 0), 2.5, (), (True,)])
def test_retry_with_a_bad_selector_lists_the_steps(engine: Engine, selector: Any,
                                                   records: Callable[..., Any]) -> None:
    asyncio.run(engine.run(ops_labelled, 1))
    run_id = only_run(engine)
    before = records(run_id)
    with pytest.raises(ValidationError) as err:
        asyncio.run(engine.retry(run_id, from_step=selector))
    assert "(0,) load" in err.value.message and "(2,) save" in err.value.message
    assert "inspect" in err.value.hint
    assert records(run_id) == before


def test_retry_refuses_cancelled_and_running_runs(engine: Engine, state_dir: Path) -> None:
    run_id = interrupt(engine, ops_chain, ["a", "b"], (0,))
    asyncio.run(engine.cancel(run_id))
    with pytest.raises(ValidationError, match="cancelled") as err:
        asyncio.run(engine.retry(run_id, from_step=(0,)))
    assert "restart" in err.value.hint
    cli = invoke("retry", run_id, "--dir", str(state_dir))
    assert cli.exit_code == 2 and "durably restart" in cli.stderr


def test_retry_and_restart_on_the_command_line(state_dir: Path, engine: Engine) -> None:
    broken.add("b")
    with pytest.raises(ValueError):
        asyncio.run(engine.run(ops_plain, ["a", "b", "c"], key="nightly"))
    run_id = only_run(engine)
    failed = invoke("retry", "nightly", "--dir", str(state_dir))
    assert failed.exit_code == 1 and "b is broken" in failed.stderr
    broken.clear()
    fixed = invoke("retry", "nightly", "--dir", str(state_dir))
    assert fixed.exit_code == 0, fixed.stderr
    assert json.loads(fixed.stdout) == ["A", "B", "C"]
    assert f"✓ {run_id}  completed" in fixed.stderr and "2 ran · 1 replayed" in fixed.stderr
    assert calls == {"a": 1, "b": 3, "c": 1}

    again = invoke("retry", run_id, "--from-step", "1", "--dir", str(state_dir), "--json")
    assert again.exit_code == 0, again.stderr
    summary = json.loads(again.stdout)
    assert summary["result"] == ["A", "B", "C"] and summary["run_id"] == run_id and again.stderr == ""
    assert summary["exit_code"] == 0
    assert summary["runs"] == [{"run_id": run_id, "status": "completed", "detail": None, "ran": 2, "replayed": 1,
                                "failed": 0, "retries": 0}]
    by_label = invoke("retry", run_id, "--from-step", "c", "--dir", str(state_dir))
    assert by_label.exit_code == 0
    assert calls == {"a": 1, "b": 4, "c": 3}
    bad = invoke("retry", run_id, "--from-step", "7.1", "--dir", str(state_dir))
    assert bad.exit_code == 2 and "its steps: 0 a, 1 b, 2 c" in bad.stderr

    restarted = invoke("restart", "nightly", "--dir", str(state_dir))
    assert restarted.exit_code == 0, restarted.stderr
    assert json.loads(restarted.stdout) == ["A", "B", "C"]
    assert calls == {"a": 2, "b": 5, "c": 4}
    runs = asyncio.run(engine.list(key="nightly"))
    assert len(runs) == 2
    assert asyncio.run(engine.inspect("nightly")).run_id != run_id
    assert invoke("restart", "nope", "--dir", str(state_dir)).exit_code == 2


@workflow
async def ops_parked(ctx: Any) -> Any:
    await ctx.step(work, "before", name="before")
    return await ctx.wait_for("go", timeout=3600)


def test_retry_of_a_parked_run_under_no_wait_exits_3(state_dir: Path, engine: Engine) -> None:
    with pytest.raises(RunParkedError):
        asyncio.run(engine.run(ops_parked, wait=False))
    run_id = only_run(engine)
    parked = invoke("retry", run_id, "--no-wait", "--dir", str(state_dir))
    assert parked.exit_code == 3 and "waiting" in parked.stderr
    asyncio.run(engine.signal(run_id, "go", "yes"))
    assert asyncio.run(engine.retry(run_id)) == "yes"
    assert calls == {"before": 1}


def test_parse_step() -> None:
    assert parse_step("2") == (2,)
    assert parse_step("3.1.0") == (3, 1, 0)
    assert parse_step("fetch page") == "fetch page"
    with pytest.raises(ValidationError):
        parse_step(" ")


# ---- restart --------------------------------------------------------------------------------------


def test_restart_creates_a_new_run_and_reruns_everything(engine: Engine) -> None:
    asyncio.run(engine.run(ops_chain, ["a", "b"], key="daily"))
    old = only_run(engine)
    assert asyncio.run(engine.restart(old)) == ["A", "B"]
    assert calls == {"a": 2, "b": 2}
    new = asyncio.run(engine.inspect("daily"))
    assert new.run_id != old and new.key == "daily" and new.input == ["a", "b"] and new.status == "completed"
    assert asyncio.run(engine.inspect(old)).status == "completed"


def test_restart_a_cancelled_run(engine: Engine) -> None:
    old = interrupt(engine, ops_chain, ["a", "b"], (0,))
    asyncio.run(engine.cancel(old))
    assert asyncio.run(engine.restart(old)) == ["A", "B"]
    assert calls == {"a": 2, "b": 1}


# ---- which code runs an old run -------------------------------------------------------------------

FLAKY = textwrap.dedent('''
    import sys
    from pathlib import Path
    from durably_py import run, workflow

    HERE = Path(__file__).parent

    def step(i):
        with (HERE / "executions.txt").open("a") as f:
            f.write(f"{i}\\n")
        if i == 2 and not (HERE / "fixed").exists():
            raise ValueError("step 2 is broken")
        return i * 10

    @workflow
    async def ops_flaky_script(ctx, n):
        return sum([await ctx.step(step, i, name=f"step-{i}") for i in range(n)])

    if __name__ == "__main__":
        print("main block ran")
        print(run(ops_flaky_script, int(sys.argv[2]), dir=sys.argv[1]))
''')


def test_workflow_for_imports_the_script_of_a_run(tmp_path: Path, state_dir: Path, engine: Engine) -> None:
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    proc = subprocess.run([sys.executable, str(script), str(state_dir), "4"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "step 2 is broken" in proc.stderr
    run_id = only_run(engine)
    state = asyncio.run(engine.inspect(run_id))
    assert state.script == str(script.resolve()) and state.status == "failed"

    (tmp_path / "fixed").write_text("")
    result = invoke("retry", run_id, "--dir", str(state_dir))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "60"
    assert "main block ran" not in result.stdout
    assert (tmp_path / "executions.txt").read_text().split() == ["0", "1", "2", "2", "3"]
    assert engine.workflow_for(run_id).name == "ops_flaky_script"


def test_workflow_for_names_the_workflow_and_script_when_the_code_is_gone(tmp_path: Path,
                                                                          engine: Engine) -> None:
    script = tmp_path / "gone.py"
    script.write_text(FLAKY.replace("ops_flaky_script", "ops_gone_script"))
    (tmp_path / "fixed").write_text("")
    proc = subprocess.run([sys.executable, str(script), str(engine.storage.dir), "1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    run_id = only_run(engine)
    script.unlink()
    with pytest.raises(ValidationError) as err:
        engine.workflow_for(run_id)
    assert "ops_gone_script" in err.value.message and str(script) in err.value.message
    assert "Import the module" in err.value.hint


def test_runs_record_their_script_and_module(engine: Engine, records: Callable[..., Any]) -> None:
    asyncio.run(engine.run(ops_chain, ["a"]))
    header = records()[0]
    assert header["script"] == str(Path(__file__).resolve())
    assert header["module"] == ops_chain.fn.__module__
    assert engine.workflow_for(only_run(engine)) is ops_chain
