"""Operations by filter: `durably cancel|resume|retry --status ... --workflow ... [--yes]` count the runs, ask
(and touch nothing without `--yes` and without a terminal), then act; `engine.cancel_many`, `resume_many` and
`retry_many` return the runs acted on and, for each they could not act on, why."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import durably, read_until

from durably_py import BulkResult, ValidationError, create_engine

WF = textwrap.dedent('''
    import os, sys
    from durably_py import workflow

    def call(n):
        if os.path.exists(os.path.join(os.path.dirname(__file__), "outage")):
            raise ConnectionError("downstream is down")
        return n * 2

    @workflow
    async def bulk_job(ctx, n):
        return await ctx.step(call, n)

    @workflow
    async def bulk_other(ctx, n):
        return await ctx.step(call, n)

    @workflow
    async def bulk_gate(ctx, n):
        await ctx.step(call, n)
        return await ctx.wait_for("go", timeout=3600)

    if __name__ == "__main__":
        from durably_py import create_engine
        import asyncio
        engine = create_engine(sys.argv[1])

        async def main():
            for n in range(int(sys.argv[3])):
                try:
                    await engine.run({"job": bulk_job, "other": bulk_other, "gate": bulk_gate}[sys.argv[2]], n, wait=False)
                except Exception:
                    pass

        asyncio.run(main())
''')

STORES = {"file": ".durably", "sqlite": "sqlite:runs.db"}


def project(tmp_path: Path) -> Path:
    (tmp_path / "wf.py").write_text(WF)
    return tmp_path


def seed(root: Path, storage: str, workflow: str, count: int, script: str = "wf.py") -> None:
    """Record `count` runs of `workflow` in one process (with the outage flag set, they fail)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, script, storage, workflow, str(count)], cwd=root, env=env, check=True,
                   timeout=120)


def cli(root: Path, storage: str, *args: str) -> subprocess.CompletedProcess[str]:
    return durably(*args, "--storage", storage, cwd=root, timeout=180)


def statuses(root: Path, storage: str, workflow: str | None = None) -> dict[str, int]:
    """How many runs of the store have each status (read in this process: cheaper than `durably list`)."""
    url = f"sqlite:{root / storage.removeprefix('sqlite:')}" if storage.startswith("sqlite:") else str(root / storage)
    counts: dict[str, int] = {}
    for run in asyncio.run(create_engine(url).list(workflow=workflow)):
        counts[run.status] = counts.get(run.status, 0) + 1
    return counts


@pytest.mark.parametrize("kind", sorted(STORES))
def test_fifty_failed_runs_are_retried_in_one_command_after_a_confirmation(tmp_path: Path, kind: str) -> None:
    root, storage = project(tmp_path), STORES[kind]
    (root / "outage").touch()
    seed(root, storage, "job", 50)
    seed(root, storage, "other", 3)
    assert statuses(root, storage) == {"failed": 53}

    refused = cli(root, storage, "retry", "--status", "failed", "--workflow", "bulk_job")  # no --yes, no terminal
    assert refused.returncode == 2, refused.stderr
    assert "would retry 50 runs matching --status failed --workflow bulk_job" in refused.stderr
    assert "nothing was touched" in refused.stderr and "--yes" in refused.stderr
    assert statuses(root, storage) == {"failed": 53}

    (root / "outage").unlink()
    started = time.perf_counter()
    done = cli(root, storage, "retry", "--status", "failed", "--workflow", "bulk_job", "--yes", "--json")
    took = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["operation"] == "retry" and report["selected"] == 50 and report["skipped"] == []
    assert len(report["acted"]) == 50 and {a["status"] for a in report["acted"]} == {"completed"}
    assert statuses(root, storage, "bulk_job") == {"completed": 50}
    assert statuses(root, storage, "bulk_other") == {"failed": 3}  # the filter kept them out
    print(f"\n{kind}: 50 failed runs retried in one `durably retry --status failed --yes`: {took:.2f} s")

    table = cli(root, storage, "retry", "-w", "bulk_other", "-y")
    assert table.returncode == 0 and "retried 3 of 3 runs: 3 completed" in table.stderr
    nothing = cli(root, storage, "retry", "--status", "failed", "-y")
    assert nothing.returncode == 0 and "no run matches --status failed; nothing to retry" in nothing.stderr


