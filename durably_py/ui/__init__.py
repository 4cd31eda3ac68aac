"""`durably ui`: a local web console and JSON API over an `Engine` (needs the `ui` extra: Starlette, uvicorn).

Importing this package needs neither; `create_app` and `serve` import them when called and raise a
`DurablyError` naming what to install when they are missing.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from ..errors import DurablyError

if TYPE_CHECKING:
    from .._engine.engine import Engine

INSTALL = "pip install 'durably-py[ui]'"


def missing_extra() -> list[str]:
    """The packages of the `ui` extra that are not installed (empty when the console can run)."""
    missing = []
    for name in ("starlette", "uvicorn"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _require() -> None:
    missing = missing_extra()
    if missing:
        raise DurablyError(f"durably ui needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                           "not installed", hint=f"Install the console's extra: {INSTALL}", docs="docs/ui.md")


def create_app(engine: Engine, *, token: str | None = None, loopback: bool = True, poll: float = 0.25) -> Any:
    """The console's ASGI application (a Starlette app) over `engine`.

    `token`: when set, every page and API request must carry it (`Authorization: Bearer TOKEN`, or the
    cookie that opening `/?token=TOKEN` sets). `loopback`: the server listens on a loopback address only,
    so requests must name a local host (a guard against DNS rebinding). `poll`: seconds between the
    storage checks behind the live event streams."""
    _require()
    from .app import build

    return build(engine, token=token, loopback=loopback, poll=poll)


def serve(engine: Engine, *, host: str = "127.0.0.1", port: int = 8765, open_browser: bool = False,
          token: str | None = None, announce: Any = print) -> None:
    """Serve the console until interrupted; off loopback a token is required (made when `token` is None)."""
    _require()
    from .app import run_server

    run_server(engine, host=host, port=port, open_browser=open_browser, token=token, announce=announce)


__all__ = ["INSTALL", "create_app", "missing_extra", "serve"]
