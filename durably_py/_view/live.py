"""The live view of `durably run` on a terminal: the state it shows, the rows it draws, and the one writer.

Drawing never waits for the workflow, and the workflow never waits for drawing:

- `Watcher` (a `RunHook`) holds what the view shows. Step events update it where they happen (the run's
  event loop, or a sync step's thread), under a lock held for a few assignments. What a run with no step in
  flight waits for, and how a run that another process runs is getting on, a reader thread of its own takes
  from the run's log twice a second (`Watcher.look`); nothing else reads storage, and never the drawing.
- `view_rows` turns a snapshot of that state into the rows of the view: no I/O, no event loop, no storage.
- `LiveTerminal` owns the terminal while the view shows. sys.stderr (and sys.stdout when it is a terminal
  too) become streams that only queue what they are given, from any thread, and return at once; file
  descriptors 2 (and 1) point at pipes that a thread of their own drains into the same queue, so what a
  subprocess of a step or C code writes there is queued too. One writer thread prints the queued lines above
  the view and redraws it eight times a second. Only that thread writes to the terminal, so a row is never
  glued to output and output never waits for a row.

rich is imported by the writer thread only (to style the rows); nothing here imports it at module level.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .._engine.engine import RunHook
from .._engine.runs import owner_text
from .._events import StepEvent

if TYPE_CHECKING:
    from .._engine.engine import Engine
    from .._state.history import RunState

TICK = 1 / 8  # seconds between redraws of the view
POLL = 0.5  # seconds between looks at the logs of idle and joined runs
SHOWN = 8  # runs the view shows at most (the first one always, then the latest)
STOP_WAIT = 1.0  # seconds `LiveTerminal.stop` waits for the writer to draw its last frame
PARTIAL_WAIT = 1.0  # seconds an unfinished line waits for its end before it shows on its own
DRAIN_WAIT = 0.2  # seconds `LiveTerminal.stop` waits for what is still in a descriptor's pipe


# ---- texts shared with the summary and `inspect` ------------------------------------------------------------


def duration_text(seconds: float | None) -> str:
    """A duration as the CLI shows it: 12.3ms, 4.56s, 3m07s, 2h05m."""
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.1f}ms"
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def when_text(value: Any) -> str:
    """A recorded time (ISO text, datetime or epoch seconds) in local time, as the rest of the CLI shows times."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = datetime.fromtimestamp(value).astimezone()
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return value
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if isinstance(value, datetime) else str(value or "")


def is_step(label: str) -> bool:
    """Whether a recorded label is a step of the workflow's own (`ctx.step`), not a sleep, wait, spawn, join,
    loop, graph or recorded value (`ctx.*`): what the end-of-run summary, `inspect` and the console count."""
    return not label.startswith("ctx.")


# ---- what the view shows -----------------------------------------------------------------------------------


@dataclass
class RunTally:
    """What one run's step events (and looks at its log) added up to."""

    run_id: str
    ran: int = 0
    replayed: int = 0
    failed: int = 0
    retries: int = 0
    running: dict[tuple[int, ...], tuple[str, float]] = field(default_factory=dict)  # label, time it started
    retrying: dict[tuple[int, ...], str] = field(default_factory=dict)
    status: str | None = None  # read back from the log once the command is done
    detail: str | None = None  # what a parked run waits for: live (from the log) and once done
    joined: str | None = None  # `pid N on HOST` while another process runs the run and this one waits
    lease: str | None = None  # why this process waits for a lease its owner no longer renews
    logged: int = 0  # steps the log shows ended (the progress of a joined run)
    logged_running: list[tuple[str, float]] = field(default_factory=list)  # label, start (epoch) per the log
    over: bool = False  # this process stopped running it

    @property
    def steps(self) -> int:
        """Steps that ended (ran or replayed, ok or failed) in this process."""
        return self.ran + self.replayed + self.failed

    def to_dict(self) -> dict[str, Any]:
        """JSON form for `durably run --json`."""
        return {"run_id": self.run_id, "status": self.status, "detail": self.detail, "ran": self.ran,
                "replayed": self.replayed, "failed": self.failed, "retries": self.retries}


