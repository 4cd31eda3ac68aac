"""Retry policies on Restate (against a real restate-server), with the same results as on FileStorage: errors
that give up at once (durably's `NonRetryableError`, `Retry(give_up_on=)`, and Restate's own `TerminalError`),
unlimited attempts with a constant backoff, a deadline for all attempts, and a run that fails for good."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import durably
from restate_env import ROOT, RestateEnv, server_binary

pytest.importorskip("restate", reason="the restate extra (restate-sdk) is not installed")
if server_binary() is None:  # pragma: no cover - CI installs it via .ci/run
    pytest.skip("restate-server is not installed (.ci/run installs it into .ci/restate)", allow_module_level=True)

FLOWS = str(ROOT / "tests" / "restate_policy_flows.py")


@pytest.fixture(scope="module")
def marks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("policy-marks")
    os.environ["DURABLY_TEST_MARKS"] = str(path)
    return path


@pytest.fixture(scope="module")
def env(marks: Path) -> Any:
    environment = RestateEnv([FLOWS])
    yield environment
    environment.close()


def on_restate(env: RestateEnv, *args: str) -> Any:
    return durably(*args, "--restate", env.ingress, "--restate-admin", env.admin, cwd=ROOT, timeout=60,
                   pythonpath=False, PYTHONPATH=str(ROOT))


def on_files(tmp_path: Path, *args: str) -> Any:
    return durably(*args, "--dir", str(tmp_path / "state"), cwd=ROOT, pythonpath=False, PYTHONPATH=str(ROOT))


def executions(marks: Path, tag: str) -> int:
    return sum(len(p.read_text()) for p in marks.glob(f"{tag}.*"))


@pytest.mark.parametrize(("workflow", "result", "runs"), [
    ("rs_declined", {"type": "Declined", "tag": "{tag}"}, 1),
    ("rs_forbidden", "{tag}: forbidden", 1),
    ("rs_forever", 7, 7),
    ("rs_deadline", "{tag}: still down", None),
])
def test_retry_policies_match_files(env: RestateEnv, marks: Path, tmp_path: Path, workflow: str, result: Any,
                                    runs: int | None) -> None:
    outcomes = {}
    for mode, call in (("restate", lambda *a: on_restate(env, *a)), ("files", lambda *a: on_files(tmp_path, *a))):
        tag = f"{workflow}-{mode}"
        done = call("run", FLOWS, "--workflow", workflow, "--input", json.dumps(tag), "--key", tag)
        assert done.returncode == 0, done.stderr
        expected = json.loads(json.dumps(result).replace("{tag}", tag))
        assert json.loads(done.stdout) == expected
        outcomes[mode] = executions(marks, tag)
    if runs is not None:
        assert outcomes == {"restate": runs, "files": runs}
    else:  # 0.2 s apart within 1 s: more than one attempt, at most six, in both modes
        assert all(1 < n <= 6 for n in outcomes.values()), outcomes


def test_a_terminal_error_from_a_step_gives_up_at_once(env: RestateEnv, marks: Path) -> None:
    done = on_restate(env, "run", FLOWS, "--workflow", "rs_terminal", "--input", '"term"', "--key", "term")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == "TerminalError: term: refused by the remote side"
    assert executions(marks, "term") == 1


def test_a_non_retryable_failure_ends_the_run_as_a_terminal_failure(env: RestateEnv, marks: Path,
                                                                    tmp_path: Path) -> None:
    restate = on_restate(env, "run", FLOWS, "--workflow", "rs_fails", "--input", '"bad"', "--key", "bad")
    files = on_files(tmp_path, "run", FLOWS, "--workflow", "rs_fails", "--input", '"bad-f"', "--key", "bad-f")
    assert restate.returncode == files.returncode == 1, (restate.stderr, files.stderr)
    assert "Declined: bad: declined" in restate.stderr and "Declined: bad-f: declined" in files.stderr
    assert executions(marks, "bad") == 1 and executions(marks, "bad-f") == 1
    state = json.loads(on_restate(env, "inspect", "bad", "--json").stdout)
    assert state["status"] == "failed" and [s["attempts"] for s in state["steps"]] == [1]
    again = on_restate(env, "run", FLOWS, "--workflow", "rs_fails", "--input", '"bad"', "--key", "bad")
    assert again.returncode == 1 and executions(marks, "bad") == 1  # Restate does not retry the invocation


def test_what_a_run_knows_of_itself(env: RestateEnv, tmp_path: Path) -> None:
    restate = on_restate(env, "run", FLOWS, "--workflow", "rs_self", "--input", '"me"', "--key", "self")
    files = on_files(tmp_path, "run", FLOWS, "--workflow", "rs_self", "--input", '"me"', "--key", "self")
    assert json.loads(restate.stdout) == {"tick": None, "engine": "unsupported"}, restate.stderr
    assert json.loads(files.stdout) == {"tick": None, "engine": "available"}, files.stderr
