"""Restate mode against a real restate-server: the same workflows give the same results as on FileStorage,
through `durably serve --restate` and `durably run/signal/list/inspect/cancel --restate` subprocesses, and
survive SIGKILLs of the service."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import durably
from restate_env import ROOT, RestateEnv, server_binary

pytest.importorskip("restate", reason="the restate extra (restate-sdk) is not installed")
if server_binary() is None:  # pragma: no cover - CI installs it via .ci/run
    pytest.skip("restate-server is not installed (.ci/run installs it into .ci/restate)", allow_module_level=True)

FLOWS = str(ROOT / "tests" / "restate_flows.py")


@pytest.fixture(scope="module")
def marks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("marks")
    os.environ["DURABLY_TEST_MARKS"] = str(path)
    return path


@pytest.fixture(scope="module")
def env(marks: Path) -> Any:
    environment = RestateEnv([FLOWS, str(ROOT / "examples" / "approval.py")])
    yield environment
    environment.close()


@pytest.fixture(scope="module")
def replay_env(marks: Path) -> Any:
    environment = RestateEnv([FLOWS], always_replay=True)
    yield environment
    environment.close()


def cli(env: RestateEnv, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return durably(*args, "--restate", env.ingress, "--restate-admin", env.admin, cwd=ROOT, timeout=timeout,
                   pythonpath=False, PYTHONPATH=str(ROOT))


def on_files(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return durably(*args, "--dir", str(tmp_path / "state"), cwd=ROOT, pythonpath=False, PYTHONPATH=str(ROOT))


def start(env: RestateEnv, workflow: str, input: Any, key: str) -> None:
    from durably_py.restate.client import RestateClient

    RestateClient(env.ingress, env.admin).start(workflow, input, key=key)


def executions(marks: Path, tag: str) -> int:
    return sum(len(p.read_text()) for p in marks.glob(f"{tag}.*"))


CONFORMANCE = [("basics", "3"), ("parent", "[1, -2, 3]"), ("fan_branches", '{"branches": 4, "steps": 3}'),
               ("saga", "null"), ("typed", '{"item": "tea", "qty": "4"}'), ("typed", '{"item": "tea"}')]


@pytest.mark.parametrize(("workflow", "input"), CONFORMANCE)
def test_same_workflow_same_result_as_on_files(env: RestateEnv, tmp_path: Path, workflow: str, input: str) -> None:
    key = f"conf-{workflow}-{CONFORMANCE.index((workflow, input))}"
    files = on_files(tmp_path, "run", FLOWS, "--workflow", workflow, "--input", input, "--key", key)
    restate = cli(env, "run", FLOWS, "--workflow", workflow, "--input", input, "--key", key)
    assert restate.returncode == files.returncode, (restate.stderr, files.stderr)
    if files.returncode == 0:
        assert json.loads(restate.stdout) == json.loads(files.stdout)
    else:
        assert restate.stderr.splitlines()[0] == files.stderr.splitlines()[0], (restate.stderr, files.stderr)


def test_saga_compensates_in_reverse_once(env: RestateEnv, marks: Path) -> None:
    done = cli(env, "run", FLOWS, "--workflow", "saga", "--key", "saga-2")
    assert done.returncode == 1 and "carrier down" in done.stderr
    state = json.loads(cli(env, "inspect", "saga-2", "--json").stdout)
    assert state["status"] == "failed"
    assert [s["label"] for s in state["steps"]] == ["reserve", "reserve", "ship"]
    assert state["steps"][2]["error"]["type"] == "builtins:RuntimeError"
    shown = cli(env, "inspect", "saga-2")
    assert shown.returncode == 0 and "reserve" in shown.stdout and "carrier down" in shown.stdout, shown.stderr


def test_wait_for_signals_park_and_queue(env: RestateEnv) -> None:
    parked = cli(env, "run", FLOWS, "--workflow", "signals", "--key", "sig-1", "--no-wait")
    assert parked.returncode == 3, parked.stderr
    # signal only once the first wait has timed out (the second one reads slot 1), however loaded the machine
    journal = ("SELECT count(*) AS n FROM sys_journal WHERE entry_json LIKE '%\"signal:go:1\"%' AND id IN "
               "(SELECT id FROM sys_invocation WHERE target_service_key = 'sig-1')")
    deadline = time.monotonic() + 60
    while env.sql(journal)[0]["n"] == 0:
        assert time.monotonic() < deadline, "the first wait never timed out"
        time.sleep(0.05)
    assert cli(env, "signal", "sig-1", "go", "1").returncode == 0
    assert cli(env, "signal", "sig-1", "go", '"two"').returncode == 0
    done = cli(env, "run", FLOWS, "--workflow", "signals", "--key", "sig-1")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["timeout", 1, "two"]
    listed = json.loads(cli(env, "list", "--json", "--workflow", "signals").stdout)
    assert [(r["run_id"], r["status"]) for r in listed] == [("sig-1", "completed")]


def test_awakeables_map_to_restate_awakeables_resolved_by_the_cli(env: RestateEnv, marks: Path) -> None:
    parked = cli(env, "run", FLOWS, "--workflow", "callback", "--input", "1", "--key", "awk-1", "--no-wait")
    assert parked.returncode == 3, parked.stderr
    deadline = time.monotonic() + 60
    while not (marks / "awakeable-1").exists():
        assert time.monotonic() < deadline, "the workflow never handed its awakeable out"
        time.sleep(0.05)
    awakeable = (marks / "awakeable-1").read_text()
    unknown = cli(env, "resolve-awakeable", "sign_1nope", "1")
    assert unknown.returncode == 2 and "AwakeableNotFoundError" in unknown.stderr, unknown.stderr
    done = cli(env, "resolve-awakeable", awakeable, '{"ref": "ch_1"}', "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"awakeable": awakeable, "rejected": False, "resolved": True}
    again = cli(env, "resolve-awakeable", awakeable, '{"ref": "ch_2"}')  # Restate keeps the first, silently
    assert again.returncode == 0, again.stderr
    finished = cli(env, "run", FLOWS, "--workflow", "callback", "--input", "1", "--key", "awk-1")
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout) == {"paid": {"ref": "ch_1"}, "again": {"ref": "ch_1"},
                                           "late": "timed out: True", "name": "payment", "deadline": True,
                                           "url": None}


def test_races_of_handles_give_the_same_answer_as_on_files(env: RestateEnv, tmp_path: Path) -> None:
    results = []
    for where in ("restate", "files"):
        run = (lambda *a: cli(env, *a)) if where == "restate" else (lambda *a: on_files(tmp_path, *a))
        parked = run("run", FLOWS, "--workflow", "races", "--key", f"race-{where}", "--no-wait")
        assert parked.returncode == 3, parked.stderr
        assert run("signal", f"race-{where}", "go").returncode == 0
        done = run("run", FLOWS, "--workflow", "races", "--key", f"race-{where}")
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout))
    assert results[0] == results[1] == [[3, 10], 3, "quick", 4, "signal"]


def test_approval_example_runs_unchanged(env: RestateEnv) -> None:
    example = str(ROOT / "examples" / "approval.py")
    parked = cli(env, "run", example, "--workflow", "expense", "--input", '{"amount": 420}', "--key", "exp-1",
                 "--no-wait")
    assert parked.returncode == 3, parked.stderr
    state = json.loads(cli(env, "inspect", "exp-1", "--json").stdout)
    assert state["status"] in ("waiting", "running")
    assert cli(env, "signal", "exp-1", "approval", '{"ok": true, "by": "ana"}').returncode == 0
    done = cli(env, "run", example, "--workflow", "expense", "--input", '{"amount": 420}', "--key", "exp-1")
    assert json.loads(done.stdout) == "paid 420.00, approved by ana", done.stderr


def test_identity_by_input_digest_runs_once(env: RestateEnv, marks: Path) -> None:
    first = cli(env, "run", FLOWS, "--workflow", "seq", "--input", "2")
    second = cli(env, "run", FLOWS, "--workflow", "seq", "--input", "2")
    assert first.returncode == second.returncode == 0, first.stderr
    assert json.loads(first.stdout) == json.loads(second.stdout) == 1
    assert executions(marks, "seq2-0") == 1 and executions(marks, "seq2-1") == 1
    assert len(json.loads(cli(env, "list", "--json", "--workflow", "seq").stdout)) == 1


def test_unsupported_feature_fails_loudly(env: RestateEnv) -> None:
    done = cli(env, "run", FLOWS, "--workflow", "budgeted", "--key", "budget-1")
    assert done.returncode == 1
    assert "NotSupportedError" in done.stderr and "ctx.charge" in done.stderr and "Restate mode" in done.stderr


def test_features_that_cannot_map_each_fail_loudly_at_their_call(env: RestateEnv) -> None:
    done = cli(env, "run", FLOWS, "--workflow", "features", "--key", "features-1")
    assert done.returncode == 0, done.stderr
    outcomes = dict(json.loads(done.stdout))
    assert outcomes.keys() == {"stash", "snapshot", "uses", "concurrency_key", "graph", "annotate", "emit", "generator",
                              "transaction", "reserve", "charge"}
    for name, outcome in outcomes.items():
        assert isinstance(outcome, str) and outcome.startswith("NotSupportedError: "), (name, outcome)
        assert "is not supported in Restate mode" in outcome, (name, outcome)
    assert "a write and the step's record cannot commit together" in outcomes["transaction"]


def test_cancel_ends_a_parked_run(env: RestateEnv) -> None:
    assert cli(env, "run", FLOWS, "--workflow", "signals", "--key", "sig-cancel", "--no-wait").returncode == 3
    cancelled = cli(env, "cancel", "sig-cancel", "--json")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["status"] == "cancelled"


def test_serve_needs_restate_flag() -> None:
    done = subprocess.run([sys.executable, "-m", "durably_py.cli", "serve", "--import", FLOWS], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--restate" in done.stderr


def test_unsafe_step_killed_inside_is_interrupted_not_rerun(env: RestateEnv, marks: Path) -> None:
    start(env, "charge", 60, "charge-1")  # killed inside the step, however late the kill comes
    deadline = time.monotonic() + 60
    while executions(marks, "charge") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    env.service.kill()
    env.service.start()
    done = cli(env, "run", FLOWS, "--workflow", "charge", "--input", "60", "--key", "charge-1")
    assert json.loads(done.stdout) == "interrupted: StepInterruptedError", done.stderr
    assert executions(marks, "charge") == 1


def test_sigkill_mid_run_reruns_no_completed_step(env: RestateEnv, marks: Path) -> None:
    start(env, "seq", 10, "seq-kill")
    deadline = time.monotonic() + 60
    while sum(executions(marks, f"seq10-{i}") for i in range(10)) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    env.service.kill()
    before = [executions(marks, f"seq10-{i}") for i in range(10)]
    env.service.start()
    done = cli(env, "run", FLOWS, "--workflow", "seq", "--input", "10", "--key", "seq-kill")
    assert json.loads(done.stdout) == sum(range(10)), done.stderr
    after = [executions(marks, f"seq10-{i}") for i in range(10)]
    assert 0 < sum(before) < 10
    assert all(n <= 2 for n in after) and sum(n == 2 for n in after) <= 1, after


def test_branches_survive_repeated_kills(env: RestateEnv, marks: Path) -> None:
    spec = '{"branches": 5, "steps": 4, "tag": "kill"}'
    start(env, "fan_branches", json.loads(spec), "fb-kill")
    rng = random.Random(7)
    for _ in range(3):
        time.sleep(rng.uniform(0.03, 0.12))
        env.service.kill()
        env.service.start()
    done = cli(env, "run", FLOWS, "--workflow", "fan_branches", "--input", spec, "--key", "fb-kill")
    assert json.loads(done.stdout) == [[f"kill-{b}-{s}" for s in range(4)] for b in range(5)], done.stderr
    for b in range(5):
        runs = [executions(marks, f"kill-{b}-{s}") for s in range(4)]
        assert all(n >= 1 for n in runs) and sum(runs) - 4 <= 3, runs


def test_always_replay_gives_the_same_results(replay_env: RestateEnv, tmp_path: Path) -> None:
    for workflow, input in CONFORMANCE[:3]:
        files = on_files(tmp_path, "run", FLOWS, "--workflow", workflow, "--input", input, "--key", f"ar-{workflow}")
        restate = cli(replay_env, "run", FLOWS, "--workflow", workflow, "--input", input, "--key", f"ar-{workflow}")
        assert restate.returncode == 0, restate.stderr
        assert json.loads(restate.stdout) == json.loads(files.stdout)
    journal = replay_env.sql("SELECT count(*) AS n FROM sys_journal WHERE name = 'durably:sched'")
    assert journal[0]["n"] > 0
    assert cli(replay_env, "run", FLOWS, "--workflow", "chatty", "--input", '"ar"').stdout.strip() == "6"
    logged = [line for line in replay_env.service.log.read_text().splitlines() if line.endswith(" ar")]
    assert logged == ["before ar", "after ar", "end ar"]


@pytest.mark.slow
def test_branches_survive_many_random_kills(env: RestateEnv, marks: Path) -> None:
    rng = random.Random(11)
    for trial in range(12):
        branches, steps = rng.randint(4, 8), 3
        spec = json.dumps({"branches": branches, "steps": steps, "tag": f"soak{trial}"})
        key = f"fb-soak-{trial}"
        start(env, "fan_branches", json.loads(spec), key)
        time.sleep(rng.uniform(0.02, 0.35))
        env.service.kill()
        env.service.start()
        done = cli(env, "run", FLOWS, "--workflow", "fan_branches", "--input", spec, "--key", key)
        assert json.loads(done.stdout) == [[f"soak{trial}-{b}-{s}" for s in range(steps)] for b in range(branches)]
        for b in range(branches):
            runs = [executions(marks, f"soak{trial}-{b}-{s}") for s in range(steps)]
            assert sum(runs) - steps <= 1, (trial, b, runs)


def test_commands_restate_cannot_offer_say_so() -> None:
    done = subprocess.run([sys.executable, "-m", "durably_py.cli", "retry", "some-run", "--restate",
                           "http://127.0.0.1:9"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "NotSupportedError" in done.stderr and "durably retry" in done.stderr and "Restate mode" in done.stderr


def test_run_json_has_the_shape_it_has_on_files(env: RestateEnv, tmp_path: Path) -> None:
    files = json.loads(on_files(tmp_path, "run", FLOWS, "--workflow", "basics", "--input", "5", "--json").stdout)
    restate = json.loads(cli(env, "run", FLOWS, "--workflow", "basics", "--input", "5", "--json").stdout)
    assert restate.keys() == files.keys()
    assert (restate["status"], restate["exit_code"], restate["result"]) == \
        (files["status"], files["exit_code"], files["result"])


def test_service_serves_back_to_back_runs_and_stops_on_sigterm_and_ctrl_c(env: RestateEnv) -> None:
    from restate_env import http

    for i in range(20):
        spec = {"branches": 8, "steps": 3, "tag": f"b2b{i}"}
        done = http("POST", f"{env.ingress}/durably.fan_branches/b2b-{i}/run", spec, timeout=60)
        assert done == [[f"b2b{i}-{b}-{s}" for s in range(3)] for b in range(8)]
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = env.service.proc
        assert proc is not None and proc.poll() is None
        proc.send_signal(sig)
        try:
            assert proc.wait(30) == 0
        finally:
            env.service.kill()
            env.service.start()
        assert http("POST", f"{env.ingress}/durably.fan_branches/b2b-{sig.name}/run",
                    {"branches": 2, "steps": 1, "tag": sig.name}, timeout=60) == [[f"{sig.name}-0-0"], [f"{sig.name}-1-0"]]


def durably_in(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI in `cwd` with no Restate flags, the user's config under `cwd`/user-config, and `env` added."""
    return durably(*args, cwd=cwd, unset=("DURABLY_*",), pythonpath=False,
                   **{"PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(cwd / "user-config"),
                      "DURABLY_TEST_MARKS": os.environ["DURABLY_TEST_MARKS"], **env})