@dataclass
class Look:
    """What a look at one run's log found (`Watcher.look`)."""

    detail: str | None
    steps: int
    running: list[tuple[str, float]]


class Watcher(RunHook):
    """Every run of the process (its step events, starts and ends) as the live view and the summary show it."""

    def __init__(self, engine: Engine | None) -> None:
        super().__init__(self.on_event)
        self.lock = threading.Lock()
        self.runs: dict[str, RunTally] = {}
        self.started_at = time.monotonic()
        self.engine = engine
        self.say: Callable[[str], None] = lambda line: None  # a line for the person at the terminal
        self.reader: threading.Thread | None = None
        self.reading = False

    # ---- updated where events happen (the run's loop, a step's thread) ----------------------------
    def tally(self, run_id: str) -> RunTally:
        """The tally of a run, made when first seen (call with the lock held)."""
        tally = self.runs.get(run_id)
        if tally is None:
            tally = self.runs[run_id] = RunTally(run_id)
        return tally

    def found(self, run_id: str) -> None:
        """A run was found or created: it shows even before (or without) a step of its own."""
        with self.lock:
            self.tally(run_id)

    def started(self, run_id: str, workflow: str = "", *, joined: bool = False) -> None:
        holder = self.holder(run_id) if joined else {}
        with self.lock:
            tally = self.tally(run_id)
            first = joined and tally.joined is None and bool(holder)
            tally.joined = owner_text(holder.get("owner")) if joined else None
            tally.lease = None
            tally.over = False
        if first:
            note = lease_note(holder)
            self.say(f"{run_id} is held by {note}" if note else
                     f"joined {run_id} (running in {owner_text(holder.get('owner'))})")

    def ended(self, run_id: str, status: str, error: BaseException | None) -> None:
        with self.lock:
            self.tally(run_id).over = True

    def on_event(self, event: StepEvent) -> None:
        """Count one step event (of a step of the workflow's own: a replayed sleep or join is not one)."""
        if not is_step(event.label):
            return
        with self.lock:
            tally = self.tally(event.run_id)
            tally.detail = None
            path = event.path
            if event.status == "running":
                tally.retrying.pop(path, None)
                tally.running[path] = (event.label, time.time())
            elif event.status == "ok":
                tally.running.pop(path, None)
                tally.ran += 1
            elif event.status == "replayed":
                tally.replayed += 1
            elif event.status == "retrying":
                tally.running.pop(path, None)
                tally.retrying[path] = event.label
                tally.retries += 1
            elif event.status == "failed":
                tally.running.pop(path, None)
                tally.retrying.pop(path, None)
                tally.failed += 1

    @property
    def elapsed(self) -> float:
        """Seconds since the command started."""
        return time.monotonic() - self.started_at

    def snapshot(self) -> list[RunTally]:
        """Copies of the tallies, in the order the runs were found (for drawing without the lock)."""
        with self.lock:
            return [RunTally(**{**vars(t), "running": dict(t.running), "retrying": dict(t.retrying),
                                "logged_running": list(t.logged_running)}) for t in self.runs.values()]

    # ---- the reader thread: what a run waits for, and a joined run's progress ---------------------
    def holder(self, run_id: str) -> dict[str, Any]:
        """Who holds a run's lease now (`Runs.holder`; {} when no one does or it cannot be read)."""
        if self.engine is None:
            return {}
        try:
            return self.engine.runs.holder(run_id)
        except Exception:  # noqa: BLE001 - then it is said without the owner
            return {}

    def look(self, run_id: str) -> Look | None:
        """Read one run's log: what it waits for, how many steps ended, which are running (None: unreadable)."""
        from .._state.history import describe

        if self.engine is None:
            return None
        runs = self.engine.runs
        try:
            history, _ = runs.read(run_id)
            held = self.engine.storage.held(run_id)
            state = describe(history, held=held)
        except Exception:  # noqa: BLE001 - a run not readable yet shows without what it waits for
            return None
        running = [(s.label, s.started_at.timestamp()) for s in state.steps
                   if s.status == "running" and s.started_at is not None]
        steps = sum(s.status in ("ok", "failed") and is_step(s.label) for s in state.steps)
        return Look(parked_detail(state), steps, running)

    def start_reading(self) -> None:
        """Start the reader thread (once); it ends with `stop_reading`."""
        if self.engine is None or self.reader is not None:
            return
        self.reading = True
        self.reader = threading.Thread(target=self._read_loop, name="durably-live-reader", daemon=True)
        self.reader.start()

    def stop_reading(self) -> None:
        """Stop the reader thread (it ends after its current look)."""
        self.reading = False

    def _read_loop(self) -> None:
        while self.reading:
            time.sleep(POLL)
            with self.lock:
                wanted = [t.run_id for t in self.runs.values()
                          if not t.over and (t.joined or not (t.running or t.retrying))]
            for run_id in [*wanted[:1], *wanted[1:][-(SHOWN - 1):]]:
                if not self.reading:
                    return
                found = self.look(run_id)
                if found is None:
                    continue
                with self.lock:
                    tally = self.runs[run_id]
                    if tally.joined or not (tally.running or tally.retrying):
                        tally.detail = found.detail
                    if tally.joined:
                        tally.logged, tally.logged_running = found.steps, found.running
                if tally.joined:
                    note = lease_note(self.holder(run_id))
                    with self.lock:
                        tally.lease = note


