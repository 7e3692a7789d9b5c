"""Media parts of chat messages (``api.chatmedia``): where each part's ids go in the rendered
prompt, how parts are joined to text, what is refused and which field the 400 names; and the
Qwen3-Omni inputs (``adapters.omni_chatmedia``): placeholders as many as the walks' own checks
want, made by upstream's image processor and Whisper extractor."""

from __future__ import annotations

import base64
import dataclasses
import io
from typing import Any

import pytest
import torch

from walkserve.api import audiocodec, chatmedia, chatprompt
from walkserve.api.errors import ApiError
from walkserve.api.profile import ChatMediaTask, MediaWalk, ModelProfile, TextTask, plain_chat
from walkserve.api.schemas import ChatMessage


def encode(text: str) -> list[int]:
    return list(text.encode())


TASK = TextTask(
    walk="chat",
    prompt_input="ids",
    max_tokens_input="n",
    tokens_channel="tokens",
    first_token_output=None,
    eos_id=None,
    vocab_size=1000,
    max_prompt_tokens=100,
    max_tokens_limit=8,
    default_max_tokens=4,
    encode=encode,
    decode=lambda ids: bytes(ids).decode(),
    chat_template=plain_chat,
)


def fake_walk(name: str, mark: int) -> MediaWalk:
    def inputs(values: list[torch.Tensor]) -> tuple[dict[str, Any], list[list[int]]]:
        shapes = [tuple(value.shape) for value in values]
        return {f"{name}_shape": shapes[0] if len(shapes) == 1 else shapes}, [
            [mark + 2 * i, mark + 2 * i + 1] for i in range(len(values))
        ]

    return MediaWalk(name, inputs, speak_walk=f"speak_{name}")


MEDIA = ChatMediaTask(audio=fake_walk("audio", 900), image=fake_walk("image", 800), max_parts=2)


def png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (3, 2), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def messages(*content: Any, role: str = "user") -> list[ChatMessage]:
    return [ChatMessage.model_validate({"role": role, "content": list(content)})]


def build(msgs: list[ChatMessage], task: ChatMediaTask = MEDIA) -> tuple[str, dict, list[int]]:
    parts = chatmedia.MediaParts(task, "m", 1 << 20)
    rendered = chatprompt.render(TASK, msgs, None, "m", parts.mark)
    return parts.prompt(rendered, encode)


def test_the_part_ids_go_where_the_part_is() -> None:
    walk, inputs, ids = build(
        messages(
            {"type": "text", "text": "a"},
            image_part(data_url(png())),
            {"type": "text", "text": "b"},
        )
    )
    assert walk == "image" and inputs == {"image_shape": (2, 3, 3)}  # [H, W, 3] uint8
    assert ids == [*encode("user: a"), 800, 801, *encode("b\nassistant:")]


def test_text_parts_keep_their_new_lines_and_text_only_is_unchanged() -> None:
    msgs = messages({"type": "text", "text": "a"}, {"type": "text", "text": "b"})
    assert chatprompt.render(TASK, msgs, None, "m") == "user: a\nb\nassistant:"
    parts = chatmedia.MediaParts(MEDIA, "m", 1 << 20)
    assert chatprompt.render(TASK, msgs, None, "m", parts.mark) == "user: a\nb\nassistant:"
    assert parts.parts == []


def test_an_audio_clip_is_decoded_at_the_task_rate() -> None:
    wav = audiocodec.encode(torch.zeros(8000), "wav", 8000)  # 1 s at 8 kHz
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "WAV"},
    }
    walk, inputs, ids = build(messages(part))
    assert walk == "audio" and inputs == {"audio_shape": (16000,)}
    assert ids == [*encode("user: "), 900, 901, *encode("\nassistant:")]


def test_speaking_picks_the_speak_walk() -> None:
    parts = chatmedia.MediaParts(MEDIA, "m", 1 << 20, speaking=True)
    rendered = chatprompt.render(TASK, messages(image_part(data_url(png()))), None, "m", parts.mark)
    assert parts.prompt(rendered, encode)[0] == "speak_image"


