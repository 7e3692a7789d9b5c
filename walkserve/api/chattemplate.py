"""``--chat-template``: a Jinja chat template (Hugging Face's format: ``messages``, ``tools``,
``add_generation_prompt``) in place of the model's own, rendered in a sandbox as transformers
renders templates (``ImmutableSandboxedEnvironment``: a template cannot reach Python objects
beyond the values given). The template renders both plain chats and chats with tools."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from walkserve.api.profile import ModelProfile


def compile_template(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ValueError(f"--chat-template does not compile: {e}") from None


def with_chat_template(profile: ModelProfile, source: str) -> ModelProfile:
    """``profile`` whose text task renders chats with the template ``source``."""
    if profile.text is None:
        raise ValueError(f"--chat-template: model {profile.name!r} has no text generation")
    template = compile_template(source)

    def render(
        messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> str:
        return str(
            template.render(messages=list(messages), tools=tools, add_generation_prompt=True)
        )

    def chat(messages: Sequence[tuple[str, str]]) -> str:
        return render([{"role": r, "content": c} for r, c in messages], None)

    text = dataclasses.replace(profile.text, chat_template=chat, tool_template=render)
    return dataclasses.replace(profile, text=text)
