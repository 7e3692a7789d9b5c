"""Generated tokens -> OpenAI completion and chat responses. Pure: no server, no I/O.

- ``TextAssembler`` applies EOS, stop strings and ``max_tokens`` and decides which text is safe
  to stream;
- ``Step`` is one generated token with its logprob columns (the sampled token's raw
  log-probability first, then the most likely ids'), read from a request's outputs
  (``steps_from_outputs``) or its stream (``StepStream``);
- ``Choice`` holds one choice's text and the logprobs of the tokens it kept;
  ``completion_logprobs`` / ``chat_logprobs`` shape them as each API does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from walkserve.api.profile import TextTask
from walkserve.runtime.conductor import StreamItem


class TextAssembler:
    """Generated tokens -> text, with EOS, stop strings and max_tokens. ``take()`` returns the
    text that is safe to send so far (held back: a possible stop-string prefix and an
    incomplete UTF-8 sequence).

    Decoding is incremental (vLLM's offsets method, for any ``decode``): each token decodes
    only the few tokens since the last complete piece of text, twice (with and without the
    new tokens), and the text grows by the difference; stop strings are searched in the new
    tail only. A reply of n tokens costs O(n), not the O(n^2) of decoding all its tokens at
    every token, and its text equals decoding them all at once."""

    def __init__(self, task: TextTask, stops: list[str], max_tokens: int) -> None:
        self.task, self.stops, self.max_tokens = task, stops, max_tokens
        self.tokens: list[int] = []  # sent to the client (EOS excluded)
        self.generated = 0
        self.text = ""
        self.sent = 0
        self.finish_reason: str | None = None
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._prefix = 0  # tokens[_prefix:_read] decode to the text's last complete piece
        self._read = 0
        self._cut = False  # a stop string ended the text

    def feed(self, token: int) -> bool:
        """Take one token; True once generation is over."""
        if self.finish_reason is not None:
            return True
        self.generated += 1
        if self.task.eos_id is not None and token == self.task.eos_id:
            self.finish_reason = "stop"
            return True
        self.tokens.append(token)
        searched = max(0, len(self.text) - self._hold)
        self._grow()
        for stop in self.stops:
            at = self.text.find(stop, searched)
            if at >= 0:
                self.text = self.text[:at]
                self.finish_reason = "stop"
                self._cut = True
                return True
        if self.generated >= self.max_tokens:
            self.finish_reason = "length"
            return True
        return False

    def _grow(self) -> None:
        decode = self.task.decode
        before = decode(self.tokens[self._prefix : self._read])
        after = decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)

    def finish(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "length" if self.generated >= self.max_tokens else "stop"
        if not self._cut and self._read < len(self.tokens):  # the last tokens, even a partial char
            before = self.task.decode(self.tokens[self._prefix : self._read])
            after = self.task.decode(self.tokens[self._prefix :])
            self.text += after[len(before) :]
            self._prefix = self._read = len(self.tokens)
        self._hold = 0

    def take(self) -> str:
        end = len(self.text) - (self._hold if self.finish_reason is None else 0)
        if self.finish_reason is None:
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out


def all_tokens(task: TextTask, outputs: Mapping[str, Any]) -> Iterator[int]:
    yield from reply_tokens(task.leads, task.tokens_channel, outputs)


def reply_tokens(leads: Sequence[str], channel: str, outputs: Mapping[str, Any]) -> Iterator[int]:
    """A reply's tokens from a request's outputs: the lead outputs' (one token each, those
    present), then the channel's."""
    for name in leads:
        if name in outputs:
            yield int(outputs[name].reshape(-1)[0])
    if channel in outputs:
        yield from (int(t) for t in outputs[channel].reshape(-1).tolist())


# ---------------------------------------------------------------- steps and logprobs

#: The ext walks' logprob outputs: (lead value, lead ids), (channel values, channel ids).
LEAD_LOGPROBS = ("logprob", "logprob_id")
CHANNEL_LOGPROBS = ("logprobs", "logprob_ids")


@dataclass(frozen=True)
class Step:
    token: int
    values: tuple[float, ...] = ()  # [n]: the token's log-probability, then the top ids'
    ids: tuple[int, ...] = ()


def _rows(value: Any) -> list[list[Any]]:  # [1, k, n] -> k rows of n
    return [list(r) for r in value.reshape(value.shape[-2], value.shape[-1]).tolist()]


def steps_from_outputs(task: TextTask, outputs: Mapping[str, Any]) -> list[Step]:
    """Every generated token of a finished request, with logprobs where the walk has them."""
    tokens = list(all_tokens(task, outputs))
    values: list[list[float]] = []
    ids: list[list[int]] = []
    lead_v, lead_i = LEAD_LOGPROBS
    if lead_v in outputs:
        values += _rows(outputs[lead_v])
        ids += _rows(outputs[lead_i])
    chan_v, chan_i = CHANNEL_LOGPROBS
    if chan_v in outputs:
        values += _rows(outputs[chan_v])
        ids += _rows(outputs[chan_i])
    if not values:
        return [Step(t) for t in tokens]
    return [Step(t, tuple(v), tuple(i)) for t, v, i in zip(tokens, values, ids)]