def test_audio_and_images_in_one_request_run_the_mixed_walk() -> None:
    wav = audiocodec.encode(torch.zeros(800), "wav", 16000)
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode()}}
    audio["input_audio"]["format"] = "wav"
    image = image_part(data_url(png()))
    msgs = messages(image, {"type": "text", "text": "a"}, audio, image)
    with pytest.raises(ApiError, match="cannot take audio and images in one request"):
        build(msgs, dataclasses.replace(MEDIA, max_parts=3))
    task = dataclasses.replace(MEDIA, max_parts=3, mixed_walk="both")
    walk, inputs, ids = build(msgs, task)
    assert walk == "both"
    assert inputs == {"image_shape": [(2, 3, 3), (2, 3, 3)], "audio_shape": (800,)}
    want = [*encode("user: "), 800, 801, *encode("a"), 900, 901, 802, 803]
    assert ids == [*want, *encode("\nassistant:")]  # each part's ids where it is
    speaking = chatmedia.MediaParts(task, "m", 1 << 20, speaking=True)
    rendered = chatprompt.render(TASK, msgs, None, "m", speaking.mark)
    with pytest.raises(ApiError, match="in one request with audio output"):
        speaking.prompt(rendered, encode)


@pytest.mark.parametrize(
    ("part", "match", "param"),
    [
        (image_part("http://x/y.png"), "remote image URLs are not enabled", ".image_url.url"),
        (image_part("file:///y.png"), "other than data URLs", ".image_url.url"),
        (image_part("data:image/png,abc"), "must be base64", ".image_url.url"),
        (image_part("data:text/plain;base64,AAAA"), "'text/plain'", ".image_url.url"),
        (image_part("data:image/png;base64,@@"), "not base64", ".image_url.url"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "takes no video", ""),
        ({"type": "file", "file": {"file_id": "f"}}, "file parts", ""),
        (
            {"type": "input_audio", "input_audio": {"data": "", "format": "aac"}},
            "'aac'",
            ".input_audio.format",
        ),
    ],
)
def test_refusals_name_the_field(part: Any, match: str, param: str) -> None:
    with pytest.raises(ApiError, match=match) as info:
        build(messages(part))
    assert info.value.param == f"messages[0].content[0]{param}"


def test_limits_kind_and_role() -> None:
    image = image_part(data_url(png()))
    one = ChatMediaTask(image=MEDIA.image)
    with pytest.raises(ApiError, match="at most 1 media part") as info:
        build(messages(image, image), one)
    assert info.value.param == "messages[0].content[1]"
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    with pytest.raises(ApiError, match="takes no audio in chat"):
        build(messages(audio), one)
    with pytest.raises(ApiError, match="go in user messages"):
        build(messages(image, role="system"))
    with pytest.raises(ApiError, match=r"corrupt or truncated|not a PNG") as info:
        build(messages(image_part(data_url(png()[:30]))))
    assert info.value.param == "messages[0].content[0].image_url.url"
    with pytest.raises(ApiError, match="reserved text"):
        build(messages({"type": "text", "text": "\x00media7\x00"}, image))


def video_part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def test_videos_are_decoded_to_the_picked_frames_and_go_alone() -> None:
    """A ``video_url`` data URL: PyAV's frames, those the task's picker chose, to the video
    walk; its ids where the part is. Videos with images or with audio output are 400s."""
    from walkserve.api import videocodec

    def inputs(videos: list[Any]) -> tuple[dict[str, Any], list[list[int]]]:
        found = [(v.indices, tuple(v.frames.shape), v.fps) for v in videos]
        return {"videos": found}, [[700 + i] for i in range(len(videos))]

    task = dataclasses.replace(
        MEDIA,
        max_parts=3,
        video=MediaWalk("video", inputs),
        video_frames=lambda total, fps: range(0, total, 2),
    )
    frames = torch.zeros(5, 16, 24, 3, dtype=torch.uint8)
    mp4 = data_url(videocodec.encode(frames, 5), "video/mp4")
    walk, got, ids = build(
        messages(video_part(mp4), {"type": "text", "text": "b"}, video_part(mp4)), task
    )
    assert walk == "video" and got == {"videos": [((0, 2, 4), (3, 16, 24, 3), 5.0)] * 2}
    assert ids == [*encode("user: "), 700, *encode("b"), 701, *encode("\nassistant:")]
    with pytest.raises(ApiError, match="reads video parts alone") as info:
        build(messages(video_part(mp4), image_part(data_url(png()))), task)
    assert info.value.param == "messages"
    with pytest.raises(ApiError, match="cannot answer video with audio output"):
        parts = chatmedia.MediaParts(task, "m", 1 << 20, speaking=True)
        chatprompt.render(TASK, messages(video_part(mp4)), None, "m", parts.mark)
    for url, match in [
        (data_url(b"garbage" * 9, "video/mp4"), "not a video that can be read"),
        (data_url(png()), "a data URL of 'image/png'"),
        ("http://x/y.mp4", "remote video URLs are not enabled"),
    ]:
        with pytest.raises(ApiError, match=match) as info:
            build(messages(video_part(url)), task)
        assert info.value.param == "messages[0].content[0].video_url.url"
    no_video = ChatMediaTask(image=MEDIA.image)  # a model without video keeps its 400
    with pytest.raises(ApiError, match="takes no video") as info:
        build(messages(video_part(mp4)), no_video)
    assert info.value.param == "messages[0].content[0]"


