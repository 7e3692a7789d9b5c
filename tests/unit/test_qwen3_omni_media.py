"""Qwen3-Omni walks with audio and image input against the upstream model: the captured
``speak_audio`` / ``chat_audio`` and ``speak_image`` / ``chat_image`` walks (reference
interpreter) equal upstream ``generate()`` with the same ``input_features`` /
``feature_attention_mask`` or ``pixel_values`` / ``image_grid_thw`` token for token (thinker
text, talker codec frames; greedy), and the waveform equals upstream code2wav's
``chunked_decode`` of those codes with the walk's LeftContext sizes. Images move the rotary
positions (upstream keeps the offset on the thinker and talker modules, ``rope_deltas``); the
walks carry it per request instead, so requests of different audio lengths or image grids run
together on the lowered, batched callables (one dispatch per node over all requests,
interleaved as a worker interleaves them) without disturbing each other, and a text-only
request is right even while upstream's module attributes hold another request's offset. A
prompt whose placeholders do not match its media is refused. Videos (``chat_video``) equal
upstream ``thinker.generate()`` on upstream's processor's inputs (below)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from walkserve import capture
from walkserve.adapters import omni_video
from walkserve.adapters import qwen3_omni as q
from walkserve.lowering.batched import BatchedRunner
from walkserve.lowering.callables import build_callables
from walkserve.lowering.lower import lower

pytest.importorskip("transformers")

# (mel frames, masked padding frames, text after the audio, thinker max_new_tokens,
# max_audio_tokens). 150 and 230 frames span several of the encoder's 100-frame chunks; the
# talkers stop at codec EOS or max_audio_tokens at different lengths.
AUDIO = [
    (37, 0, [10, 11, 12, 13, 14], 16, 40),
    (64, 0, [44, 45], 16, 40),
    (150, 7, [120, 7, 99, 3], 12, 30),
    (230, 0, [150, 151, 152, 5, 6, 7], 9, 24),
]


# (patch grid h x w, text after the image, thinker max_new_tokens). The grids shift the rotary
# positions after the image by -18, -2 and 0 (upstream's rope_deltas).
IMAGES = [((8, 12), [10, 11], 12), ((4, 4), [44, 45, 46], 16), ((6, 2), [7], 10)]


@pytest.fixture(scope="module")
def tiny() -> tuple[q.Qwen3OmniWalks, capture.CapturedModel]:
    walks, sample = q.tiny()
    return walks, capture.trace(walks, sample)


def audio(walks: q.Qwen3OmniWalks, i: int) -> dict[str, Any]:
    frames, padding, user, max_new, max_audio = AUDIO[i]
    config = walks.upstream.config
    return {
        **q.audio_request(config, frames, user, padding=padding, seed=i),
        "max_new_tokens": max_new,
        "max_audio_tokens": max_audio,
        "speaker_id": config.talker_config.speaker_id["ethan"],
    }


def image(walks: q.Qwen3OmniWalks, i: int) -> dict[str, Any]:
    grid, user, max_new = IMAGES[i]
    return {
        **q.image_request(walks.upstream.config, grid, user, seed=i),
        "max_new_tokens": max_new,
        "max_audio_tokens": 30,
        "speaker_id": q.TINY_SPEAKER,
    }


def upstream_generate(
    walks: q.Qwen3OmniWalks, r: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upstream ``generate()``, greedy, with the request's media: (new text tokens, codes,
    waveform)."""
    return q.upstream_speech(walks, r)


def text_of(out: dict[str, Any]) -> torch.Tensor:
    return torch.cat([out["first_token"], out["text_tokens"]], dim=1)


def test_speak_audio_equals_upstream_generate_token_for_token(tiny: Any) -> None:
    walks, captured = tiny
    frames = set()
    for i in range(len(AUDIO)):
        r = audio(walks, i)
        text, codes, _ = upstream_generate(walks, r)
        got = captured.run(r, walk="speak_audio")
        assert torch.equal(text_of(got), text), i
        assert torch.equal(got["codes"], codes), i
        want = walks.code2wav.chunked_decode(
            codes, chunk_size=q.TINY_CHUNK, left_context_size=q.TINY_CONTEXT
        )
        assert torch.equal(got["waveform"], want), i
        frames.add(codes.shape[-1])
        # The audio matters: the same prompt without its features (placeholders read as text
        # by the text walk) gives other tokens or codes.
        plain = captured.run({k: v for k, v in r.items() if "feature" not in k}, walk="speak")
        assert not (torch.equal(text_of(plain), text) and torch.equal(plain["codes"], codes))
    assert len(frames) > 2  # talkers of different lengths


