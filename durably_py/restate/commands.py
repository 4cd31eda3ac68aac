"""What `durably serve --restate` and `durably run --restate` do; the CLI only parses and prints."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._authoring.workflow import REGISTRY, load_script
from ..errors import ValidationError
from .client import RestateClient


def run_workflow(script: Path, workflow: str, input: Any, *, key: str | None, wait: bool, ingress: str | None,
                 admin: str | None, on_run: Callable[[str], Any] | None = None) -> Any:
    """Start `workflow` of `script` on Restate (or find its run) and return its result.

    The script is imported only to check the workflow exists and to convert the input with its schema;
    the run itself executes in whichever `durably serve --restate` process Restate picks."""
    load_script(script)
    wf = REGISTRY.get(workflow)
    if wf is None:
        known = ", ".join(sorted(REGISTRY)) or "none"
        raise ValidationError(f"{script.name} defines no workflow {workflow!r} (it defines: {known})",
                              hint="Pass --workflow with one of the names above.")
    if wf.input_schema is not None:
        input = wf.input_schema.to_builtins(wf.input_schema.convert(input, "input"))
    client = RestateClient(ingress, admin)
    run_id = client.start(wf.name, input, key=key)
    if on_run is not None:
        on_run(run_id)
    result = client.result(run_id, wait=wait)
    return wf.output_schema.convert(result, "result") if wf.output_schema is not None else result


def serve(imports: list[str], *, host: str, port: int, admin: str | None, register: bool,
          announce: Any = None) -> None:
    """Import the workflows, serve them as Restate workflows, register the deployment, run until stopped."""
    from .server import DEFAULT_ADMIN, import_workflows, serve_async

    import_workflows(imports)
    target = (admin or DEFAULT_ADMIN) if register else None
    asyncio.run(serve_async(host=host, port=port, admin=target, announce=announce))
