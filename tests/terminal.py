"""A command on a real pseudo-terminal, as a person at a terminal runs it: stdin, stdout and stderr are the
terminal (not pipes), the window has a size, and what the terminal shows is read as the command writes it."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """`durably ARGS` (or any argv) on a pty of `columns` x `rows`; the output is drained by a thread, so a
    command never blocks on a full terminal."""

    def __init__(self, *args: str, cwd: Path, columns: int = 80, rows: int = 24, argv: list[str] | None = None,
                 **env: str) -> None:
        self.controller, terminal = os.openpty()
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        environ = {**os.environ, "TERM": "xterm-256color", "PYTHONPATH": os.pathsep.join(sys.path), **env}
        for name in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE"):
            if name not in env:
                environ.pop(name, None)
        command = argv if argv is not None else [sys.executable, "-m", "durably_py.cli", *args]
        self.proc = subprocess.Popen(command, cwd=cwd, stdin=terminal, stdout=terminal, stderr=terminal,
                                     env=environ, start_new_session=True)
        os.close(terminal)
        self.data = bytearray()
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.controller, 65536)
            except OSError:
                return
            if not chunk:
                return
            with self.lock:
                self.data += chunk

    @property
    def raw(self) -> str:
        """Everything the command wrote to the terminal so far, escape sequences included."""
        with self.lock:
            return self.data.decode(errors="replace")

    @property
    def text(self) -> str:
        """What was written, without escape sequences and carriage returns."""
        return ANSI.sub("", self.raw).replace("\r", "")

    def wait_for(self, needle: str, seconds: float = 20.0) -> bool:
        """Whether `needle` shows (in the plain text) within `seconds`."""
        deadline = time.monotonic() + seconds
        while needle not in self.text:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return needle in self.text
            time.sleep(0.02)
        return True

    def send(self, sig: int = signal.SIGINT) -> None:
        """Send a signal to the command (Ctrl-C: SIGINT)."""
        self.proc.send_signal(sig)

    def wait(self, seconds: float = 60.0) -> int | None:
        """The exit code, or None when the command still runs after `seconds` (it is killed then)."""
        try:
            code = self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        self.reader.join(2)
        return code

    def close(self) -> None:
        """Kill the command if it still runs and close the terminal."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.close(self.controller)
        except OSError:
            pass

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def interrupt(term: Terminal, sig: int = signal.SIGINT, seconds: float = 10.0) -> tuple[int | None, float]:
    """Send `sig` and return the exit code with how long the command took to exit after it."""
    sent = time.monotonic()
    term.send(sig)
    code = term.wait(seconds)
    return code, time.monotonic() - sent
