"""What the OpenAI-style routes need to know about the served model: which walk does text,
speech or image generation, which inputs it takes, its tokenizer and its limits. A model that
offers none of these tasks is still served through ``/v1/walks/{walk}``.

The types only: this module imports nothing from the runtime or the adapters. The adapters
build their models' profiles from these types, and ``adapters.registry.profile_for(name)``
finds the profile of a served name (so no model is named here).

Speech models may have voices (``Voices``): a voice name -> the walk inputs it sets (a speaker
id) and the text put before the input (Orpheus's ``"tara: "``). A model that speaks in a chat
(``ChatAudioTask``) names the walk whose text tokens are the transcript and whose waveform is
the audio of ``/v1/chat/completions`` with ``modalities: ["text", "audio"]``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]
ChatTemplate = Callable[[Sequence[tuple[str, str]]], str]
#: OpenAI-shaped messages (dicts: role, content, and name, tool_calls, tool_call_id where
#: given; tool call arguments as objects) and the request's tools -> the prompt
ToolTemplate = Callable[[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None], str]
#: how a model writes a tool call (``api.tools``)
ToolFormat = Literal["hermes", "llama3_json"]


def plain_chat(messages: Sequence[tuple[str, str]]) -> str:
    """The toy chat template of the built-in models: ``role: content`` lines, then
    ``assistant:``."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


