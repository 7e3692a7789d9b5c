"""Media parts of chat messages -> the walk that reads them and its inputs (a profile's
``ChatMediaTask``). ``MediaParts.mark`` checks each part as ``chatprompt.render`` meets it and
puts a mark in its place; ``MediaParts.prompt`` decodes the parts (CPU work: run it off the
event loop), asks the model's ``MediaWalk.inputs`` for each one's walk inputs and placeholder
ids, and splices those ids where the marks are in the rendered prompt::

    input_audio {data: base64, format: wav | mp3 | flac}  -> audiocodec.decode (PyAV), mono,
                                                            resampled to task.sample_rate
    image_url {url: data:image/png|jpeg|webp;base64,...}  -> imagecodec.decode (Pillow), under
                                                            the server's max_image_pixels
    image_url http(s) / file URLs, video_url, file        -> 400 naming the field

Media parts go in user messages; at most ``task.max_parts`` per request (several parts' inputs
are concatenated along dimension 0, in the order of the parts: a VLM's images). Raises
``ApiError``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from walkserve.api import audiocodec, imagecodec, media
from walkserve.api.errors import bad
from walkserve.api.profile import ChatMediaTask, Encode, MediaWalk, TextTask
from walkserve.api.schemas import ContentPart

AUDIO_FORMATS = ("wav", "mp3", "flac")
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp")
DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),(.*)", re.DOTALL)
MARK = "\x00media{}\x00"  # never in a chat template; text holding "\x00media" is refused


@dataclass(frozen=True)
class Part:
    kind: str  # "audio" or "image"
    data: bytes
    where: str  # the field named by a 400 about the data
    mark: str


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{where} is not base64", where) from None


def image_bytes(url: str, where: str) -> bytes:
    """The image of a data URL; a 400 for other URLs (not fetched by this server)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise bad(
            f"{where}: remote image URLs are not enabled on this server; send the image as a"
            " data URL (data:image/png;base64,...)",
            where,
        )
    m = DATA_URL.fullmatch(url)
    if m is None:
        raise bad(
            f"{where}: image URLs other than data URLs (file paths, {scheme or 'no'} scheme) are"
            " not enabled on this server; send data:image/png;base64,...",
            where,
        )
    mime, params = m.group(1).lower(), m.group(2).lower().split(";")
    if mime not in IMAGE_TYPES:
        raise bad(f"{where}: a data URL of {mime or 'no type'!r}; send one of {IMAGE_TYPES}", where)
    if "base64" not in params:
        raise bad(f"{where}: the data URL must be base64 (data:{mime};base64,...)", where)
    return _b64(m.group(3), where)


class MediaParts:
    """The media parts of one request, met in order by ``chatprompt.render``."""

    def __init__(
        self, task: ChatMediaTask, model: str, max_image_pixels: int, speaking: bool = False
    ) -> None:
        self.task, self.model, self.speaking = task, model, speaking
        self.max_image_pixels = max_image_pixels
        self.parts: list[Part] = []

    def _walk(self, kind: str, where: str) -> MediaWalk:
        walk = self.task.audio if kind == "audio" else self.task.image
        if walk is None:
            other = "images (image_url)" if kind == "audio" else "audio (input_audio)"
            raise bad(
                f"{where}: model {self.model!r} takes no {kind} in chat; it takes {other}", where
            )
        if self.speaking and walk.speak_walk is None:
            raise bad(
                f"{where}: model {self.model!r} cannot answer {kind} with audio output", where
            )
        return walk

    def mark(self, part: ContentPart, where: str, role: str) -> str:
        if part.type == "video_url":
            raise bad(
                f"{where}: model {self.model!r} takes no video (its walks read one image or one"
                " audio clip); send image_url or input_audio",
                where,
            )
        if part.type == "file":
            raise bad(
                f"{where}: file parts are not supported; send image_url or input_audio", where
            )
        if role != "user":
            raise bad(f"{where}: media parts go in user messages, not {role} messages", where)
        if len(self.parts) >= self.task.max_parts:
            why = f"model {self.model!r} takes no more"
            if self.task.max_parts == 1:
                why = f"the walks of model {self.model!r} read one image or one audio clip"
            raise bad(
                f"{where}: at most {self.task.max_parts} media part(s) per request: {why}", where
            )
        if part.type == "input_audio":
            self._walk("audio", where)
            fmt = part.input_audio.format.lower()
            if fmt not in AUDIO_FORMATS:
                raise bad(
                    f"{where}.input_audio.format {part.input_audio.format!r} is not supported;"
                    f" send one of {list(AUDIO_FORMATS)}",
                    f"{where}.input_audio.format",
                )
            data_where = f"{where}.input_audio.data"
            found = Part("audio", _b64(part.input_audio.data, data_where), data_where, "")
        elif part.type == "image_url":
            self._walk("image", where)
            url_where = f"{where}.image_url.url"
            found = Part("image", image_bytes(part.image_url.url, url_where), url_where, "")
        else:  # text and refusal parts never reach the marks
            raise bad(f"{where}: unexpected content part {part.type!r}", where)
        found = dataclasses.replace(found, mark=MARK.format(len(self.parts)))
        self.parts.append(found)
        return found.mark

    def prompt(self, rendered: str, encode: Encode) -> tuple[str, dict[str, Any], list[int]]:
        """(the walk, the media walk inputs, the prompt ids) of the rendered prompt (which
        holds each part's mark once). CPU work: decodes the media."""
        if rendered.count("\x00media") != len(self.parts):
            raise bad("a text part holds the reserved text '\\x00media'", "messages")
        walks, ids, rest = set(), [], rendered
        inputs: dict[str, Any] = {}
        for part in self.parts:
            walk = self._walk(part.kind, part.where)
            try:
                if part.kind == "audio":
                    clip = audiocodec.decode(
                        part.data, self.task.sample_rate, self.task.max_audio_seconds
                    )
                    part_inputs, placeholders = walk.inputs(clip)
                else:
                    image = imagecodec.decode(part.data, self.max_image_pixels)
                    part_inputs, placeholders = walk.inputs(media.image_to_uint8(image))
            except ValueError as e:
                raise bad(f"{part.where}: {e}", part.where) from None
            before, rest = rest.split(part.mark, 1)
            ids += [*encode(before), *placeholders]
            for key, value in part_inputs.items():  # several parts: in order, along dim 0
                inputs[key] = torch.cat([inputs[key], value]) if key in inputs else value
            walks.add(walk.speak_walk if self.speaking else walk.walk)
        ids += encode(rest)
        if len(walks) != 1:
            raise bad("the media parts of one request need one walk", "messages")
        return walks.pop() or "", inputs, ids


def media_text_task(task: TextTask, walk: str, inputs: dict[str, Any]) -> TextTask:
    """``task`` run by the media walk with the media inputs (no ext walk: logprobs, logit bias
    and grammars are 400s with media)."""
    return dataclasses.replace(
        task, walk=walk, ext_walk=None, extra_inputs={**task.extra_inputs, **inputs}
    )