def test_chat_audio_equals_upstream_thinker_generate(tiny: Any) -> None:
    walks, captured = tiny
    for i in range(len(AUDIO)):
        r = audio(walks, i)
        want = walks.upstream.thinker.generate(
            r["input_ids"],
            input_features=r["input_features"],
            feature_attention_mask=r["feature_attention_mask"],
            max_new_tokens=r["max_new_tokens"],
            eos_token_id=walks.eos,
            do_sample=False,
        )
        keys = ("input_ids", "input_features", "feature_attention_mask", "max_new_tokens")
        got = captured.run({k: r[k] for k in keys}, walk="chat_audio")
        assert torch.equal(text_of(got), want[:, r["input_ids"].shape[1] :]), i


def test_talker_prompt_uses_the_hidden_projection_at_audio_positions(tiny: Any) -> None:
    """The talker's user part at audio placeholders is ``hidden_projection`` of the thinker's
    ``accept_hidden_layer`` states there, elsewhere ``text_projection`` of the embeddings."""
    walks, _ = tiny
    r = audio(walks, 1)
    ids = r["input_ids"]
    out = walks.thinker(
        input_ids=ids,
        input_features=r["input_features"],
        feature_attention_mask=r["feature_attention_mask"],
        output_hidden_states=True,
    )
    hidden = out.hidden_states[walks.upstream.config.talker_config.accept_hidden_layer]
    first = out.logits[:, -1:].argmax(-1)
    prompt = walks.talker_prompt(ids, first, q.TINY_SPEAKER, hidden)  # [1, U + 9, D]
    user = ids[0, : ids.shape[1] - 3]  # the user turn: all but the assistant header
    assert prompt.shape[1] == user.shape[0] + 9
    talker = walks.upstream.talker
    at = (user == walks.upstream.config.thinker_config.audio_token_id).nonzero().flatten()
    assert len(at) == int(q.audio_token_count(AUDIO[1][0], 50)) > 0
    want_audio = talker.hidden_projection(hidden[0, at])
    torch.testing.assert_close(prompt[0, at], want_audio, rtol=1e-6, atol=1e-6)
    text_at = (user != walks.upstream.config.thinker_config.audio_token_id).nonzero().flatten()
    embeds = walks.thinker.get_input_embeddings()(user[text_at])
    torch.testing.assert_close(
        prompt[0, text_at], talker.text_projection(embeds), rtol=1e-6, atol=1e-6
    )


def test_speak_image_equals_upstream_generate_token_for_token(tiny: Any) -> None:
    walks, captured = tiny
    frames, deltas = set(), set()
    for i in range(len(IMAGES)):
        r = image(walks, i)
        text, codes, _ = upstream_generate(walks, r)
        got = captured.run(r, walk="speak_image")
        assert torch.equal(text_of(got), text), i
        assert torch.equal(got["codes"], codes), i
        want = walks.code2wav.chunked_decode(
            codes, chunk_size=q.TINY_CHUNK, left_context_size=q.TINY_CONTEXT
        )
        assert torch.equal(got["waveform"], want), i
        frames.add(codes.shape[-1])
        # The walk's carried offsets are upstream's rope_deltas (left on the modules by the
        # generate() above): rope = (last text position, last multimodal position).
        for positions, upstream in (
            (walks.thinker_positions, walks.upstream.thinker.model),
            (walks.talker_positions, walks.upstream.talker),
        ):
            _, rope = positions(r["input_ids"], r["image_grid_thw"])
            assert torch.equal(rope[:, 1:] - rope[:, :1], upstream.rope_deltas.to(rope.dtype))
        deltas.add(float(walks.upstream.thinker.model.rope_deltas))
    assert len(frames) > 1 and len(deltas) == 3