class StepStream:
    """A streamed request's steps in order: the lead outputs' (read once the stream begins),
    then each iteration's token with its logprobs (their channels' items, paired by index)."""

    def __init__(self, task: TextTask, with_logprobs: bool) -> None:
        self.task, self.with_logprobs = task, with_logprobs
        self.started = False
        self.pending: dict[int, dict[str, Any]] = {}
        self.next_index = 0

    def lead(self, outputs: Mapping[str, Any]) -> list[Step]:
        """The lead steps (outputs sent before the stream's first item)."""
        self.started = True
        tokens = [int(outputs[n].reshape(-1)[0]) for n in self.task.leads if n in outputs]
        lead_v, lead_i = LEAD_LOGPROBS
        if self.with_logprobs and lead_v in outputs and tokens:
            v, i = _rows(outputs[lead_v])[0], _rows(outputs[lead_i])[0]
            return [Step(tokens[0], tuple(v), tuple(i)), *(Step(t) for t in tokens[1:])]
        return [Step(t) for t in tokens]

    def add(self, item: StreamItem) -> list[Step]:
        """The steps complete once ``item`` arrived (in order)."""
        channels: tuple[str, ...] = (self.task.tokens_channel, *CHANNEL_LOGPROBS)
        if item.channel not in channels or (
            item.channel != self.task.tokens_channel and not self.with_logprobs
        ):
            return []
        self.pending.setdefault(item.index, {})[item.channel] = item.value
        done: list[Step] = []
        need = channels if self.with_logprobs else channels[:1]
        while all(c in self.pending.get(self.next_index, {}) for c in need):
            got = self.pending.pop(self.next_index)
            self.next_index += 1
            tokens = [int(t) for t in got[need[0]].reshape(-1).tolist()]
            if not self.with_logprobs:
                done += [Step(t) for t in tokens]
                continue
            rows = zip(tokens, _rows(got[need[1]]), _rows(got[need[2]]))
            done += [Step(t, tuple(v), tuple(i)) for t, v, i in rows]
        return done

    def rest(self, outputs: Mapping[str, Any], fed: int) -> list[Step]:
        """The steps of the final outputs after the first ``fed`` (a reply that ended before
        its stream carried them)."""
        return steps_from_outputs(self.task, outputs)[fed:]


@dataclass
class Choice:
    """One choice: its text (``TextAssembler``) and the steps of the tokens it kept."""

    text: TextAssembler
    kept: list[Step] = field(default_factory=list)
    fed: int = 0  # steps fed so far (kept or not)

    def feed(self, step: Step) -> bool:
        """Take one step; True once generation is over."""
        self.fed += 1
        before = len(self.text.tokens)
        done = self.text.feed(step.token)
        if len(self.text.tokens) > before:
            self.kept.append(step)
        return done


def token_text(task: TextTask, token: int) -> str:
    return task.decode([token])


def token_bytes(task: TextTask, token: int) -> list[int]:
    data = task.token_bytes(token) if task.token_bytes is not None else None
    return list(data if data is not None else token_text(task, token).encode("utf-8", "replace"))


def chat_logprobs(task: TextTask, steps: Sequence[Step], top: int) -> dict[str, Any]:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(token: int, value: float) -> dict[str, Any]:
        text = token_text(task, token)
        return {"token": text, "logprob": value, "bytes": token_bytes(task, token)}

    content = []
    for s in steps:
        alternatives = [entry(t, v) for t, v in zip(s.ids[1 : top + 1], s.values[1 : top + 1])]
        content.append({**entry(s.token, s.values[0]), "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def completion_logprobs(
    task: TextTask, steps: Sequence[Step], top: int, offset: int = 0
) -> dict[str, Any]:
    """OpenAI completions ``logprobs``: parallel lists of tokens, their log-probabilities, the
    ``top`` most likely alternatives of each (a dict) and each token's offset in the text."""
    tokens, values, tops, offsets = [], [], [], []
    for s in steps:
        text = token_text(task, s.token)
        tokens.append(text)
        values.append(s.values[0])
        tops.append(
            {token_text(task, t): v for t, v in zip(s.ids[1 : top + 1], s.values[1 : top + 1])}
        )
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def usage(prompt: Sequence[int], texts: Sequence[TextAssembler]) -> dict[str, int]:
    """Prompt tokens counted once, completion tokens of every choice."""
    completion = sum(t.generated for t in texts)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
    }


def envelope(rid: str, model: str, chat: bool, created: int | None = None) -> dict[str, Any]:
    """The fields every response or chunk body starts with."""
    kind = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model}
