"""What a newcomer meets on the command line, through real subprocesses (a pseudo-terminal where a person would
see it): mistakes that are usage errors and create nothing, code changes guided safely, signals that never
vanish, and the small things a first run trips on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import durably
from terminal import Terminal

PIPELINE = textwrap.dedent('''
    from durably_py import workflow

    def load(cfg):
        return cfg["n"] * 2

    @workflow
    async def etl(ctx, cfg):
        return await ctx.step(load, cfg)

    @workflow
    async def optional(ctx, cfg=None):
        return cfg
''')


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pipeline.py").write_text(PIPELINE)
    return tmp_path


def runs_in(project: Path) -> list[Path]:
    return sorted((project / ".durably" / "runs").glob("*.jsonl")) if (project / ".durably" / "runs").is_dir() else []


# ---- mistakes get a clear error, nothing created ---------------------------------------------------------------


def test_a_workflow_that_needs_an_input_run_without_one_is_a_usage_error(project: Path) -> None:
    with Terminal("run", "pipeline.py", "-w", "etl", cwd=project) as term:
        assert term.wait(30) == 2
        text = term.text
    assert "ValidationError: workflow 'etl' takes an input (cfg) and no --input was given" in text
    assert "hint: Pass it as JSON: durably run pipeline.py -w etl --input '{...}'" in text and "docs: " in text
    assert "Traceback" not in text and runs_in(project) == []  # no failed run recorded
    queued = durably("enqueue", "pipeline.py", "-w", "etl", cwd=project)
    assert queued.returncode == 2 and "durably enqueue pipeline.py -w etl --input" in queued.stderr
    assert runs_in(project) == []
    fine = durably("run", "pipeline.py", "-w", "optional", cwd=project)  # its input has a default
    assert fine.returncode == 0 and fine.stdout.strip() == "null"
    done = durably("run", "pipeline.py", "-w", "etl", "--input", '{"n": 2}', cwd=project)
    assert done.returncode == 0 and done.stdout.strip() == "4"


@pytest.mark.parametrize("command", [["list"], ["inspect", "etl-x"], ["logs", "etl-x"], ["graph", "etl-x"],
                                     ["signal", "etl-x", "go"], ["cancel", "etl-x"], ["prune", "--older-than", "1d"]])
def test_a_read_command_on_a_mistyped_sqlite_store_creates_nothing(project: Path, command: list[str]) -> None:
    done = durably(*command, "--storage", "sqlite:typo.db", cwd=project)
    assert done.returncode == 2, done.stderr
    assert f"no SQLite store at {project / 'typo.db'} (from --storage); nothing was created" in done.stderr
    assert "hint: " in done.stderr and not (project / "typo.db").exists()
    env = durably(*command, cwd=project, DURABLY_STORAGE="sqlite:typo.db")
    assert env.returncode == 2 and "(from $DURABLY_STORAGE)" in env.stderr and not (project / "typo.db").exists()


def test_a_mistyped_store_on_a_terminal(project: Path) -> None:
    with Terminal("list", "--storage", "sqlite:state/typo.db", cwd=project) as term:
        assert term.wait(30) == 2
        assert f"no SQLite store at {project / 'state' / 'typo.db'}" in term.text.replace("\n", "")
    assert not (project / "state").exists()


@pytest.fixture
def without_restate(tmp_path: Path) -> dict[str, str]:
    """An environment in which the restate SDK cannot be imported, as without the extra."""
    shim = tmp_path / "shim" / "restate"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError(\"No module named 'restate'\")\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim.parent), *sys.path])}


@pytest.mark.parametrize("command", [
    ["serve", "--restate", "--import", "pipeline.py"],
    ["serve", "--restate", "http://127.0.0.1:1", "--import", "pipeline.py"],
    ["run", "pipeline.py", "-w", "etl", "-i", "{}", "--restate", "http://127.0.0.1:1"],
    ["list", "--restate", "http://127.0.0.1:1"],
    ["inspect", "x", "--restate", "http://127.0.0.1:1"],
    ["pause", "x", "--restate", "http://127.0.0.1:1"],
    ["signal", "x", "go", "--restate", "http://127.0.0.1:1"],
])
def test_restate_mode_without_the_extra_says_so(project: Path, without_restate: dict[str, str],
                                                command: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "durably_py.cli", *command], cwd=project, env=without_restate,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("ValidationError: Restate mode needs the restate extra\n"), done.stderr
    assert "hint: pip install 'durably-py[restate]'" in done.stderr and "docs: " in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_takes_restate_as_every_command_does(project: Path) -> None:
    help_text = durably("serve", "--help", cwd=project, COLUMNS="200").stdout
    assert "--restate" in help_text and "[URL]" in help_text
    missing = durably("serve", "--import", "pipeline.py", cwd=project)
    assert missing.returncode == 2 and "durably serve needs --restate" in missing.stderr
    bad = durably("serve", "--restate", "not-a-url", "--import", "pipeline.py", cwd=project)
    assert bad.returncode == 2 and "restate must be an http:// or https:// URL" in bad.stderr


def test_retry_from_step_takes_the_paths_inspect_prints(project: Path) -> None:
    durably("run", "pipeline.py", "-w", "etl", "-i", '{"n": 1}', cwd=project, check=True)
    run_id = durably("list", "-q", cwd=project).stdout.split()[0]
    shown = durably("inspect", run_id, cwd=project).stdout
    assert "(0,) load  ok" in shown
    for spec in ("(0,)", "( 0, )", "0", "load"):
        done = durably("retry", run_id, "--from-step", spec, cwd=project)
        assert done.returncode == 0 and done.stdout.strip() == "2", (spec, done.stderr)
    bad = durably("retry", run_id, "--from-step", "(7,)", cwd=project)
    assert bad.returncode == 2 and "matches no recorded step" in bad.stderr and "(2, 0, 1)" in bad.stderr


def test_ui_help_names_the_extra(project: Path) -> None:
    with Terminal("ui", "--help", cwd=project, columns=200) as term:
        assert term.wait(30) == 0
        assert "pip install 'durably-py[ui]'" in term.text
    piped = durably("ui", "--help", cwd=project, COLUMNS="200")
    assert "pip install 'durably-py[ui]'" in piped.stdout
