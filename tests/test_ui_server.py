"""The console as a real `durably ui` server answers bodies it cannot take with 400 (malformed, not UTF-8,
nested too deep, an integer of 5,000 digits, a lone surrogate, a NUL in a signal name) and bodies over its
cap with 413 while they arrive, never with a 500 or a traceback; it answers only local names for itself
(any loopback address it binds), and the test client's name only under the test client."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

from durably_py import RunParkedError, ValidationError, create_engine, workflow
from durably_py.ui.app import MAX_BODY

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


@workflow(name="ui_server_waiter")
async def waiter(ctx: Any) -> Any:
    return await ctx.wait_for("go")


class Server:
    """`durably ui` on a free port of `host`, over `storage`; its stderr kept."""

    def __init__(self, storage: str, host: str = "127.0.0.1") -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "ui", "--storage", storage, "--host",
                                      host, "--port", "0"], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: self.url is not None or self.proc.poll() is not None, 30)
        assert self.url is not None, "".join(self.err)
        found = re.match(r"http://([^/]+):(\d+)/", self.url)
        assert found is not None
        self.host, self.port = found.group(1), int(found.group(2))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    @property
    def url(self) -> str | None:
        found = re.search(r"(http://\S+/)", "".join(self.err))
        return found.group(1) if found else None

    def request(self, method: str, path: str, body: bytes | Any = None, headers: dict[str, str] | None = None,
                chunked: bool = False) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        sent = {"Content-Type": "application/json", **(headers or {})}
        try:
            conn.request(method, path, body=body, headers=sent, encode_chunked=chunked)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        return response.status, json.loads(data) if data.startswith(b"{") else {"text": data.decode()}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(params=["file", "postgres"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "file":
        yield str(tmp_path / "state")
        return
    import uuid

    import psycopg

    dsn = request.getfixturevalue("postgres_dsn")
    parts = dict(p.split("=", 1) for p in dsn.split())
    schema = f"test_{uuid.uuid4().hex[:16]}"
    yield f"postgresql://{parts['user']}@/{parts['dbname']}?host={parts['host']}&schema={schema}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_bodies_the_console_cannot_take_are_400_or_413_and_nothing_is_stored(storage: str) -> None:
    engine = create_engine(storage)
    with pytest.raises(RunParkedError) as parked:
        asyncio.run(engine.run(waiter, wait=False))
    run_id = parked.value.run_id
    with pytest.raises(ValidationError):
        asyncio.run(engine.signal(run_id, "\ud800"))
    server = Server(storage)
    try:
        signal = f"/api/runs/{run_id}/signal"
        bad = {
            "nested 100,000 deep": b'{"name": "go", "payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "a 5,000-digit integer": b'{"name": "go", "payload": ' + b"7" * 5000 + b"}",
            "invalid UTF-8": b'{"name": "go", "payload": "\xff\xfe"}',
            "a lone surrogate": b'{"name": "\\ud800", "payload": 1}',
            "a NUL in the name": b'{"name": "g\\u0000o", "payload": 1}',
            "not an object": b"[1, 2]",
            "not JSON": b"{name: go}",
        }
        for what, body in bad.items():
            status, answer = server.request("POST", signal, body)
            assert status == 400, (what, status, answer)
            assert answer["error"] == "ValidationError" and answer["hint"] and answer["docs"], (what, answer)
        big = b'{"name": "go", "payload": "' + b"x" * MAX_BODY + b'"}'
        status, answer = server.request("POST", signal, big)
        assert status == 413 and "at most 1,048,576" in answer["message"] and answer["hint"]
        status, answer = server.request("POST", signal, iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                                        chunked=True)  # no Content-Length: refused as it passes the cap
        assert status == 413, answer
        assert engine.storage.inbox(run_id) == []  # nothing of any of them was stored
        status, answer = server.request("POST", signal, b'{"name": "go", "payload": "fine"}')
        assert status == 200 and answer["sent"] is True
        wait_until(lambda: len(engine.storage.inbox(run_id)) == 1)
        time.sleep(0.2)
        assert "Traceback" not in "".join(server.err) and "500" not in "".join(server.err)
    finally:
        server.close()


def test_a_real_server_refuses_the_test_clients_name_and_answers_any_loopback_address_it_binds(
        tmp_path: Path) -> None:
    server = Server(str(tmp_path / "state"))
    try:
        status, answer = server.request("GET", "/api/runs", headers={"Host": "testserver"})
        assert status == 403 and "is not this console's address" in answer["message"]
        status, answer = server.request("GET", "/api/runs", headers={"Host": "evil.example:80"})
        assert status == 403
        for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}"):
            assert server.request("GET", "/api/runs", headers={"Host": host})[0] == 200
    finally:
        server.close()
    other = Server(str(tmp_path / "state"), host="127.0.0.2")
    try:
        assert other.url is not None and other.url.startswith("http://127.0.0.2:") and "token" not in other.url
        status, answer = other.request("GET", "/api/runs")  # as the printed URL names it: Host 127.0.0.2:PORT
        assert status == 200, answer
        assert other.request("GET", "/", headers={"Host": f"127.0.0.2:{other.port}"})[0] == 200
    finally:
        other.close()
