"""What a `StaleRunError` tells the user to do: code that now calls another step at a recorded path was most
likely inserted before it (`ctx.patched`) or renamed (`durably adopt`)."""

from __future__ import annotations

import inspect
import re
from typing import Any


def stale_hint(fn: Any, run_id: str, recorded: str, called: str) -> str:
    """The hint of a `StaleRunError` where the code now calls `called` at the path of the recorded `recorded`.

    When the workflow's code (`fn`) still names `recorded` (its function or its `name=`), the new step was most
    likely inserted before it: the hint offers `ctx.patched` first, so runs recorded before the change skip the
    new step. Otherwise the step was most likely renamed, and the hint offers `durably adopt` first."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = ""
    restart = f"or start over with fresh=True (`durably restart {run_id}`)."
    if still_calls(source, recorded):
        return (f"The code still calls {recorded!r}, so {called!r} looks inserted before it: put the new step "
                f"under `if ctx.patched(\"add-{called}\"):` so runs recorded before the change skip it, then "
                f"`durably retry {run_id}`. If {called!r} is {recorded!r} renamed, `durably adopt {run_id}` uses its "
                f"recorded result and continues; {restart}")
    return (f"If {called!r} is the same work as {recorded!r} under a new name, `durably adopt {run_id}` uses its "
            "recorded result and continues; else restore the old code (or put the change under ctx.patched), "
            f"{restart}")


def still_calls(source: str, label: str) -> bool:
    """Whether workflow code (`source`) still makes a call recorded as `label`: a step named so (`name="..."`),
    a step of the function of that name without a `name=`, or the `ctx.` operation itself (`ctx.sleep`)."""
    if label.startswith("ctx."):
        return re.search(rf"\.{re.escape(label[4:])}\(", source) is not None
    if re.search(rf"name\s*=\s*(['\"]){re.escape(label)}\1", source):
        return True
    for found in re.finditer(rf"\.step\(\s*{re.escape(label)}\s*(?=[,)])", source):
        depth, end = 0, found.start() + len(".step")
        while end < len(source):  # the whole call, to its closing parenthesis
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            if depth == 0:
                break
            end += 1
        if not re.search(r"\bname\s*=", source[found.start():end]):
            return True
    return False