def lease_note(holder: dict[str, Any]) -> str | None:
    """`pid 4242 on vm, which is not running; its lease expires in 12.0s, then this process continues the run`
    while the process holding a run no longer runs (None while it runs, or where that cannot be told)."""
    if not holder or holder.get("alive") is not False:
        return None
    expires = holder.get("expires")
    left = f"; its lease expires in {duration_text(max(expires - time.time(), 0))}" if expires else ""
    return f"{owner_text(holder.get('owner'))}, which is not running{left}, then this process continues the run"


def parked_detail(state: RunState) -> str | None:
    """What a parked run waits for: `waiting for 'approval' (deadline ...)`, `sleeping until ...`, `paused`; or,
    when what it waited for came, that it is ready to continue."""
    if state.status == "paused":
        return "paused"
    if state.status == "over_budget":
        over = state.over_budget or {}
        return f"over budget: raise it with `durably budget {over.get('owner') or state.run_id} --raise KIND=N`"
    if state.ready:
        return f"ready: {state.ready}; a worker or `durably retry {state.run_id}` continues it"
    if state.status == "waiting":
        waits = [s.output for s in state.steps if s.status == "waiting" and isinstance(s.output, dict)]
        parts = []
        for wait in waits:
            if "limit" in wait:
                parts.append(f"{wait['limit']} (looks again by {when_text(wait.get('until'))})")
                continue
            if "children" in wait:
                count = wait.get("count") or len(wait["children"])
                parts.append(f"{count} child run{'s' if count != 1 else ''} to end")
                continue
            deadline = wait.get("deadline")
            if "awakeable" in wait:
                parts.append(f"awakeable {wait['awakeable']} (deadline {when_text(deadline)})" if deadline
                             else f"awakeable {wait['awakeable']} (no deadline)")
                continue
            parts.append(f"{wait.get('signal')!r} (deadline {when_text(deadline)})" if deadline
                         else f"{wait.get('signal')!r} (no deadline)")
        return "waiting for " + ", ".join(parts) if parts else "waiting"
    if state.status == "sleeping":
        wakes = [str(s.output.get("until")) for s in state.steps
                 if s.status == "sleeping" and isinstance(s.output, dict)]
        wakes += [f"{s.output['retry_at']}" for s in state.steps
                  if s.status == "retrying" and isinstance(s.output, dict) and s.output.get("retry_at")]
        return f"sleeping until {when_text(min(wakes))}" if wakes else "sleeping"
    return None


# ---- the rows ------------------------------------------------------------------------------------------------

