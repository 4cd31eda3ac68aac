"""Restate mode: durably workflows on Restate's replicated, distributed engine (`pip install 'durably-py[restate]'`).

`app(*workflows)` is the ASGI app serving them as Restate workflows named `durably.<workflow>`;
`serve(...)` serves it and registers it with the Restate admin API; `RestateClient` runs, signals,
lists, inspects and cancels runs through Restate's ingress and admin APIs. See docs/restate.md.
"""

from __future__ import annotations

try:
    import restate as _restate  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    from ..errors import ValidationError

    raise ValidationError("Restate mode needs the restate extra",
                          hint="pip install 'durably-py[restate]'", docs="docs/restate.md") from exc

from .client import RestateClient, run_key
from .service import app, service_name, workflow_service

__all__ = ["RestateClient", "app", "run_key", "service_name", "workflow_service"]
