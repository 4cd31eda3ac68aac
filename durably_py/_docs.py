"""Where the documentation shipped with durably is: the pages errors and advisories point to.

A `docs/page.md#anchor` pointer (what a `DurablyError` or an advisory carries, and what the log records) is
shown to people as the installed page's path and the `durably docs` command that prints it."""

from __future__ import annotations

from pathlib import Path

DOCS_DIR = Path(__file__).parent / "docs"


def docs_location(pointer: str) -> str:
    """A `docs/page.md#anchor` pointer as the installed page's path and the command that prints it."""
    page, _, anchor = pointer.partition("#")
    target = DOCS_DIR / Path(page).name
    if not page.endswith(".md") or not target.is_file():
        return pointer
    topic = target.stem + (f"#{anchor}" if anchor else "")
    return f"{target}  (`durably docs {topic}` prints it)"
