"""Shared fixtures: a per-test state dir and a reader for a run's JSONL records."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A fresh `.durably` state dir for the test (not created until a run needs it)."""
    return tmp_path / ".durably"


def log_files(state_dir: Path) -> list[Path]:
    """Every run log under `state_dir`, sorted by name."""
    return sorted((state_dir / "runs").glob("*.jsonl"))


@pytest.fixture
def records(state_dir: Path) -> Callable[..., list[dict[str, Any]]]:
    """`records(run_id=None)`: the decoded lines of a run's log (the only run when no id is given)."""

    def read(run_id: str | None = None) -> list[dict[str, Any]]:
        if run_id is None:
            logs = log_files(state_dir)
            assert len(logs) == 1, f"expected exactly one run log, found {logs}"
            path = logs[0]
        else:
            path = state_dir / "runs" / f"{run_id}.jsonl"
        return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]

    return read
