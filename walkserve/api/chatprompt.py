"""Chat messages -> the prompt text, through the model's chat template (``TextTask``'s
``chat_template`` for plain (role, text) turns, its ``tool_template`` when the request has
tools, tool calls, tool results or message names). Content given as a list of parts is
joined: every ``text`` part (and an assistant's ``refusal`` parts) in order, separated by new
lines; a media part (``image_url``, ``input_audio``, ``video_url``, ``file``) the model cannot
take is a 400 naming where it is. A route that takes media passes ``marks``: each media part
becomes the mark it returns (``api.chatmedia``), joined to its neighbours without a new line
(as upstream chat templates put ``<|audio_start|>...`` next to the text). Raises ``ApiError``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from walkserve.api.errors import bad
from walkserve.api.profile import TextTask
from walkserve.api.schemas import ChatMessage, ContentPart, Tool, ToolCall

PART_KINDS = {"image_url": "images", "input_audio": "audio", "video_url": "video", "file": "files"}
#: (a media part, where it is, the message's role) -> the text that stands for it
Marks = Callable[[ContentPart, str, str], str]


def message_text(message: ChatMessage, index: int, model: str, marks: Marks | None = None) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    out, last_text = "", False
    for j, part in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if part.type == "text":
            text = part.text
        elif part.type == "refusal":
            if message.role != "assistant":
                raise bad(f"{where}: a refusal part belongs to an assistant message", where)
            text = part.refusal
        elif marks is not None:
            out, last_text = out + marks(part, where, message.role), False
            continue
        else:
            raise bad(
                f"{where}: content part {part.type!r} is not supported by model {model!r}: it"
                f" takes text only, not {PART_KINDS[part.type]}",
                where,
            )
        out, last_text = out + ("\n" if last_text else "") + text, True
    return out


def _arguments(call: ToolCall, where: str) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise bad(f"{where}.function.arguments is not JSON", where) from None


def check_roles(messages: Sequence[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role == "tool" and (m.tool_call_id is None or m.content is None):
            raise bad(f"{where}: a tool message needs tool_call_id and content", where)
        if m.role != "tool" and m.tool_call_id is not None:
            raise bad(f"{where}: only a tool message has tool_call_id", where)
        if m.tool_calls is not None and m.role != "assistant":
            raise bad(f"{where}: only an assistant message has tool_calls", where)
        if m.content is None and m.role != "assistant":
            raise bad(f"{where}: a {m.role} message needs content", where)
        if m.role == "assistant" and m.content is None and not m.tool_calls:
            raise bad(f"{where}: an assistant message needs content or tool_calls", where)


def render(
    task: TextTask,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool] | None,
    model: str,
    marks: Marks | None = None,
) -> str:
    """The prompt of ``messages`` (and ``tools``) in the model's chat format."""
    check_roles(messages)
    texts = [message_text(m, i, model, marks) for i, m in enumerate(messages)]
    rich = bool(tools) or any(
        m.role == "tool" or m.tool_calls or m.name is not None for m in messages
    )
    if not rich:
        return task.chat_template([(m.role, t) for m, t in zip(messages, texts)])
    if task.tool_template is None:
        what = "tools" if tools else "tool calls, tool results or message names"
        raise bad(f"model {model!r} has no chat template that renders {what}", "tools")
    shaped = []
    for i, (m, text) in enumerate(zip(messages, texts)):
        item: dict[str, Any] = {"role": m.role, "content": text}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            item["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c, f"messages[{i}].tool_calls[{k}]"),
                    },
                }
                for k, c in enumerate(m.tool_calls)
            ]
        shaped.append(item)
    specs = None
    if tools:
        specs = [t.function.model_dump(exclude_none=True) for t in tools]
        specs = [{"type": "function", "function": s} for s in specs]
    return task.tool_template(shaped, specs)
