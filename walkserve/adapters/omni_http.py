"""The HTTP face of the Qwen-Omni adapters (``qwen3_omni``, ``qwen25_omni``): the
``ModelProfile`` that maps ``/v1/chat/completions`` (text, and text + audio) and
``/v1/audio/speech`` onto their walks, a chat template and tokenizer for the tiny random
instances, and the checkpoint's own tokenizer and chat template for a local checkpoint.

Qwen-Omni models are chat models whose talker speaks the thinker's reply; they have no plain
text-to-speech mode. ``/v1/audio/speech`` therefore sends the input as a chat turn asking the
model to read it aloud (``READ_ALOUD``) and returns the audio of the reply: a real checkpoint
reads the text (more or less faithfully: it is the model's reply, not a TTS), the random tiny
ones say noise. The request's ``max_tokens`` bounds the talker's codec tokens; the thinker's
reply is bounded by ``OmniLimits.read_aloud_tokens``. In chat, ``max_tokens`` bounds the reply's
text tokens and ``OmniLimits.chat_audio_tokens`` the audio.

What crosses the boundary: ``OmniWalkNames`` (which walk, inputs and outputs do what: the
adapters' own names), ``ChatIds`` (the chat-format token ids of a config), voices as
``api.profile.Voices``; out comes a ``ModelProfile``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from walkserve.api.profile import (
    ChatAudioTask,
    Decode,
    Encode,
    ModelProfile,
    SpeechTask,
    TextTask,
    Voice,
    Voices,
)

READ_ALOUD = "Read the following text aloud, exactly as written, and say nothing else:\n\n{text}"
SAMPLE_RATE = 24000  # Qwen2.5-Omni token2wav and Qwen3-Omni code2wav both speak at 24 kHz
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class ChatIds:
    """Token ids of the chat format (``<|im_start|> role \\n ... <|im_end|> \\n``) that the tiny
    configs put among their special ids."""

    im_start: int
    im_end: int
    system: int
    user: int
    assistant: int


@dataclass(frozen=True)
class OmniWalkNames:
    """Which of an adapter's walks, inputs and outputs serve which route."""

    chat_walk: str  # text-only chat (Qwen3-Omni: "chat"; Qwen2.5-Omni: "speak", audio unused)
    speech_walk: str  # thinker -> talker -> waveform
    prompt_input: str  # [1, P] chat prompt ids
    text_limit_input: str  # the thinker's max_new_tokens
    audio_limit_input: str  # the talker's max codec tokens
    leads: tuple[str, ...]  # outputs holding the reply's first tokens, in order
    text_channel: str  # the reply's further tokens, streamed
    waveform: str  # the waveform output (streamed or not)
    # Inputs the chat walk needs beyond prompt and limit (Qwen2.5-Omni: speaker, talker limit).
    chat_extra: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class OmniLimits:
    max_prompt_tokens: int
    default_text_tokens: int
    max_text_tokens: int
    default_audio_tokens: int  # /v1/audio/speech max_tokens when not given
    max_audio_tokens: int
    read_aloud_tokens: int  # the thinker's limit when it reads a speech input aloud
    chat_audio_tokens: int  # the talker's limit in chat with audio output


TINY_LIMITS = OmniLimits(
    max_prompt_tokens=512,
    default_text_tokens=8,
    max_text_tokens=64,
    default_audio_tokens=40,
    max_audio_tokens=256,
    read_aloud_tokens=12,
    chat_audio_tokens=40,
)
CHECKPOINT_LIMITS = OmniLimits(
    max_prompt_tokens=4096,
    default_text_tokens=256,
    max_text_tokens=2048,
    default_audio_tokens=2048,  # 164 s at 12.5 codec frames per second
    max_audio_tokens=4096,  # upstream talker_max_new_tokens
    read_aloud_tokens=2048,
    chat_audio_tokens=4096,
)


def chatml(messages: Sequence[tuple[str, str]]) -> str:
    """The Qwen chat format, ending with the assistant header the talker's prompt needs."""
    turns = "".join(f"<|im_start|>{ROLES[r]}\n{c}<|im_end|>\n" for r, c in messages)
    return turns + "<|im_start|>assistant\n"


