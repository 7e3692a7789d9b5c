"""Tool calls (``tools`` / ``tool_choice`` of chat): the grammar that forces a call, and the
parser that finds calls in a reply. Pure: no server, no I/O.

The call formats the chat templates teach their models::

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Hermes, Qwen)
    llama3_json   {"name": "f", "parameters": {...}}                            (Llama 3.x)

``tool_choice``: ``none`` (tools rendered, no call parsed), ``auto`` (the reply is parsed and
calls found become ``message.tool_calls``), ``required`` (the reply is constrained to one call
of one of the tools, its arguments valid for that tool's ``parameters`` schema), a named
function (constrained to a call of it). ``StreamParser`` sends the text outside calls as it
comes and each call once it is complete (one ``tool_calls`` delta per call, arguments whole).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from walkserve.api import structured
from walkserve.api.profile import ToolFormat

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object
    id: str

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_schema(name: str, parameters: dict[str, Any] | None, fmt: ToolFormat) -> dict[str, Any]:
    key = "arguments" if fmt == "hermes" else "parameters"
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: parameters or {"type": "object"}},
        "required": ["name", key],
        "additionalProperties": False,
    }


def call_grammar(functions: Sequence[tuple[str, dict[str, Any] | None]], fmt: ToolFormat) -> str:
    """A grammar for exactly one call of one of ``functions`` ((name, parameters) pairs)."""
    options = [_call_schema(name, params, fmt) for name, params in functions]
    schema = structured.compact(options[0] if len(options) == 1 else {"anyOf": options})
    if fmt == "llama3_json":
        return structured.json_schema_grammar(schema, "tools")
    lark = f'start: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"\ncall: %json {json.dumps(schema)}'
    return structured.lark_grammar(lark, "tools")


def _as_call(data: Any, fmt: ToolFormat) -> Call | None:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments" if fmt == "hermes" else "parameters", data.get("arguments"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(data["name"], json.dumps(args, ensure_ascii=False), call_id())


def parse_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[Call]]:
    """The reply's text outside tool calls (None if there is none) and its calls, in order.
    Text that looks like a call but does not parse stays text."""
    if fmt == "llama3_json":
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        calls = []
        for piece in body.split(";") if body.startswith("{") else []:
            try:
                call = _as_call(json.loads(piece), fmt)
            except json.JSONDecodeError:
                return text or None, []
            if call is None:
                return text or None, []
            calls.append(call)
        return (None, calls) if calls else (text or None, [])
    content, calls, rest = [], [], text
    while (start := rest.find(HERMES_OPEN)) >= 0:
        end = rest.find(HERMES_CLOSE, start)
        if end < 0:
            break
        inner = rest[start + len(HERMES_OPEN) : end]
        try:
            call = _as_call(json.loads(inner), fmt)
        except json.JSONDecodeError:
            call = None
        if call is None:
            content.append(rest[: end + len(HERMES_CLOSE)])
        else:
            content.append(rest[:start])
            calls.append(call)
        rest = rest[end + len(HERMES_CLOSE) :]
    content.append(rest)
    joined = "".join(content)
    return (joined if joined.strip() else None) if calls else (text or None), calls


class StreamParser:
    """A streamed reply's text -> content deltas and completed calls. ``feed(delta)`` returns
    ``(content, calls)`` safe to send now: text that may still turn out to begin a call is
    held back until it does or cannot."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.sent_content = 0  # chars of ``text`` sent as content
        self.calls = 0  # calls sent
        self.in_call_format = False  # llama3_json: the reply is a call (starts with "{")

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[Call]]:
        self.text += piece
        if self.fmt == "llama3_json":
            return self._feed_llama(final)
        _, calls = parse_calls(self.text, self.fmt)
        new_calls = calls[self.calls :]
        self.calls = len(calls)
        # Content: everything before an unfinished "<tool_call>" (or a prefix of it).
        safe = len(self.text)
        open_at = self.text.rfind(HERMES_OPEN)
        if open_at >= 0 and self.text.find(HERMES_CLOSE, open_at) < 0 and not final:
            safe = open_at
        elif not final:
            for k in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1):
                if HERMES_OPEN.startswith(self.text[-k:]):
                    safe = len(self.text) - k
                    break
        visible = _outside_calls(self.text[:safe])
        out = visible[self.sent_content :] if len(visible) > self.sent_content else ""
        self.sent_content = max(self.sent_content, len(visible))
        return out, new_calls

    def _feed_llama(self, final: bool) -> tuple[str, list[Call]]:
        stripped = self.text.lstrip().removeprefix(PYTHON_TAG).lstrip()
        if not stripped and not final:
            return "", []
        if stripped.startswith("{") or (PYTHON_TAG.startswith(self.text.lstrip()) and not final):
            self.in_call_format = True
            if not final:
                return "", []
            _, calls = parse_calls(self.text, self.fmt)
            if calls:
                return "", calls
            self.in_call_format = False
        out = self.text[self.sent_content :]
        self.sent_content = len(self.text)
        return out, []


def _outside_calls(text: str) -> str:
    """``text`` without its complete, parsable hermes calls."""
    out, rest = [], text
    while (start := rest.find(HERMES_OPEN)) >= 0:
        end = rest.find(HERMES_CLOSE, start)
        if end < 0:
            break
        inner = rest[start + len(HERMES_OPEN) : end]
        try:
            ok = _as_call(json.loads(inner), "hermes") is not None
        except json.JSONDecodeError:
            ok = False
        out.append(rest[:start] if ok else rest[: end + len(HERMES_CLOSE)])
        rest = rest[end + len(HERMES_CLOSE) :]
    out.append(rest)
    return "".join(out)
