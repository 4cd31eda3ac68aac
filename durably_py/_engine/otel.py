"""OpenTelemetry spans for runs and step attempts, through the globally configured tracer provider.

With the `otel` extra installed (`pip install 'durably-py[otel]'`) every run this process executes
becomes a span, and every step attempt a child span of it, with the attributes `durably.run_id`,
`durably.workflow`, `durably.step.path`, `durably.step.label`, `durably.step.attempt` and
`durably.status`. Steps answered from the log on replay are not exported again: they were exported by
the process that ran them. `DURABLY_OTEL=0` turns export off. Built on the engine's run hooks (the
same step events `on_step=` receives), so the kernel knows nothing of it.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import Any

from .._events import StepEvent
from .hooks import RunHook, add_run_hook

TRACER_NAME = "durably"
ENDS = ("ok", "retrying", "failed")


def enabled() -> bool:
    """True when the OpenTelemetry API is installed and `DURABLY_OTEL` does not turn export off."""
    if os.environ.get("DURABLY_OTEL", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return importlib.util.find_spec("opentelemetry") is not None \
        and importlib.util.find_spec("opentelemetry.trace") is not None


class OtelHook(RunHook):
    """Turns run starts and ends and step events into spans on the global tracer provider."""

    def __init__(self) -> None:
        super().__init__(self.on_event)
        self.lock = threading.Lock()
        self.runs: dict[str, Any] = {}
        self.attempts: dict[tuple[str, tuple[int, ...]], Any] = {}
        self.workflows: dict[str, str] = {}

    def active(self) -> bool:
        """Only while a tracer provider is configured: before that, spans would go nowhere at the cost of every step."""
        from opentelemetry import trace

        return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)

    @staticmethod
    def tracer() -> Any:
        from opentelemetry import trace

        return trace.get_tracer(TRACER_NAME)

    def started(self, run_id: str, workflow: str = "", *, joined: bool = False) -> None:
        if joined:  # the process running it exports it
            return
        span = self.tracer().start_span(f"durably run {workflow}", attributes={
            "durably.run_id": run_id, "durably.workflow": workflow})
        with self.lock:
            self.runs[run_id] = span
            self.workflows[run_id] = workflow

    def ended(self, run_id: str, status: str, error: BaseException | None) -> None:
        with self.lock:
            span = self.runs.pop(run_id, None)
            self.workflows.pop(run_id, None)
            open_steps = [key for key in self.attempts if key[0] == run_id]
            steps = [self.attempts.pop(key) for key in open_steps]
        for step in steps:  # attempts cut off by the end of the run (a crash, Ctrl-C, a lost lease)
            step.set_attribute("durably.status", "interrupted")
            step.end()
        if span is None:
            return
        span.set_attribute("durably.status", status)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()

    def on_event(self, event: StepEvent) -> None:
        if event.status == "replayed":
            return
        key = (event.run_id, event.path)
        if event.status == "running":
            from opentelemetry import trace

            with self.lock:
                parent = self.runs.get(event.run_id)
                workflow = self.workflows.get(event.run_id, "")
            context = trace.set_span_in_context(parent) if parent is not None else None
            span = self.tracer().start_span(event.label, context=context, attributes={
                "durably.run_id": event.run_id, "durably.workflow": workflow,
                "durably.step.path": ".".join(map(str, event.path)), "durably.step.label": event.label,
                "durably.step.attempt": event.attempt})
            with self.lock:
                self.attempts[key] = span
            return
        if event.status not in ENDS:
            return
        with self.lock:
            span = self.attempts.pop(key, None)
        if span is None:
            return
        span.set_attribute("durably.status", event.status)
        if event.error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.record_exception(event.error)
            span.set_status(Status(StatusCode.ERROR, f"{type(event.error).__name__}: {event.error}"))
        span.end(end_time=time.time_ns())


_installed: OtelHook | None = None


def install_if_available() -> OtelHook | None:
    """Start exporting spans when OpenTelemetry is installed and not turned off (once per process)."""
    global _installed
    if _installed is None and enabled():
        _installed = OtelHook()
        add_run_hook(_installed)
    return _installed


__all__ = ["OtelHook", "enabled", "install_if_available"]