Row = list[tuple[str, str]]  # (text, rich style) segments
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def _in_flight(tally: RunTally, now: float) -> list[tuple[str, float]]:
    """The labels in flight with how long each has run, longest first (a joined run's from its log)."""
    running = [(label, now - since) for label, since in tally.running.values()]
    running += [(label, now - since) for label, since in tally.logged_running]
    running.sort(key=lambda item: -item[1])
    return running


def run_row(tally: RunTally, now: float) -> Row:
    """One run's row: its id, counts, and the steps in flight with their time, or what it waits for."""
    row: Row = [(tally.run_id, "bold"), ("  ", "")]
    if tally.joined:
        row.append((f"joined (running in {tally.joined})", "cyan"))
        row.append((f" · {tally.logged} done", "green"))
    else:
        row.append((f"{tally.ran} done", "green"))
    if tally.replayed:
        row.append((f" · {tally.replayed} replayed", "green"))
    running = _in_flight(tally, now)
    if running:
        row.append((f" · {len(running)} running", "cyan"))
    if tally.retrying:
        row.append((f" · {len(tally.retrying)} retrying", "yellow"))
    if tally.failed:
        row.append((f" · {tally.failed} failed", "red"))
    labels = [f"{label} {duration_text(seconds) if seconds >= 1 else ''}".rstrip() for label, seconds in running]
    labels = list(dict.fromkeys([*labels, *tally.retrying.values()]))
    if tally.lease:
        row.append((f"  {tally.lease}", "yellow"))
    elif labels:
        shown = ", ".join(labels[:3]) + (f" +{len(labels) - 3}" if len(labels) > 3 else "")
        row.append((f"  {shown}", "bright_black"))
    elif tally.detail:
        row.append((f"  {tally.detail}", "blue"))
    return row


def view_rows(tallies: list[RunTally], elapsed: float, now: float) -> list[Row]:
    """The rows of the view: a title with the time so far, then the first run (the one the command started,
    pinned on top however many children follow), a count of the runs left out, and the latest runs."""
    shown = tallies if len(tallies) <= SHOWN else [tallies[0], *tallies[-(SHOWN - 1):]]
    parked = bool(shown) and all(t.detail and not t.running and not t.joined for t in shown)
    mark = ("⏸", "blue") if parked else (SPINNER[int(elapsed / 0.08) % len(SPINNER)], "cyan")
    rows: list[Row] = [[mark, (" ", ""), (f"durably  {duration_text(elapsed)}", "bold")]]
    for i, tally in enumerate(shown):
        if i == 1 and len(tallies) > SHOWN:
            rows.append([("  ", ""), (f"… {len(tallies) - SHOWN} more runs", "bright_black")])
        rows.append([("  ", ""), *run_row(tally, now)])
    return rows


# ---- the one writer ------------------------------------------------------------------------------------------


