"""`durably serve --restate`: serve imported workflows over HTTP/2 and register them with the Restate admin API."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._authoring.workflow import REGISTRY, load_script
from ..errors import ValidationError

DEFAULT_ADMIN = "http://127.0.0.1:9070"


def import_workflows(targets: list[str]) -> list[str]:
    """Import each script path or module name; return the names of every workflow now registered."""
    for target in targets:
        if target.endswith(".py") or Path(target).is_file():
            if not Path(target).is_file():
                raise ValidationError(f"no such script: {target}", hint="Pass a .py file or an importable module.")
            load_script(target)
        else:
            try:
                importlib.import_module(target)
            except ImportError as exc:
                raise ValidationError(f"cannot import {target!r}: {exc}",
                                      hint="Pass a .py file or a module on sys.path.") from exc
    return sorted(REGISTRY)


def register(admin: str, uri: str, timeout: float = 30.0) -> dict[str, Any]:
    """Register the deployment at `uri` with the Restate admin API (`POST /deployments`); return its answer."""
    body = json.dumps({"uri": uri, "force": True}).encode()
    request = urllib.request.Request(f"{admin.rstrip('/')}/deployments", data=body, method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise ValidationError(f"Restate refused to register {uri}: HTTP {exc.code} {detail}",
                              hint="Check that the admin URL is right and that the server can reach the "
                                   "deployment URL.", docs="docs/restate.md#serving") from None
    except OSError as exc:
        raise ValidationError(f"cannot reach the Restate admin API at {admin}: {exc}",
                              hint="Start restate-server, or pass --restate-admin / DURABLY_RESTATE_ADMIN.",
                              docs="docs/restate.md#serving") from None


async def _wait_listening(host: str, port: int) -> None:
    for _ in range(400):
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.025)
    raise ValidationError(f"the service did not start listening on {host}:{port}")


_STOP = (signal.SIGINT, signal.SIGTERM)


def stop_on_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> Callable[[], None]:
    """Set `stop` on the first SIGINT or SIGTERM (exit at once on the second); return the undo.

    `loop.add_signal_handler` is not enough: asyncio keeps one handler per signal and the Restate SDK's app
    installs its own SIGTERM handler on the serving loop when its first request arrives, so a handler set
    before that silently stops firing and the server never stops. Here the two signals are blocked in this
    thread (and so in every thread it starts from now on) and taken by a thread of ours with
    `signal.sigwait`, which no handler can pre-empt. Where that is unavailable (not Unix, or not the main
    thread) it falls back to `loop.add_signal_handler`."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        for sig in _STOP:
            loop.add_signal_handler(sig, stop.set)
        return lambda: None
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP)
    done = threading.Event()

    def wait() -> None:
        received = 0
        while not done.is_set():
            sig = signal.sigwait(_STOP)
            if done.is_set():
                return
            received += 1
            if received > 1:
                os._exit(128 + sig)
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop is closed: the server has stopped already
                return

    thread = threading.Thread(target=wait, name="durably-restate-signals", daemon=True)
    thread.start()

    def undo() -> None:
        done.set()
        if thread.ident is not None and thread.is_alive():
            signal.pthread_kill(thread.ident, signal.SIGTERM)  # blocked there: sigwait takes it and returns
            thread.join(1)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    return undo


async def serve_async(*, host: str = "127.0.0.1", port: int = 9080, admin: str | None = DEFAULT_ADMIN,
                      advertise: str | None = None, announce: Any = None, asgi: Any = None) -> None:
    """Serve every imported workflow (or the ASGI app `asgi`) until SIGINT/SIGTERM; register the deployment
    first when `admin` is set."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from .service import app

    if not REGISTRY and asgi is None:
        raise ValidationError("no workflows to serve", hint="Pass --import SCRIPT_OR_MODULE defining @workflow "
                              "functions.", docs="docs/restate.md#serving")
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    stop = asyncio.Event()
    undo = stop_on_signals(asyncio.get_running_loop(), stop)
    try:
        server = asyncio.ensure_future(serve(asgi if asgi is not None else app(), config,
                                             shutdown_trigger=stop.wait))
        await _wait_listening(host, port)
        uri = advertise or f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        if admin:
            answer = await asyncio.to_thread(register, admin, uri)
            services = [s.get("name") for s in answer.get("services", [])]
        else:
            services = [f"durably.{name}" for name in sorted(REGISTRY)]
        if announce is not None:
            announce(uri, services)
        await server
    finally:
        undo()


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    """`python -m durably_py.restate.server --import flows.py --port 9080 --admin URL` (what the CLI runs)."""
    import argparse

    parser = argparse.ArgumentParser(prog="durably serve --restate")
    parser.add_argument("--import", dest="imports", action="append", default=[])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9080)
    parser.add_argument("--admin", default=DEFAULT_ADMIN)
    parser.add_argument("--no-register", action="store_true")
    args = parser.parse_args(argv)
    import_workflows(args.imports)
    asyncio.run(serve_async(host=args.host, port=args.port, admin=None if args.no_register else args.admin,
                            announce=lambda uri, s: print(f"serving {', '.join(s)} at {uri}", flush=True)))


if __name__ == "__main__":
    main()
