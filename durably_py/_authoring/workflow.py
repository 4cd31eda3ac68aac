"""`@workflow`: names an async function as a durable workflow and fingerprints its code."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any, overload

from ..errors import ValidationError

REGISTRY: dict[str, Workflow] = {}


def _fingerprint(fn: Callable[..., Any]) -> str:
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = getattr(getattr(fn, "__code__", None), "co_code", b"").hex()
    return hashlib.sha256(source.encode()).hexdigest()[:16]


_SOURCES: dict[str, tuple[str, bytes] | None] = {}  # source file -> as this process first read it


def source_file(fn: Callable[..., Any]) -> str | None:
    """The absolute path of the file defining `fn` (None where there is none, as for code built by `exec`)."""
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return None
    return os.path.abspath(path) if path else None


def source_of(path: str | None) -> tuple[str, bytes] | None:
    """The sha256 (hex) and bytes of the source file at `path` as this process first read it (when its first
    workflow was declared, so as it was imported), None where there is no file: what a run's header records as
    its `source` and the store keeps once (docs/versioning.md#upgrades)."""
    if path is None:
        return None
    try:
        return _SOURCES[path]
    except KeyError:
        pass
    try:
        text = Path(path).read_bytes()
        found: tuple[str, bytes] | None = hashlib.sha256(text).hexdigest(), text
    except OSError:
        found = None
    if len(_SOURCES) < 4096:
        _SOURCES[path] = found
    return found


class Workflow:
    """A durable workflow: `async def fn(ctx)` or `async def fn(ctx, input)` plus its name and schemas."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], *, name: str | None = None,
                 input: Any = None, output: Any = None, queue: str | None = None) -> None:
        from .queues import check_queue_name
        from .schema import compile_schema

        if not inspect.iscoroutinefunction(fn):
            raise ValidationError(
                f"@workflow needs an `async def` function, got {fn!r}",
                hint="Write the workflow as `async def name(ctx, input): ...`.",
                docs="docs/authoring.md#workflows",
            )
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not 1 <= len(params) <= 2:
            raise ValidationError(
                f"workflow {fn.__qualname__} takes {len(params)} positional parameters; it must take (ctx) or (ctx, input)",
                hint="Bundle several inputs into one dict or dataclass.",
                docs="docs/authoring.md#workflows",
            )
        self.fn = fn
        self.name = name or fn.__qualname__
        self.takes_input = len(params) == 2
        self.fingerprint = _fingerprint(fn)
        self.source_file = source_file(fn)  # what a run's header records as its script (`identity.script_of`)
        self._source = source_of(self.source_file)  # the file as imported, before anyone edits it
        self.input_schema = compile_schema(input, f"input schema of workflow {self.name!r}")
        self.output_schema = compile_schema(output, f"output schema of workflow {self.name!r}")
        self.queue = check_queue_name(queue) if queue is not None else None  # where `enqueue` puts its runs
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", self.name)
        self.__qualname__ = getattr(fn, "__qualname__", self.name)
        self.__module__ = fn.__module__
        REGISTRY[self.name] = self

    @property
    def source(self) -> tuple[str, bytes] | None:
        """The digest and bytes of the file defining the workflow, as this process imported it (`source_of`)."""
        return self._source

    def __call__(self, ctx: Any, input: Any = None) -> Awaitable[Any]:
        return self.fn(ctx, input) if self.takes_input else self.fn(ctx)

    def __repr__(self) -> str:
        return f"<workflow {self.name}>"


@overload
def workflow(fn: Callable[..., Awaitable[Any]], /) -> Workflow: ...
@overload
def workflow(*, name: str | None = None, input: Any = None, output: Any = None,
             queue: str | None = None) -> Callable[[Callable[..., Awaitable[Any]]], Workflow]: ...


def workflow(fn: Callable[..., Awaitable[Any]] | None = None, /, *, name: str | None = None,
             input: Any = None, output: Any = None, queue: str | None = None) -> Any:
    """Mark `async def f(ctx[, input])` as a workflow; bare or as `@workflow(name=..., input=..., output=...,
    queue=...)` (`queue`: the named queue `enqueue` puts its runs on unless told another)."""
    if fn is not None:
        return Workflow(fn)
    return lambda f: Workflow(f, name=name, input=input, output=output, queue=queue)


def as_workflow(wf: Any) -> Workflow:
    """Accept a `Workflow` or a plain async function (wrapped on the fly)."""
    if isinstance(wf, Workflow):
        return wf
    if inspect.iscoroutinefunction(wf):
        return Workflow(wf)
    raise ValidationError(
        f"{wf!r} is not a workflow",
        hint="Decorate an `async def f(ctx, input)` with @workflow, or pass the async function itself.",
        docs="docs/authoring.md#workflows",
    )


def load_script(path: str | Path) -> ModuleType:
    """Import a script file as a module (not as `__main__`, so its main block does not run), registering its workflows."""
    script = Path(path)
    name = re.sub(r"\W", "_", script.stem) or "script"
    if name in sys.modules or not name.isidentifier():
        name = f"_durably_script_{name}"
    spec = importlib.util.spec_from_file_location(name, script)
    if spec is None or spec.loader is None:
        raise ValidationError(f"cannot import {script}", hint="Pass a Python file (.py).")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