def test_cancel_and_resume_by_filter_through_the_cli(tmp_path: Path) -> None:
    root, storage = project(tmp_path), STORES["file"]
    seed(root, storage, "gate", 4)
    seed(root, storage, "job", 2)
    assert statuses(root, storage) == {"waiting": 4, "completed": 2}
    engine = create_engine(root / storage)
    for run in asyncio.run(engine.list(workflow="bulk_gate"))[:3]:
        assert asyncio.run(engine.pause(run.run_id)).status == "paused"
    assert statuses(root, storage, "bulk_gate") == {"paused": 3, "waiting": 1}

    resumed = cli(root, storage, "resume", "--status", "paused", "--yes", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["selected"] == 3
    assert statuses(root, storage, "bulk_gate") == {"waiting": 4}

    wrong = cli(root, storage, "cancel", "--status", "completed", "--yes")
    assert wrong.returncode == 2 and "not 'completed'" in wrong.stderr
    both = cli(root, storage, "cancel", "some-run", "--workflow", "bulk_gate")
    assert both.returncode == 2 and "takes a RUN or --status/--workflow, not both" in both.stderr

    cancelled = cli(root, storage, "cancel", "--workflow", "bulk_gate", "--yes")
    assert cancelled.returncode == 0, cancelled.stderr
    assert "cancelled 4 of 4 runs: 4 cancelled" in cancelled.stderr
    assert statuses(root, storage) == {"cancelled": 4, "completed": 2}


def _on_a_terminal(root: Path, answer: bytes, *args: str) -> tuple[int, str]:
    """Run the CLI with stdin and stderr on a terminal, answer its question, return (exit code, what it showed)."""
    controller, terminal = pty.openpty()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", *args], cwd=root, env=env, stdin=terminal,
                            stdout=subprocess.PIPE, stderr=terminal)
    os.close(terminal)
    try:
        seen = read_until(controller, b"[y/N]", 60)
        os.write(controller, answer + b"\n")
        code = proc.wait(timeout=60)
        seen += read_until(controller, b"\x00", 0.5)
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
    return code, seen.decode(errors="replace")


def test_on_a_terminal_the_count_is_shown_and_only_yes_acts(tmp_path: Path) -> None:
    root = project(tmp_path)
    seed(root, ".durably", "gate", 3)
    code, shown = _on_a_terminal(root, b"n", "cancel", "--status", "waiting")
    assert "cancel 3 runs matching --status waiting: bulk_gate-" in shown and "Cancel 3 runs? [y/N]" in shown
    assert code == 1 and "nothing was touched" in shown
    assert statuses(root, ".durably") == {"waiting": 3}
    code, shown = _on_a_terminal(root, b"y", "cancel", "--status", "waiting")
    assert code == 0 and "cancelled 3 of 3 runs: 3 cancelled" in shown
    assert statuses(root, ".durably") == {"cancelled": 3}


def test_the_python_api_returns_what_it_acted_on_and_why_not(tmp_path: Path) -> None:
    root = project(tmp_path)
    seed(root, ".durably", "gate", 2)
    (root / "outage").touch()
    seed(root, ".durably", "job", 5)
    (root / "ghost.py").write_text(WF.replace("bulk_job", "bulk_ghost").replace('"job": ', '"ghost": '))
    seed(root, ".durably", "ghost", 1, script="ghost.py")
    (root / "ghost.py").unlink()  # the code of that run is gone
    engine = create_engine(root / ".durably")

    async def main() -> None:
        preview = await engine.retry_many(status="failed", dry_run=True)
        assert isinstance(preview, BulkResult) and len(preview.selected) == 6 and preview.acted == []
        assert len(await engine.list(status="failed")) == 6  # a dry run touches nothing
        with pytest.raises(ValidationError, match="not 'waiting'"):
            await engine.retry_many(status="waiting")
        with pytest.raises(ValidationError, match="workflow="):
            await engine.cancel_many(workflow="")

        again = await engine.retry_many(workflow="bulk_job")  # the outage goes on: each fails again, still acted on
        assert len(again.acted) == 5 and {s.status for s in again.acted} == {"failed"} and not again.skipped

        (root / "outage").unlink()
        (victim,) = [r for r in preview.selected if r.startswith("bulk_ghost-")]
        result = await engine.retry_many(status=["failed", "interrupted"])
        assert sorted(s.run_id for s in result.acted) == sorted(r for r in preview.selected if r != victim)
        assert {s.status for s in result.acted} == {"completed"}
        assert list(result.skipped) == [victim]
        assert "cannot find the code of workflow 'bulk_ghost'" in result.skipped[victim]

        paused = await engine.cancel_many(workflow="bulk_gate", dry_run=True)
        for run_id in paused.selected:
            await engine.pause(run_id)
        resumed = await engine.resume_many()
        assert sorted(s.run_id for s in resumed.acted) == sorted(paused.selected)
        assert {s.status for s in resumed.acted} == {"waiting"}
        cancelled = await engine.cancel_many(status=["waiting", "failed"])
        assert sorted(s.run_id for s in cancelled.acted) == sorted([*paused.selected, victim])
        assert {s.status for s in cancelled.acted} == {"cancelled"}

    asyncio.run(main())


def test_a_run_held_by_another_process_is_reported_not_waited_for_forever(tmp_path: Path) -> None:
    root = project(tmp_path)
    seed(root, ".durably", "gate", 2)
    engine = create_engine(root / ".durably")
    held, free = (s.run_id for s in asyncio.run(engine.list()))
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from durably_py import FileStorage
        lease = FileStorage({str(root / '.durably')!r}).claim({held!r}, "elsewhere", 60)
        print("held", flush=True)
        time.sleep(120)  # holds the run and never reads its inbox
    """)], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        result = asyncio.run(engine.cancel_many(status="waiting", timeout=0.3))
        assert [s.run_id for s in result.acted] == [free] and list(result.skipped) == [held]
        assert "is still waiting after 0.3 s; it stops at its next step boundary" in result.skipped[held]
    finally:
        holder.kill()
        holder.wait()
    again = asyncio.run(engine.cancel_many(timeout=5))  # the holder died: its run is cancelled at once
    assert [s.run_id for s in again.acted] == [held] and not again.skipped
