"""Run hooks: watchers of every run this process runs (the CLI's live view, OpenTelemetry export)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from .._events import StepEvent


class RunHook:
    """Watches every run this process runs: its step events, when it starts and how it ends.

    The CLI's live view is one (`set_run_hook`); OpenTelemetry export is another (`add_run_hook`)."""

    def __init__(self, listener: Callable[[StepEvent], Any], on_run: Callable[[str], Any] | None = None) -> None:
        self.listener = listener
        self.on_run = on_run

    def started(self, run_id: str, workflow: str = "", *, joined: bool = False) -> None:
        """A run was found or created (also one with no step of its own); `joined`: another process runs it."""
        if self.on_run is not None:
            self.on_run(run_id)

    def ended(self, run_id: str, status: str, error: BaseException | None) -> None:
        """This process stopped running the run: completed, failed, cancelled, parked or interrupted."""

    def active(self) -> bool:
        """Whether to watch a run starting now; a watcher with nothing to report opts out and costs nothing."""
        return True

    def chain(self, on_step: Callable[[StepEvent], Any] | None) -> Callable[[StepEvent], Any]:
        def both(event: StepEvent) -> None:
            self.listener(event)
            if on_step is not None:
                on_step(event)
        return both


_run_hook: RunHook | None = None


def set_run_hook(hook: RunHook | None) -> None:
    """Install (or remove) the process-wide step listener the CLI uses."""
    global _run_hook
    _run_hook = hook


_added_hooks: list[RunHook] = []
_otel_checked = False


def add_run_hook(hook: RunHook) -> None:
    """Add a process-wide run watcher (in addition to the CLI's)."""
    _added_hooks.append(hook)


def remove_run_hook(hook: RunHook) -> None:
    """Remove a watcher `add_run_hook` added."""
    with contextlib.suppress(ValueError):
        _added_hooks.remove(hook)


def run_hooks() -> list[RunHook]:
    """The watchers of a run starting now; the first call installs OpenTelemetry export when it is available."""
    global _otel_checked
    if not _otel_checked:
        _otel_checked = True
        from . import otel

        otel.install_if_available()
    return ([_run_hook] if _run_hook is not None else []) + [hook for hook in _added_hooks if hook.active()]
