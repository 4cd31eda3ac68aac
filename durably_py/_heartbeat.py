"""Keeping held runs alive from a thread of their own, so a step that blocks the event loop never costs a lease.

One daemon thread per engine renews the lease of every run the engine holds, every `heartbeat` seconds,
and while one of those runs has been inside a step for longer than the control interval, it lists the
run's inbox: a cancel or pause request sent meanwhile is handed to the run's event loop at once (and a
cancel also flags the running attempts, so sync code polling `attempt().cancelled` can stop). Once a
run has been inside steps for `START_RECORD_AFTER` seconds, it records a `start` for each running one,
so a process killed inside a long step leaves which step it was in. The event loop itself may be blocked by a step running on it; none of this waits for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

from .errors import LeaseLostError

if TYPE_CHECKING:
    from ._kernel import RunKernel
    from .storage.base import Lease, Storage

CONTROL_NAMES = ("$cancel", "$pause", "$resume")
START_RECORD_AFTER = 2.0  # seconds inside steps before the running ones get a start record


class Heartbeat:
    """Renews leases and watches inboxes for the live runs of one engine; its thread runs only while there are some."""

    def __init__(self, storage: Storage, ttl: float, every: float, control_every: float) -> None:
        self.storage = storage
        self.ttl = ttl
        self.every = every
        self.control_every = control_every
        self.runs: dict[RunKernel, tuple[Lease, asyncio.AbstractEventLoop, list[float]]] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def add(self, kernel: RunKernel, lease: Lease) -> None:
        """Keep `kernel`'s run alive from now until `remove`; call it from the run's event loop."""
        loop = asyncio.get_running_loop()
        with self.lock:
            self.runs[kernel] = (lease, loop, [time.monotonic() + self.every])
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="durably-heartbeat", daemon=True)
                self.thread.start()

    def remove(self, kernel: RunKernel) -> None:
        """Stop renewing `kernel`'s lease (its run ended or was abandoned)."""
        with self.lock:
            self.runs.pop(kernel, None)
            if not self.runs:
                self.wake.set()

    def _run(self) -> None:
        tick = min(self.every, self.control_every)
        while True:
            self.wake.wait(tick)
            with self.lock:
                if not self.runs:
                    self.thread = None
                    self.wake.clear()
                    return
                runs = list(self.runs.items())
            now = time.monotonic()
            for kernel, (lease, loop, due) in runs:
                if now >= due[0]:
                    due[0] = now + self.every
                    self._renew(kernel, lease)
                busy = now - kernel.step_running_since if kernel.step_running_since is not None else 0.0
                if busy >= START_RECORD_AFTER:
                    self._record_starts(kernel)
                if busy >= self.control_every and now >= kernel.next_control:
                    self._watch_inbox(kernel, loop)

    def _renew(self, kernel: RunKernel, lease: Lease) -> None:
        try:
            alive = self.storage.heartbeat(lease, self.ttl)
        except Exception:  # noqa: BLE001 - a storage hiccup is retried at the next beat; the lease has slack
            return
        if not alive and kernel.lost is None:
            kernel.lost = LeaseLostError(
                f"run {lease.run_id} was claimed by another process after this one's lease lapsed; "
                "this process stops writing to it", run_id=lease.run_id)

    def _record_starts(self, kernel: RunKernel) -> None:
        try:
            kernel.record_long_steps()
        except Exception:  # noqa: BLE001 - a start record is a courtesy to `inspect`; the step's result is what counts
            pass

    def _watch_inbox(self, kernel: RunKernel, loop: asyncio.AbstractEventLoop) -> None:
        try:
            names = {message.get("name") for message in self.storage.inbox(kernel.run_id)}
        except Exception:  # noqa: BLE001 - looked at again at the next beat
            return
        if "$cancel" in names:
            kernel.flag_attempts()
        if names.intersection(CONTROL_NAMES):
            try:
                loop.call_soon_threadsafe(kernel.interrupt)
            except RuntimeError:  # the loop closed meanwhile: the run is over
                pass