def plain_tool_chat(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> str:
    """``plain_chat`` with tools (a ``tools:`` line of their JSON first), an assistant's calls
    in the hermes format and tool results as ``tool:`` lines."""
    lines = [f"tools: {json.dumps(list(tools), separators=(',', ':'))}\n"] if tools else []
    for m in messages:
        text = m.get("content") or ""
        for call in m.get("tool_calls") or ():
            body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
            text += f"<tool_call>\n{json.dumps(body, separators=(',', ':'))}\n</tool_call>"
        who = m["role"] if not m.get("name") else f"{m['role']} ({m['name']})"
        lines.append(f"{who}: {text}\n")
    return "".join(lines) + "assistant:"


@dataclass(frozen=True)
class TextTask:
    walk: str  # the entry walk; prefill -> decode
    prompt_input: str
    max_tokens_input: str
    tokens_channel: str  # the accumulated output that streams one token per item
    first_token_output: str | None  # an output emitted before the channel (HF prefill's token)
    eos_id: int | None
    vocab_size: int
    max_prompt_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    encode: Encode
    decode: Decode
    chat_template: ChatTemplate
    sampling: bool = False  # the walks take temperature, top_p, top_k and seed inputs
    # Further outputs, after first_token_output, that hold the next reply tokens before the
    # channel's (Qwen2.5-Omni's second token); each [B, 1].
    lead_outputs: tuple[str, ...] = ()
    # Inputs every request of the walk gets besides the prompt and the limit.
    extra_inputs: Mapping[str, Any] = field(default_factory=dict)
    # The entry walk for requests with logprobs, a logit bias or a grammar (the text walks'
    # ``prefill_ext``: inputs ``constraints`` and ``logprobs``, outputs ``logprob`` /
    # ``logprob_id`` beside the lead token and ``logprobs`` / ``logprob_ids`` beside the
    # channel); None: such requests get a 400.
    ext_walk: str | None = None
    structured_output: bool = False  # the LM's worker has a vocabulary for grammars
    tool_template: ToolTemplate | None = None  # None: requests with tools get a 400
    tool_format: ToolFormat = "hermes"
    token_bytes: Callable[[int], bytes] | None = None  # one id's bytes (logprobs' ``bytes``)
    has_tokenizer: bool = True  # False: prompts as token ids only, answers as token ids
    max_model_len: int | None = None  # prompt + max_tokens at most this (--max-model-len)

    @property
    def leads(self) -> tuple[str, ...]:
        """The outputs holding the reply's first tokens, in order, before the channel's."""
        first = () if self.first_token_output is None else (self.first_token_output,)
        return first + self.lead_outputs


@dataclass(frozen=True)
class Voice:
    """What choosing one voice changes in a request."""

    inputs: Mapping[str, Any] = field(default_factory=dict)  # walk inputs (a speaker id)
    prefix: str = ""  # text put before the input (Orpheus: "tara: ")


@dataclass(frozen=True)
class Voices:
    """A model's voices by name. ``default`` is used when a request names none; ``None``:
    the request then gets no voice inputs and no prefix (the model's own default)."""

    table: Mapping[str, Voice]
    default: str | None = None

    def __post_init__(self) -> None:
        if not self.table:
            raise ValueError("Voices needs at least one voice")
        if self.default is not None and self.default not in self.table:
            raise ValueError(f"default voice {self.default!r} is not one of {self.names}")

    @property
    def names(self) -> list[str]:
        return sorted(self.table)

    def resolve(self, name: str | None) -> Voice:
        """The voice called ``name`` (exactly, else ignoring case); ``ValueError`` naming the
        voices there are when there is none."""
        if name is None:
            return Voice() if self.default is None else self.table[self.default]
        if name in self.table:
            return self.table[name]
        folded = {k.casefold(): v for k, v in self.table.items()}
        if name.casefold() in folded:
            return folded[name.casefold()]
        raise ValueError(f"unknown voice {name!r}; this model's voices are {self.names}")


@dataclass(frozen=True)
class SpeechTask:
    walk: str
    prompt_input: str
    max_tokens_input: str  # the request's max_tokens: audio tokens (Orpheus LM, Omni talker)
    waveform_channel: str  # [B, samples] or [B, 1, samples] chunks, float in [-1, 1]
    sample_rate: int
    vocab_size: int
    max_prompt_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    encode: Encode  # the input text (after the voice's prefix) -> the walk's prompt ids
    voices: Voices | None = None  # None: one voice; the request's voice is not checked
    # Inputs every request gets (a thinker's text limit when a chat model reads text aloud).
    extra_inputs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatAudioTask:
    """Chat with audio output (``modalities: ["text", "audio"]``): one walk gives the reply's
    text tokens (the transcript) and its waveform. The prompt is made and the transcript
    decoded as the profile's ``TextTask`` does (its tokenizer, chat template, EOS, limits)."""

    walk: str
    prompt_input: str
    max_tokens_input: str  # the reply's text tokens (max_tokens / max_completion_tokens)
    leads: tuple[str, ...]  # outputs holding the reply's first tokens, before the channel's
    transcript_channel: str  # the reply's further text tokens, streamed
    waveform_channel: str  # [B, samples] or [B, 1, samples] chunks, float in [-1, 1]
    sample_rate: int
    voices: Voices | None = None
    extra_inputs: Mapping[str, Any] = field(default_factory=dict)  # e.g. the audio limit


#: (feature frames, language, context prompt) -> the walk's prompt ids, holding the audio
#: placeholders for that many frames (``TranscriptionTask``)
AudioPrompt = Callable[[int, str | None, str | None], list[int]]
#: waveform [samples] float at the extractor's rate -> (features [1, mel, T], mask [1, T])
AudioFeatures = Callable[[Any], tuple[Any, Any]]


@dataclass(frozen=True)
class TranscriptionTask:
    """``/v1/audio/transcriptions``: a walk that reads one audio clip (the model's own feature
    extractor's features and frame mask) and a prompt, and writes text tokens. The reply is
    decoded as the profile's ``TextTask`` does (its tokenizer, EOS)."""

    walk: str
    prompt_input: str
    features_input: str  # [1, mel, T] float
    mask_input: str  # [1, T] int64, 1 = a real frame
    max_tokens_input: str
    leads: tuple[str, ...]  # outputs holding the reply's first tokens, before the channel's
    text_channel: str  # the reply's further tokens, streamed
    sample_rate: int  # the feature extractor's; uploads are resampled to it
    features: AudioFeatures
    prompt: AudioPrompt
    max_tokens: int  # the reply's tokens at most
    max_audio_seconds: float
    extra_inputs: Mapping[str, Any] = field(default_factory=dict)


#: a request's decoded media parts of one kind, in order (clips [samples] float at
#: ``ChatMediaTask.sample_rate``, images [H, W, 3] uint8 RGB, or ``videocodec.Video``s: the
#: frames ``ChatMediaTask.video_frames`` picked) -> (the walk's media inputs
#: for all of them, the prompt ids that stand for each), as an upstream processor is called
#: with the list (an audio feature extractor pads the clips to the longest)
MediaInputs = Callable[[list[Any]], tuple[dict[str, Any], list[list[int]]]]
OneMedia = Callable[[Any], tuple[dict[str, Any], list[int]]]  # one part -> (inputs, ids)
#: (a video's frames, its frame rate) -> the indices of the frames the model reads, ascending
FramePicker = Callable[[int, float], Sequence[int]]


def all_frames(total: int, fps: float) -> list[int]:
    return list(range(total))


@dataclass(frozen=True)
class VideoLimits:
    """What one uploaded video may hold (``api.videocodec`` checks each before it decodes the
    frames it covers): its encoded bytes, its length, its frames and each frame's pixels."""

    max_bytes: int = 16 << 20
    max_seconds: float = 60.0
    max_frames: int = 3600  # in the file (a picker reads fewer)
    max_pixels: int = 1920 * 1080  # width x height of a frame

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_frames < 1 or self.max_pixels < 1:
            raise ValueError(f"video limits must be >= 1, got {self}")
        if not self.max_seconds > 0:
            raise ValueError(f"video max_seconds must be > 0, got {self.max_seconds}")


@dataclass(frozen=True)
class MediaWalk:
    """The walk that reads one media part of a kind in a chat prompt. It takes the inputs of
    the profile's ``TextTask`` walk (prompt, limit, sampling) and writes its outputs (leads,
    token channel), so the reply is generated and decoded as a text chat's is; ``speak_walk``
    likewise for the ``ChatAudioTask`` walk (audio out), None: no audio out with this media."""

    walk: str
    inputs: MediaInputs
    speak_walk: str | None = None


@dataclass(frozen=True)
class ChatMediaTask:
    """``/v1/chat/completions`` with media parts in the messages: ``input_audio`` clips
    (decoded by PyAV, resampled to ``sample_rate``) through ``audio``, ``image_url`` data URLs
    (decoded by Pillow under the server's ``max_image_pixels``) through ``image``,
    ``video_url`` data URLs (decoded by PyAV under ``video_limits``, only the frames
    ``video_frames`` picks) through ``video``; None: that kind is a 400. The part's ids go
    where the part stands in the rendered prompt. A request with audio and images runs
    ``mixed_walk`` (``mixed_speak_walk`` for audio out) with both kinds' inputs; None: a 400.
    Videos go alone (no other kind in the request)."""

    audio: MediaWalk | None = None
    image: MediaWalk | None = None
    video: MediaWalk | None = None
    video_limits: VideoLimits = field(default_factory=VideoLimits)
    video_frames: FramePicker = all_frames
    sample_rate: int = 16000
    max_audio_seconds: float = 30.0
    max_parts: int = 1  # media parts per request
    mixed_walk: str | None = None  # the walk of requests with audio and images
    mixed_speak_walk: str | None = None  # with audio out


@dataclass(frozen=True)
class ImageTask:
    walk: str
    prompt_input: str
    noise_input: str | None  # None: the walk draws its own randomness (see seed_input)
    noise_shape: tuple[int, ...]  # per image, without the batch dimension
    size: int  # the only accepted width and height
    vocab_size: int
    max_prompt_tokens: int
    image_output: str  # [B, 3, H, W] in [-1, 1]
    encode: Encode
    edit_walk: str | None = None  # (prompt, image, noise) -> image; None: no /v1/images/edits
    image_input: str | None = None  # the edit walk's input image [B, 3, H, W] in [-1, 1]
    # walk name -> further inputs every request of that walk gets (a negative prompt, a
    # schedule), made per request.
    extra_inputs: Callable[[str], dict[str, Any]] | None = None
    image_range: tuple[float, float] = (-1.0, 1.0)  # the value range of image_output
    edit_noise_input: str | None = None  # the edit walk's seeded noise, if not noise_input
    edit_noise_shape: tuple[int, ...] | None = None  # its shape, if not noise_shape
    seed_input: str | None = None  # the walk takes the request's seed as [B] int64 here
    # image_output [3, H, W] -> [H, W, 3] uint8 RGB as the model's own postprocessing makes
    # it (an upstream processor's); None: image_range mapped to [-1, 1], then rounded
    pixels: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class ModelProfile:
    name: str
    text: TextTask | None = None
    speech: SpeechTask | None = None
    image: ImageTask | None = None
    chat_audio: ChatAudioTask | None = None  # needs text (tokenizer, template) as well
    transcription: TranscriptionTask | None = None  # needs text (tokenizer) as well
    chat_media: ChatMediaTask | None = None  # needs text (template, tokenizer) as well

    def __post_init__(self) -> None:
        if self.chat_audio is not None and self.text is None:
            raise ValueError(f"{self.name}: chat_audio needs a text task (tokenizer, template)")
        if self.transcription is not None and self.text is None:
            raise ValueError(f"{self.name}: transcription needs a text task (tokenizer)")
        if self.chat_media is not None and self.text is None:
            raise ValueError(f"{self.name}: chat_media needs a text task (template, tokenizer)")


def with_limits(profile: ModelProfile, max_model_len: int) -> ModelProfile:
    """``profile`` whose text requests hold at most ``max_model_len`` tokens, prompt and
    generated together (``--max-model-len``); ``ValueError`` past what the model takes."""
    text = profile.text
    if text is None:
        raise ValueError(f"--max-model-len: model {profile.name!r} has no text generation")
    most = text.max_prompt_tokens + text.max_tokens_limit
    if not 2 <= max_model_len <= most:
        raise ValueError(
            f"--max-model-len must be in [2, {most}] for {profile.name!r}, got {max_model_len}"
        )
    limited = dataclasses.replace(
        text,
        max_prompt_tokens=min(text.max_prompt_tokens, max_model_len - 1),
        max_tokens_limit=min(text.max_tokens_limit, max_model_len - 1),
        max_model_len=max_model_len,
    )
    return dataclasses.replace(profile, text=limited)


def without_tokenizer(profile: ModelProfile) -> ModelProfile:
    """``profile`` whose text task takes token ids only (``--skip-tokenizer-init``)."""
    if profile.text is None:
        return profile
    return dataclasses.replace(profile, text=dataclasses.replace(profile.text, has_tokenizer=False))
