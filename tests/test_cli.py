"""The `durably` command line: list/inspect in process, `durably run` as a real subprocess."""

from __future__ import annotations

import json
import textwrap
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import durably as run_cli
from helpers import invoke

from durably_py import Retry, attempt, run, workflow
from durably_py.cli import parse_duration
from durably_py.errors import ValidationError


@pytest.fixture(autouse=True)
def no_user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the user's own durably config and environment out of these tests."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "user-config"))
    for name in ("DURABLY_DIR", "DURABLY_STORAGE", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)


def double(x: int) -> int:
    return x * 2


def flaky(x: int) -> int:
    if attempt().number == 1:
        raise ConnectionError("first try fails")
    return x + 1


def explode(x: int) -> int:
    raise ValueError(f"cannot handle {x}")


async def branch(ctx: Any, i: int) -> int:
    a = await ctx.step(double, i)
    return await ctx.step(double, a)


@workflow
async def cli_pipeline(ctx: Any, n: int) -> dict[str, Any]:
    ctx.annotate(stage="done")
    first = await ctx.step(double, n)
    fanned = await ctx.parallel([lambda i=i: branch(ctx, i) for i in range(2)])
    last = await ctx.step(flaky, first, retry=Retry(2, base=0.01))
    return {"first": first, "fanned": [r.value for r in fanned], "last": last}


@workflow
async def cli_broken(ctx: Any, n: int) -> int:
    await ctx.step(double, n)
    return await ctx.step(explode, n)


@pytest.fixture
def two_runs(state_dir: Path) -> dict[str, str]:
    """One completed run (with a key) and one failed run in `state_dir`."""
    run(cli_pipeline, 3, key="nightly", dir=state_dir)
    with pytest.raises(ValueError):
        run(cli_broken, 5, dir=state_dir)
    listed = {r["workflow"]: r["run_id"] for r in json.loads(invoke("list", "--dir", str(state_dir), "--json").stdout)}
    return listed


# ---- list / inspect in process --------------------------------------------------------------------


def test_list_json_filters_and_table(state_dir: Path, two_runs: dict[str, str]) -> None:
    result = invoke("list", "--dir", str(state_dir), "--json")
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert {r["workflow"]: r["status"] for r in rows} == {"cli_pipeline": "completed", "cli_broken": "failed"}
    failed = json.loads(invoke("list", "--dir", str(state_dir), "--json", "--status", "failed").stdout)
    assert [r["run_id"] for r in failed] == [two_runs["cli_broken"]]
    keyed = json.loads(invoke("list", "--dir", str(state_dir), "--json", "--key", "nightly").stdout)
    assert [r["run_id"] for r in keyed] == [two_runs["cli_pipeline"]]
    assert len(json.loads(invoke("list", "--dir", str(state_dir), "--json", "--limit", "1").stdout)) == 1
    assert len(json.loads(invoke("list", "--dir", str(state_dir), "--json", "--since", "1h").stdout)) == 2
    table = invoke("list", "--dir", str(state_dir))
    assert table.exit_code == 0
    for text in (two_runs["cli_pipeline"], two_runs["cli_broken"], "completed", "failed", "nightly", "run id"):
        assert text in table.stdout


def test_list_rejects_bad_options(state_dir: Path) -> None:
    bad_status = invoke("list", "--dir", str(state_dir), "--status", "finished")
    assert bad_status.exit_code == 2
    assert "unknown status 'finished'" in bad_status.stderr and "hint:" in bad_status.stderr
    assert invoke("list", "--dir", str(state_dir), "--since", "soon").exit_code == 2
    assert invoke("list", "--dir", str(state_dir), "--limit", "0").exit_code == 2
    empty = invoke("list", "--dir", str(state_dir))
    assert empty.exit_code == 0 and "no runs" in empty.stdout


def test_inspect_shows_tree_header_and_json(state_dir: Path, two_runs: dict[str, str]) -> None:
    result = invoke("inspect", "--dir", str(state_dir), "nightly")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in (two_runs["cli_pipeline"], "cli_pipeline", "completed", "nightly", "stage", "steps (6)",
                 "(1,) parallel", "branch 0", "branch 1", "(1, 0, 1) double", "flaky", "2 attempts", "→ 6"):
        assert text in out, text
    data = json.loads(invoke("inspect", "--dir", str(state_dir), "--json", two_runs["cli_pipeline"]).stdout)
    assert data["status"] == "completed" and data["key"] == "nightly" and data["attempt"] == 1
    assert data["result"] == {"first": 6, "fanned": [0, 4], "last": 7}
    assert [s["path"] for s in data["steps"]] == [[0], [1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1], [2]]
    assert data["steps"][-1]["attempts"] == 2
    assert data["annotations"] == {"stage": "done"}


