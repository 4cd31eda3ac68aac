"""What a newcomer meets on the command line, through real subprocesses (a pseudo-terminal where a person would
see it): mistakes that are usage errors and create nothing, code changes guided safely, signals that never
vanish, and the small things a first run trips on."""

from __future__ import annotations

import asyncio
import json
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

    @workflow
    async def gate(ctx, n):
        return [n, await ctx.wait_for("approval", timeout=600)]

    def explode(n):
        raise RuntimeError("broken")

    @workflow
    async def broken(ctx, n):
        return await ctx.step(explode, n)
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


def test_restate_mode_without_the_extra_on_a_terminal(project: Path, without_restate: dict[str, str]) -> None:
    for command in (["serve", "--restate", "--import", "pipeline.py"], ["list", "--restate", "http://127.0.0.1:1"]):
        with Terminal(*command, cwd=project, columns=80, PYTHONPATH=without_restate["PYTHONPATH"]) as term:
            assert term.wait(60) == 2, term.text
            text = term.text
        assert "ValidationError: Restate mode needs the restate extra" in text, text
        assert "hint: pip install 'durably-py[restate]'" in text and "docs: " in text
        assert "Traceback" not in text, text


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


# ---- signals never vanish ---------------------------------------------------------------------------------------


def test_a_signal_to_an_ended_run_is_refused_naming_its_status(project: Path) -> None:
    durably("run", "pipeline.py", "-w", "etl", "-i", '{"n": 1}', cwd=project, check=True)
    assert durably("run", "pipeline.py", "-w", "broken", "-i", "1", cwd=project).returncode == 1
    assert durably("run", "pipeline.py", "-w", "gate", "-i", "1", "--no-wait", cwd=project).returncode == 3
    ids = {row["workflow"]: row["run_id"] for row in json.loads(durably("list", "--json", cwd=project).stdout)}
    assert durably("cancel", ids["gate"], cwd=project).returncode == 0
    for workflow, status, move in (("etl", "completed", "restart"), ("broken", "failed", "retry"),
                                   ("gate", "cancelled", "restart")):
        done = durably("signal", ids[workflow], "approval", "1", cwd=project)
        assert done.returncode == 2, done.stderr
        assert f"run {ids[workflow]} is {status}; no step will read signal 'approval', so nothing was sent" \
            in done.stderr
        assert f"`durably {move} {ids[workflow]}`" in done.stderr
        assert json.loads(durably("inspect", ids[workflow], "--json", cwd=project).stdout)["signals"] == []

    from durably_py import ValidationError, create_engine

    engine = create_engine(str(project / ".durably"))
    with pytest.raises(ValidationError, match="is completed; no step will read signal 'x'") as info:
        asyncio.run(engine.signal(ids["etl"], "x"))
    assert info.value.hint and info.value.docs


def test_a_signal_for_another_name_warns_strict_refuses_and_unread_ones_show(project: Path) -> None:
    assert durably("run", "pipeline.py", "-w", "gate", "-i", "2", "--no-wait", cwd=project).returncode == 3
    run_id = durably("list", "-q", cwd=project).stdout.split()[0]
    with Terminal("signal", run_id, "aproval", '{"ok": true}', cwd=project, columns=250) as term:
        assert term.wait(30) == 0
        text = term.text
    assert f"sent 'aproval' to {run_id}" in text
    assert (f"warning: {run_id} waits for 'approval', not 'aproval': 'aproval' stays in its inbox until a "
            "ctx.wait_for('aproval') reads it (--strict refuses such a signal)") in text
    strict = durably("signal", run_id, "aproval", "--strict", cwd=project)
    assert strict.returncode == 2 and f"run {run_id} waits for 'approval', not 'aproval'; nothing was sent" \
        in strict.stderr
    as_json = json.loads(durably("signal", run_id, "later", "--json", cwd=project).stdout)
    assert as_json["awaited"] == ["approval"] and as_json["status"] == "waiting" and "not 'later'" in as_json["warning"]

    state = json.loads(durably("inspect", run_id, "--json", cwd=project).stdout)
    assert [(s["name"], s["payload"]) for s in state["signals"]] == [("aproval", {"ok": True}), ("later", None)]
    shown = durably("inspect", run_id, cwd=project, COLUMNS="250").stdout
    assert "signal    'aproval' unread since " in shown and 'payload {"ok": true}' in shown
    assert f"next      durably signal {run_id} approval PAYLOAD" in shown  # still waiting for its own
    logged = durably("logs", run_id, cwd=project, COLUMNS="250").stdout.splitlines()
    assert logged[-2].endswith("signal 'aproval' sent, unread: it waits in the run's inbox  payload {\"ok\": true}")
    assert logged[-1].endswith("signal 'later' sent, unread: it waits in the run's inbox")
    document = json.loads(durably("logs", run_id, "--json", cwd=project).stdout)
    assert [(r["t"], r["name"]) for r in document[-2:]] == [("signal", "aproval"), ("signal", "later")]
    lines = durably("logs", run_id, "-o", "jsonl", cwd=project).stdout.splitlines()
    assert json.loads(lines[-1])["name"] == "later"

    assert durably("signal", run_id, "approval", '"yes"', cwd=project).returncode == 0
    done = durably("retry", run_id, cwd=project)
    assert done.returncode == 0 and json.loads(done.stdout) == [2, "yes"]
    left = json.loads(durably("inspect", run_id, "--json", cwd=project).stdout)["signals"]
    assert [s["name"] for s in left] == ["aproval", "later"]  # never read: still shown, never dropped


