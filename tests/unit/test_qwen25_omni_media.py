"""Qwen2.5-Omni's thinker with audio and image input against the upstream model: the captured
``chat_media`` / ``chat_image`` / ``chat_audio`` walks (reference interpreter) equal upstream
``thinker.generate()`` (greedy) token for token on the inputs upstream's own
``Qwen2_5OmniProcessor`` makes of the same images and clips (several of each in one prompt);
the served profile makes those same inputs and placeholders, for chat and for
``/v1/audio/transcriptions`` (whose reply is upstream's greedy one); images move the rotary positions
(upstream's ``rope_deltas``), which the walks carry per request, so requests with different
media run together on the lowered, batched callables; a prompt whose placeholders do not
match its media is refused. The ``speak_*`` walks (``tiny_audible``: a waveform that is not
all but zero) equal upstream ``generate()`` in text, talker codes and waveform
(``upstream_speech``, its talker spared ``pixel_values``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from walkserve import capture
from walkserve.adapters import qwen25_omni as q
from walkserve.lowering.batched import BatchedRunner
from walkserve.lowering.callables import build_callables
from walkserve.lowering.lower import lower

pytest.importorskip("transformers")

IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"


@pytest.fixture(scope="module")
def tiny() -> tuple[q.Qwen25OmniWalks, capture.CapturedModel]:
    walks, sample = q.tiny()
    return walks, capture.trace(walks, sample)


@pytest.fixture(scope="module")
def processor() -> Any:
    return q.tiny_processor()


def picture(seed: int, width: int, height: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def clip(samples: int, period: float, gain: float = 0.3) -> np.ndarray:
    return (np.sin(np.arange(samples) / period) * gain).astype(np.float32)


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


# (user turn with media marks, images (seed, width, height), clips (samples, period), walk,
# max_new_tokens)
CASES = [
    (f"Hi{IMAGE}{AUDIO}what?", [(1, 30, 20)], [(12000, 11.0)], "chat_media", 10),
    (
        f"Hi{IMAGE}{AUDIO}and{IMAGE}{AUDIO}",
        [(2, 30, 20), (3, 40, 24)],
        [(12000, 11.0), (5000, 7.0)],
        "chat_media",
        9,
    ),
    (f"{AUDIO}x{AUDIO}", [], [(8000, 5.0), (30000, 13.0)], "chat_audio", 8),
    (f"{IMAGE}Describe.{IMAGE}", [(4, 64, 64), (5, 200, 90)], [], "chat_image", 8),
]


def processed(processor: Any, case: Any) -> dict[str, Any]:
    """The processor's inputs for a case (text, its images and clips), as a request of the
    case's walk."""
    user, images, clips, _, max_new = case
    out = processor(
        text=[chat(user)],
        images=[picture(*i) for i in images] or None,
        audio=[clip(*c) for c in clips] or None,
        return_tensors="pt",
    )
    return {k: v for k, v in out.items() if k != "attention_mask"} | {"max_new_tokens": max_new}


def upstream(walks: q.Qwen25OmniWalks, r: dict[str, Any]) -> list[int]:
    """Greedy upstream ``thinker.generate()`` on the request's inputs: its new tokens."""
    media = {k: r[k] for k in (*q.MEDIA_INPUTS, *q.VIDEO_INPUTS) if k in r}
    ids = r["input_ids"]
    out = walks.upstream.thinker.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **media,
        max_new_tokens=r["max_new_tokens"],
        eos_token_id=walks.eos,
        do_sample=False,
    )
    return out[0, ids.shape[1] :].tolist()


def reply(walks: q.Qwen25OmniWalks, out: dict[str, Any], max_new: int) -> list[int]:
    """The walk's reply as a client gets it: at most ``max_new`` tokens, up to its EOS."""
    tokens = [*out["first_token"][0], *out["second_token"][0], *out["text_tokens"][0]]
    tokens = [int(t) for t in tokens][:max_new]
    return tokens[: tokens.index(walks.eos) + 1] if walks.eos in tokens else tokens


@pytest.mark.parametrize("case", CASES, ids=[c[3] + str(i) for i, c in enumerate(CASES)])
def test_media_walks_equal_upstream_thinker_generate_on_the_processors_inputs(
    tiny: Any, processor: Any, case: Any
) -> None:
    walks, captured = tiny
    r = processed(processor, case)
    want = upstream(walks, r)
    got = captured.run(r, walk=case[3])
    assert reply(walks, got, r["max_new_tokens"]) == want
    assert len(want) > 2
    # The media are read: other pixels / another clip (same shapes) give another reply.
    other = {k: -v if k in ("pixel_values", "input_features") else v for k, v in r.items()}
    assert reply(walks, captured.run(other, walk=case[3]), r["max_new_tokens"]) != want


