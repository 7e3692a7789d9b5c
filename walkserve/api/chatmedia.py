"""Media parts of chat messages -> the walk that reads them and its inputs (a profile's
``ChatMediaTask``). ``MediaParts.mark`` checks each part as ``chatprompt.render`` meets it and
puts a mark in its place; ``MediaParts.prompt`` decodes the parts (CPU work: run it off the
event loop), asks the model's ``MediaWalk.inputs`` for each one's walk inputs and placeholder
ids, and splices those ids where the marks are in the rendered prompt::

    input_audio {data: base64, format: wav | mp3 | flac}  -> audiocodec.decode (PyAV), mono,
                                                            resampled to task.sample_rate
    image_url {url: data:image/png|jpeg|webp;base64,...}  -> imagecodec.decode (Pillow), under
                                                            the server's max_image_pixels
    video_url {url: data:video/mp4|webm|...;base64,...}   -> videocodec.decode (PyAV), under
                                                            the task's ``video_limits``, the
                                                            frames its ``video_frames`` picks
    image_url / video_url http(s) / file URLs             -> read as the deployer's
                                                            ``mediafetch.MediaFetch`` allows
                                                            (off by default: a 400)
    file; a kind the model does not take                  -> 400 naming the field

Media parts go in user messages; at most ``task.max_parts`` per request. A kind's parts go to
its ``MediaWalk.inputs`` together, in order (``per_part`` for processors that take each alone:
their tensors concatenated along dimension 0); a request with audio and images runs the task's
``mixed_walk``; videos go alone. Raises ``ApiError``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from walkserve.api import audiocodec, imagecodec, media, videocodec
from walkserve.api.errors import bad
from walkserve.api.mediafetch import MediaFetch
from walkserve.api.profile import (
    ChatMediaTask,
    Encode,
    MediaInputs,
    MediaWalk,
    OneMedia,
    TextTask,
)
from walkserve.api.schemas import ContentPart

AUDIO_FORMATS = ("wav", "mp3", "flac")
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp")
VIDEO_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/x-msvideo")
KIND_PARTS = {"audio": "audio (input_audio)", "image": "images (image_url)"}
KIND_PARTS["video"] = "video (video_url)"
DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),(.*)", re.DOTALL)
MARK = "\x00media{}\x00"  # never in a chat template; text holding "\x00media" is refused


@dataclass(frozen=True)
class Part:
    kind: str  # "audio", "image" or "video"
    data: bytes
    where: str  # the field named by a 400 about the data
    mark: str
    url: str | None = None  # an image or video to read (``MediaFetch.read``) instead of ``data``


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{where} is not base64", where) from None


def image_bytes(url: str, where: str) -> bytes:
    """The image of a data URL."""
    return data_url_bytes(url, where, IMAGE_TYPES)


def data_url_bytes(url: str, where: str, types: tuple[str, ...]) -> bytes:
    """The data of a base64 data URL of one of ``types``."""
    m = DATA_URL.fullmatch(url)
    if m is None:
        raise bad(f"{where}: not a data URL (data:{types[0]};base64,...)", where)
    mime, params = m.group(1).lower(), m.group(2).lower().split(";")
    if mime not in types:
        raise bad(f"{where}: a data URL of {mime or 'no type'!r}; send one of {types}", where)
    if "base64" not in params:
        raise bad(f"{where}: the data URL must be base64 (data:{mime};base64,...)", where)
    return _b64(m.group(3), where)


class MediaParts:
    """The media parts of one request, met in order by ``chatprompt.render``."""

    def __init__(
        self,
        task: ChatMediaTask,
        model: str,
        max_image_pixels: int,
        speaking: bool = False,
        fetch: MediaFetch | None = None,
    ) -> None:
        self.task, self.model, self.speaking = task, model, speaking
        self.max_image_pixels = max_image_pixels
        self.fetch = fetch or MediaFetch()
        self.parts: list[Part] = []

    def _walk(self, kind: str, where: str) -> MediaWalk:
        walk = getattr(self.task, kind)
        if walk is None:
            other = " and ".join(p for k, p in KIND_PARTS.items() if getattr(self.task, k))
            raise bad(
                f"{where}: model {self.model!r} takes no {kind} in chat; it takes {other}", where
            )
        if self.speaking and walk.speak_walk is None:
            raise bad(
                f"{where}: model {self.model!r} cannot answer {kind} with audio output", where
            )
        return walk

    def mark(self, part: ContentPart, where: str, role: str) -> str:
        if part.type == "video_url" and self.task.video is None:
            raise bad(
                f"{where}: model {self.model!r} takes no video (its walks read images and audio"
                " clips); send image_url or input_audio",
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
            found = self._url_part("image", part.image_url.url, f"{where}.image_url.url")
        elif part.type == "video_url":
            self._walk("video", where)
            found = self._url_part("video", part.video_url.url, f"{where}.video_url.url")
        else:  # text and refusal parts never reach the marks
            raise bad(f"{where}: unexpected content part {part.type!r}", where)
        found = dataclasses.replace(found, mark=MARK.format(len(self.parts)))
        self.parts.append(found)
        return found.mark

    def _url_part(self, kind: str, url: str, where: str) -> Part:
        if url[:5].lower() == "data:":
            types = IMAGE_TYPES if kind == "image" else VIDEO_TYPES
            return Part(kind, data_url_bytes(url, where, types), where, "")
        self.fetch.check(url, where, kind)
        return Part(kind, b"", where, "", url=url)

    def prompt(self, rendered: str, encode: Encode) -> tuple[str, dict[str, Any], list[int]]:
        """(the walk, the media walk inputs, the prompt ids) of the rendered prompt (which
        holds each part's mark once). CPU work: decodes the media; each kind's parts go to
        its walk's inputs together, in order."""
        if rendered.count("\x00media") != len(self.parts):
            raise bad("a text part holds the reserved text '\\x00media'", "messages")
        kinds = sorted({part.kind for part in self.parts})
        name = self._walk_name(kinds)  # before any decoding: a 400 for kinds that cannot mix
        inputs: dict[str, Any] = {}
        placeholders: dict[str, list[int]] = {}  # mark -> ids
        for kind in kinds:
            parts = [part for part in self.parts if part.kind == kind]
            walk = self._walk(kind, parts[0].where)
            decoded = [self._decode(part) for part in parts]
            try:
                found, ids = walk.inputs(decoded)
            except ValueError as e:
                where = parts[0].where if len(parts) == 1 else "messages"
                raise bad(f"{where}: {e}", where) from None
            inputs.update(found)
            placeholders.update(zip((part.mark for part in parts), ids))
        out, rest = [], rendered
        for part in self.parts:
            before, rest = rest.split(part.mark, 1)
            out += [*encode(before), *placeholders[part.mark]]
        out += encode(rest)
        return name, inputs, out

    def _decode(self, part: Part) -> Any:
        try:
            if part.kind == "audio":
                return audiocodec.decode(
                    part.data, self.task.sample_rate, self.task.max_audio_seconds
                )
            data = part.data if part.url is None else self.fetch.read(part.url, part.where)
            if part.kind == "video":
                return videocodec.decode(data, self.task.video_limits, self.task.video_frames)
            return media.image_to_uint8(imagecodec.decode(data, self.max_image_pixels))
        except ValueError as e:
            raise bad(f"{part.where}: {e}", part.where) from None

    def _walk_name(self, kinds: list[str]) -> str:
        if len(kinds) > 1 and "video" in kinds:
            raise bad(
                f"model {self.model!r} reads video parts alone: send no images or audio with them",
                "messages",
            )
        if len(kinds) == 1:
            walk = self._walk(kinds[0], "messages")
            return (walk.speak_walk if self.speaking else walk.walk) or ""
        name = self.task.mixed_speak_walk if self.speaking else self.task.mixed_walk
        if name is None:
            out = " with audio output" if self.speaking else ""
            raise bad(
                f"model {self.model!r} cannot take audio and images in one request{out}; send"
                " one kind",
                "messages",
            )
        return name


def media_text_task(task: TextTask, walk: str, inputs: dict[str, Any]) -> TextTask:
    """``task`` run by the media walk with the media inputs (no ext walk: logprobs, logit bias
    and grammars are 400s with media)."""
    return dataclasses.replace(
        task, walk=walk, ext_walk=None, extra_inputs={**task.extra_inputs, **inputs}
    )


def per_part(one: OneMedia) -> MediaInputs:
    """``MediaInputs`` of a processor that handles each part alone (images): each part's
    tensors concatenated along dimension 0, in order."""

    def inputs(parts: list[Any]) -> tuple[dict[str, Any], list[list[int]]]:
        joined: dict[str, Any] = {}
        ids = []
        for part in parts:
            found, part_ids = one(part)
            for key, value in found.items():
                joined[key] = torch.cat([joined[key], value]) if key in joined else value
            ids.append(part_ids)
        return joined, ids

    return inputs
