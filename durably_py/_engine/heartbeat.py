"""Keeping held runs alive from a thread of their own, so a step that blocks the event loop never costs a lease.

One daemon thread per engine renews the lease of every run the engine holds, every `heartbeat` seconds,
and while one of those runs has been inside a step for longer than the control interval, it lists the
run's inbox: a cancel or pause request sent meanwhile is handed to the run's event loop at once (and a
cancel also flags the running attempts, so sync code polling `attempt().cancelled` can stop). Once a
run has been inside steps for `START_RECORD_AFTER` seconds, it records a `start` for each running one,
so a process killed inside a long step leaves which step it was in. The event loop itself may be blocked by a step running on it; none of this waits for it.

The lease is `ttl` seconds (`Engine(lease=)`, `durably worker --lease`), renewed every `every` seconds
(`heartbeat=`, a third of the lease by default); `check_lease` keeps both in the range where a renewal
has time to land. A renewal that is late (this thread could not run: a step holding the GIL in one long C
call, a process stopped or starved, a storage call that hangs) is noticed twice before the lease lapses
on a storage whose leases expire (SQLite, PostgreSQL, memory): a watchdog armed at every tick
(`faulthandler.dump_traceback_later`, whose C thread needs no GIL) writes every thread's stack to stderr
once the thread has not ticked for `late_after` seconds, and the thread itself reports the late renewal
(`report`, a line on stderr or the worker's log) as soon as it runs again.
"""

from __future__ import annotations

import asyncio
import faulthandler
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import LeaseLostError, ValidationError

if TYPE_CHECKING:
    from .._replay.kernel import RunKernel
    from ..storage.base import Lease, Storage

CONTROL_NAMES = ("$cancel", "$pause", "$resume")
START_RECORD_AFTER = 2.0  # seconds inside steps before the running ones get a start record
MIN_LEASE = 2.0
"""The shortest lease an engine takes: renewed every third of it, a renewal then has 0.67 s to land; a lease
any shorter would lapse under an ordinary pause of a busy machine."""
LEASE_DOCS = "docs/deploying.md#leases-and-heartbeats"


def check_lease(lease: Any, heartbeat: Any = None) -> tuple[float, float]:
    """The lease and renewal interval in seconds: `lease` at least `MIN_LEASE`, `heartbeat` (None: a third
    of the lease) more than 0 and at most half the lease, so one late renewal still lands in time."""
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not MIN_LEASE <= lease <= 1e9:
        raise ValidationError(f"a lease is {MIN_LEASE:g} to 1e9 seconds, got {lease!r}",
                              hint="lease=30 (the default) holds a claimed run 30 s past its last renewal; after a "
                                   "crash another process takes the run over within that plus one poll.",
                              docs=LEASE_DOCS)
    if heartbeat is None:
        return float(lease), lease / 3
    if isinstance(heartbeat, bool) or not isinstance(heartbeat, int | float) or not 0 < heartbeat <= lease / 2:
        raise ValidationError(f"a heartbeat is more than 0 and at most half the lease ({lease:g} s), got {heartbeat!r}",
                              hint=f"Leave it out to renew every third of the lease ({lease / 3:g} s), or lengthen "
                                   "the lease.", docs=LEASE_DOCS)
    return float(lease), float(heartbeat)