def test_images_move_the_positions_as_upstream_rope_deltas(tiny: Any, processor: Any) -> None:
    """The walk's ``rope`` is the prompt's largest position: upstream's ``rope_deltas`` (left
    on the module by ``generate()``) + the prompt's length - 1."""
    walks, _ = tiny
    deltas = set()
    for case in CASES[:2] + CASES[3:]:
        r = processed(processor, case)
        upstream(walks, r)
        mask = r.get("feature_attention_mask")
        _, rope = walks.thinker_positions(r["input_ids"], r["image_grid_thw"], mask)
        delta = walks.upstream.thinker.model.rope_deltas
        assert torch.equal(rope, delta + r["input_ids"].shape[1] - 1)
        deltas.add(int(delta))
    assert len(deltas) == 3 and 0 not in deltas


def test_the_profile_makes_the_processors_inputs(processor: Any) -> None:
    """The served media inputs (``with_qwen25_chat_media``): the features, masks, pixels,
    grids and placeholder ids upstream's processor makes of the same clips and images."""
    profile = q.tiny_profile("m")
    task = profile.chat_media
    assert task is not None and task.audio is not None and task.image is not None
    assert task.mixed_walk == "chat_media" and task.audio.speak_walk == "speak_audio"
    assert task.image.speak_walk == "speak_image" and task.mixed_speak_walk == "speak_media"
    assert task.max_audio_seconds == 30.0  # the extractor's chunk: upstream cuts longer clips
    _, images, clips, _, _ = CASES[1]
    audio, audio_ids = task.audio.inputs([torch.from_numpy(clip(*c)) for c in clips])
    pixels, image_ids = task.image.inputs([torch.from_numpy(picture(*i)) for i in images])
    text = chat("".join(f"{IMAGE}{AUDIO}" for _ in images))
    want = processor(
        text=[text],
        images=[picture(*i) for i in images],
        audio=[clip(*c) for c in clips],
        return_tensors="pt",
    )
    for key, value in {**audio, **pixels}.items():
        assert torch.equal(value, want[key]), key
    ids = profile.text.encode(chat("")) if profile.text else []
    user = [t for i, a in zip(image_ids, audio_ids) for t in (*i, *a)]
    assert [*ids[:3], *user, *ids[3:]] == want["input_ids"][0].tolist()


def test_the_transcription_inputs_are_the_processors_and_its_reply_upstreams(
    tiny: Any, processor: Any
) -> None:
    """``with_qwen25_transcription``: an uploaded clip becomes the input ids, features
    (padded to 30 s) and frame mask upstream's processor makes of the decoded clip in the
    same turn, and the ``chat_audio`` walk's reply on them is upstream ``generate()``'s."""
    from walkserve.adapters.omni_transcribe import instruction
    from walkserve.api import audiocodec
    from walkserve.api.routes.transcriptions import clip_inputs

    walks, captured = tiny
    task = q.tiny_profile("m").transcription
    assert task is not None and task.walk == "chat_audio" and task.max_audio_seconds == 30.0
    upload = audiocodec.encode(torch.from_numpy(clip(20000, 9.0)), "flac", 16000)
    inputs, ids, seconds = clip_inputs(task, upload, "de", "abc")
    assert seconds == pytest.approx(1.25)
    decoded = audiocodec.decode(upload, 16000, 30.0).numpy()
    want = processor(
        text=[chat(AUDIO + instruction("de", "abc"))], audio=[decoded], return_tensors="pt"
    )
    assert inputs["input_features"].shape[-1] == 3000  # padding="max_length", as upstream's
    for key in ("input_ids", "input_features", "feature_attention_mask"):
        assert torch.equal(inputs[key], want[key]), key
    assert ids == want["input_ids"][0].tolist()
    r = {k: v for k, v in want.items() if k != "attention_mask"} | {"max_new_tokens": 12}
    expected = upstream(walks, r)
    assert len(expected) > 2
    assert reply(walks, captured.run(r, walk=task.walk), 12) == expected