# ---- code changes guided safely ---------------------------------------------------------------------------------

CHANGED = textwrap.dedent('''
    import os
    from durably_py import workflow

    def reserve(n):
        return f"reserved {n}"

    def audit(n):
        return f"audited {n}"

    def charge(n):
        return f"charged {n}"

    if os.environ.get("FLOW_VERSION", "1") == "1":
        @workflow(name="order")
        async def order(ctx, n):
            first = await ctx.step(reserve, n)
            await ctx.wait_for("go", timeout=600)
            return [first, await ctx.step(charge, n)]
    elif os.environ["FLOW_VERSION"] == "inserted":
        @workflow(name="order")
        async def order(ctx, n):
            checked = await ctx.step(audit, n)
            first = await ctx.step(reserve, n)
            await ctx.wait_for("go", timeout=600)
            return [checked, first, await ctx.step(charge, n)]
    else:
        @workflow(name="order")
        async def order(ctx, n):
            first = await ctx.step(reserve, n, name="hold")
            await ctx.wait_for("go", timeout=600)
            return [first, await ctx.step(charge, n)]
''')


def test_a_stale_run_at_an_inserted_step_offers_ctx_patched_first(project: Path) -> None:
    (project / "changed.py").write_text(CHANGED)
    assert durably("run", "changed.py", "-w", "order", "-i", "1", "--no-wait", cwd=project).returncode == 3
    run_id = durably("list", "-q", cwd=project).stdout.split()[0]
    stale = durably("retry", run_id, cwd=project, FLOW_VERSION="inserted")
    assert stale.returncode == 1 and "StaleRunError" in stale.stderr
    hint = stale.stderr.split("hint: ", 1)[1]
    assert hint.startswith("The code still calls 'reserve', so 'audit' looks inserted before it: put the new step "
                           "under `if ctx.patched(\"add-audit\"):`"), hint
    assert hint.index("ctx.patched") < hint.index("durably adopt")
    renamed = durably("retry", run_id, cwd=project, FLOW_VERSION="renamed")
    assert renamed.returncode == 1
    assert renamed.stderr.split("hint: ", 1)[1].startswith("If 'hold' is the same work as 'reserve' under a new "
                                                           f"name, `durably adopt {run_id}`")


def test_adopt_says_what_it_maps_where_and_asks_first(project: Path) -> None:
    (project / "changed.py").write_text(CHANGED)
    assert durably("run", "changed.py", "-w", "order", "-i", "2", "--no-wait", cwd=project).returncode == 3
    run_id = durably("list", "-q", cwd=project).stdout.split()[0]
    assert durably("retry", run_id, cwd=project, FLOW_VERSION="renamed").returncode == 1
    plan = (f"adopt {run_id}: at (0,), the step now called 'hold' is the recorded 'reserve' (its recorded result "
            "\"reserved 2\"); then the run continues")
    with Terminal("adopt", run_id, "--no-wait", cwd=project, columns=250, FLOW_VERSION="renamed") as term:
        assert term.wait_for("Adopt? [y/N]", 30), term.text
        assert plan in term.text
        os.write(term.controller, b"n\n")
        assert term.wait(30) == 1 and "nothing was touched" in term.text
    assert json.loads(durably("inspect", run_id, "--json", cwd=project).stdout)["status"] == "stale"
    with Terminal("adopt", run_id, "--no-wait", cwd=project, columns=250, FLOW_VERSION="renamed") as term:
        assert term.wait_for("Adopt? [y/N]", 30)
        os.write(term.controller, b"y\n")
        assert term.wait(30) == 3  # adopted, then parked on its wait again
    assert json.loads(durably("inspect", run_id, "--json", cwd=project).stdout)["status"] == "waiting"
    by_path = durably("adopt", run_id, "--path", "(0,)", "--yes", cwd=project, FLOW_VERSION="renamed")
    assert by_path.returncode == 2 and "is waiting, not stale" in by_path.stderr


# ---- small things a newcomer trips on ----------------------------------------------------------------------------


