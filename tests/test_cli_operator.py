"""The operator's CLI through real subprocesses: JSON-only stdout, every run in the summary, parked state,
readable tables at 80 columns, `--from-step` syntax, SIGTERM, state-dir discovery and the small defects."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import durably as run_cli
from helpers import read_until

WORKFLOWS = textwrap.dedent('''
    import os, sys, time
    from durably_py import Retry, workflow

    def maybe_fail(x):
        if os.environ.get("FAIL"):
            raise ValueError("told to fail")
        return x

    @workflow
    async def resumable(ctx, n):
        a = await ctx.step(add_one, n)
        return await ctx.step(maybe_fail, a)

    def add_one(x):
        return x + 1

    def nap(seconds):
        time.sleep(seconds)
        return seconds

    def slow_forever(x):
        time.sleep(5)
        return x

    @workflow
    async def loud(ctx, n):
        ctx.log("hello from ctx.log")
        return await ctx.step(add_one, n)

    @workflow
    async def nostep(ctx, n):
        return n * 2

    @workflow
    async def early(ctx, n):
        raise ValueError("broken before any step")

    @workflow
    async def noinput(ctx):
        return "ok"

    @workflow
    async def waiter(ctx):
        await ctx.step(add_one, 1)
        return await ctx.wait_for("approval", timeout=3600)

    @workflow
    async def napper(ctx, n):
        return [await ctx.step(nap, n) for _ in range(2)]

    @workflow
    async def twice(ctx, n):
        a = await ctx.step(add_one, n, name="inc")
        b = await ctx.step(add_one, a, name="inc")
        return await ctx.step(add_one, b, name="last")

    def flaky(n):
        from durably_py import attempt
        if attempt().number < 3:
            raise ConnectionError(f"try {attempt().number} failed")
        return {"n": n, "ok": True}

    @workflow
    async def inspected(ctx, inp):
        a = await ctx.step(flaky, inp["n"], retry=Retry(3, base=0.01))
        await ctx.sleep(0.3)
        if os.environ.get("CUT"):
            os._exit(9)
        return await ctx.wait_for("approval", timeout=3600)

    @workflow
    async def child(ctx, x):
        return x

    def missing_input(results):
        raise KeyError("no such field")

    @workflow
    async def grapher(ctx):
        from durably_py import Task
        done = await ctx.graph({"a": Task(child, 1), "b": Task(child, missing_input, depends_on=["a"])})
        return sorted(done)

    @workflow
    async def bad_kwargs(ctx, n):
        return await ctx.step(add_one, n, x=1)

    @workflow
    async def timing_out(ctx, n):
        return await ctx.step(slow_forever, n, timeout=0.05, retry=Retry(2, base=0.01))

    if __name__ == "__main__":
        from durably_py import run
        print(run(resumable, int(sys.argv[1])))
''')


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder holding `wf.py`, with the user's config and durably environment kept out."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "user-config"))
    for name in ("DURABLY_DIR", "DURABLY_STORAGE", "DURABLY_SCRIPT", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "project"
    (root / "sub").mkdir(parents=True)
    (root / "wf.py").write_text(WORKFLOWS)
    return root


durably = partial(run_cli, columns=80, pythonpath=False)


def seed(cwd: Path, *runs: tuple[str, Any, str | None, bool]) -> None:
    """Record runs of wf.py's workflows in one process (workflow, input, key, fail?): cheaper than one CLI each."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, ".")
        import wf
        from durably_py import run
        for name, value, key, fail in {runs!r}:
            os.environ["FAIL"] = "1" if fail else ""
            try:
                run(getattr(wf, name), value, key=key)
            except Exception:
                pass
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def as_json(proc: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(proc.stdout)


# ---- 1. --json keeps stdout JSON only --------------------------------------------------------------------


def test_run_and_restart_json_is_one_object_with_the_run_id(project: Path) -> None:
    proc = durably("run", "wf.py", "--workflow", "loud", "--input", "1", "--json", cwd=project)
    assert proc.returncode == 0, proc.stderr
    out = as_json(proc)
    assert out["run_id"].startswith("loud-") and out["status"] == "completed" and out["result"] == 2
    assert out["exit_code"] == 0 and out["error"] is None
    assert [r["run_id"] for r in out["runs"]] == [out["run_id"]] and out["runs"][0]["ran"] == 1
    assert "hello from ctx.log" in proc.stderr
    again = durably("restart", out["run_id"], "--json", cwd=project)
    assert again.returncode == 0, again.stderr
    restarted = as_json(again)
    assert restarted["run_id"] != out["run_id"] and restarted["result"] == 2
    failed = durably("run", "wf.py", "--workflow", "early", "--input", "1", "--json", cwd=project)
    assert failed.returncode == 1
    body = as_json(failed)
    assert body["status"] == "failed" and body["error"] == {"type": "ValueError", "message": "broken before any step"}


# ---- 2. every run appears, also without a step of its own -------------------------------------------------


def test_runs_without_steps_appear_in_the_summary(project: Path) -> None:
    for name, code, status in (("nostep", 0, "completed"), ("early", 1, "failed")):
        proc = durably("run", "wf.py", "--workflow", name, "--input", "3", cwd=project)
        assert proc.returncode == code, proc.stderr
        run_id = json.loads(durably("list", "--workflow", name, "--json", cwd=project).stdout)[0]["run_id"]
        assert f"{run_id}  {status}  0 steps: 0 ran · 0 replayed" in proc.stderr
        assert "no durable" not in proc.stderr


def test_a_process_that_joins_a_live_run_reports_it(project: Path) -> None:
    args = [sys.executable, "-m", "durably_py.cli", "run", "wf.py", "--workflow", "napper", "--input", "0.6"]
    first = subprocess.Popen(args, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not list((project / ".durably" / "runs").glob("napper-*.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.05)
    joined = durably("run", "wf.py", "--workflow", "napper", "--input", "0.6", cwd=project)
    first.communicate(timeout=30)
    assert joined.returncode == 0, joined.stderr
    assert json.loads(joined.stdout) == [0.6, 0.6]
    run_id = json.loads(durably("list", "--json", cwd=project).stdout)[0]["run_id"]
    assert f"{run_id}  completed" in joined.stderr


# ---- 3 and 8. parked state in the live view; SIGTERM like Ctrl-C -------------------------------------------


def test_live_view_shows_the_wait_and_sigterm_restores_the_terminal(project: Path) -> None:
    controller, terminal = pty.openpty()
    env = {**os.environ, "COLUMNS": "100", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", "wf.py", "--workflow", "waiter"],
                            cwd=project, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=terminal, env=env)
    os.close(terminal)
    try:
        seen = read_until(controller, b"waiting for 'approval' (deadline", 20)
        assert b"waiting for 'approval' (deadline" in seen, seen.decode(errors="replace")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
        seen += read_until(controller, b"done in", 5)
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
    text = seen.decode(errors="replace")
    assert "\x1b[?25h" in text  # the cursor is shown again
    assert "stopped by SIGTERM; run the same command again to resume where it stopped" in text


def test_sigterm_exits_143_and_the_run_resumes(project: Path) -> None:
    args = [sys.executable, "-m", "durably_py.cli", "run", "wf.py", "--workflow", "napper", "--input", "1.5"]
    proc = subprocess.Popen(args, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            b'"t":"ok"' in log.read_bytes() for log in (project / ".durably" / "runs").glob("napper-*.jsonl")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM; run the same command again to resume where it stopped" in err
    assert "interrupted" in err and out == ""
    again = durably("run", "wf.py", "--workflow", "napper", "--input", "1.5", cwd=project)
    assert again.returncode == 0 and "1 replayed" in again.stderr


STUBBORN = textwrap.dedent("""
    import asyncio, pathlib
    from durably_py import workflow

    async def stubborn(marker):
        pathlib.Path(marker).write_text("started")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(60)  # a clean-up that takes its time: only a second Ctrl-C cuts it short
        return 1

    @workflow
    async def holdout(ctx, marker):
        await ctx.step(lambda: 0, name="quick")
        return await ctx.step(stubborn, marker)
""")


def test_a_second_ctrl_c_exits_at_once_and_restores_the_terminal(project: Path) -> None:
    (project / "stubborn.py").write_text(STUBBORN)
    marker = project / "started"
    controller, terminal = pty.openpty()
    env = {**os.environ, "COLUMNS": "100", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", "stubborn.py", "--workflow", "holdout",
                             "--input", json.dumps(str(marker))], cwd=project, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=terminal, env=env)
    os.close(terminal)
    try:
        deadline = time.monotonic() + 30
        seen = b""
        while not marker.exists() and time.monotonic() < deadline:
            seen += read_until(controller, b"\0", 0.1)
        assert marker.exists(), seen.decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        seen += read_until(controller, b"\0", 1.0)
        assert proc.poll() is None  # the step's clean-up holds the first Ctrl-C
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        assert proc.wait(timeout=10) == 130
        assert time.monotonic() - started < 5
        seen += read_until(controller, b"done in", 5)
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
    text = seen.decode(errors="replace")
    assert "\x1b[?25h" in text  # the cursor is shown again
    assert "interrupted; run the same command again to resume where it stopped" in text
    state = json.loads(durably("inspect", "--json", "--dir", ".durably",
                               durably("list", "-q", cwd=project).stdout.split()[0], cwd=project).stdout)
    assert state["status"] == "interrupted"


def test_list_on_a_terminal_shows_a_page_of_20_and_says_how_many_more(project: Path) -> None:
    seed(project, *[("twice", n, f"k-{n}", False) for n in range(23)])
    controller, terminal = pty.openpty()
    env = {**os.environ, "COLUMNS": "200", "TERM": "xterm", "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "list"], cwd=project, stdin=subprocess.DEVNULL,
                            stdout=terminal, stderr=subprocess.PIPE, env=env)
    os.close(terminal)
    try:
        seen = read_until(controller, b"more at once)", 30)
        assert proc.wait(timeout=30) == 0
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
    lines = seen.decode(errors="replace").splitlines()
    assert sum("twice-" in line for line in lines) == 20
    assert lines[-1].strip() == "3 more (--offset 20 shows the next page, --limit N more at once)"
    assert len(durably("list", "-q", cwd=project).stdout.split()) == 23  # piped output is not cut


def test_no_wait_summary_says_what_the_run_waits_for(project: Path) -> None:
    proc = durably("run", "wf.py", "--workflow", "waiter", "--no-wait", cwd=project)
    assert proc.returncode == 3
    run_id = json.loads(durably("list", "--json", cwd=project).stdout)[0]["run_id"]
    assert f"`durably signal {run_id} approval PAYLOAD`" in proc.stderr  # the real signal name
    assert "waiting for 'approval' (deadline 20" in proc.stderr
    out = as_json(durably("run", "wf.py", "--workflow", "waiter", "--no-wait", "--json", cwd=project))
    assert out["status"] == "waiting" and out["detail"].startswith("waiting for 'approval' (deadline ")
    assert out["exit_code"] == 3 and out["error"]["type"] == "RunParkedError"


# ---- 4. durably list at 80 columns ----------------------------------------------------------------------


def test_list_fits_80_columns_with_whole_ids_and_names_the_empty_filter(project: Path) -> None:
    seed(project, *[("twice", n, f"key-number-{n}", False) for n in range(3)], ("early", 1, None, False))
    table = durably("list", cwd=project)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[0].split() == ["run", "id", "workflow", "key", "status", "updated"]
    for row in json.loads(durably("list", "--json", cwd=project).stdout):
        assert any(line.startswith(row["run_id"] + " ") for line in lines), row["run_id"]
    empty = durably("list", "--status", "cancelled", "--workflow", "twice", cwd=project)
    assert empty.returncode == 0
    assert empty.stdout.startswith("no runs match --status cancelled --workflow twice in ")


# ---- 6. --from-step takes what its hint shows ---------------------------------------------------------------


def test_from_step_takes_paths_labels_and_label_nth(project: Path) -> None:
    run_id = as_json(durably("run", "wf.py", "--workflow", "twice", "--input", "1", "--json", cwd=project))["run_id"]
    for spec, ran in (("1", 2), ("inc", 3), ("inc#2", 2), ("last", 1)):
        proc = durably("retry", run_id, "--from-step", spec, "--json", cwd=project)
        assert proc.returncode == 0, (spec, proc.stderr)
        out = as_json(proc)
        assert out["result"] == 4 and out["runs"][0]["ran"] == ran, spec
    bad = durably("retry", run_id, "--from-step", "inc#3", cwd=project)
    assert bad.returncode == 2
    assert f"--from-step inc#3 matches no recorded step of run {run_id}; its steps: 0 inc, 1 inc, 2 last" in bad.stderr
    assert "a step path such as 2, 2.0.1 or (2, 0, 1)" in bad.stderr and "label#N" in bad.stderr
    assert "(3, 1, 0)" not in bad.stderr


# ---- 10. inspect ------------------------------------------------------------------------------------------


def test_inspect_shows_json_values_waits_sleeps_failed_attempts_and_the_next_move(project: Path) -> None:
    cut = durably("run", "wf.py", "--workflow", "inspected", "--input", '{"n": 1}', CUT="1", cwd=project)
    assert cut.returncode == 9
    run_id = json.loads(durably("list", "--json", cwd=project).stdout)[0]["run_id"]
    shown = durably("inspect", run_id, COLUMNS="200", cwd=project).stdout
    assert "input     {\"n\": 1}" in shown and "status    interrupted" in shown
    assert f"next      durably retry {run_id} resumes it (cut off after (1,) ctx.sleep)" in shown
    parked = durably("run", "wf.py", "--workflow", "inspected", "--input", '{"n": 1}', "--no-wait", cwd=project)
    assert parked.returncode == 3 and "1 step: 0 ran · 1 replayed" in parked.stderr
    lines = durably("inspect", run_id, COLUMNS="200", cwd=project).stdout.splitlines()
    assert any(line.startswith("parked    waiting for 'approval' (deadline 20") for line in lines)
    assert f"next      durably signal {run_id} approval PAYLOAD" in lines
    assert "steps (1) · ctx calls (1 · 1 waiting)" in lines  # as the summary counts: the flaky step
    flaky = next(line for line in lines if "(0,) flaky" in line)
    assert flaky.endswith('→ {"n": 1, "ok": true}') and "3 attempts" in flaky
    assert any(line.endswith("attempt 1 failed after " + line.split("after ")[-1].split(":")[0]
                             + ": ConnectionError: try 1 failed") for line in lines)
    assert sum("failed after" in line for line in lines) == 2
    sleep = next(line for line in lines if "(1,) ctx.sleep" in line)
    seconds = float(sleep.split()[-1].removesuffix("ms")) / 1000
    assert 0.25 <= seconds < 5, sleep
    wait = next(line for line in lines if "(2,) ctx.wait_for" in line)
    assert "→ waiting for signal 'approval' until 20" in wait
    state = json.loads(durably("inspect", run_id, "--json", cwd=project).stdout)
    assert state["input"] == {"n": 1} and state["status"] == "waiting"


# ---- 5. graph truth after a Task.input function raised -----------------------------------------------------


def test_graph_shows_a_task_whose_input_raised_as_failed(project: Path) -> None:
    proc = durably("run", "wf.py", "--workflow", "grapher", "--json", cwd=project)
    out = as_json(proc)
    assert out["status"] == "completed", proc.stderr
    graph = as_json(durably("graph", out["run_id"], "--json", cwd=project))
    assert [(n["id"], n["status"], n["wait"]) for n in graph[0]["nodes"]] == [
        ("a", "completed", None), ("b", "failed", "input_failed")]
    assert graph[0]["status"] != "running"
    assert "running" not in durably("graph", out["run_id"], cwd=project).stdout


# ---- 9. the state dir is found like git finds .git ----------------------------------------------------------


def test_state_dir_is_the_nearest_durably_folder(project: Path) -> None:
    failed = durably("run", "wf.py", "--workflow", "resumable", "--input", "5", FAIL="1", cwd=project)
    assert failed.returncode == 1
    from_sub = durably("run", "../wf.py", "--workflow", "resumable", "--input", "5", cwd=project / "sub")
    assert from_sub.returncode == 0 and json.loads(from_sub.stdout) == 6
    assert "1 ran · 1 replayed" in from_sub.stderr
    assert not (project / "sub" / ".durably").exists()
    rows = json.loads(durably("list", "--json", cwd=project / "sub").stdout)
    assert len(rows) == 1 and rows[0]["workflow"] == "resumable" and rows[0]["status"] == "completed"
    script = durably("run", "../wf.py", "--", "7", FAIL="1", cwd=project / "sub")
    assert script.returncode == 1
    resumed = durably("run", "../wf.py", "--", "7", cwd=project / "sub")
    assert resumed.returncode == 0 and "1 ran · 1 replayed" in resumed.stderr
    assert not (project / "sub" / ".durably").exists()
    not_a_dir = durably("list", "--dir", "wf.py", cwd=project)
    assert not_a_dir.returncode == 2 and "--dir 'wf.py' is a file, not a directory" in not_a_dir.stderr


# ---- 11. the small ones ----------------------------------------------------------------------------------------


def test_signal_json_cancel_twice_and_usage_errors(project: Path) -> None:
    durably("run", "wf.py", "--workflow", "waiter", "--no-wait", "--key", "gate", cwd=project)
    run_id = json.loads(durably("list", "--json", cwd=project).stdout)[0]["run_id"]
    sent = as_json(durably("signal", "gate", "other", "1", "--json", cwd=project))
    assert sent == {"run_id": run_id, "signal": "other", "payload": 1, "sent": True, "status": "waiting",
                    "awaited": ["approval"],
                    "warning": f"{run_id} waits for 'approval', not 'other': 'other' stays in its inbox until a "
                               "ctx.wait_for('other') reads it (--strict refuses such a signal)"}
    first = durably("cancel", "gate", "--json", cwd=project)
    assert as_json(first) == {"run_id": run_id, "status": "cancelled", "cancelled": True}
    second = durably("cancel", "gate", cwd=project)
    assert second.returncode == 0 and second.stderr.strip() == f"{run_id} was already cancelled"

    (project / "broken.py").write_text("def oops(:\n")
    syntax = durably("run", "broken.py", "--workflow", "x", cwd=project)
    assert syntax.returncode == 2
    assert "cannot import broken.py: SyntaxError:" in syntax.stderr and "broken.py:1" in syntax.stderr

    option = durably("run", "wf.py", "--verbose", cwd=project)
    flat = " ".join(option.stderr.replace("│", " ").split())
    assert option.returncode == 2 and "Options for the script go after `--`: durably run SCRIPT -- --verbose" in flat

    no_input = durably("run", "wf.py", "--workflow", "noinput", "--input", "1", cwd=project)
    assert no_input.returncode == 2
    assert "ValidationError: workflow 'noinput' takes no input, got 1" in no_input.stderr

    kwargs = durably("run", "wf.py", "--workflow", "bad_kwargs", "--input", "1", cwd=project)
    assert kwargs.returncode == 1
    assert "ArgumentError: ctx.step() got unknown keyword argument(s) 'x'" in kwargs.stderr

    timed = durably("run", "wf.py", "--workflow", "timing_out", "--input", "1", cwd=project)
    assert timed.returncode == 1 and "StepTimeoutError" in timed.stderr
    assert "give `retry=` more attempts" in timed.stderr and "add `retry=`" not in timed.stderr


# ---- list filters, paging, -q and -o ------------------------------------------------------------------------


def test_list_filters_pages_and_quiet_ids_feed_xargs(project: Path) -> None:
    seed(project, *[("resumable", n, f"night-{n}", n > 0) for n in range(3)], ("twice", 1, "day-1", False))
    rows = json.loads(durably("list", "--json", cwd=project).stdout)
    assert len(rows) == 4
    failed = durably("list", "-q", "--status", "failed", cwd=project)
    assert sorted(failed.stdout.split()) == sorted(r["run_id"] for r in rows if r["status"] == "failed")
    both = durably("list", "-q", "--status", "failed", "--status", "completed", "--key", "night-", cwd=project)
    assert len(both.stdout.split()) == 3
    page = [json.loads(line) for line in durably("list", "-o", "jsonl", "--limit", "2", "--offset", "1", cwd=project)
            .stdout.splitlines()]
    assert [r["run_id"] for r in page] == [r["run_id"] for r in rows[1:3]]
    table = durably("list", "--limit", "3", cwd=project).stdout
    assert table.rstrip().endswith("1 more (--offset 3 shows the next page, --limit N more at once)")
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert durably("list", "-q", "--since", future, cwd=project).stdout == ""
    assert len(durably("list", "-q", "--since", "1h", "--until", future, cwd=project).stdout.split()) == 4
    assert durably("list", "-q", "--until", "1h", cwd=project).stdout == ""
    assert durably("list", "--since", "yesterday", cwd=project).returncode == 2

    cli = f"{sys.executable} -m durably_py.cli"
    retried = subprocess.run(f"{cli} list -q --status failed | xargs -n1 {cli} retry", shell=True, cwd=project,
                             capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert retried.returncode == 0, retried.stderr
    statuses = {r["status"] for r in json.loads(durably("list", "--json", cwd=project).stdout)}
    assert statuses == {"completed"}


# ---- durably logs ----------------------------------------------------------------------------------------------


def test_logs_follow_prints_what_another_process_appends_until_the_run_ends(project: Path) -> None:
    args = [sys.executable, "-m", "durably_py.cli", "run", "wf.py", "--workflow", "napper", "--input", "0.8"]
    writer = subprocess.Popen(args, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = project / ".durably" / "runs"
    deadline = time.monotonic() + 20
    while not list(runs.glob("napper-*.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.05)
    run_id = next(runs.glob("napper-*.jsonl")).stem
    started = time.time()
    followed = durably("logs", run_id, "--follow", "-o", "jsonl", cwd=project)
    writer.communicate(timeout=30)
    assert followed.returncode == 0, followed.stderr
    records = [json.loads(line) for line in followed.stdout.splitlines()]
    assert records[0]["t"] == "run" and records[0]["run_id"] == run_id
    assert records[-1]["t"] == "end" and records[-1]["status"] == "completed"
    oks = [r for r in records if r["t"] == "ok"]
    assert [r["l"] for r in oks] == ["nap", "nap"] and any(r["ts"] > started for r in oks)
    assert records == [json.loads(line) for line in durably("logs", run_id, "-o", "jsonl", cwd=project).stdout.splitlines()]
    shown = durably("logs", run_id, COLUMNS="200", cwd=project).stdout.splitlines()
    assert f"run {run_id} of napper created  input 0.8" in shown[0]
    assert "(0,) nap  ok" in shown[2] and shown[-1].endswith("run completed  → [0.8, 0.8]")


def test_logs_follow_stops_when_the_run_parks(project: Path) -> None:
    durably("run", "wf.py", "--workflow", "waiter", "--no-wait", "--key", "gate", cwd=project)
    followed = durably("logs", "gate", "--follow", timeout=20, cwd=project)
    assert followed.returncode == 0
    assert "waiting for signal 'approval' (deadline " in followed.stdout.splitlines()[-1]


# ---- configuration: flags > env > project config > user config > nearest .durably/ ---------------------------


def config_of(cwd: Path, *args: str, **env: str) -> dict[str, Any]:
    proc = durably("config", "--json", *args, **env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return as_json(proc)


def test_settings_come_from_flags_env_project_and_user_config_in_that_order(project: Path, tmp_path: Path) -> None:
    sub = project / "sub"
    assert config_of(sub)["sources"] == {"dir": "default", "color": "default"}
    made = durably("init", cwd=project)
    assert made.returncode == 0 and "created .durably/config.toml" in made.stderr.replace(str(project) + "/", "")
    assert (project / ".durably" / ".gitignore").read_text().splitlines()[1:] == ["*", "!.gitignore", "!config.toml"]
    found = config_of(sub)
    assert found["dir"] == str(project / ".durably") and found["sources"]["dir"] == "nearest .durably/"

    user = tmp_path / "user-config" / "durably" / "config.toml"
    user.parent.mkdir(parents=True)
    user.write_text('dir = "/tmp/from-user"\ncolor = false\n')
    from_user = config_of(sub)
    assert from_user["dir"] == "/tmp/from-user" and from_user["sources"] == {"dir": str(user), "color": str(user)}
    (project / ".durably" / "config.toml").write_text('dir = "state"\n')
    from_project = config_of(sub)
    assert from_project["dir"] == str(project / "state")
    assert from_project["sources"] == {"dir": str(project / ".durably" / "config.toml"), "color": str(user)}
    from_env = config_of(sub, DURABLY_DIR=str(tmp_path / "env-dir"), NO_COLOR="1")
    assert from_env["dir"] == str(tmp_path / "env-dir") and from_env["sources"] == {"dir": "$DURABLY_DIR",
                                                                                    "color": "$NO_COLOR"}
    from_flag = config_of(sub, "--storage", "sqlite:runs.db", DURABLY_DIR=str(tmp_path / "env-dir"))
    assert from_flag["storage"] == "sqlite:runs.db" and from_flag["dir"] is None
    assert from_flag["sources"]["storage"] == "--storage"
    shown = durably("config", cwd=sub).stdout.splitlines()
    assert shown[0] == f"dir     {project / 'state'}  ({project / '.durably' / 'config.toml'})"

    ran = durably("run", "../wf.py", "--workflow", "twice", "--input", "1", cwd=sub)
    assert ran.returncode == 0 and list((project / "state" / "runs").glob("twice-*.jsonl"))

    (project / ".durably" / "config.toml").write_text('dri = "state"\n')
    bad = durably("list", cwd=sub)
    assert bad.returncode == 2 and "has unknown key 'dri'" in bad.stderr and "dir, storage, color" in bad.stderr


def test_this_repository_commits_an_example_durably_folder() -> None:
    from durably_py._config import read_config

    root = Path(__file__).resolve().parent.parent
    assert read_config(root / ".durably" / "config.toml") == {}  # every key is an example, commented out
    kept = [line for line in (root / ".durably" / ".gitignore").read_text().splitlines() if not line.startswith("#")]
    assert kept == ["*", "!.gitignore", "!config.toml"]
    assert "!/.durably/config.toml" in (root / ".gitignore").read_text()