@pytest.mark.parametrize("index", [1, 2, 3], ids=["speak_media", "speak_audio", "speak_image"])
def test_speak_walks_equal_upstream_generate(processor: Any, index: int) -> None:
    """Audio out with media: the thinker's text, the talker's codes and token2wav's waveform
    (under the request's seed) equal upstream ``generate()``'s (greedy) on the processor's
    inputs."""
    walks, sample = q.tiny_audible()
    captured = capture.trace(walks, sample)
    case = CASES[index]
    walk = case[3].replace("chat_", "speak_")
    r = processed(processor, case) | {"max_audio_tokens": 30, "text_bos_id": q.TINY_SPEAKER_BOS}
    r["seed"] = 3
    talker, given = walks.upstream.talker, {}

    def record(*args: Any, **kwargs: Any) -> Any:
        given.update(kwargs)
        return type(talker).generate(talker, *args, **kwargs)

    talker.generate = record  # upstream_speech spies on it, then deletes it
    text, codes, waveform = q.upstream_speech(walks, r, seed=3, walk=walk)
    # The talker's prompt term (the greedy codes of the tiny talker do not show it): last
    # hidden state + input embedding, zero on the media's placeholder rows, as upstream's.
    media = {k: r[k] for k in q.MEDIA_INPUTS if k in r}
    with torch.no_grad():
        _, parts = walks._think(r["input_ids"], r["max_new_tokens"], media, (0.0, 1.0, 0, 0), True)
    assert parts is not None
    prompt = r["input_ids"].shape[1]
    torch.testing.assert_close(parts[0], given["inputs_embeds"][:, :prompt], rtol=0, atol=1e-5)
    got = captured.run(r, walk=walk)
    assert reply(walks, got, r["max_new_tokens"]) == text[0].tolist()
    assert torch.cat([got["first_code"], got["codes"]], 1).tolist() == codes.tolist()
    assert codes.shape[1] > 2 and waveform.abs().max() > 0.1
    assert torch.equal(got["waveform"].reshape(-1), waveform)


def test_requests_with_different_media_run_together(tiny: Any, processor: Any) -> None:
    """Lowered callables, all requests in lockstep: each request's reply equals upstream
    ``thinker.generate()`` on that request alone (image grids whose rotary offsets differ,
    clips of different lengths)."""
    walks, captured = tiny
    plan = lower(captured, captured.sample_inputs, check_capture=False)
    runner = BatchedRunner(captured, plan, build_callables(captured, plan))
    cases = [
        CASES[0],
        (f"{AUDIO}{IMAGE}ok", [(7, 48, 16)], [(20000, 3.0)], "chat_media", 12),
        CASES[1],
    ]
    requests = [processed(processor, c) for c in cases]
    calls, forwards = walks.thinker_lm.packing()
    outs = runner.run(requests, "chat_media")
    calls, forwards = (
        walks.thinker_lm.packing()[0] - calls,
        walks.thinker_lm.packing()[1] - forwards,
    )
    assert forwards < calls <= 3 * forwards  # the paged pool packs their steps
    for r, got in zip(requests, outs):
        assert reply(walks, got, r["max_new_tokens"]) == upstream(walks, r)


def test_placeholders_must_match_the_media(tiny: Any, processor: Any) -> None:
    walks, _ = tiny
    r = processed(processor, CASES[2])
    keys = ("input_ids", "input_features", "feature_attention_mask", "max_new_tokens")
    audio = {k: r[k] for k in keys}
    at = int((audio["input_ids"][0] == walks.audio_placeholders.audio_token).nonzero()[0])
    short = torch.cat([audio["input_ids"][:, :at], audio["input_ids"][:, at + 1 :]], dim=1)
    with pytest.raises(ValueError, match="audio placeholder tokens"):
        walks.chat_audio(**{**audio, "input_ids": short})
    with pytest.raises(ValueError, match="one feature row per clip"):
        one = {**audio, "feature_attention_mask": audio["feature_attention_mask"][:1]}
        walks.chat_audio(**{**one, "input_features": audio["input_features"][:1]})
    r = processed(processor, CASES[3])
    image = {k: r[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "max_new_tokens")}
    with pytest.raises(ValueError, match="patches"):
        walks.chat_image(**{**image, "pixel_values": image["pixel_values"][:-1]})


VIDEO = "<|vision_bos|><|VIDEO|><|vision_eos|>"


