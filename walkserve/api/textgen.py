"""Generated tokens -> OpenAI completion and chat responses: ``TextAssembler`` applies EOS,
stop strings and ``max_tokens`` and decides which text is safe to stream; the other functions
build the response and SSE chunk bodies. Pure: no server, no I/O."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from walkserve.api.profile import TextTask
from walkserve.api.schemas import ChatCompletionRequest, CompletionRequest


class TextAssembler:
    """Generated tokens -> text, with EOS, stop strings and max_tokens. ``take()`` returns the
    text that is safe to send so far (held back: a possible stop-string prefix and an
    incomplete UTF-8 sequence)."""

    def __init__(self, task: TextTask, stops: list[str], max_tokens: int) -> None:
        self.task, self.stops, self.max_tokens = task, stops, max_tokens
        self.tokens: list[int] = []  # sent to the client (EOS excluded)
        self.generated = 0
        self.text = ""
        self.sent = 0
        self.finish_reason: str | None = None
        self._hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, token: int) -> bool:
        """Take one token; True once generation is over."""
        if self.finish_reason is not None:
            return True
        self.generated += 1
        if self.task.eos_id is not None and token == self.task.eos_id:
            self.finish_reason = "stop"
            return True
        self.tokens.append(token)
        self.text = self.task.decode(self.tokens)
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                self.text = self.text[:at]
                self.finish_reason = "stop"
                return True
        if self.generated >= self.max_tokens:
            self.finish_reason = "length"
            return True
        return False

    def finish(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "length" if self.generated >= self.max_tokens else "stop"
        self._hold = 0

    def take(self) -> str:
        end = len(self.text) - (self._hold if self.finish_reason is None else 0)
        if self.finish_reason is None:
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out


def all_tokens(task: TextTask, outputs: dict[str, Any]) -> Iterator[int]:
    yield from reply_tokens(task.leads, task.tokens_channel, outputs)


def reply_tokens(leads: Sequence[str], channel: str, outputs: Mapping[str, Any]) -> Iterator[int]:
    """A reply's tokens from a request's outputs: the lead outputs' (one token each, those
    present), then the channel's."""
    for name in leads:
        if name in outputs:
            yield int(outputs[name].reshape(-1)[0])
    if channel in outputs:
        yield from (int(t) for t in outputs[channel].reshape(-1).tolist())


def chunk(
    rid: str, model: str, chat: bool, delta: dict[str, Any] | None, index: int = 0
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": None}] if delta else [],
    }


def delta(
    rid: str,
    model: str,
    chat: bool,
    text: str,
    token_ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    finish_reason: str | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
        choice["logprobs"] = None
    if body.return_token_ids:
        choice["token_ids"] = token_ids
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def usage(prompt: list[int], texts: list[TextAssembler]) -> dict[str, int]:
    """Prompt tokens counted once, completion tokens of every choice."""
    completion = sum(t.generated for t in texts)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
    }


def text_response(
    rid: str,
    model: str,
    chat: bool,
    texts: list[TextAssembler],
    prompt: list[int],
    return_token_ids: bool,
    created: int,
) -> dict[str, Any]:
    choices = []
    for index, text in enumerate(texts):
        choice: dict[str, Any] = {"index": index, "finish_reason": text.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text.text}
        else:
            choice["text"] = text.text
            choice["logprobs"] = None
        if return_token_ids:
            choice["token_ids"] = list(text.tokens)
        choices.append(choice)
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt, texts),
    }
    if return_token_ids:
        body["prompt_token_ids"] = list(prompt)
    return body