def test_chat_image_equals_upstream_thinker_generate(tiny: Any) -> None:
    walks, captured = tiny
    for i in range(len(IMAGES)):
        r = image(walks, i)
        want = walks.upstream.thinker.generate(
            r["input_ids"],
            pixel_values=r["pixel_values"],
            image_grid_thw=r["image_grid_thw"],
            max_new_tokens=r["max_new_tokens"],
            eos_token_id=walks.eos,
            do_sample=False,
        )
        keys = ("input_ids", "pixel_values", "image_grid_thw", "max_new_tokens")
        got = captured.run({k: r[k] for k in keys}, walk="chat_image")
        assert torch.equal(text_of(got), want[:, r["input_ids"].shape[1] :]), i


@pytest.mark.parametrize("kind", ["audio", "image"])
def test_requests_of_different_media_run_together(tiny: Any, kind: str) -> None:
    """Lowered callables, all requests in lockstep (prefills, then decode steps of every
    request interleaved): each request's tokens, codes and waveform equal upstream
    ``generate()`` on that request alone (audio clips of different lengths; images whose
    rotary offsets differ)."""
    walks, captured = tiny
    sample = captured.sample_inputs
    plan = lower(captured, sample, check_capture=False)
    runner = BatchedRunner(captured, plan, build_callables(captured, plan))
    if kind == "audio":
        requests = [audio(walks, i) for i in (2, 0, 3)]
    else:
        requests = [image(walks, i) for i in (0, 1, 2)]
    decoders = (walks.thinker_lm, walks.talker_lm, walks.predictor_lm)
    before = [d.packing() for d in decoders]
    outs = runner.run(requests, f"speak_{kind}")
    for d, (calls, forwards) in zip(decoders, before):  # the paged pool packs their steps
        calls, forwards = d.packing()[0] - calls, d.packing()[1] - forwards
        assert forwards < calls <= 3 * forwards, (type(d).__name__, calls, forwards)
    for r, got in zip(requests, outs):
        text, codes, _ = upstream_generate(walks, r)
        assert torch.equal(text_of(got), text)
        assert torch.equal(got["codes"], codes)
        want = walks.code2wav.chunked_decode(
            codes, chunk_size=q.TINY_CHUNK, left_context_size=q.TINY_CONTEXT
        )
        torch.testing.assert_close(got["waveform"], want, rtol=0, atol=1e-5 * want.abs().max())


def test_text_only_request_still_works(tiny: Any) -> None:
    """Also while upstream's modules hold an image request's rotary offset (as a worker's
    would, were the walks reading it): the walks read no position state off the modules."""
    walks, captured = tiny
    config = walks.upstream.config
    r = {
        "input_ids": q.chat_prompt(config, [120, 7, 99, 3]),
        "max_new_tokens": 12,
        "max_audio_tokens": 24,
        "speaker_id": q.TINY_SPEAKER,
    }
    text, codes, _ = upstream_generate(walks, r)
    captured.run(audio(walks, 0), walk="speak_audio")  # an audio request before it
    upstream_generate(walks, image(walks, 0))  # leaves rope_deltas = -18 on the modules
    assert float(walks.upstream.thinker.model.rope_deltas) == -18
    assert float(walks.upstream.talker.rope_deltas) == -18
    got = captured.run(r, walk="speak")
    assert torch.equal(text_of(got), text)
    assert torch.equal(got["codes"], codes)


def test_placeholder_count_must_match_the_features(tiny: Any) -> None:
    walks, _ = tiny
    r = audio(walks, 0)
    short = {**r, "input_ids": torch.cat([r["input_ids"][:, :3], r["input_ids"][:, 4:]], dim=1)}
    with pytest.raises(ValueError, match="audio placeholder tokens"):
        walks.speak_audio(**short)
    two = {**r, "feature_attention_mask": r["feature_attention_mask"].repeat(2, 1)}
    with pytest.raises(ValueError, match="one feature row per clip"):
        walks.chat_audio(
            **{
                k: two[k]
                for k in ("input_ids", "input_features", "feature_attention_mask", "max_new_tokens")
            }
        )


