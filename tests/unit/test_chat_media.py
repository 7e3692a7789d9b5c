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
    def inputs(value: torch.Tensor) -> tuple[dict[str, Any], list[int]]:
        return {f"{name}_shape": tuple(value.shape)}, [mark, mark + 1]

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


def test_qwen3_inputs_satisfy_the_walks_placeholder_checks() -> None:
    from walkserve.adapters import omni_chatmedia, qwen3_omni
    from walkserve.adapters.omni_transcribe import tiny_extractor

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
    inputs, ids = task.image.inputs(image)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8]]  # 16 x 32 pixels: 4 x 8 patches of 4
    assert ids == [
        thinker.vision_start_token_id,
        *[thinker.image_token_id] * 8,
        thinker.vision_end_token_id,
    ]
    check = qwen3_omni.ImagePlaceholders(thinker.image_token_id, 2)
    check(torch.tensor([ids]), inputs["pixel_values"], inputs["image_grid_thw"])
    clip = torch.sin(torch.arange(8000) / 5.0)
    inputs, ids = task.audio.inputs(clip)
    qwen3_omni.AudioPlaceholders(thinker.audio_token_id, 50)(
        torch.tensor([ids]), inputs["feature_attention_mask"]
    )
    assert ids[0] == thinker.audio_start_token_id and ids[-1] == thinker.audio_end_token_id
    want, _ = omni_chatmedia.whisper_features(extractor)(clip)
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


def png_of(image: torch.Tensor) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image.numpy(), "RGB").save(out, format="PNG")
    return out.getvalue()