def test_inspect_failed_run_shows_error(state_dir: Path, two_runs: dict[str, str]) -> None:
    result = invoke("inspect", "--dir", str(state_dir), two_runs["cli_broken"])
    assert result.exit_code == 0
    assert "failed" in result.stdout and "ValueError: cannot handle 5" in result.stdout
    data = json.loads(invoke("inspect", "--dir", str(state_dir), "--json", two_runs["cli_broken"]).stdout)
    assert data["status"] == "failed" and data["error"]["message"] == "cannot handle 5"
    assert [s["status"] for s in data["steps"]] == ["ok", "failed"]


def test_inspect_unknown_run_exits_2_with_hint(state_dir: Path, two_runs: dict[str, str]) -> None:
    result = invoke("inspect", "--dir", str(state_dir), "no-such-run")
    assert result.exit_code == 2
    assert "RunNotFoundError: no run with id or key 'no-such-run'" in result.stderr
    assert "hint: `durably list` shows the runs" in result.stderr
    assert "docs: " in result.stderr and "Traceback" not in result.output
    assert result.stdout == ""


def test_inspect_invalid_run_id_exits_2(state_dir: Path) -> None:
    result = invoke("inspect", "--dir", str(state_dir), "../x")
    assert result.exit_code == 2
    assert "invalid run id '../x'" in result.stderr and "hint:" in result.stderr
    assert "Traceback" not in result.output


def test_run_usage_errors_exit_2(tmp_path: Path) -> None:
    script = tmp_path / "wf.py"
    script.write_text("print('imported')\n")
    missing = invoke("run", str(tmp_path / "nope.py"))
    assert missing.exit_code == 2 and "no script file" in missing.stderr
    bad_json = invoke("run", str(script), "--workflow", "x", "--input", "{nope")
    assert bad_json.exit_code == 2 and "is not valid JSON" in bad_json.stderr
    assert invoke("run", str(script), "--key", "k").exit_code == 2


def test_help_documents_exit_codes() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for text in ("Exit codes", "130", "parked", "run", "list", "inspect"):
        assert text in result.stdout


def test_parse_duration() -> None:
    assert parse_duration("30s") == 30
    assert parse_duration("5m") == 300
    assert parse_duration("2h") == 7200
    assert parse_duration("1h30m") == 5400
    assert parse_duration("1.5") == 1.5
    assert parse_duration("250ms") == 0.25
    for bad in ("", "5 minutes", "m5", "-3s"):
        with pytest.raises(ValidationError):
            parse_duration(bad)


# ---- durably run in real subprocesses --------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    from durably_py import run, workflow

    SIDE = Path(__file__).with_name("executions.txt")
    KILL_MARK = Path(__file__).with_name("kill-once")

    def work(i):
        with SIDE.open("a") as f:
            f.write(f"step-{i}\\n")
        if i == int(os.environ.get("KILL_AT", "-1")) and not KILL_MARK.exists():
            KILL_MARK.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        if i == int(os.environ.get("FAIL_AT", "-1")):
            raise ValueError(f"step {i} is broken")
        return i * 10

    @workflow
    async def steps(ctx, input):
        values = [await ctx.step(work, i, name=f"work-{i}") for i in range(input["n"])]
        return {"n": input["n"], "sum": sum(values)}

    if __name__ == "__main__":
        print("main block:", sys.argv[1:])
        print("result:", run(steps, {"n": int(sys.argv[1])}))