class QueuedStream(io.TextIOBase):
    """sys.stdout or sys.stderr while the view shows: `write` queues the text and returns (any thread, never
    blocking, never drawing); the writer thread prints it. Once the view stopped, writes go straight through
    (a logging handler made meanwhile keeps this object)."""

    def __init__(self, terminal: LiveTerminal, real: Any, index: int) -> None:
        self._terminal = terminal
        self._real = real
        self._index = index
        self._tty = bool(real.isatty())  # asked before its descriptor pointed at a pipe

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not self._terminal.queue(self._index, text):
            self._real.write(text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self._terminal.queue(self._index, None):
            self._real.flush()

    def isatty(self) -> bool:
        return self._tty

    def fileno(self) -> int:
        return int(self._real.fileno())

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._real, "encoding", "utf-8") or "utf-8")

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self._real, "errors", None)

    @property
    def buffer(self) -> Any:
        """Bytes written here are decoded and queued like text."""
        return _QueuedBuffer(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _QueuedBuffer(io.RawIOBase):
    """`sys.stdout.buffer` of a `QueuedStream`."""

    def __init__(self, stream: QueuedStream) -> None:
        self._stream = stream

    def write(self, data: Any) -> int:
        self._stream.write(bytes(data).decode(self._stream.encoding, errors="replace"))
        return len(data)

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._stream.flush()


class DescriptorPipe:
    """File descriptor `fd` (1 or 2) pointed at a pipe while the view shows: a thread queues what subprocesses
    and C code write to it as stream `index`, so it never lands in the middle of a row. `out` writes to the
    terminal the descriptor pointed at before."""

    def __init__(self, terminal: LiveTerminal, index: int, fd: int, real: Any) -> None:
        self.terminal, self.index, self.fd = terminal, index, fd
        self.encoding = str(getattr(real, "encoding", None) or "utf-8")
        self.saved = os.dup(fd)
        read, write = os.pipe()
        try:
            os.dup2(write, fd)
        except OSError:
            os.close(read)
            os.close(self.saved)
            raise
        finally:
            os.close(write)
        self.read = read
        self.out = open(self.saved, "w", encoding=self.encoding, errors="replace", closefd=False)  # noqa: SIM115
        self.thread = threading.Thread(target=self._pump, name=f"durably-live-fd{fd}", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        decoder = codecs.getincrementaldecoder(self.encoding)(errors="replace")
        while True:
            try:
                chunk = os.read(self.read, 65536)
            except OSError:
                return
            if not chunk:
                break
            text = decoder.decode(chunk)
            if text and not self.terminal.queue(self.index, text, source=-self.fd):
                with contextlib.suppress(OSError):  # the view is over: straight to the terminal
                    os.write(self.fd, chunk)
        os.close(self.read)

    def restore(self) -> None:
        """Point the descriptor at the terminal again and wait a moment for what is still in the pipe (a
        subprocess that outlives the view keeps writing through it, to the terminal)."""
        with contextlib.suppress(OSError):
            os.dup2(self.saved, self.fd)
        self.thread.join(DRAIN_WAIT)

    def close(self) -> None:
        """Once the writer is done: close the copy of the terminal's descriptor."""
        with contextlib.suppress(OSError):
            self.out.close()
            os.close(self.saved)


class LiveTerminal:
    """The terminal while the live view shows: queued output above, the view's rows below, one writer thread."""

    def __init__(self, watcher: Watcher, color: bool = True) -> None:
        self.watcher = watcher
        self.color = color
        self.reals: list[Any] = []  # the streams replaced, by index: stderr, then stdout when it is a terminal
        self.outs: list[Any] = []  # where the writer writes each: the terminal, never a descriptor's pipe
        self.pipes: list[DescriptorPipe] = []
        self.pending: deque[tuple[int, int, str | None]] = deque()  # (stream, thread, text or None for a flush)
        self.wake = threading.Event()
        self.live = False
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.height = 0  # rows of the view on screen now
        self.partial: dict[tuple[int, int], tuple[str, float]] = {}  # unfinished lines, since when

    # ---- any thread -------------------------------------------------------------------------------
    def queue(self, index: int, text: str | None, source: int | None = None) -> bool:
        """Queue text (None: a flush) for the writer, from the calling thread (or `source`: a descriptor's
        pipe); False once the view stopped (write it directly)."""
        if not self.live:
            return False
        self.pending.append((index, threading.get_ident() if source is None else source, text))
        if text is None or "\n" in text:
            self.wake.set()
        return True

    # ---- the command's thread ---------------------------------------------------------------------
    def start(self) -> None:
        """Replace sys.stderr (and sys.stdout when it is the terminal) and start drawing."""
        self.reals = [sys.stderr]
        replaced = [sys.stderr]
        if sys.stdout.isatty():
            self.reals.append(sys.stdout)
        self.live = True
        self.outs = list(self.reals)
        sys.stderr = QueuedStream(self, replaced[0], 0)
        if len(self.reals) > 1:
            sys.stdout = QueuedStream(self, self.reals[1], 1)
        for index, real in enumerate(self.reals):
            try:
                real.flush()
                pipe = DescriptorPipe(self, index, real.fileno(), real)
            except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
                continue  # not a real descriptor: only what Python writes is queued
            self.pipes.append(pipe)
            self.outs[index] = pipe.out
        self.watcher.start_reading()
        self.thread = threading.Thread(target=self._run, name="durably-live-view", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Print what is still queued, take the view off the screen and give the streams back; waits for the
        writer at most `STOP_WAIT` seconds (a terminal that does not take output never holds the command)."""
        self.watcher.stop_reading()
        for pipe in self.pipes:
            pipe.restore()
        self.live = False
        self.done.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join(STOP_WAIT)
        for pipe in self.pipes:
            pipe.close()
        if isinstance(sys.stderr, QueuedStream):
            sys.stderr = self.reals[0]
        if len(self.reals) > 1 and isinstance(sys.stdout, QueuedStream):
            sys.stdout = self.reals[1]

    # ---- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        from rich.console import Console

        err = self.outs[0]
        console = Console(file=err, highlight=False, no_color=not self.color or None)
        try:
            err.write("\x1b[?25l")  # no cursor blinking over the rows
            while not self.done.is_set():
                self._frame(console, final=False)
                self.wake.wait(TICK)
                self.wake.clear()
                time.sleep(0.01)  # let a burst of output gather into one frame
            self._frame(console, final=True)
        except Exception:  # noqa: BLE001 - a broken terminal ends the view, never the run
            pass
        finally:
            try:
                err.write("\x1b[?25h")
                err.flush()
            except Exception:  # noqa: BLE001 - closed meanwhile
                pass

    def _lines(self, final: bool) -> list[tuple[int, str]]:
        """The complete lines queued so far, in order, each with its stream. A thread's unfinished line waits for
        its end, so lines of two threads never mix; one left unfinished for `PARTIAL_WAIT` seconds (a prompt)
        shows as a line of its own."""
        out: list[tuple[int, str]] = []
        partial = self.partial
        now = time.monotonic()
        while self.pending:
            index, thread, text = self.pending.popleft()
            if not text:
                continue
            key = (index, thread)
            lines = (partial.pop(key, ("", 0.0))[0] + text).split("\n")
            out.extend((index, line) for line in lines[:-1])
            if lines[-1]:
                partial[key] = (lines[-1], now)
        for key, (rest, since) in list(partial.items()):
            if final or now - since >= PARTIAL_WAIT:
                out.append((key[0], rest))
                del partial[key]
        return out

    def _frame(self, console: Any, final: bool) -> None:
        """One redraw: rub the rows out, print the queued lines, draw the rows again (not after the last)."""
        chunks: list[tuple[int, str]] = []  # (stream, text), the rows and their erasing on stderr
        if self.height:
            chunks.append((0, "\r\x1b[2K" + "\x1b[1A\x1b[2K" * (self.height - 1)))
        chunks.extend((index, line + "\n") for index, line in self._lines(final))
        rows = [] if final else self._rows(console)
        chunks.append((0, "\n".join(rows)))
        while chunks:
            index = chunks[0][0]
            same = 0
            while same < len(chunks) and chunks[same][0] == index:
                same += 1
            stream = self.outs[index]
            stream.write("".join(text for _, text in chunks[:same]))
            stream.flush()
            del chunks[:same]
        self.height = len(rows)

    def _rows(self, console: Any) -> list[str]:
        """The view's rows as terminal text, each cut to the terminal's width."""
        from rich.text import Text

        width, lines = console.size  # $COLUMNS / $LINES, else what descriptors 0-2 say (1 and 2 may be pipes now)
        try:
            size = os.get_terminal_size(self.outs[0].fileno())  # so ask the terminal itself
        except (OSError, ValueError, AttributeError):
            size = None
        if size is not None and size.columns and "COLUMNS" not in os.environ:
            width = size.columns
        if size is not None and size.lines and "LINES" not in os.environ:
            lines = size.lines
        rows = view_rows(self.watcher.snapshot(), self.watcher.elapsed, time.time())[:max(lines - 1, 1)]
        out = []
        for row in rows:
            line = Text.assemble(*row, no_wrap=True, overflow="ellipsis")
            line.truncate(max(width - 1, 1), overflow="ellipsis")
            with console.capture() as captured:
                console.print(line, end="", soft_wrap=True)
            out.append(captured.get())
        return out
