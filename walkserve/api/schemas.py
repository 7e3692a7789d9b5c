"""Request bodies of the HTTP API, as pydantic models. They check types and ranges only; limits
that depend on the served model (prompt length, ``max_tokens``, image size) are checked in
``api.app`` against its ``ModelProfile``. Unknown fields are ignored, as the OpenAI API does,
except where a value we cannot honour is named (those are rejected with a message)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class _TextGeneration(_Body):
    """What completions and chat completions share: limits, sampling, stops, choices, stream."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # not OpenAI's; vLLM's extension
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False


class CompletionRequest(_TextGeneration):
    prompt: str | list[int]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str


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


class SpeechRequest(_Body):
    model: str
    input: str = Field(min_length=1)
    voice: str | dict[str, Any] | None = None
    response_format: Literal["wav", "pcm"] = "wav"
    speed: float = Field(default=1.0, gt=0.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False


class ImageRequest(_Body):
    model: str
    prompt: str = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    seed: int = Field(default=0, ge=0, lt=2**63)


class WalkRequest(_Body):
    model: str | None = None
    # name -> JSON int / float / bool, nested list, or {"b64", "dtype", "shape"}; checked
    # against the walk's inputs by ``api.jsontensor`` (pydantic would coerce "8" to 8)
    inputs: dict[str, Any]
    stream: bool = False
    encoding: Literal["list", "b64"] = "list"
