"""Run ids: readable, and unable to collide (the engine, child runs, the queue and schedules name new runs so)."""

from __future__ import annotations

import base64
import re
import secrets

_ID_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford's base 32, lowercase: no i, l, o, u
_TO_ID_ALPHABET = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", _ID_ALPHABET.encode())  # from RFC 4648's
_slugs: dict[str, str] = {}  # workflow name -> the slug its run ids start with


def new_run_id(workflow: str) -> str:
    """A readable id that cannot collide: the workflow's name, then 80 random bits as 16 base-32 digits
    (lowercase, so ids differ on case-insensitive file systems too; the old 32 bits per workflow per day
    collided among 10,000 children)."""
    slug = _slugs.get(workflow)
    if slug is None:
        slug = re.sub(r"[^A-Za-z0-9_-]+", "-", workflow).strip("-_")[:40] or "run"
        if len(_slugs) < 4096:
            _slugs[workflow] = slug
    return f"{slug}-{base64.b32encode(secrets.token_bytes(10)).translate(_TO_ID_ALPHABET).decode()}"
