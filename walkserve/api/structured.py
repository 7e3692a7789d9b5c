"""Structured output as a grammar for the sampler (``runtime.kv.grammar``: llguidance, applied
as a token mask in the worker). Pure: request fields in, an llguidance grammar string out, or
``ValueError`` naming the field and what is wrong.

    response_format {"type": "json_object"}                 any JSON object
    response_format {"type": "json_schema", "json_schema": {"schema": S}}   JSON valid for S
    guided_json S | guided_regex R | guided_choice [a, b]   vLLM's extensions
    a forced tool call (tool_choice "required" or named)    ``api.tools.call_grammar``

JSON is compact (no whitespace between tokens: ``whitespace_flexible`` off), so a model with
random weights cannot pad its answer with blanks until ``max_tokens``; every schema keyword
llguidance supports is honoured, and one it does not support is refused (400), never ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any

COMPACT = {"whitespace_flexible": False}
MAX_SCHEMA_BYTES = 64 << 10


def compact(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance's compact-whitespace option (its own, if set, kept)."""
    options = {**COMPACT, **schema.get("x-guidance", {})}
    return {**schema, "x-guidance": options}


def json_schema_grammar(schema: dict[str, Any] | str, field: str) -> str:
    import llguidance

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field} must be a JSON Schema object")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise ValueError(f"{field} is over {MAX_SCHEMA_BYTES} bytes")
    return checked(llguidance.LLMatcher.grammar_from_json_schema(compact(schema)), field)


def regex_grammar(regex: str, field: str) -> str:
    import llguidance

    return checked(llguidance.LLMatcher.grammar_from_regex(regex), field)


def lark_grammar(lark: str, field: str) -> str:
    import llguidance

    return checked(llguidance.LLMatcher.grammar_from_lark(lark), field)


def checked(grammar: str, field: str) -> str:
    """``grammar`` if llguidance accepts it, else ``ValueError`` with its reason."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{field} cannot be used: {error.strip()}")
    return grammar


def request_grammar(
    response_format: Any,
    guided_json: dict[str, Any] | str | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
) -> str | None:
    """The grammar a request's fields ask for (None: free text); at most one may be set."""
    asked = []
    if response_format is not None and response_format.type != "text":
        asked.append("response_format")
    asked += [
        name
        for name, value in (
            ("guided_json", guided_json),
            ("guided_regex", guided_regex),
            ("guided_choice", guided_choice),
        )
        if value is not None
    ]
    if len(asked) > 1:
        raise ValueError(f"send one of {asked}, not several: each constrains the whole output")
    if not asked:
        return None
    if asked[0] == "response_format":
        if response_format.type == "json_object":
            return json_schema_grammar({"type": "object"}, "response_format")
        spec = response_format.json_schema
        if spec is None:
            raise ValueError('response_format json_schema needs "json_schema": {"name", "schema"}')
        return json_schema_grammar(
            spec.schema_ or {"type": "object"}, "response_format.json_schema"
        )
    if guided_json is not None:
        return json_schema_grammar(guided_json, "guided_json")
    if guided_regex is not None:
        return regex_grammar(guided_regex, "guided_regex")
    assert guided_choice is not None
    if any(not c for c in guided_choice):
        raise ValueError("guided_choice entries must be non-empty strings")
    return regex_grammar("(" + "|".join(re.escape(c) for c in guided_choice) + ")", "guided_choice")
