"""How a run's execution is steered from outside and how it rests (`Control`): the control inbox (cancel,
pause and resume requests), holds and naps at durable boundaries, durable sleeps and waits for signals, the
run's cancellation in its turn, parking when every strand rests, and stopping."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from .. import records
from .._authoring.handles import Handle, fail, not_durable, set_result
from .._clock import Clock
from .._codec import dump_error, from_iso, load_value, to_iso
from .._state.history import path_tuple
from ..errors import RunCancelledError, WaitTimeoutError
from .log import RunLog
from .stops import CANCEL_PATH, CLEANUP_OVER, Rest, forever, is_run_cancel
from .tasks import current_task, internal
from .turns import Turns, deadline_over, raw_timers

if TYPE_CHECKING:
    from .._authoring.calls import Attempt
    from ..storage.base import Storage
    from .ports import Hooks

CONTROL_EVERY = 0.5
LIMIT_LOOK = 0.5  # seconds between looks at a limit a run waits for in its own process
DEFAULT_CLEANUP = 60.0  # seconds a cancelled workflow may spend on clean-up before it is stopped


def signal_time(signal: dict[str, Any]) -> float:
    """When a stored signal arrived (epoch seconds on the sender's engine clock), for the order of outcomes
    ready at the same moment."""
    try:
        return from_iso(signal["at"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return time.time()


class Control:
    """The control requests, rests and stops of one execution of a run."""

    def __init__(self, *, storage: Storage, log: RunLog, turns: Turns, clock: Clock,
                 running: Mapping[Attempt, Any], wait: bool, poll: float) -> None:
        self.storage = storage
        self.log = log
        self.history = log.history
        self.run_id = log.run_id
        self.turns = turns
        self.clock = clock
        self.running = running  # the run's attempts in flight (`Steps.running`)
        self.wait = wait  # False: a run that rests on durable waits only parks (leaves its process)
        self.poll = poll
        self.hooks: Hooks | None = None
        self.next_control = 0.0
        self.stopping: Callable[[], bool] | None = None  # a worker's graceful stop: no new steps once it says so
        self.holding: asyncio.Future[None] | None = None
        self.rests: dict[object, Rest] = {}  # the durable waits strands are in now
        self.halted: asyncio.Future[tuple[str, Any]] | None = None  # how this execution of the run stops
        self.driver: asyncio.Task[Any] | None = None  # the task that runs this execution
        self.torn_down = False  # ended by a BaseException of the workflow's (KeyboardInterrupt...): as by a kill
        self.cancel_error: RunCancelledError | None = None
        self.canceller: asyncio.Task[Any] | None = None  # delivers a cancel request in its turn
        self.cancel_rec: records.Cancel | None = None  # the cancel delivered, once it is
        self.cancel_pending: records.Cancel | None = None  # a cancel requested in this process, not delivered yet
        self.cleanup = DEFAULT_CLEANUP  # seconds a cancelled workflow may clean up for (the engine's setting)
        self.cleanup_timer: asyncio.TimerHandle | None = None
        self.cut: Callable[[asyncio.Task[Any] | None], None] = lambda here: None  # cuts the run's work for a cancel
        self.requests: dict[str, Callable[[dict[str, Any]], None]] = {}  # other `$` requests, by name, and who acts

    # ---- the inbox: cancel, pause and resume requests -------------------------------------------
    def control(self, force: bool = False) -> None:
        """Act on the inbox's control requests (listed at most every 0.5 s unless forced).

        `$cancel` asks for the run's cancellation, delivered in the run's turn (`request_cancel`); `$pause` /
        `$resume` record a pause / resume. While the run is paused the next boundary of every strand comes
        here, and `boundary` holds it."""
        now = time.monotonic()
        if not force and now < self.next_control:
            return
        self.next_control = now + CONTROL_EVERY
        for message in self.storage.inbox(self.run_id):
            name = message.get("name")
            if name in ("$pause", "$resume"):
                self.storage.ack(self.run_id, message["id"])
                if self.history.paused != (name == "$pause"):
                    self.log.write(records.Pause(ts=time.time()) if name == "$pause" else records.Resume(ts=time.time()))
                    self.log.sync()
            elif name == "$cancel":
                self.storage.ack(self.run_id, message["id"])
                self.request_cancel(message.get("payload"))
            elif name in self.requests:
                self.storage.ack(self.run_id, message["id"])
                self.requests[name](message)
        if self.history.paused:
            self.next_control = float("-inf")

    def flag_attempts(self) -> None:
        """Set the cancelled flag of every running attempt (thread-safe: the heartbeat calls it for a cancel)."""
        for att in list(self.running):
            att.cancel()

    def interrupt(self) -> None:
        """A control request arrived while a step ran (the heartbeat saw it): act on it now. A cancel is
        delivered at the run's next quiet point, which is now when every strand waits (on steps or anything
        else); a pause takes effect at the next step boundary."""
        if self.log.dead or self.turns.closed:
            return
        try:
            self.control(force=True)
        except Exception:  # noqa: BLE001 - the next step boundary asks the storage again
            pass

    async def boundary(self, force: bool = False) -> None:
        """A durable boundary: act on control requests, and while the run is paused wait here until it resumes."""
        if self.stopping is not None and self.stopping():
            await self.interrupted()
        if not self.history.paused:
            self.control(force)
        canceller = self.canceller
        if canceller is not None and self.cancel_rec is None and not canceller.done():
            await asyncio.shield(canceller)  # a cancel requested goes first: it reaches the workflow here
        if self.history.paused:
            await self.hold()

    async def interrupted(self) -> NoReturn:
        """A worker's graceful stop reached this strand: it starts nothing more, and the run leaves its process
        (due again at once) as soon as the rest of it is quiet and no step runs."""
        with self.resting(Rest("interrupted", "stopped by its worker", parkable=True, at=time.time())):
            await forever()
        raise AssertionError("unreachable")

    async def hold(self) -> None:
        """Wait out a pause; every strand shares one pause loop, so the inbox is polled once per `poll` seconds."""
        if self.holding is None or self.holding.done():
            self.holding = internal(self._hold())
            self.holding.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(self.holding)

    async def _hold(self) -> None:
        """The pause loop: returns on `$resume`; a run that does not wait parks as paused once it is quiet."""
        with self.resting(Rest("paused", "paused", parkable=not self.wait)):
            while True:
                if self.log.lost is not None:
                    raise self.log.lost
                self.control(force=True)
                if not self.history.paused:
                    return
                info = self.storage.info(self.run_id)
                if info is not None and info.kind != "pause":
                    self.log.write(records.Pause(ts=time.time()))  # keeps `list`, which reads the last record, exact
                self.turns.wake()
                await asyncio.sleep(self.poll)

    async def nap(self, when: datetime, force: bool = False) -> None:
        """Wait until `when` on the run's clock, acting on control requests every `poll` seconds meanwhile."""
        if force or time.monotonic() >= self.next_control:
            await self.boundary(force)
        if self.clock.now() >= when:
            await self.clock.sleep_until(when)
            return
        sleeper = internal(self.clock.sleep_until(when))
        try:
            while not sleeper.done():
                await asyncio.wait((sleeper,), timeout=self.poll)
                if not sleeper.done():
                    self.turns.wake()  # look for a quiet point to park at, whatever changed meanwhile
                    await self.boundary(force=True)
        finally:
            sleeper.cancel()
        sleeper.result()

    async def live_turn(self, when: float | None = None) -> None:
        """Wait for the turn of an outcome of this process that happened at `when` (default: now)."""
        turns = self.turns
        if not turns.live_now():
            await turns.live(time.time() if when is None else when)

    # ---- outcomes reaching the workflow -------------------------------------------------------------
    def deliver(self, h: Handle, value: Any) -> None:
        """Make `value` the result of `h` (its turn came); its observers' callbacks run before the next turn."""
        if not h.done():
            set_result(h, value)
            if h.observed:
                self.turns.hop()

    def failed(self, h: Handle, exc: BaseException) -> None:
        """The operation of `h` ended with `exc` (raised to its direct awaiter as well). A stop of the whole
        run (a crash, a lost lease) or a tear-down leaves the handle pending: nothing of the workflow sees it."""
        if h.done() or isinstance(exc, GeneratorExit) or self.log.stops(exc):
            return
        if not isinstance(exc, Exception | asyncio.CancelledError):
            self.torn_down = True  # KeyboardInterrupt, SystemExit...: the steps it cuts off are cut as by a kill
        fail(h, exc)
        if h.observed:
            self.turns.hop()

    def cancel_cut(self, exc: BaseException, h: Handle | None = None) -> BaseException:
        """The error an awaiter of `h` gets for `exc`: the run's cancel error when the run's cancel request cut
        the operation. A cancellation this run's kernel caused (a cancel request, the workflow cancelling `h`)
        is taken back from the task, so clean-up code runs in a task that is not cancelling."""
        if not isinstance(exc, asyncio.CancelledError):
            return exc
        task = asyncio.current_task()
        if self.cancel_error is not None and is_run_cancel(exc):
            if task is not None:
                task.uncancel()
            return self.cancel_error
        if h is not None and h.cancelled() and task is not None and task is h.driver:
            task.uncancel()
        return exc

    def stopped_from_outside(self) -> bool:
        """Whether what runs this execution is being cancelled (Ctrl-C, a worker stopping, the event loop
        closing): a step cut off then is cut as by a kill, and recorded as nothing."""
        driver = self.driver
        return self.torn_down or (driver is not None and driver.cancelling() > 0)

    # ---- resting and stopping --------------------------------------------------------------------
    @contextlib.contextmanager
    def resting(self, rest: Rest) -> Iterator[None]:
        """While the calling strand waits on something durable (`rest` says how the run would park on it)."""
        rest.task = current_task()
        key = object()
        self.rests[key] = rest
        turns = self.turns
        turns.resting = True
        turns.wake()
        try:
            yield
        finally:
            del self.rests[key]
            turns.resting = bool(self.rests)

    def at_rest(self) -> None:
        """The run is quiet and nothing is due to reach it: park it when every strand rests on something durable
        that lets it park (no step running), else let the waits that can go on in this process do so."""
        halted = self.halted
        if halted is None or halted.done() or not self.rests:
            return
        rests = list(self.rests.values())
        parks = not self.running and all(r.parkable for r in rests)
        if parks and any(r.children for r in rests) and any(
                not r.children and (r.at is not None or r.signal is not None) for r in rests):
            parks = False  # a queue entry waits for children, or for times and signals, not both at once
        if parks and raw_timers(self.turns, {r.task for r in rests}):
            parks = False  # a plain asyncio timer of the workflow's would be lost: wait here for it
        if not parks:
            for r in rests:
                if r.fallback is not None and not r.fallback.done():
                    r.fallback.set_result(None)
            return
        self.stop(("park", rests))

    def stop(self, outcome: tuple[str, Any]) -> None:
        """End this execution of the run with `outcome` (the driver in `RunKernel.run` takes it from there)."""
        halted = self.halted
        if halted is not None and not halted.done():
            halted.set_result(outcome)

    async def halt(self, exc: BaseException) -> NoReturn:
        """The whole run stops here (a crash, a lost lease, a full disk): the calling strand waits until the run
        is torn down, and nothing of the workflow sees `exc`."""
        self.stop(("halt", exc))
        await forever()
        raise AssertionError("unreachable")

    # ---- cancellation --------------------------------------------------------------------------
    def request_cancel(self, payload: Any) -> None:
        """A cancel request arrived: it reaches the workflow in the run's turn (`deliver_cancel`)."""
        if self.canceller is not None or self.turns.closed:
            return
        options = payload if isinstance(payload, dict) else {}
        compensate = options.get("compensate") is True
        window = options.get("cleanup")
        if isinstance(window, bool) or not isinstance(window, int | float) or not 0 <= window < 1e9:
            window = self.cleanup
        rec = records.Cancel(compensate=compensate, until=to_iso(self.clock.now() + timedelta(seconds=window)))
        self.cancel_pending = rec
        self.cancel_in_turn(rec, recorded=False)

    def cancel_in_turn(self, rec: records.Cancel, recorded: bool) -> None:
        """Deliver the cancel `rec` in its turn: a recorded one where the log has it, a new one when the run is
        next quiet."""

        async def deliver() -> None:
            if recorded:
                await self.turns.recorded(CANCEL_PATH)
            else:
                await self.live_turn()
            if self.cancel_rec is None:
                self.deliver_cancel(rec, recorded)

        self.canceller = self.turns.start(deliver(), contextvars.copy_context())
        self.next_control = float("-inf")  # the next step boundary waits for it

    def deliver_cancel(self, rec: records.Cancel, recorded: bool, here: asyncio.Task[Any] | None = None) -> None:
        """The run is cancelled here: record it (the cancel's place in the log), cut the steps running (each
        recorded as cancelled, its awaiter gets `RunCancelledError`), and cancel the workflow's task, which may
        catch it (`except RunCancelledError:` / `except asyncio.CancelledError:` / `finally:`) and run clean-up
        steps until its clean-up window ends (`cut`)."""
        if self.turns.closed:
            return
        self.cancel_error = RunCancelledError(
            f"run {self.run_id} was cancelled", run_id=self.run_id,
            hint=f"Start it over with `durably restart {self.run_id}` (or run(..., fresh=True)).",
            docs="docs/operations.md#cancel")
        if not recorded:
            rec = records.Cancel(compensate=rec.compensate, until=rec.until, ts=time.time())
            self.log.write(rec)
            self.log.sync()
        self.cancel_rec = rec
        self.cut(here)
        left = (from_iso(rec.until) - self.clock.now()).total_seconds() if rec.until else self.cleanup
        loop = asyncio.get_running_loop()
        self.cleanup_timer = loop.call_later(max(left, 0.0), self.stop, ("halt", CLEANUP_OVER))

    def cut_inline(self, att: Any) -> None:
        """A quick sync step on the loop thread saw a cancel request while it ran (the heartbeat flagged it).
        Nothing else of the run can run meanwhile, so the cancel is delivered here, and the step is cut by it:
        recorded as cancelled, its awaiter gets `RunCancelledError`."""
        self.control(force=True)
        pending = self.cancel_pending
        if pending is not None and self.cancel_rec is None:
            self.deliver_cancel(pending, recorded=False, here=asyncio.current_task())
        if self.cancel_error is not None:
            self.log.write(records.Err(path=att.path, label=att.label, attempt=att.number,
                                       error=dump_error(self.cancel_error), ts=time.time()))
            raise self.cancel_error

    async def limited(self, path: str, label: str, reason: str, wait: float | None, signal: str,
                      released: asyncio.Future[None], recheck: float) -> None:
        """Rest until a limit (`_replay.limits`) may let the attempt at `path` start: `wait` seconds for a rate
        limit's window, else until a permit comes back (`released`, in this process) or `recheck` seconds
        pass. A run a worker serves parks meanwhile when the rest of it rests too (due again then, or at once on
        `signal`); nothing is recorded but the park, so the attempt starts afresh when it may."""
        seconds = recheck if wait is None else wait
        due = self.clock.now() + timedelta(seconds=seconds)
        rest = Rest("waiting", f"waiting for {reason}", parkable=not self.wait, at=due.timestamp(),
                    signal=signal if wait is None else None, path=path, label=label,
                    record=records.Park(path=path, until=to_iso(due), limit=reason, ts=time.time()))
        with self.resting(rest):
            await self.boundary(force=True)
            if wait is not None:
                await self.nap(due)
                return
            # a permit given back here wakes it at once; one given back in another process, at its next look
            await asyncio.wait((released,), timeout=min(seconds, max(self.poll, LIMIT_LOOK)))

    # ---- durable sleeps and waits for signals ------------------------------------------------
    def check_durable_wait(self, h: Handle) -> None:
        """A durable wait must not sit inside a plain asyncio deadline, which a park or a crash would lose."""
        task = current_task()
        if task is not None and deadline_over(task):
            raise not_durable(h.label)

    async def sleep(self, h: Handle, path: str, when: datetime) -> None:
        """The operation of `ctx.sleep` at `path`: its wake time is recorded the first time it runs."""
        log = self.log
        wake = self.history.wakes.get(path)
        if wake is None:
            if self.hooks is not None:
                self.hooks.unrecorded(path, "ctx.sleep", "ctx.sleep")
            log.write(records.Wake(path=path, at=to_iso(when), ts=time.time()))
            log.sync()
        else:
            when = from_iso(wake.at)
        if self.clock.now() < when:
            h.driver = current_task()
            self.check_durable_wait(h)
            with self.resting(Rest("sleeping", f"sleeping until {to_iso(when)}", parkable=not self.wait,
                                   at=when.timestamp(), path=path, label="ctx.sleep")):
                await self.nap(when, force=True)
        await self.live_turn(when.timestamp())
        log.write(records.Ok(attempt=1, path=path, label="ctx.sleep", value=None, ms=0, ts=time.time()))
        log.step_done()

    async def wait_for(self, h: Handle, path: str, name: str, schema: Any, timeout: float | None) -> Any:
        """The operation of `ctx.wait_for` at `path`: the payload of the next signal `name` sent to the run."""
        log = self.log
        opened = self.history.waits.get(path)
        if opened is None:
            if self.hooks is not None:
                self.hooks.unrecorded(path, "ctx.wait_for", "ctx.wait_for")
            deadline = self.clock.now() + timedelta(seconds=timeout) if timeout else None
            wait = records.Wait(path=path, name=name, deadline=to_iso(deadline) if deadline else None,
                                ts=time.time())
            form = schema.json_schema() if schema is not None else None
            if form is not None:  # what the console renders as a form, and checks a submitted value against
                wait.schema = form
            log.write(wait)
            log.sync()
            if timeout is None:
                log.advise("WAITFOR_NO_TIMEOUT", 1, f"ctx.wait_for({name!r}) waits without a timeout")
        else:
            deadline = from_iso(opened.deadline) if opened.deadline else None
        expires = self.clock.deadline(deadline) if deadline is not None else None
        h.driver = current_task()
        checked = False
        rest = Rest("waiting", f"waiting for signal {name!r}", parkable=not self.wait,
                    at=deadline.timestamp() if deadline is not None else None, signal=name, path=path,
                    label="ctx.wait_for")
        with self.resting(rest):
            while True:
                await self.boundary(force=True)
                signal = self.next_signal(name)
                if signal is not None and not self.turns.live_now():
                    await self.turns.live(signal_time(signal))
                    signal = self.next_signal(name)  # another wait may have taken it in its turn
                if signal is not None:
                    log.write(records.Ok(attempt=1, path=path, label="ctx.wait_for",
                                         value=signal.get("payload"), ms=0, signal=signal["id"], ts=time.time()))
                    log.step_done()
                    self.storage.ack(self.run_id, signal["id"])
                    value = load_value(signal.get("payload"))
                    if schema is not None:
                        value = schema.convert(value, f"signal {name!r}")
                    break
                if deadline is not None and expires is not None and self.clock.monotonic() >= expires:
                    await self.live_turn(deadline.timestamp())
                    error = WaitTimeoutError(f"no signal {name!r} arrived within {timeout or 0:g}s "
                                             f"(deadline {to_iso(deadline)})", name=name,
                                             path=list(path_tuple(path)))
                    log.write(records.Err(attempt=1, path=path, label="ctx.wait_for", error=dump_error(error),
                                          ts=time.time()))
                    log.step_done()
                    raise error
                if not checked:
                    self.check_durable_wait(h)
                    checked = True
                self.turns.wake()
                pause = self.poll if expires is None else min(self.poll, expires - self.clock.monotonic())
                await self.clock.sleep(pause)
        return value

    def next_signal(self, name: str) -> dict[str, Any] | None:
        """The oldest unread signal `name` in the run's inbox (acknowledging ones already recorded)."""
        for signal in self.storage.inbox(self.run_id):
            if signal["id"] in self.history.signals:
                self.storage.ack(self.run_id, signal["id"])
            elif signal.get("name") == name:
                return signal
        return None