def test_a_first_run_in_a_git_repository_keeps_its_state_out_of_git(project: Path) -> None:
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    done = durably("run", "pipeline.py", "-w", "etl", "-i", '{"n": 1}', cwd=project)
    assert done.returncode == 0, done.stderr
    from durably_py._config import EXAMPLE_GITIGNORE

    assert (project / ".durably" / ".gitignore").read_text() == EXAMPLE_GITIGNORE  # what `durably init` writes
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=project,
                            capture_output=True, text=True, check=True).stdout
    assert ".durably/runs" not in status and ".durably/.gitignore" in status  # the one file meant for git
    elsewhere = project / "nogit"
    elsewhere.mkdir()
    (elsewhere / "pipeline.py").write_text(PIPELINE)
    outside = durably("run", "pipeline.py", "-w", "etl", "-i", '{"n": 1}', cwd=elsewhere,
                      GIT_CEILING_DIRECTORIES=str(project))
    assert outside.returncode == 0


def test_json_is_one_document_on_every_command(project: Path) -> None:
    durably("run", "pipeline.py", "-w", "etl", "-i", '{"n": 1}', cwd=project, check=True)
    assert durably("run", "pipeline.py", "-w", "gate", "-i", "3", "--no-wait", cwd=project).returncode == 3
    ids = {row["workflow"]: row["run_id"] for row in json.loads(durably("list", "--json", cwd=project).stdout)}
    commands = [["list"], ["inspect", ids["etl"]], ["logs", ids["etl"]], ["graph", ids["etl"]], ["config"],
                ["pause", ids["gate"]], ["resume", ids["gate"]], ["restart", ids["etl"]],
                ["signal", ids["gate"], "approval", "1"], ["prune", "--older-than", "1d", "--dry-run"],
                ["schedules"], ["run", "pipeline.py", "-w", "etl", "-i", '{"n": 5}'],
                ["enqueue", "pipeline.py", "-w", "etl", "-i", '{"n": 6}'], ["retry", ids["gate"]],
                ["replay-check", "pipeline.py", "-w", "etl"], ["cancel", "--status", "pending", "--yes"]]
    for command in commands:
        done = durably(*command, "--json", cwd=project)
        assert done.returncode == 0, (command, done.stderr)
        json.loads(done.stdout)  # one document: anything after it would not parse
    lines = durably("logs", ids["etl"], "-o", "jsonl", cwd=project).stdout.splitlines()
    assert len(lines) > 2 and all(json.loads(line)["t"] for line in lines)


def completions(project: Path, *words: str) -> list[str]:
    line = " ".join(["durably", *words])
    done = subprocess.run([sys.executable, "-m", "durably_py.cli"], cwd=project, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "_DURABLY_COMPLETE":
                               "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(len(words))}, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_shell_completes_statuses_run_ids_and_workflow_names(project: Path) -> None:
    durably("run", "pipeline.py", "-w", "etl", "-i", '{"n": 1}', "--key", "nightly-1", cwd=project, check=True)
    run_id = durably("list", "-q", cwd=project).stdout.split()[0]
    assert completions(project, "list", "--status", "w") == ["waiting"]
    assert set(completions(project, "cancel", "--status", "")) >= {"pending", "running", "failed"}
    assert completions(project, "inspect", "etl-") == [run_id]
    assert completions(project, "retry", "night") == ["nightly-1"]
    assert completions(project, "run", "pipeline.py", "-w", "") == ["broken", "etl", "gate", "optional"]
    assert completions(project, "list", "--workflow", "e") == ["etl"]


def test_docs_show_run_ids_as_runs_get_them() -> None:
    import re

    docs = Path(__file__).resolve().parent.parent / "docs"
    old = re.compile(r"\b[a-z_]+-20\d{6}-[0-9a-f]{4,8}\b")
    found = {page.name: old.findall(page.read_text()) for page in docs.glob("*.md")}
    assert not any(found.values()), {page: ids for page, ids in found.items() if ids}
    from durably_py._ids import new_run_id

    assert re.fullmatch(r"invoice-[0-9a-z]{16}", new_run_id("invoice"))
    assert "invoice-egzh681avjsqp33j" in (docs / "versioning.md").read_text()


def test_advisories_point_to_the_installed_docs_as_errors_do(project: Path) -> None:
    from durably_py._docs import DOCS_DIR

    parked = durably("run", "pipeline.py", "-w", "gate", "-i", "4", "--no-wait", cwd=project)
    assert parked.returncode == 3
    pointer = f"docs: {DOCS_DIR / 'advisories.md'}  (`durably docs advisories#waitfor_no_timeout` prints it)"
    assert "durably advisory [INFO] WAITFOR_NO_TIMEOUT" not in parked.stderr  # gate has a timeout
    (project / "forever.py").write_text(PIPELINE.replace('timeout=600', 'timeout=None'))
    parked = durably("run", "forever.py", "-w", "gate", "-i", "5", "--no-wait", cwd=project)
    assert parked.returncode == 3 and pointer in parked.stderr, parked.stderr
    run_id = durably("list", "-q", "--workflow", "gate", cwd=project).stdout.split()[0]
    shown = durably("inspect", run_id, cwd=project, COLUMNS="250").stdout
    assert pointer in shown
    assert durably("docs", "advisories#waitfor_no_timeout", cwd=project).stdout.startswith("## ")