def frames(seed: int, count: int, width: int, height: int) -> np.ndarray:
    """A video's frames, already picked (the processor is called with them as the server's
    ``omni_video.pick_frames`` leaves them)."""
    shape = (count, height, width, 3)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def video_request(processor: Any, user: str, videos: list[np.ndarray], n: int) -> dict[str, Any]:
    out = processor(text=[chat(user)], videos=videos, return_tensors="pt")
    return {k: v for k, v in out.items() if k != "attention_mask"} | {"max_new_tokens": n}


VIDEO_CASES = [
    (f"Hi{VIDEO}what?", [(1, 4, 32, 24)], 10),
    (f"{VIDEO}and{VIDEO}", [(2, 6, 40, 40), (3, 3, 24, 16)], 9),  # odd: the last frame again
]


@pytest.mark.parametrize("case", VIDEO_CASES, ids=["one", "two"])
def test_the_video_walk_equals_upstream_thinker_generate(
    tiny: Any, processor: Any, case: Any
) -> None:
    """``chat_video`` on the processor's inputs (``pixel_values_videos``, ``video_grid_thw``,
    ``video_second_per_grid``) replies as upstream ``thinker.generate()`` (greedy) does; the
    pixels are read, and the videos move the positions as upstream's ``rope_deltas``."""
    walks, captured = tiny
    user, videos, n = case
    r = video_request(processor, user, [frames(*v) for v in videos], n)
    assert r["video_second_per_grid"].tolist() == [1.0] * len(videos)  # 2 frames at 2 fps
    want = upstream(walks, r)
    assert len(want) > 2
    assert reply(walks, captured.run(r, walk="chat_video"), n) == want
    _, rope = walks.video_positions(r["input_ids"], r["video_grid_thw"], r["video_second_per_grid"])
    delta = walks.upstream.thinker.model.rope_deltas
    assert torch.equal(rope, delta + r["input_ids"].shape[1] - 1) and int(delta) != 0
    other = r | {"pixel_values_videos": -r["pixel_values_videos"]}
    assert reply(walks, captured.run(other, walk="chat_video"), n) != want


def test_the_profile_makes_the_processors_video_inputs(processor: Any) -> None:
    """The served video inputs (``chat_video``, the frames ``pick_frames`` reads, no audio
    out): the pixels, grids, seconds and placeholders upstream's processor makes of them."""
    from walkserve.api.videocodec import Video

    task = q.tiny_profile("m").chat_media
    assert task is not None and task.video is not None
    assert task.video.walk == "chat_video" and task.video.speak_walk is None
    assert list(task.video_frames(6, 3.0)) == [0, 1, 3, 4]  # 2 s read at 2 frames a second
    videos = [frames(*v) for v in VIDEO_CASES[1][1]]
    parts = [Video(torch.from_numpy(v), 2.0, len(v), tuple(range(len(v)))) for v in videos]
    got, ids = task.video.inputs(parts)
    want = processor(text=[chat(VIDEO * 2)], videos=videos, return_tensors="pt")
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    text = q.tiny_profile("m").text
    assert text is not None
    prompt = text.encode(chat(""))
    assert [*prompt[:3], *ids[0], *ids[1], *prompt[3:]] == want["input_ids"][0].tolist()


def test_requests_with_different_videos_run_together(tiny: Any, processor: Any) -> None:
    walks, captured = tiny
    plan = lower(captured, captured.sample_inputs, check_capture=False)
    runner = BatchedRunner(captured, plan, build_callables(captured, plan))
    requests = [
        video_request(processor, u, [frames(*v) for v in vs], n) for u, vs, n in VIDEO_CASES
    ]
    for r, got in zip(requests, runner.run(requests, "chat_video")):
        assert reply(walks, got, r["max_new_tokens"]) == upstream(walks, r)


def test_video_placeholders_must_match_the_video(tiny: Any, processor: Any) -> None:
    walks, _ = tiny
    r = video_request(processor, VIDEO, [frames(1, 4, 32, 24)], 4)
    keys = ("pixel_values_videos", "video_grid_thw", "video_second_per_grid", "max_new_tokens")
    short = r["input_ids"][:, :-6]  # drops placeholders and the turn's end
    short = torch.cat([short[:, :-1], r["input_ids"][:, -5:]], dim=1)
    with pytest.raises(ValueError, match="video placeholder tokens"):
        walks.chat_video(short, **{k: r[k] for k in keys})
    with pytest.raises(ValueError, match="pixel_values_videos holds"):
        walks.chat_video(r["input_ids"], r["pixel_values_videos"][:-1], *[r[k] for k in keys[1:]])