def test_restate_urls_come_from_flags_env_project_and_user_config(env: RestateEnv, tmp_path: Path) -> None:
    project, user = tmp_path / "project", tmp_path / "project" / "user-config" / "durably" / "config.toml"
    (project / ".durably").mkdir(parents=True)
    user.parent.mkdir(parents=True)
    user.write_text(f'restate = "{env.ingress}"\nrestate_admin = "{env.admin}"\n')
    ran = durably_in(project, "run", FLOWS, "--workflow", "basics", "--input", "4", "--key", "cfg-user")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["a"] == 5 and not (project / ".durably" / "runs").exists()

    shown = json.loads(durably_in(project, "config", "--json").stdout)
    assert (shown["restate"], shown["restate_admin"]) == (env.ingress, env.admin)
    assert shown["sources"]["restate"] == shown["sources"]["restate_admin"] == str(user)
    config_file = project / ".durably" / "config.toml"
    config_file.write_text('restate = "http://127.0.0.1:9"\nrestate_admin = "http://127.0.0.1:9"\n')
    shown = json.loads(durably_in(project, "config", "--json").stdout)
    assert shown["restate"] == "http://127.0.0.1:9" and shown["sources"]["restate"] == str(config_file)
    unreachable = durably_in(project, "inspect", "cfg-user")
    assert unreachable.returncode != 0 and "cannot reach Restate" in unreachable.stderr
    from_env = durably_in(project, "inspect", "cfg-user", "--json", DURABLY_RESTATE=env.ingress,
                          DURABLY_RESTATE_ADMIN=env.admin)
    assert json.loads(from_env.stdout)["status"] == "completed", from_env.stderr
    # an admin URL from a lower source than the ingress URL is not paired with it
    paired = json.loads(durably_in(project, "config", "--json", DURABLY_RESTATE="http://other:8080").stdout)
    assert paired["restate_admin"] == "http://other:9070" and paired["sources"]["restate"] == "$DURABLY_RESTATE"
    flagged = durably_in(project, "list", "--json", "--workflow", "basics", "--restate", env.ingress,
                         "--restate-admin", env.admin, DURABLY_RESTATE="http://127.0.0.1:9")
    assert "cfg-user" in [r["run_id"] for r in json.loads(flagged.stdout)], flagged.stderr

    config_file.write_text(f'restate = "{env.ingress}"\nrestate_admin = "{env.admin}"\n')
    listed = durably_in(project, "list", "--json", "--workflow", "basics")
    assert "cfg-user" in [r["run_id"] for r in json.loads(listed.stdout)], listed.stderr
    refused = durably_in(project, "retry", "cfg-user")
    assert refused.returncode == 2 and "Restate mode" in refused.stderr
    local = durably_in(project, "run", FLOWS, "--workflow", "basics", "--input", "4", "--dir", str(tmp_path / "files"))
    assert local.returncode == 0 and list((tmp_path / "files" / "runs").glob("basics-*")), local.stderr
    config_file.write_text('restate = "127.0.0.1:8080"\n')
    bad = durably_in(project, "list")
    assert bad.returncode == 2 and "restate must be an http:// or https:// URL" in bad.stderr