class TinyChatTokenizer:
    """Text <-> ids for the tiny random Omni configs (no real tokenizer exists for them):
    ``<|im_start|>`` + role word and ``<|im_end|>`` map to the config's special ids, other
    text to its UTF-8 bytes; bytes at or above ``first_special`` (where the configs keep their
    special ids) become ``?``. Decoding drops every id at or above ``first_special``."""

    SPECIAL = re.compile(r"<\|im_start\|>(system|user|assistant)?|<\|im_end\|>")

    def __init__(self, ids: ChatIds, first_special: int) -> None:
        self.ids, self.first_special = ids, first_special

    def encode(self, text: str) -> list[int]:
        roles = {"system": self.ids.system, "user": self.ids.user}
        roles["assistant"] = self.ids.assistant
        out: list[int] = []
        pos = 0
        for m in self.SPECIAL.finditer(text):
            out += self._bytes(text[pos : m.start()])
            if m.group(0) == "<|im_end|>":
                out.append(self.ids.im_end)
            else:
                out.append(self.ids.im_start)
                if m.group(1):
                    out.append(roles[m.group(1)])
            pos = m.end()
        return out + self._bytes(text[pos:])

    def _bytes(self, text: str) -> list[int]:
        return [b if b < self.first_special else ord("?") for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < self.first_special)
        return data.decode("utf-8", errors="replace")


def voices_from(speakers: Mapping[str, int], input_name: str, default: str) -> Voices:
    """A voice per speaker: the speaker's id as walk input ``input_name``."""
    table = {name: Voice(inputs={input_name: int(v)}) for name, v in speakers.items()}
    return Voices(table, default if default in table else sorted(table)[0])


def omni_profile(
    name: str,
    walks: OmniWalkNames,
    limits: OmniLimits,
    eos_id: int,
    vocab_size: int,
    encode: Encode,
    decode: Decode,
    chat: Callable[[Sequence[tuple[str, str]]], str],
    voices: Voices,
) -> ModelProfile:
    """Text chat, chat with audio output and read-aloud speech over an Omni adapter's walks."""
    text = TextTask(
        walk=walks.chat_walk,
        prompt_input=walks.prompt_input,
        max_tokens_input=walks.text_limit_input,
        tokens_channel=walks.text_channel,
        first_token_output=walks.leads[0],
        eos_id=eos_id,
        vocab_size=vocab_size,
        max_prompt_tokens=limits.max_prompt_tokens,
        max_tokens_limit=limits.max_text_tokens,
        default_max_tokens=limits.default_text_tokens,
        encode=encode,
        decode=decode,
        chat_template=chat,
        lead_outputs=walks.leads[1:],
        sampling=True,  # the chat walks take temperature, top_p, top_k, seed
        extra_inputs=dict(walks.chat_extra or {}),
    )
    chat_audio = ChatAudioTask(
        walk=walks.speech_walk,
        prompt_input=walks.prompt_input,
        max_tokens_input=walks.text_limit_input,
        leads=walks.leads,
        transcript_channel=walks.text_channel,
        waveform_channel=walks.waveform,
        sample_rate=SAMPLE_RATE,
        voices=voices,
        extra_inputs={walks.audio_limit_input: limits.chat_audio_tokens},
    )

    def read_aloud(input_text: str) -> list[int]:
        return encode(chat([("user", READ_ALOUD.format(text=input_text))]))

    speech = SpeechTask(
        walk=walks.speech_walk,
        prompt_input=walks.prompt_input,
        max_tokens_input=walks.audio_limit_input,
        waveform_channel=walks.waveform,
        sample_rate=SAMPLE_RATE,
        vocab_size=vocab_size,
        max_prompt_tokens=limits.max_prompt_tokens,
        max_tokens_limit=limits.max_audio_tokens,
        default_max_tokens=limits.default_audio_tokens,
        encode=read_aloud,
        voices=voices,
        extra_inputs={walks.text_limit_input: limits.read_aloud_tokens},
    )
    return ModelProfile(name, text=text, speech=speech, chat_audio=chat_audio)


def checkpoint_text(path: str) -> tuple[Encode, Decode, Callable[..., str]]:
    """A local checkpoint's own tokenizer and chat template (``tokenizer_config.json``, else
    the processor's ``chat_template.json`` / ``chat_template.jinja``); the Qwen chat format
    when it has none or when its template does not end with the assistant header."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    template = getattr(tok, "chat_template", None) or _template_file(path)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    header = encode("<|im_start|>assistant\n")  # the talker's prompt needs it last

    def decode(token_ids: list[int]) -> str:
        return str(tok.decode(token_ids, skip_special_tokens=True))

    def chat(messages: Sequence[tuple[str, str]]) -> str:
        if template:
            rendered = str(
                tok.apply_chat_template(
                    [{"role": ROLES[r], "content": c} for r, c in messages],
                    chat_template=template,
                    tokenize=False,
                    add_generation_prompt=True,
                )
            )
            if encode(rendered)[-3:] == header:
                return rendered
        return chatml(messages)

    return encode, decode, chat


def _template_file(path: str) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    js = os.path.join(path, "chat_template.json")
    if os.path.isfile(js):
        with open(js) as f:
            value = json.load(f).get("chat_template")
        return value if isinstance(value, str) else None
    return None