''')


durably = partial(run_cli, unset=("DURABLY_DIR", "DURABLY_SCRIPT"), pythonpath=False)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def executions(script: Path) -> list[str]:
    side = script.with_name("executions.txt")
    return side.read_text().splitlines() if side.exists() else []


def test_run_script_keeps_stdout_and_records_script(tmp_path: Path, script: Path) -> None:
    proc = durably("run", "job.py", "--dir", "state", "--", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "main block: ['3']\nresult: {'n': 3, 'sum': 30}\n"
    assert "completed" in proc.stderr and "3 ran" in proc.stderr
    assert executions(script) == ["step-0", "step-1", "step-2"]
    rows = json.loads(durably("list", "--dir", "state", "--json", cwd=tmp_path).stdout)
    assert len(rows) == 1 and rows[0]["status"] == "completed"
    assert rows[0]["script"] == str(script.resolve())
    assert rows[0]["run_id"] in proc.stderr


def test_run_failing_script_exits_1_without_traceback(tmp_path: Path, script: Path) -> None:
    proc = durably("run", "job.py", "--", "3", FAIL_AT="1", cwd=tmp_path)
    assert proc.returncode == 1
    assert "ValueError: step 1 is broken" in proc.stderr
    assert f"{script.resolve()}:" in proc.stderr and "in work" in proc.stderr
    assert "Traceback" not in proc.stderr and "durably inspect" in proc.stderr
    debug = durably("run", "job.py", "--debug", "--", "3", FAIL_AT="1", cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_run_workflow_with_input_prints_json(tmp_path: Path, script: Path) -> None:
    proc = durably("run", "job.py", "--workflow", "steps", "--input", '{"n": 3}', cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"n": 3, "sum": 30}
    assert "main block" not in proc.stdout
    (tmp_path / "input.json").write_text('{"n": 2}')
    as_json = durably("run", "job.py", "-w", "steps", "-i", "@input.json", "--key", "two", "--json", cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    outcome = json.loads(as_json.stdout)
    assert outcome["result"] == {"n": 2, "sum": 10} and outcome["status"] == "completed"
    assert outcome["run_id"].startswith("steps-") and outcome["exit_code"] == 0
    assert as_json.stderr == ""
    unknown = durably("run", "job.py", "--workflow", "nope", cwd=tmp_path)
    assert unknown.returncode == 2 and "no workflow named 'nope'" in unknown.stderr and "steps" in unknown.stderr
    state = json.loads(durably("inspect", "two", "--json", cwd=tmp_path).stdout)
    assert state["script"] == str(script.resolve()) and state["input"] == {"n": 2}


def test_run_resumes_after_sigkill(tmp_path: Path, script: Path) -> None:
    first = durably("run", "job.py", "--", "4", KILL_AT="2", cwd=tmp_path)
    assert first.returncode == -9
    assert executions(script) == ["step-0", "step-1", "step-2"]
    second = durably("run", "job.py", "--", "4", KILL_AT="2", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.endswith("result: {'n': 4, 'sum': 60}\n")
    assert executions(script) == ["step-0", "step-1", "step-2", "step-2", "step-3"]
    assert "2 ran" in second.stderr and "2 replayed" in second.stderr
    rows = json.loads(durably("list", "--json", cwd=tmp_path).stdout)
    assert len(rows) == 1 and rows[0]["status"] == "completed"


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(("example", "args", "expected"), [
    ("quickstart.py", ["2"], '"receipt": "receipt for pay-'),
    ("slow_steps.py", ["3", "0.01"], "{'steps': 3,"),
])
def test_examples_run_under_durably(tmp_path: Path, example: str, args: list[str], expected: str) -> None:
    proc = durably("run", str(EXAMPLES / example), "--", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout and "completed" in proc.stderr
    rows = json.loads(durably("list", "--json", cwd=tmp_path).stdout)
    assert [r["script"] for r in rows] == [str(EXAMPLES / example)]


# ---- signal and parking -----------------------------------------------------------------------------


@workflow
async def cli_gate(ctx: Any) -> str:
    answer = await ctx.wait_for("open", timeout=600)
    return f"opened by {answer['by']}"


def test_signal_delivers_to_a_parked_run(state_dir: Path) -> None:
    from durably_py import RunParkedError

    with pytest.raises(RunParkedError):
        run(cli_gate, key="gate", dir=state_dir, wait=False)
    listed = json.loads(invoke("list", "--dir", str(state_dir), "--json", "--status", "waiting").stdout)
    assert [r["key"] for r in listed] == ["gate"]
    sent = invoke("signal", "gate", "open", '{"by": "ops"}', "--dir", str(state_dir))
    assert sent.exit_code == 0, sent.output
    assert run(cli_gate, key="gate", dir=state_dir) == "opened by ops"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["gate", "open", "{not json"], "not valid JSON"),
        (["gate", "", "1"], "signal name"),
        (["gate", "$cancel", "1"], "signal name"),
        (["nope", "open", "1"], "no run"),
        (["../etc", "open", "1"], "invalid run id"),
    ],
)
def test_bad_signals_exit_2_with_a_hint(state_dir: Path, args: list[str], needle: str) -> None:
    from durably_py import RunParkedError

    with pytest.raises(RunParkedError):
        run(cli_gate, key="gate", dir=state_dir, wait=False)
    result = invoke("signal", *args, "--dir", str(state_dir))
    assert result.exit_code == 2
    assert needle in result.output and "hint" in result.output


def test_run_no_wait_exits_3_when_parked(tmp_path: Path) -> None:
    script = tmp_path / "gate.py"
    script.write_text(textwrap.dedent("""
        from durably_py import workflow

        @workflow
        async def gate(ctx):
            return await ctx.wait_for("open", timeout=60)
    """))
    done = run_cli("run", str(script), "--workflow", "gate", "--no-wait", "--dir", str(tmp_path / "state"),
                   pythonpath=False)
    assert done.returncode == 3, done.stderr
    assert "waiting" in done.stderr


def test_approval_example_parks_takes_a_signal_and_finishes(tmp_path: Path) -> None:
    args = ["run", str(EXAMPLES / "approval.py"), "--workflow", "expense", "--input", '{"amount": 420}',
            "--key", "exp-1"]
    parked = durably(*args, "--no-wait", cwd=tmp_path)
    assert parked.returncode == 3, parked.stderr
    assert "waiting for the signal 'approval'" in parked.stderr  # ctx.log writes to stderr
    sent = durably("signal", "exp-1", "approval", '{"ok": true, "by": "ana"}', cwd=tmp_path)
    assert sent.returncode == 0, sent.stderr
    done = durably(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == "paid 420.00, approved by ana"
    assert "waiting for the signal" not in done.stderr  # ctx.log stays quiet while a parked run resumes
    rows = {r["workflow"]: r["status"] for r in json.loads(durably("list", "--json", cwd=tmp_path).stdout)}
    assert rows == {"expense": "completed", "check_line": "completed"}