def test_image_placeholders_must_match_the_grid(tiny: Any) -> None:
    walks, _ = tiny
    r = image(walks, 1)
    keys = ("input_ids", "pixel_values", "image_grid_thw", "max_new_tokens")
    short = {k: r[k] for k in keys}
    short["input_ids"] = torch.cat([r["input_ids"][:, :3], r["input_ids"][:, 4:]], dim=1)
    with pytest.raises(ValueError, match="image placeholder tokens"):
        walks.chat_image(**short)
    with pytest.raises(ValueError, match="patches"):
        walks.chat_image(**{**short, "pixel_values": r["pixel_values"][:-1]})


def mixed(
    walks: q.Qwen3OmniWalks, grids: list[tuple[int, int]], clips: list[int]
) -> dict[str, Any]:
    """A prompt with images and audio clips in one user turn, interleaved (image, clip, image,
    ...), laid out as upstream's processor does; the clips padded to the longest as its
    feature extractor pads a batch."""
    config = walks.upstream.config
    thinker = config.thinker_config
    user: list[int] = []
    pixels, grid_rows, features, masks = [], [], [], []
    longest = max(clips) if clips else 0
    for i in range(max(len(grids), len(clips))):
        if i < len(grids):
            r = q.image_request(config, grids[i], seed=10 + i)
            h, w = grids[i]
            count = h * w // thinker.vision_config.spatial_merge_size**2
            user += [thinker.vision_start_token_id, *[thinker.image_token_id] * count]
            user += [thinker.vision_end_token_id]
            pixels.append(r["pixel_values"])
            grid_rows.append(r["image_grid_thw"])
        if i < len(clips):
            a = q.audio_request(config, clips[i], padding=longest - clips[i], seed=20 + i)
            count = int(q.audio_token_count(clips[i], thinker.audio_config.n_window))
            user += [thinker.audio_start_token_id, *[thinker.audio_token_id] * count]
            user += [thinker.audio_end_token_id]
            features.append(a["input_features"])
            masks.append(a["feature_attention_mask"])
    user += [44, 45, 46]
    return {
        "input_ids": q.chat_prompt(config, user),
        "input_features": torch.cat(features),
        "feature_attention_mask": torch.cat(masks),
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.cat(grid_rows),
        "max_new_tokens": 10,
        "max_audio_tokens": 30,
        "speaker_id": q.TINY_SPEAKER,
    }


MIXED = [([(4, 4)], [64]), ([(8, 12), (6, 2)], [150, 37])]


@pytest.mark.parametrize("grids, clips", MIXED)
def test_chat_media_with_images_and_clips_equals_upstream_generate(
    tiny: Any, grids: list[tuple[int, int]], clips: list[int]
) -> None:
    """Images and audio clips in one prompt: the thinker's text (``chat_media``) equals
    upstream ``thinker.generate()`` on the same inputs (its rotary positions count the clips
    too)."""
    walks, captured = tiny
    r = mixed(walks, grids, clips)
    media = {k: r[k] for k in q.MEDIA_INPUTS}
    want = walks.upstream.thinker.generate(
        r["input_ids"],
        **media,
        max_new_tokens=r["max_new_tokens"],
        eos_token_id=walks.eos,
        do_sample=False,
    )
    keys = ("input_ids", *q.MEDIA_INPUTS, "max_new_tokens")
    got = captured.run({k: r[k] for k in keys}, walk="chat_media")
    assert torch.equal(text_of(got), want[:, r["input_ids"].shape[1] :])


# ---------------------------------------------------------------- videos (``chat_video``)
# The captured walk (reference interpreter, and the lowered callables with requests of
# different videos together) replies as upstream ``thinker.generate()`` (greedy) does on the
# inputs upstream's ``Qwen3OmniMoeProcessor`` makes of the same frames (its video processor
# torch's twin of upstream's, ``omni_video.TorchVideoProcessor``, where torchvision does not
# import): the vision tower's and DeepStack features at the video placeholders, the positions
# of upstream ``get_rope_index`` (``video_second_per_grid`` 2: the processor's 1 fps).

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def processor() -> Any:
    """Upstream's processor over the tiny ids (``test_chat_media.upstream_processor``) with
    the tiny profile's video processor."""
    from test_chat_media import upstream_processor

    from walkserve.adapters import omni_chatmedia
    from walkserve.adapters.omni_transcribe import tiny_extractor

    thinker = q.tiny_config().thinker_config
    extractor = tiny_extractor(int(thinker.audio_config.num_mel_bins))
    images = omni_chatmedia.tiny_image_processor(thinker.vision_config)
    with pytest.MonkeyPatch.context() as patch:
        out = upstream_processor(patch, images, extractor)
    settings = omni_video.tiny_video_settings(thinker.vision_config, omni_video.TINY_VIDEO_PIXELS)
    out.video_processor = omni_video.upstream_video_processor(
        settings
    ) or omni_video.TorchVideoProcessor(settings)
    return out


