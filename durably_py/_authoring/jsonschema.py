"""A schema as JSON Schema, and checking a JSON value against one, for values that arrive from outside a run.

An awakeable's `schema=` is compiled in the workflow (`schema.compile_schema`), but it is resolved from
another process (the CLI, the console, a callback) that has none of the workflow's code. So the awakeable
records its schema as JSON Schema (`json_schema`: msgspec's for a type, the model's own for pydantic), and the
resolving side checks a value against that document (`check`) before anything is stored: a value that does not
match is a `ValidationError` naming where, and nothing changes. The run converts the value with the compiled
schema as `ctx.wait_for(schema=)` does, which stays the final word (a pydantic validator, a callable schema).

`check` covers what msgspec and pydantic generate: ``$ref`` into ``$defs``, ``anyOf`` / ``oneOf`` / ``allOf``,
``type``, ``enum``, ``const``, ``properties`` / ``required`` / ``additionalProperties``, ``items`` /
``prefixItems``, lengths, bounds and ``pattern``; other keywords are not checked.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from ..errors import ValidationError
from .schema import Schema

__all__ = ["check", "json_schema"]

_DEPTH = 64


def json_schema(schema: Schema | None) -> dict[str, Any] | None:
    """The JSON Schema of a compiled schema (None: none, or a callable validator, which has no JSON Schema)."""
    if schema is None:
        return None
    spec = schema.spec
    try:
        if schema.kind == "type":
            doc = msgspec.json.schema(spec)
        elif schema.kind == "pydantic":
            make = getattr(spec, "model_json_schema", None) or getattr(spec, "json_schema", None)
            if make is None:
                return None
            doc = make()
        else:
            return None
    except Exception:  # noqa: BLE001 - a type without a JSON Schema is checked by the run alone
        return None
    return doc if isinstance(doc, dict) else None


def check(value: Any, doc: dict[str, Any], where: str) -> None:
    """Raise `ValidationError` naming the first place where `value` (plain JSON) does not match `doc`."""
    problem = _problem(value, doc, doc, "value", 0)
    if problem is not None:
        at, why = problem
        raise ValidationError(f"{where}: invalid value at {at}: {why}",
                              hint="Send a value that matches the schema the workflow declared (`durably inspect "
                                   "RUN --json` shows it under the awakeable); nothing was changed.",
                              docs="docs/authoring.md#awakeables-and-callbacks", path=at)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is(value: Any, kind: str) -> bool:
    got = _kind(value)
    if kind == "number":
        return got in ("integer", "number")
    if kind == "integer":
        return got == "integer" or got == "number" and math.isfinite(value) and float(value).is_integer()
    return got == kind


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any] | None:
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) else None


def _problem(value: Any, doc: Any, root: dict[str, Any], at: str, depth: int) -> tuple[str, str] | None:
    """Where and why `value` does not match `doc` (None: it matches)."""
    if not isinstance(doc, dict) or depth > _DEPTH:
        return None
    if "$ref" in doc:
        target = _resolve(str(doc["$ref"]), root)
        found = _problem(value, target, root, at, depth + 1) if target is not None else None
        if found is not None:
            return found
    for key in ("anyOf", "oneOf"):
        options = doc.get(key)
        if isinstance(options, list) and options:
            problems = [_problem(value, o, root, at, depth + 1) for o in options]
            if all(p is not None for p in problems):
                deepest = max((p for p in problems if p is not None), key=lambda p: len(p[0]))
                return deepest if deepest[0] != at else (at, f"{_preview(value)} matches none of the allowed shapes")
    for sub in doc.get("allOf") or ():
        found = _problem(value, sub, root, at, depth + 1)
        if found is not None:
            return found
    kinds = doc.get("type")
    if kinds is not None:
        wanted = kinds if isinstance(kinds, list) else [kinds]
        if not any(_is(value, str(k)) for k in wanted):
            return at, f"expected {' or '.join(map(str, wanted))}, got {_kind(value)} {_preview(value)}"
    if "const" in doc and value != doc["const"]:
        return at, f"expected {doc['const']!r}, got {_preview(value)}"
    if isinstance(doc.get("enum"), list) and value not in doc["enum"]:
        return at, f"expected one of {', '.join(map(repr, doc['enum']))}, got {_preview(value)}"
    if isinstance(value, dict):
        return _object(value, doc, root, at, depth)
    if isinstance(value, list):
        return _array(value, doc, root, at, depth)
    if isinstance(value, str):
        return _text(value, doc, at)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _number(value, doc, at)
    return None


def _object(value: dict[str, Any], doc: dict[str, Any], root: dict[str, Any], at: str,
            depth: int) -> tuple[str, str] | None:
    found_props = doc.get("properties")
    props: dict[str, Any] = found_props if isinstance(found_props, dict) else {}
    for name in doc.get("required") or ():
        if name not in value:
            return at, f"missing required field {name!r}"
    extra = doc.get("additionalProperties", True)
    for name, item in value.items():
        if name in props:
            found = _problem(item, props[name], root, f"{at}.{name}", depth + 1)
        elif extra is False:
            return at, f"unknown field {name!r} (allowed: {', '.join(props) or 'none'})"
        else:
            found = _problem(item, extra, root, f"{at}.{name}", depth + 1)
        if found is not None:
            return found
    return None


def _array(value: list[Any], doc: dict[str, Any], root: dict[str, Any], at: str,
           depth: int) -> tuple[str, str] | None:
    if isinstance(doc.get("minItems"), int) and len(value) < doc["minItems"]:
        return at, f"expected at least {doc['minItems']} items, got {len(value)}"
    if isinstance(doc.get("maxItems"), int) and len(value) > doc["maxItems"]:
        return at, f"expected at most {doc['maxItems']} items, got {len(value)}"
    found_prefix = doc.get("prefixItems")
    prefix: list[Any] = found_prefix if isinstance(found_prefix, list) else []
    for i, item in enumerate(value):
        sub = prefix[i] if i < len(prefix) else doc.get("items")
        if sub is False:
            return at, f"expected at most {len(prefix)} items, got {len(value)}"
        found = _problem(item, sub, root, f"{at}[{i}]", depth + 1)
        if found is not None:
            return found
    return None


def _text(value: str, doc: dict[str, Any], at: str) -> tuple[str, str] | None:
    if isinstance(doc.get("minLength"), int) and len(value) < doc["minLength"]:
        return at, f"expected at least {doc['minLength']} characters, got {len(value)}"
    if isinstance(doc.get("maxLength"), int) and len(value) > doc["maxLength"]:
        return at, f"expected at most {doc['maxLength']} characters, got {len(value)}"
    pattern = doc.get("pattern")
    if isinstance(pattern, str):
        try:
            if re.search(pattern, value) is None:
                return at, f"{_preview(value)} does not match the pattern {pattern!r}"
        except re.error:
            return None
    return None


def _number(value: float, doc: dict[str, Any], at: str) -> tuple[str, str] | None:
    for key, fails, says in (("minimum", lambda b: value < b, ">="), ("maximum", lambda b: value > b, "<="),
                             ("exclusiveMinimum", lambda b: value <= b, ">"),
                             ("exclusiveMaximum", lambda b: value >= b, "<")):
        bound = doc.get(key)
        if isinstance(bound, int | float) and not isinstance(bound, bool) and fails(bound):
            return at, f"expected a number {says} {bound}, got {value}"
    return None


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
