"""A fleet runs the code it was given: `durably worker --import X` claims only runs of the workflows X
declares and never imports what a run's header names; `list` and `inspect` say when no live worker serves
a queued run. Importing recorded code is opt-in (`--import-recorded`, or `import_recorded = true` in the
config) and limited to files under the project root; `retry` imports at most the one module or script a run
needs. Real CLI processes throughout."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

from durably_py import FileStorage, create_engine

CODE = '''
import os
from durably_py import workflow

with open(os.environ["CODE_MARKS"], "a") as f:
    f.write(f"imported {NAME} {os.getpid()}\\n")


@workflow(name=f"code_{NAME}")
async def flow(ctx, x):
    return await ctx.step(lambda: f"{NAME}:{x}", name="answer")
'''


def script(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(f"NAME = {name!r}\n" + CODE)
    return path


class Project:
    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "project"
        self.state = self.root / ".durably"
        self.state.mkdir(parents=True)
        self.marks = tmp_path / "marks.txt"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
        self.env.update(CODE_MARKS=str(self.marks), XDG_CONFIG_HOME=str(tmp_path / "user-config"))
        self.engine = create_engine(FileStorage(self.state))
        self.procs: list[subprocess.Popen[str]] = []

    def cli(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "durably_py.cli", *args], cwd=cwd or self.root, env=self.env,
                              capture_output=True, text=True, timeout=60)

    def enqueue(self, path: Path, x: int) -> str:
        done = self.cli("enqueue", str(path), "-w", f"code_{path.stem}", "--input", str(x), "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["run_id"]

    def worker(self, *args: str) -> subprocess.Popen[str]:
        log = open(self.root.parent / f"worker{len(self.procs)}.log", "w")  # noqa: SIM115 - kept for the process
        proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--poll", "0.05", *args],
                                cwd=self.root, env=self.env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        self.procs.append(proc)
        wait_until(lambda: "serving" in self.log(proc) or proc.poll() is not None, 30)
        return proc

    def log(self, proc: subprocess.Popen[str]) -> str:
        return (self.root.parent / f"worker{self.procs.index(proc)}.log").read_text()

    def imported_by(self, proc: subprocess.Popen[str]) -> list[str]:
        lines = self.marks.read_text().split("\n") if self.marks.exists() else []
        return [line.split()[1] for line in lines if line.endswith(f" {proc.pid}")]

    def state_of(self, run_id: str) -> Any:
        return asyncio.run(self.engine.inspect(run_id))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


@pytest.fixture
def project(tmp_path: Path) -> Any:
    made = Project(tmp_path)
    yield made
    made.stop()


def test_a_worker_serves_only_what_it_imported_and_the_cli_says_who_serves_the_rest(project: Project) -> None:
    a, b = script(project.root, "a"), script(project.root, "b")
    run_a, run_b = project.enqueue(a, 1), project.enqueue(b, 2)
    worker_a = project.worker("--import", str(a))
    wait_until(lambda: project.state_of(run_a).status == "completed")
    listed = project.cli("list")
    assert "1 due run of workflow 'code_b': no live worker serves it" in listed.stdout, listed.stdout
    assert "1 live worker serves code_a" in listed.stdout
    inspected = project.cli("inspect", run_b)
    assert "no live worker serves it" in inspected.stdout
    state = project.state_of(run_b)
    assert state.status == "pending" and state.attempt == 0  # never claimed, not even to be released
    assert project.imported_by(worker_a) == ["a"]  # b's recorded script was never imported
    worker_b = project.worker("--import", str(b))
    wait_until(lambda: project.state_of(run_b).status == "completed")
    assert project.state_of(run_b).result == "b:2" and project.imported_by(worker_b) == ["b"]
    assert "no live worker serves" not in project.cli("list").stdout


def test_a_worker_needs_code_to_serve(project: Project) -> None:
    done = project.cli("worker")
    assert done.returncode == 2 and "no code to serve" in done.stderr and "--import-recorded" in done.stderr


def test_recorded_code_is_imported_only_when_asked_and_only_from_under_the_project_root(project: Project,
                                                                                          tmp_path: Path) -> None:
    inside, outside = script(project.root / "flows", "c"), script(tmp_path / "elsewhere", "d")
    run_c, run_d = project.enqueue(inside, 3), project.enqueue(outside, 4)
    (project.state / "config.toml").write_text("import_recorded = true\n")  # the config key opts in
    worker = project.worker()
    wait_until(lambda: project.state_of(run_c).status == "completed")
    wait_until(lambda: "lies outside" in project.log(worker))
    assert project.state_of(run_c).result == "c:3"
    assert project.state_of(run_d).status != "completed"
    assert project.imported_by(worker) == ["c"]
    assert f"recorded code under {os.path.realpath(project.root)}" in project.log(worker)
    wider = project.worker("--code-root", str(tmp_path))  # stated otherwise: anything under tmp_path
    wait_until(lambda: project.state_of(run_d).status == "completed", 45)  # once the first worker's skip passes
    assert project.imported_by(wider) == ["d"]


def test_retry_imports_the_recorded_script_and_no_module_that_merely_shares_its_name(project: Project) -> None:
    flows = project.root / "flows"
    flows.mkdir()
    (flows / "jobs.py").write_text(
        "import os\nfrom durably_py import workflow\n\n"
        "with open(os.environ['CODE_MARKS'], 'a') as f:\n    f.write(f'imported real {os.getpid()}\\n')\n\n\n"
        "def flaky(x):\n    if not os.path.exists(os.environ['CODE_MARKS'] + '.ok'):\n"
        "        raise RuntimeError('not yet')\n    return x\n\n\n"
        "@workflow\nasync def code_jobs(ctx, x):\n    return await ctx.step(flaky, x)\n")
    (project.root / "jobs.py").write_text(  # a module of the same name on the retrying process's path
        "import os\nwith open(os.environ['CODE_MARKS'], 'a') as f:\n    f.write(f'imported decoy {os.getpid()}\\n')\n")
    failed = project.cli("run", str(flows / "jobs.py"), "--workflow", "code_jobs", "--input", "5", "--json")
    assert failed.returncode == 1, failed.stderr
    run_id = project.engine.storage.list_runs()[0].run_id
    Path(str(project.marks) + ".ok").touch()
    project.marks.unlink()
    retried = project.cli("retry", run_id, "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["result"] == 5
    assert [line.split()[1] for line in project.marks.read_text().splitlines()] == ["real"]
