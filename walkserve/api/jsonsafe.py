"""JSON in and out of the HTTP API, for any request and any output:

- ``loads(body)``: a request body as Python values, refusing what would hurt the server
  (``ValueError`` with a message for the client): nesting deeper than ``MAX_DEPTH``, integers
  longer than ``MAX_INT_DIGITS`` digits, lone UTF-16 surrogates in strings, ``NaN`` and
  ``Infinity`` (not JSON), and bodies that are not UTF-8.
- ``dumps(value)``: compact JSON bytes; a float that is not finite (a walk's output may hold
  one) becomes ``null``, as JavaScript's ``JSON.stringify`` writes it, instead of the bare
  ``NaN`` that is not JSON.

The depth is checked on the raw text before parsing (a scan for brackets outside strings), so
that Python's recursive decoder never sees a body that would exhaust its stack."""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64
MAX_INT_DIGITS = 40  # beyond any 128-bit integer; every integer field has a tighter range
_STRING_OR_BRACKET = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _depth(body: bytes) -> int:
    depth = deepest = 0
    for match in _STRING_OR_BRACKET.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer has {len(text.lstrip('-'))} digits; at most {MAX_INT_DIGITS}")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large for a float")
    return value


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON: send a finite number")


def _check_strings(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                raise ValueError("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def loads(body: bytes) -> Any:
    """``body`` as JSON (see the module docstring); ``ValueError`` says what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the request body is not UTF-8: {e}") from None
    if _depth(body) > MAX_DEPTH:
        raise ValueError(f"the request body nests deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    _check_strings(value)
    return value


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any) -> bytes:
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a float that is not finite, somewhere
        text = json.dumps(finite(value), separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")
