"""A real restate-server (from .ci/restate, installed by .ci/run) and a durably service, both as child processes.

The server runs with one partition in a temporary base dir on free loopback ports; the service is
`python -m durably_py.restate.server --import ...` in its own process so a test can SIGKILL it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def server_binary() -> str | None:
    """The native restate-server binary: $DURABLY_RESTATE_SERVER, .ci/restate (npm), or restate-server on PATH."""
    env = os.environ.get("DURABLY_RESTATE_SERVER")
    if env:
        return env
    found = sorted(glob.glob(str(ROOT / ".ci/restate/node_modules/@restatedev/restate-server-*/bin/restate-server")))
    if found:
        return found[0]
    return shutil.which("restate-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: Any = None, timeout: float = 60) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"content-type": "application/json", "accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


class Service:
    """`durably serve --restate` as a child process serving `imports` on `port` (a test can SIGKILL it)."""

    def __init__(self, imports: list[str], port: int, admin: str, log: Path) -> None:
        self.imports, self.port, self.admin, self.log = imports, port, admin, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [sys.executable, "-m", "durably_py.cli", "serve", "--restate", "--port", str(self.port),
                "--restate-admin", self.admin]
        for target in self.imports:
            args += ["--import", target]
        offset = self.log.stat().st_size if self.log.exists() else 0  # a restart waits for its own line
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited: {self.log.read_text()[-2000:]}")
            if b"serving " in self.log.read_bytes()[offset:]:
                return
            time.sleep(0.05)
        raise RuntimeError("the service did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


class RestateEnv:
    """restate-server plus the service; `always_replay=True` suspends at every await (replay from the top)."""

    def __init__(self, imports: list[str], *, always_replay: bool = False) -> None:
        binary = server_binary()
        assert binary is not None
        self.dir = Path(tempfile.mkdtemp(prefix="durably-restate-"))
        self.server_log = self.dir / "server.log"
        for tries_left in reversed(range(3)):  # a port free_port() saw free may be taken before the server binds it
            self.proc = self.start_server(binary, always_replay)
            deadline, up = time.monotonic() + 60, False
            while not up and self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    http("GET", f"{self.admin}/health", timeout=2)
                    http("GET", f"{self.ingress}/restate/health", timeout=2)
                    up = True
                except (OSError, urllib.error.URLError):
                    time.sleep(0.05)
            if up:
                break
            said = self.server_log.read_text()[-2000:]
            if not tries_left or "Address in use" not in said:
                raise RuntimeError(f"restate-server did not start: {said}")
            self.proc.kill()
            self.proc.wait()
            shutil.rmtree(self.dir / "data", ignore_errors=True)
        self.service = Service(imports, free_port(), self.admin, self.dir / "service.log")
        if imports:
            try:
                self.service.start()
            except BaseException:
                self.close()
                raise

    def start_server(self, binary: str, always_replay: bool) -> subprocess.Popen[bytes]:
        """restate-server on three ports free_port() found free, its output in `server_log`."""
        self.ingress_port, self.admin_port, self.node_port = free_port(), free_port(), free_port()
        self.ingress = f"http://127.0.0.1:{self.ingress_port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        env = {**os.environ,
               "RESTATE_INGRESS__BIND_ADDRESS": f"127.0.0.1:{self.ingress_port}",
               "RESTATE_ADMIN__BIND_ADDRESS": f"127.0.0.1:{self.admin_port}",
               "RESTATE_BIND_ADDRESS": f"127.0.0.1:{self.node_port}",
               "RESTATE_ADVERTISED_ADDRESS": f"http://127.0.0.1:{self.node_port}/",
               "RESTATE_DEFAULT_NUM_PARTITIONS": "1",
               "RESTATE_ROCKSDB_TOTAL_MEMORY_SIZE": "64 MB",
               "RESTATE_LOG_FILTER": "warn",
               "RESTATE_WORKER__INVOKER__INACTIVITY_TIMEOUT": "0s" if always_replay else "2s",
               "RESTATE_WORKER__INVOKER__RETRY_POLICY__INITIAL_INTERVAL": "50ms",
               "RESTATE_DEFAULT_RETRY_POLICY__INITIAL_INTERVAL": "50ms"}
        with open(self.server_log, "wb") as out:
            return subprocess.Popen([binary, "--no-logo", "--listen-mode", "tcp", "--base-dir", str(self.dir / "data"),
                                     "--node-name", "test"], env=env, stdout=out, stderr=subprocess.STDOUT)

    def sql(self, query: str) -> list[dict[str, Any]]:
        return http("POST", f"{self.admin}/query", {"query": query})["rows"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.service.stop()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
