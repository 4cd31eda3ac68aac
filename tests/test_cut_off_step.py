"""`inspect` names the step a killed process was inside: long steps leave a start record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import durably

FLOW = '''
import time
from durably_py import workflow


def quick():
    return "quick"


def slow_upload():
    time.sleep(30)
    return "uploaded"


def finish():
    return "done"


@workflow
async def upload(ctx):
    await ctx.step(quick)
    await ctx.step(slow_upload)
    return await ctx.step(finish)
'''


def test_inspect_names_the_step_a_killed_process_was_inside(tmp_path: Path) -> None:
    (tmp_path / "flow.py").write_text(FLOW)
    state = str(tmp_path / "state")
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", "flow.py", "--workflow", "upload",
                             "--dir", state], cwd=tmp_path, env=environ, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            logs = list((tmp_path / "state" / "runs").glob("*.jsonl")) if (tmp_path / "state" / "runs").is_dir() else []
            if logs and '"t":"start"' in logs[0].read_text():
                break
            time.sleep(0.1)
        else:
            raise AssertionError("no start record for the long step")
        live = json.loads(durably("inspect", logs[0].stem, "--json", "--dir", state, cwd=tmp_path).stdout)
        assert [(s["label"], s["status"]) for s in live["steps"]] == [("quick", "ok"), ("slow_upload", "running")]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    run_id = logs[0].stem
    inspected = json.loads(durably("inspect", run_id, "--json", "--dir", state, cwd=tmp_path).stdout)
    assert inspected["status"] == "interrupted"
    assert [(s["path"], s["label"], s["status"]) for s in inspected["steps"]] == \
        [([0], "quick", "ok"), ([1], "slow_upload", "interrupted")]
    text = durably("inspect", run_id, "--dir", state, cwd=tmp_path, COLUMNS="200").stdout
    assert "cut off in (1,) slow_upload" in text
    # quick steps leave no start record: one for the long step only
    records = [json.loads(line) for line in logs[0].read_text().splitlines()]
    assert [r["l"] for r in records if r["t"] == "start"] == ["slow_upload"]
