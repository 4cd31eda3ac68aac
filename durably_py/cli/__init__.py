"""The `durably` command line: run scripts under a live progress view, list runs, inspect and operate them.

The commands are grouped by concern (`run`, `runs`, `operate`, `queue`, `admin`) over the shared options of
`options` and the targets of `target` (the local engine, or a Restate cluster); `render` draws what they
show, and `app` holds the typer application. `durably run` itself lives in `durably_py._run_command` (free
of typer and rich, so the console script can answer a plain `durably run SCRIPT` without importing this
package)."""

from __future__ import annotations

from .._config import parse_duration
from .._run_command import to_json, user_frame
from .app import app, main
from .operate import parse_step
from .render import step_tree

__all__ = ["app", "main", "parse_duration", "parse_step", "step_tree", "to_json", "user_frame"]