def frames(seed: int, count: int, width: int, height: int) -> np.ndarray:
    shape = (count, height, width, 3)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


CASES = [
    (f"Hi{VIDEO}what?", [(1, 4, 32, 24)], 10),
    (f"{VIDEO}and{VIDEO}", [(2, 6, 40, 40), (3, 3, 24, 16)], 9),
]


def request(processor: Any, case: Any) -> dict[str, Any]:
    user, videos, n = case
    text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    out = processor(text=[text], videos=[frames(*v) for v in videos], return_tensors="pt")
    return {k: v for k, v in out.items() if k != "attention_mask"} | {"max_new_tokens": n}


def upstream(walks: q.Qwen3OmniWalks, r: dict[str, Any]) -> torch.Tensor:
    """Upstream ``thinker.generate()`` (greedy) on the request's videos: its new tokens [1, n]
    (as ``test_qwen3_omni_media`` compares the image walks)."""
    videos = {k: r[k] for k in ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")}
    n, eos, ids = r["max_new_tokens"], walks.eos, r["input_ids"]
    want = walks.upstream.thinker.generate(
        ids, **videos, max_new_tokens=n, eos_token_id=eos, do_sample=False
    )
    return want[:, ids.shape[1] :]


@pytest.mark.parametrize("case", CASES, ids=["one", "two"])
def test_the_video_walk_equals_upstream_thinker_generate(
    tiny: Any, processor: Any, case: Any
) -> None:
    walks, captured = tiny
    r = request(processor, case)
    assert r["video_second_per_grid"].tolist() == [2.0] * len(case[1])  # 1 fps
    want = upstream(walks, r)
    assert want.shape[1] > 2
    assert torch.equal(text_of(captured.run(r, walk="chat_video")), want)
    _, rope = walks.video_positions(r["input_ids"], r["video_grid_thw"], r["video_second_per_grid"])
    delta = walks.upstream.thinker.model.rope_deltas
    assert torch.equal(rope[:, 1:], delta + r["input_ids"].shape[1] - 1) and int(delta) != 0
    other = r | {"pixel_values_videos": -r["pixel_values_videos"]}
    assert not torch.equal(text_of(captured.run(other, walk="chat_video")), want)


def test_the_profile_makes_the_processors_video_inputs(processor: Any) -> None:
    from walkserve.api.videocodec import Video

    task = q.tiny_profile("m").chat_media
    assert task is not None and task.video is not None and task.video.speak_walk is None
    assert list(task.video_frames(30, 3.0)) == list(range(0, 30, 3))  # 10 s at 1 frame a second
    videos = [frames(*v) for v in CASES[1][1]]
    parts = [Video(torch.from_numpy(v), 2.0, len(v), tuple(range(len(v)))) for v in videos]
    got, ids = task.video.inputs(parts)
    r = request(processor, (VIDEO * 2, CASES[1][1], 1))
    for key, value in got.items():
        assert torch.equal(value, r[key]), key
    flat = r["input_ids"][0].tolist()
    start = flat.index(ids[0][0])
    assert flat[start : start + len(ids[0]) + len(ids[1])] == [*ids[0], *ids[1]]


def test_requests_with_different_videos_run_together(tiny: Any, processor: Any) -> None:
    walks, captured = tiny
    plan = lower(captured, captured.sample_inputs, check_capture=False)
    runner = BatchedRunner(captured, plan, build_callables(captured, plan))
    requests = [request(processor, case) for case in CASES]
    for r, got in zip(requests, runner.run(requests, "chat_video")):
        assert torch.equal(text_of(got), upstream(walks, r))