class Watchdog:
    """One `faulthandler.dump_traceback_later` for every heartbeat of the process: armed for the earliest
    deadline any of them set, so the stacks are written when the first one misses its tick."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deadlines: dict[int, float] = {}

    def arm(self, owner: object, seconds: float) -> None:
        with self.lock:
            self.deadlines[id(owner)] = time.monotonic() + seconds
            self._set()

    def disarm(self, owner: object) -> None:
        with self.lock:
            if self.deadlines.pop(id(owner), None) is not None:
                self._set()

    def _set(self) -> None:
        if not self.deadlines:
            faulthandler.cancel_dump_traceback_later()
            return
        try:
            faulthandler.dump_traceback_later(max(0.05, min(self.deadlines.values()) - time.monotonic()), file=2)
        except (RuntimeError, ValueError, OSError):  # no stderr to write to: the late report still comes
            pass


WATCHDOG = Watchdog()


def _stderr(message: str) -> None:
    print(f"durably: {message}", file=sys.stderr, flush=True)


class Heartbeat:
    """Renews leases and watches inboxes for the live runs of one engine; its thread runs only while there are some."""

    def __init__(self, storage: Storage, ttl: float, every: float | None, control_every: float,
                 report: Callable[[str], Any] = _stderr) -> None:
        self.storage = storage
        self.ttl, self.every = check_lease(ttl, every)
        self.control_every = control_every
        self.report = report
        self.expires = getattr(storage, "leases_expire", True)  # a file lease is an OS lock: it never lapses
        self.runs: dict[RunKernel, tuple[Lease, asyncio.AbstractEventLoop, list[float]]] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def add(self, kernel: RunKernel, lease: Lease) -> None:
        """Keep `kernel`'s run alive from now until `remove`; call it from the run's event loop."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        with self.lock:
            self.runs[kernel] = (lease, loop, [now + self.every, now, 0.0])  # due, renewed at, reported at
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="durably-heartbeat", daemon=True)
                self.thread.start()

    def remove(self, kernel: RunKernel) -> None:
        """Stop renewing `kernel`'s lease (its run ended or was abandoned)."""
        with self.lock:
            self.runs.pop(kernel, None)  # the thread stops at its next tick if no run came meanwhile

    def configure(self, ttl: float, every: float | None) -> None:
        """Use lease `ttl`, renewed every `every` seconds (None: a third of it), from the next claim and
        renewal on (`check_lease`)."""
        self.ttl, self.every = check_lease(ttl, every)

    @property
    def late_after(self) -> float:
        """Seconds after a renewal by which the next one is reported late: halfway from its due time to the lapse."""
        return (self.every + self.ttl) / 2

    def _run(self) -> None:
        try:
            self._beat()
        finally:
            WATCHDOG.disarm(self)

    def _beat(self) -> None:
        while True:
            tick = min(self.every, self.control_every)
            if self.expires:
                WATCHDOG.arm(self, self.late_after - tick)
            self.wake.wait(tick)
            with self.lock:
                if not self.runs:
                    self.thread = None
                    self.wake.clear()
                    return
                runs = list(self.runs.items())
            now = time.monotonic()
            for kernel, (lease, loop, due) in runs:
                if self.expires and now - due[1] > self.late_after and due[2] < due[1]:
                    due[2] = now
                    self.report(f"run {lease.run_id}: its lease was last renewed {now - due[1]:.1f} s ago (lease "
                                f"{self.ttl:g} s, renewed every {self.every:g} s): this process could not renew "
                                "it in time (a step holding the GIL, a stopped or starved process, or a slow "
                                f"storage); another process may take the run over once {self.ttl:g} s have passed")
                if now >= due[0]:
                    due[0] = now + self.every
                    if self._renew(kernel, lease):
                        due[1] = now
                busy = now - kernel.step_running_since if kernel.step_running_since is not None else 0.0
                if busy >= START_RECORD_AFTER:
                    self._record_starts(kernel)
                if busy >= self.control_every and now >= kernel.next_control:
                    self._watch_inbox(kernel, loop)

    def _renew(self, kernel: RunKernel, lease: Lease) -> bool:
        """Renew one lease; True when it was renewed."""
        try:
            alive = self.storage.heartbeat(lease, self.ttl)
        except Exception:  # noqa: BLE001 - a storage hiccup is retried at the next beat; a late one is reported
            return False
        if not alive and kernel.lost is None:
            kernel.lost = LeaseLostError(
                f"run {lease.run_id} was claimed by another process after this one's lease lapsed; "
                "this process stops writing to it", run_id=lease.run_id)
            self.report(f"run {lease.run_id}: its lease was lost to another process; this process stops writing "
                        "to it")
        return alive

    def _record_starts(self, kernel: RunKernel) -> None:
        try:
            kernel.log.record_long_steps()
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