def test_a_video_file_is_read_where_the_deployer_allows(tmp_path: Any) -> None:
    from walkserve.api import videocodec
    from walkserve.api.mediafetch import MediaFetch

    def inputs(videos: list[Any]) -> tuple[dict[str, Any], list[list[int]]]:
        return {"frames": [v.total_frames for v in videos]}, [[700]]

    task = dataclasses.replace(MEDIA, video=MediaWalk("video", inputs))
    path = tmp_path / "clip.webm"
    path.write_bytes(
        videocodec.encode(torch.zeros(3, 8, 8, 3, dtype=torch.uint8), 3, "webm", "libvpx")
    )
    parts = chatmedia.MediaParts(task, "m", 1 << 20, fetch=MediaFetch(local_dir=str(tmp_path)))
    rendered = chatprompt.render(
        TASK, messages(video_part(f"file://{path}")), None, "m", parts.mark
    )
    assert parts.prompt(rendered, encode)[:2] == ("video", {"frames": [3]})
    with pytest.raises(ApiError, match="video URLs other than data URLs"):
        build(messages(video_part(f"file://{path}")), task)


def test_qwen3_inputs_satisfy_the_walks_placeholder_checks() -> None:
    from walkserve.adapters import omni_chatmedia, qwen3_omni
    from walkserve.adapters.omni_transcribe import tiny_extractor, whisper_features

    config = qwen3_omni.tiny_config()
    thinker = config.thinker_config
    extractor = tiny_extractor(int(thinker.audio_config.num_mel_bins))
    images = omni_chatmedia.tiny_image_processor(thinker.vision_config)
    profile = omni_chatmedia.with_qwen3_chat_media(
        ModelProfile("omni", text=TASK), config, extractor, images, 30.0
    )
    task = profile.chat_media
    assert task is not None and task.image is not None and task.audio is not None
    image = torch.randint(0, 256, (20, 30, 3), dtype=torch.uint8)
    inputs, [ids] = task.image.inputs([image])
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8]]  # 16 x 32 pixels: 4 x 8 patches of 4
    assert ids == [
        thinker.vision_start_token_id,
        *[thinker.image_token_id] * 8,
        thinker.vision_end_token_id,
    ]
    check = qwen3_omni.ImagePlaceholders(thinker.image_token_id, 2)
    check(torch.tensor([ids]), inputs["pixel_values"], inputs["image_grid_thw"])
    clip = torch.sin(torch.arange(8000) / 5.0)
    inputs, [ids] = task.audio.inputs([clip])
    qwen3_omni.AudioPlaceholders(thinker.audio_token_id, 50)(
        torch.tensor([ids]), inputs["feature_attention_mask"]
    )
    assert ids[0] == thinker.audio_start_token_id and ids[-1] == thinker.audio_end_token_id
    want, _ = whisper_features(extractor)(clip)  # one clip: as the transcriptions route
    assert torch.equal(inputs["input_features"], want)


