"""What `on_step` listeners receive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StepStatus = Literal["running", "replayed", "ok", "retrying", "failed"]


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One step's progress: `replayed` came from the log, the others happened live."""

    run_id: str
    path: tuple[int, ...]
    label: str
    status: StepStatus
    attempt: int
    executions: int
    ms: float | None = None
    error: BaseException | None = None
