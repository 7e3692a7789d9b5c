"""Request bodies of the HTTP API, as strict pydantic models: a boolean is not an integer, a
string is not a number, and a field no model below defines is refused with a 400 that names it
(never silently dropped). Each body lists the OpenAI fields it does not implement
(``refused``: field -> why; a few are accepted at their neutral value, ``neutral``) so that
the message says so instead of "unknown field". Limits that depend on the served model (prompt
length, ``max_tokens``, image size, the vocabulary) are checked by the routes against its
``ModelProfile``.

Extensions beyond OpenAI's fields (vLLM's, where vLLM has one): ``top_k``, ``min_tokens``,
``ignore_eos``, ``repetition_penalty``, ``return_token_ids``, ``guided_json``,
``guided_regex``, ``guided_choice``; ``stream``, ``max_tokens`` on speech; ``seed`` on images
(a random one when absent).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

INT64 = 2**63
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128
MAX_STOP = 4
MAX_GUIDED_CHOICES = 256


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())
    #: OpenAI fields this body does not implement -> why (the 400 says it)
    refused: ClassVar[Mapping[str, str]] = {}
    #: refused fields accepted when they hold one of these values (they change nothing)
    neutral: ClassVar[Mapping[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        """A refused field: dropped when null or neutral, else a 400 that says why."""
        if not isinstance(data, dict) or not cls.refused:
            return data
        for key in [k for k in data if k in cls.refused]:
            value = data[key]
            if value is None or any(
                type(v) is type(value) and v == value for v in cls.neutral.get(key, ())
            ):
                data = {k: v for k, v in data.items() if k != key}
                continue
            raise PydanticCustomError(
                "refused_field",
                "{field} is not supported: {why}",
                {"field": key, "why": cls.refused[key]},
            )
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    refused: ClassVar[Mapping[str, str]] = {
        "continuous_usage_stats": "usage is sent once, in the last chunk (include_usage)",
        "include_obfuscation": "chunks carry no obfuscation padding",
    }
    neutral: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        "continuous_usage_stats": (False,),
        "include_obfuscation": (False,),
    }


class JsonSchemaFormat(_Body):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _TextGeneration(_Body):
    """What completions and chat completions share: limits, sampling, stops, choices, stream,
    penalties, structured output."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's: -1 or 0 is off
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # vLLM's
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's
    ignore_eos: bool = False  # vLLM's
    user: str | None = Field(default=None, max_length=256)  # accepted; changes nothing
    return_token_ids: bool = False  # vLLM's
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's
    guided_regex: str | None = Field(default=None, max_length=4096)  # vLLM's
    guided_choice: list[str] | None = Field(default=None, min_length=1)  # vLLM's


class CompletionRequest(_TextGeneration):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    refused: ClassVar[Mapping[str, str]] = {}


# ---------------------------------------------------------------- chat


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Body):
    data: str
    format: str


class AudioPart(_Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoUrl(_Body):
    url: str


class VideoPart(_Body):  # vLLM's
    type: Literal["video_url"]
    video_url: VideoUrl


class FilePart(_Body):
    type: Literal["file"]
    file: dict[str, Any]


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    TextPart | ImagePart | AudioPart | VideoPart | FilePart | RefusalPart,
    Field(discriminator="type"),
]


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant; accepted as history
    refused: ClassVar[Mapping[str, str]] = {
        "function_call": "deprecated by OpenAI: send tool_calls",
        "audio": "earlier audio replies are not kept: send their transcript as content",
    }


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class AudioOutput(_Body):
    """``audio`` of a chat request that asks for ``modalities: ["text", "audio"]``. ``format``
    is any string here, so that an unsupported one gets a 400 naming the supported ones."""

    voice: str | dict[str, Any] | None = None
    format: str = "wav"


class ChatCompletionRequest(_TextGeneration):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutput | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=256)  # accepted (a hint)
    safety_identifier: str | None = Field(default=None, max_length=256)  # accepted, like user
    refused: ClassVar[Mapping[str, str]] = {
        "functions": "deprecated by OpenAI: send tools",
        "function_call": "deprecated by OpenAI: send tool_choice",
        "prediction": "predicted outputs are not implemented",
        "web_search_options": "this server has no web search",
        "reasoning_effort": "no served model has a reasoning-effort setting",
        "verbosity": "no served model has a verbosity setting",
        "service_tier": "there is one service tier",
        "store": "completions are not stored",
        "metadata": "completions are not stored, so metadata has no use",
    }
    neutral: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        "service_tier": ("auto", "default"),
        "store": (False,),
        "metadata": ({},),
    }


# ---------------------------------------------------------------- speech, images, walks


class SpeechRequest(_Body):
    model: str
    input: str = Field(min_length=1)
    voice: str | dict[str, Any] | None = None
    response_format: str = "wav"  # any string here: a 400 names the formats (api.audiocodec)
    speed: float = Field(default=1.0, ge=0.25, le=4.0)  # OpenAI's range; time-stretched
    stream_format: Literal["audio", "sse"] | None = None  # "sse": OpenAI's speech events
    max_tokens: int | None = Field(default=None, ge=1)  # extension: the audio tokens
    stream: bool = False  # extension: raw chunks as produced
    refused: ClassVar[Mapping[str, str]] = {
        "instructions": "the served speech models take no style instructions",
    }


class TranscriptionRequest(_Body):
    """The form fields of ``/v1/audio/transcriptions`` (the file part is read apart)."""

    model: str
    language: str | None = Field(default=None, pattern=r"^[A-Za-z]{2,3}([-_][A-Za-z0-9]{2,8})?$")
    prompt: str | None = Field(default=None, max_length=4096)
    response_format: str = "json"  # any string here: a 400 names json, text, verbose_json
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)  # 0 only: greedy decoding
    stream: bool = False
    refused: ClassVar[Mapping[str, str]] = {
        "timestamp_granularities[]": "no timestamps are computed",
        "include[]": "logprobs are not returned for transcriptions",
        "chunking_strategy": "the clip is transcribed whole, in one request",
        "known_speaker_names[]": "there is no diarization",
        "known_speaker_references[]": "there is no diarization",
    }


class ImageRequest(_Body):
    model: str
    prompt: str = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    size: str | None = None
    response_format: str = "b64_json"  # any string here: a 400 names b64_json
    output_format: str = "png"  # any string here: a 400 names png, jpeg, webp
    output_compression: int | None = Field(default=None, ge=0, le=100)  # jpeg / webp quality
    seed: int | None = Field(default=None, ge=0, lt=INT64)  # extension; None: a random seed
    user: str | None = Field(default=None, max_length=256)
    refused: ClassVar[Mapping[str, str]] = {
        "quality": "the served image models have one quality",
        "style": "the served image models have no styles",
        "background": "the served image models make opaque images",
        "moderation": "there is no moderation",
        "partial_images": "images are sent whole",
        "stream": "images are sent whole",
    }
    neutral: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        "quality": ("auto", "standard"),
        "partial_images": (0,),
        "stream": (False,),
        "background": ("auto", "opaque"),
    }


class WalkRequest(_Body):
    model: str | None = None
    # name -> JSON int / float / bool, nested list, or {"b64", "dtype", "shape"}; checked
    # against the walk's inputs by ``api.jsontensor``
    inputs: dict[str, Any]
    stream: bool = False
    encoding: Literal["list", "b64"] = "list"
