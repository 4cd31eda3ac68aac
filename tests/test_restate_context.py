"""Restate mode runs a workflow with the same `WorkflowContext` and `AttemptContext` as local mode: the same
argument checks and errors, the same step paths, as a `durably run --restate` against a real restate-server
shows next to the same run on FileStorage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import durably
from restate_env import ROOT, RestateEnv, server_binary

pytest.importorskip("restate", reason="the restate extra (restate-sdk) is not installed")
if server_binary() is None:  # pragma: no cover - CI installs it via .ci/run
    pytest.skip("restate-server is not installed (.ci/run installs it into .ci/restate)", allow_module_level=True)

FLOWS = str(ROOT / "tests" / "restate_ctx_flows.py")


@pytest.fixture(scope="module")
def env() -> Any:
    environment = RestateEnv([FLOWS])
    yield environment
    environment.close()


def test_one_context_in_both_modes(env: RestateEnv, tmp_path: Path) -> None:
    restate = durably("run", FLOWS, "--workflow", "one_context", "--key", "ctx-1", "--restate", env.ingress,
                      "--restate-admin", env.admin, cwd=ROOT, pythonpath=False, PYTHONPATH=str(ROOT))
    files = durably("run", FLOWS, "--workflow", "one_context", "--key", "ctx-1", "--dir", str(tmp_path / "state"),
                    cwd=ROOT, pythonpath=False, PYTHONPATH=str(ROOT))
    assert restate.returncode == files.returncode == 0, (restate.stderr, files.stderr)
    seen = json.loads(restate.stdout)
    print(json.dumps(seen, indent=1))
    assert seen == json.loads(files.stdout)
    assert seen["ctx"] == ["WorkflowContext", True]
    assert seen["in_step"] == ["AttemptContext", True, 1, "0", None, False]
    assert seen["after"][3] == "5"  # step 0, the loop at 1, the parallel's steps at 2, 3 and 4
    assert seen["unknown keyword"].startswith("ArgumentError: ctx.step() got unknown keyword argument(s) 'retries'")
    for name in ("bad retry", "bad signal name", "bad sleep", "bad handle"):
        assert seen[name].startswith("ValidationError: "), (name, seen[name])
