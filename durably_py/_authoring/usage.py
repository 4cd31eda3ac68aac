"""What a step's result cost: the usage a model-call response reports, read into budget charges.

A step whose result looks like a model's response is charged without any code of the user's: the `usage` of an
OpenAI-style response (Chat Completions' ``prompt_tokens`` / ``completion_tokens`` / ``total_tokens``, the
Responses API's ``input_tokens`` / ``output_tokens``) or an Anthropic-style one (``input_tokens`` /
``output_tokens`` and the cache tokens), as a dict or as an object with attributes, charges ``tokens``; and
``usd`` too when the response names a ``model`` that `set_prices` priced. Other shapes are read by extractors
registered with `usage_extractor` (tried first, newest first); a step's own ``charge=`` (a callable of its
result, or False) overrides all of them for that step. See docs/policies.md#budgets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ValidationError

__all__ = ["EXTRACTORS", "Extractor", "charges_of", "set_prices", "usage_extractor"]

DOCS = "docs/policies.md#budgets"

Extractor = Callable[[Any], "Mapping[str, float] | None"]
"""A function of a step's result: the charges it stands for (``{"tokens": 1200, "usd": 0.01}``), or None when
it does not know the shape."""

EXTRACTORS: list[Extractor] = []
_PRICES: dict[str, tuple[float, float]] = {}


def usage_extractor(fn: Extractor) -> Extractor:
    """Register `fn` (usable as a decorator): a function of a step's result returning the charges it stands for
    (kind -> amount, kinds ``usd``, ``tokens``, ``units``), or None for a result it does not know. Registered
    extractors are tried before the built-in OpenAI and Anthropic readers, the latest registered first."""
    if not callable(fn):
        raise ValidationError(f"usage_extractor takes a function of a step's result, got {fn!r}",
                              hint="@durably_py.usage_extractor\ndef my_usage(result): return {'tokens': ...}",
                              docs=DOCS)
    if fn not in EXTRACTORS:
        EXTRACTORS.insert(0, fn)
    return fn


def set_prices(prices: Mapping[str, tuple[float, float]]) -> None:
    """Price models for the automatic charges: model name -> (USD per million input tokens, USD per million
    output tokens). A response naming a priced model (exactly, or a dated variant such as
    ``gpt-4o-2024-08-06`` of ``gpt-4o``) also charges ``usd``. Prices are this process's setting: the charges a
    run recorded keep the amounts they were recorded with."""
    checked: dict[str, tuple[float, float]] = {}
    if not isinstance(prices, Mapping):
        raise ValidationError(f"set_prices takes a mapping of model -> (input, output) USD per million tokens, got "
                              f"{prices!r}", hint="set_prices({'gpt-4o': (2.5, 10.0)})", docs=DOCS)
    for model, pair in prices.items():
        ok = isinstance(model, str) and model and isinstance(pair, tuple | list) and len(pair) == 2 and all(
            not isinstance(p, bool) and isinstance(p, int | float) and math.isfinite(p) and p >= 0 for p in pair)
        if not ok:
            raise ValidationError(f"price of {model!r} must be (input, output) USD per million tokens, got {pair!r}",
                                  hint="set_prices({'gpt-4o': (2.5, 10.0)})", docs=DOCS)
        checked[model] = (float(pair[0]), float(pair[1]))
    _PRICES.update(checked)


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _price(model: Any) -> tuple[float, float] | None:
    if not isinstance(model, str) or not _PRICES:
        return None
    found = _PRICES.get(model)
    if found is None:  # a dated or suffixed variant of a priced model: the longest priced prefix
        best = max((m for m in _PRICES if model.startswith(m + "-")), key=len, default=None)
        found = _PRICES.get(best) if best is not None else None
    return found


def model_usage(result: Any) -> dict[str, float] | None:
    """The charges of an OpenAI-style or Anthropic-style response (a dict or an object), else None."""
    usage = _get(result, "usage")
    if usage is None:
        return None
    prompt = _number(_get(usage, "prompt_tokens"))
    completion = _number(_get(usage, "completion_tokens"))
    if prompt is None and completion is None:  # Responses API and Anthropic
        prompt = _number(_get(usage, "input_tokens"))
        completion = _number(_get(usage, "output_tokens"))
    if prompt is None and completion is None:
        return None
    cached = sum(_number(_get(usage, k)) or 0.0 for k in ("cache_creation_input_tokens", "cache_read_input_tokens"))
    inputs = (prompt or 0.0) + cached
    outputs = completion or 0.0
    total = _number(_get(usage, "total_tokens"))
    out = {"tokens": total if total is not None and total >= inputs + outputs else inputs + outputs}
    price = _price(_get(result, "model"))
    if price is not None:
        out["usd"] = (inputs * price[0] + outputs * price[1]) / 1_000_000
    return out


def charges_of(result: Any, charge: Any = None) -> dict[str, float] | None:
    """What a step's `result` cost, by kind: its `charge=` callable's answer (False: nothing), else the first
    registered extractor's that knows the result, else the built-in readers'. None: nothing to charge."""
    if charge is False:
        return None
    if result is None or isinstance(result, str | int | float | bool | list):
        if charge is None:
            return None
    if charge is not None and charge is not True:
        found = charge(result)
    else:
        found = None
        for extractor in EXTRACTORS:
            found = extractor(result)
            if found is not None:
                break
        else:
            found = model_usage(result)
    if found is None:
        return None
    if not isinstance(found, Mapping):
        raise ValidationError(f"a usage extractor returned {found!r}, not a mapping of kind -> amount",
                              hint="Return e.g. {'tokens': 1200, 'usd': 0.01}, or None for a result it does not "
                                   "know.", docs=DOCS)
    return {k: float(v) for k, v in found.items() if v}