def upstream_processor(monkeypatch: pytest.MonkeyPatch, images: Any, extractor: Any) -> Any:
    """Upstream's ``Qwen3OmniMoeProcessor`` over the tiny config's ids: a character tokenizer
    whose special tokens (and the role words) have the tiny config's ids, as
    ``TinyChatTokenizer`` encodes them; no video processor (its class needs torchvision)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3OmniMoeProcessor
    from transformers.processing_utils import ProcessorMixin

    special = {"<|im_start|>": 250, "<|im_end|>": 251, "user": 246, "assistant": 247}
    special |= {"<|audio_start|>": 243, "<|audio_pad|>": 240, "<|audio_end|>": 238}
    special |= {"<|vision_start|>": 244, "<|image_pad|>": 241, "<|vision_end|>": 239}
    special |= {"<|video_pad|>": 242}
    vocab = {chr(i): i for i in range(1, 128)} | {"[UNK]": 0} | special
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens([AddedToken(k, special=True) for k in special])
    names = dict(image_token="<|image_pad|>", audio_token="<|audio_pad|>")
    names |= dict(video_token="<|video_pad|>", vision_bos_token="<|vision_start|>")
    names |= dict(vision_eos_token="<|vision_end|>", audio_bos_token="<|audio_start|>")
    names |= dict(audio_eos_token="<|audio_end|>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, extra_special_tokens=names)
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None)
    return Qwen3OmniMoeProcessor(
        image_processor=images, video_processor=None, feature_extractor=extractor, tokenizer=fast
    )


def test_qwen3_chat_media_equals_upstreams_processor(monkeypatch: pytest.MonkeyPatch) -> None:
    from walkserve.adapters import omni_chatmedia, omni_http, qwen3_omni
    from walkserve.adapters.omni_transcribe import tiny_extractor

    config = qwen3_omni.tiny_config()
    thinker = config.thinker_config
    extractor = tiny_extractor(int(thinker.audio_config.num_mel_bins))
    images = omni_chatmedia.tiny_image_processor(thinker.vision_config)
    tiny = omni_http.TinyChatTokenizer(qwen3_omni.qwen3_chat_ids(config), 238)
    text = dataclasses.replace(TASK, encode=tiny.encode, chat_template=omni_http.chatml)
    profile = omni_chatmedia.with_qwen3_chat_media(
        ModelProfile("omni", text=text), config, extractor, images, 30.0
    )
    assert profile.chat_media is not None
    upstream = upstream_processor(monkeypatch, images, extractor)
    g = torch.Generator().manual_seed(3)
    image = torch.randint(0, 256, (50, 70, 3), dtype=torch.uint8, generator=g)
    clip = torch.sin(torch.arange(12000) / 11.0) * 0.3
    wav = audiocodec.encode(clip, "wav", 16000)
    cases = [
        (
            image_part(data_url(png_of(image))),
            "<|vision_start|><|image_pad|><|vision_end|>",
            {"images": [image.numpy()]},
        ),
        (
            {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
            },
            "<|audio_start|><|audio_pad|><|audio_end|>",
            {"audio": [audiocodec.decode(wav, 16000, 30.0).numpy()]},
        ),
    ]
    for part, tag, media in cases:
        msgs = messages({"type": "text", "text": "Hi"}, part, {"type": "text", "text": "what?"})
        parts = chatmedia.MediaParts(profile.chat_media, "omni", 1 << 20)
        rendered = chatprompt.render(text, msgs, None, "omni", parts.mark)
        _, inputs, ids = parts.prompt(rendered, tiny.encode)
        prompt = omni_http.chatml([("user", f"Hi{tag}what?")])
        want = upstream(text=[prompt], return_tensors="pt", **media)
        assert ids == want["input_ids"][0].tolist()
        assert inputs.keys() == want.keys() - {"input_ids", "attention_mask"}
        for name, value in inputs.items():
            assert torch.equal(value, want[name]), name
    # Two images and two clips of different lengths in one message: one call of each upstream
    # processor for all of them (the clips padded to the longest), ids where the parts are.
    other = torch.randint(0, 256, (30, 20, 3), dtype=torch.uint8, generator=g)
    short = audiocodec.encode(clip[:5000], "flac", 16000)
    content = [{"type": "text", "text": "Hi"}, cases[0][0], cases[1][0]]
    content += [{"type": "text", "text": "and"}, image_part(data_url(png_of(other)))]
    content += [{"type": "input_audio", "input_audio": {"data": base64.b64encode(short).decode()}}]
    content[-1]["input_audio"]["format"] = "flac"
    content += [{"type": "text", "text": "what?"}]
    parts = chatmedia.MediaParts(profile.chat_media, "omni", 1 << 20)
    rendered = chatprompt.render(text, messages(*content), None, "omni", parts.mark)
    walk, inputs, ids = parts.prompt(rendered, tiny.encode)
    assert walk == "chat_media"
    tags = cases[0][1] + cases[1][1]
    prompt = omni_http.chatml([("user", f"Hi{tags}and{tags}what?")])
    clips = [audiocodec.decode(data, 16000, 30.0).numpy() for data in (wav, short)]
    want = upstream(
        text=[prompt], images=[image.numpy(), other.numpy()], audio=clips, return_tensors="pt"
    )
    assert ids == want["input_ids"][0].tolist()
    assert inputs.keys() == want.keys() - {"input_ids", "attention_mask"}
    for name, value in inputs.items():
        assert torch.equal(value, want[name]), name
    assert inputs["feature_attention_mask"].shape[0] == 2
    assert inputs["image_grid_thw"].shape[0] == 2


def png_of(image: torch.Tensor) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image.numpy(), "RGB").save(out, format="PNG")
    return out.getvalue()
