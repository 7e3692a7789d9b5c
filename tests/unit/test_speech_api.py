"""The speech and chat-audio HTTP pieces that need no server: voices (resolution, per-model
tables), the Omni profiles (prompts equal the adapters' own prompt builders, walk names exist
in the captured walks), streaming viability (against the load generator's own rule), the
metrics gauge, and the conductor sending a walk's finished outputs before its stream items."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from benchmarks.loadgen import Record
from walkserve import capture
from walkserve.adapters import omni_http, orpheus, qwen3_omni, qwen25_omni
from walkserve.adapters.orpheus_tiny import TINY_TOKENS
from walkserve.adapters.orpheus_tokens import orpheus_prompt
from walkserve.adapters.registry import profile_for
from walkserve.api import audio
from walkserve.api.metrics import Metrics, PlaybackClock, read_metric
from walkserve.api.profile import ModelProfile, Voice, Voices
from walkserve.api.textgen import TextAssembler, reply_tokens
from walkserve.lowering.lower import lower
from walkserve.runtime.conductor import ConductorStats, Output, StreamItem
from walkserve.runtime.local import run_local

QWEN3 = "walkserve.adapters.qwen3_omni:tiny"


@pytest.fixture(scope="module")
def qwen3_profile() -> ModelProfile:
    return profile_for(QWEN3)


# ---------------------------------------------------------------- voices


def test_voices_resolve_by_name_ignoring_case_and_name_the_choices() -> None:
    voices = Voices(
        {"ethan": Voice({"speaker_id": 7}), "Chelsie": Voice({"speaker_id": 8})}, "ethan"
    )
    assert voices.resolve("Chelsie").inputs == {"speaker_id": 8}
    assert voices.resolve("chelsie").inputs == {"speaker_id": 8}
    assert voices.resolve("ETHAN").inputs == {"speaker_id": 7}
    assert voices.resolve(None).inputs == {"speaker_id": 7}  # the default
    with pytest.raises(ValueError, match=r"unknown voice 'alloy'.*\['Chelsie', 'ethan'\]"):
        voices.resolve("alloy")
    no_default = Voices({"tara": Voice(prefix="tara: ")})
    assert no_default.resolve(None) == Voice()
    with pytest.raises(ValueError, match="default voice 'x'"):
        Voices({"tara": Voice()}, "x")
    with pytest.raises(ValueError, match="at least one voice"):
        Voices({})


def test_request_voice_forms() -> None:
    voices = Voices({"tara": Voice(prefix="tara: ")})
    assert audio.resolve_voice(voices, {"id": "tara"}).prefix == "tara: "
    assert audio.resolve_voice(None, "alloy") == Voice()  # a model with one voice takes any
    with pytest.raises(ValueError, match="voice must be a name"):
        audio.resolve_voice(voices, {"name": "tara"})
    assert audio.chat_audio_format("pcm16") == "pcm16"
    with pytest.raises(ValueError, match=r"'mp3' is not supported.*\['wav', 'pcm16'\]"):
        audio.chat_audio_format("mp3")


def test_orpheus_voices_prefix_the_prompt_text() -> None:
    profile = profile_for("walkserve.adapters.orpheus:tiny")
    assert profile.speech is not None and profile.speech.voices is not None
    voices = profile.speech.voices
    assert voices.names == sorted(orpheus.ORPHEUS_VOICES) and voices.default is None
    leo = voices.resolve("leo")
    want = orpheus_prompt(list(b"leo: Hi"), TINY_TOKENS)
    assert profile.speech.encode(leo.prefix + "Hi") == want and leo.inputs == {}


# ---------------------------------------------------------------- Omni profiles


def test_tiny_chat_tokenizer_writes_the_adapters_prompt() -> None:
    config = qwen3_omni.tiny_config()
    tok = omni_http.TinyChatTokenizer(qwen3_omni.qwen3_chat_ids(config), 238)
    ids = tok.encode(omni_http.chatml([("user", "Hi!")]))
    # ChatML has a newline after the role: the user part is "\nHi!"
    assert torch.equal(torch.tensor([ids]), qwen3_omni.chat_prompt(config, list(b"\nHi!"), 10))
    system = tok.encode(omni_http.chatml([("developer", "be")]))
    assert system[:2] == [config.im_start_token_id, config.system_token_id]
    assert tok.encode("\ue000") == [ord("?"), 0x80, 0x80]  # lead byte 0xEE: a special id
    assert tok.decode([72, 105, 250, 239]) == "Hi"


def test_qwen3_tiny_profile_maps_routes_onto_existing_walks(qwen3_profile: ModelProfile) -> None:
    p = qwen3_profile
    assert p.text is not None and p.speech is not None and p.chat_audio is not None
    model, sample = qwen3_omni.tiny()
    captured = capture.trace(model, sample)
    walks = captured.graph.walks
    for walk, names in [
        (p.text.walk, [p.text.prompt_input, p.text.max_tokens_input, *p.text.extra_inputs]),
        (p.speech.walk, [p.speech.prompt_input, p.speech.max_tokens_input, "speaker_id"]),
        (p.chat_audio.walk, [p.chat_audio.max_tokens_input, *p.chat_audio.extra_inputs]),
    ]:
        assert set(names) <= {i.name for i in walks[walk].inputs}, walk
    assert {*p.text.leads, p.text.tokens_channel} <= set(walks["chat"].outputs)
    ca = p.chat_audio
    assert {*ca.leads, ca.transcript_channel, ca.waveform_channel} <= set(walks["speak"].outputs)
    assert p.text.eos_id == model.eos
    config = qwen3_omni.tiny_config()
    assert p.speech.voices is not None and p.speech.voices.names == ["chelsie", "ethan"]
    assert p.speech.voices.resolve("Chelsie").inputs == {
        "speaker_id": config.talker_config.speaker_id["chelsie"]
    }
    text = omni_http.READ_ALOUD.format(text="Hi")
    want = qwen3_omni.chat_prompt(config, list(b"\n" + text.encode()), qwen3_omni.TINY_NEWLINE)
    assert torch.equal(torch.tensor([p.speech.encode("Hi")]), want)
    assert p.speech.extra_inputs == {"max_new_tokens": omni_http.TINY_LIMITS.read_aloud_tokens}


def test_qwen25_tiny_profile() -> None:
    p = profile_for("walkserve.adapters.qwen25_omni:tiny")
    assert p.text is not None and p.chat_audio is not None and p.speech is not None
    assert p.text.leads == ("first_token", "second_token")
    assert p.text.extra_inputs == {"max_audio_tokens": 1, "text_bos_id": 250}
    assert p.speech.voices is not None
    assert p.speech.voices.resolve("chelsie").inputs == {
        "text_bos_id": qwen25_omni.TINY_SPEAKER_BOS
    }
    assert p.speech.voices.names == ["Chelsie", "Ethan"] and p.text.sampling
    ids = p.text.encode(p.text.chat_template([("user", "ab")]))
    want = qwen3_omni.chat_prompt(qwen25_omni._Ids(), list(b"\nab"), 10)
    assert torch.equal(torch.tensor([ids]), want)


def test_profiles_without_their_checkpoint_say_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QWEN3_OMNI_DIR", raising=False)
    with pytest.raises(ValueError, match="QWEN3_OMNI_DIR"):
        profile_for("walkserve.adapters.qwen3_omni:from_env")
    with pytest.raises(ValueError, match="chat_audio needs a text task"):
        ModelProfile("x", chat_audio=profile_for(QWEN3).chat_audio)


def test_reply_tokens_put_the_leads_first() -> None:
    outputs = {"a": torch.tensor([[5]]), "b": torch.tensor([[6]]), "ch": torch.tensor([[7, 8]])}
    assert list(reply_tokens(("a", "b"), "ch", outputs)) == [5, 6, 7, 8]
    assert list(reply_tokens(("a", "missing"), "none", outputs)) == [5]


def test_transcript_leads_streams_and_completes(qwen3_profile: ModelProfile) -> None:
    """Tokens arrive as lead outputs then streamed items; EOS ends the text; at the end the
    outputs fill in what the stream did not carry, whatever was streamed."""
    task = qwen3_profile.text
    assert task is not None and task.eos_id is not None
    ids = [72, 101, 108, 108, 111, task.eos_id, 33]  # "Hello", EOS, "!"
    final = {"first_token": torch.tensor([ids[:1]]), "text_tokens": torch.tensor([ids[1:]])}
    streamed = audio.Transcript(TextAssembler(task, [], 16), ["first_token"], "text_tokens")
    parts = [streamed.stream(torch.tensor([[t]]), final) for t in ids[1:4]]
    parts.append(streamed.finish(final))
    assert "".join(parts) == "Hello" and streamed.text.finish_reason == "stop"
    for k in range(len(ids)):  # cut anywhere: the same text
        t = audio.Transcript(TextAssembler(task, [], 16), ["first_token"], "text_tokens")
        text = "".join(t.stream(torch.tensor([[x]]), final) for x in ids[1 : 1 + k])
        assert text + t.finish(final) == "Hello"
    short = audio.Transcript(TextAssembler(task, [], 3), ["first_token"], "text_tokens")
    assert short.finish(final) == "Hel" and short.text.finish_reason == "length"


# ---------------------------------------------------------------- streaming viability


def loadgen_viability(times: list[float], seconds: list[float]) -> float | None:
    record = Record(0, "speech", "/v1/audio/speech", 1, None)
    record.chunk_times, record.chunk_seconds = times, seconds
    return record.viability


def test_playback_clock_agrees_with_the_load_generator() -> None:
    rng = random.Random(3)
    for n in itertools.chain(range(1, 6), [20] * 30):
        seconds = [rng.uniform(0.01, 0.3) for _ in range(n)]
        gaps = [rng.uniform(0.0, 0.4) for _ in range(n)]
        times = list(itertools.accumulate(gaps, initial=rng.uniform(0, 2)))[1:]
        clock = PlaybackClock()
        for t, s in zip(times, seconds):
            clock.arrive(t, s)
        assert clock.judged == n - 1
        want = loadgen_viability(times, seconds)
        got = clock.on_time / clock.judged if clock.judged else 1.0
        assert want is not None and got == pytest.approx(want)


def test_playback_clock_by_hand() -> None:
    clock = PlaybackClock()
    # 1 s of audio at t=10, then chunks at 10.9 (on time), 12.5 (late: 2 s played by 12.0),
    # 12.9 (on time: 3 s played by 13.0); an empty chunk is not judged.
    for t, s in [(10.0, 1.0), (10.9, 1.0), (12.5, 1.0), (12.7, 0.0), (12.9, 1.0)]:
        clock.arrive(t, s)
    assert (clock.on_time, clock.judged) == (2, 3)


def test_metrics_render_the_viability_gauge() -> None:
    metrics = Metrics()
    stats = ConductorStats(0, 0, 0, 0, 0, 0, {})
    assert read_metric(metrics.render(0, None, stats), "walkserve:streaming_viability") == 1.0
    for arrivals in ([(0.0, 1.0), (0.5, 1.0), (5.0, 1.0)], [(0.0, 0.1), (0.05, 0.1)]):
        clock = PlaybackClock()
        for t, s in arrivals:
            clock.arrive(t, s)
        metrics.observe_playback(clock)
    text = metrics.render(0, None, stats)
    assert read_metric(text, "walkserve:streaming_viability") == pytest.approx(2 / 3)
    assert read_metric(text, "walkserve:audio_chunks_judged_total") == 3


# ---------------------------------------------------------------- conductor


def test_finished_outputs_are_sent_before_the_stream_items() -> None:
    """The chat walk's first token (from the prefill) is an ``Output`` event before the
    decode loop's first ``StreamItem``, so a streaming client can send it first; at the end
    every output is there once, equal to the reference interpreter's."""
    model, sample = qwen3_omni.tiny()
    captured = capture.trace(model, sample)
    plan = lower(captured, sample, check_capture=False)
    inputs = {"input_ids": sample["input_ids"], "max_new_tokens": 6}
    result = run_local(captured, plan, {"r": inputs}, walks="chat")
    events = [e for e in result.events if isinstance(e, Output | StreamItem)]
    first_item = next(i for i, e in enumerate(events) if isinstance(e, StreamItem))
    assert any(isinstance(e, Output) and e.name == "first_token" for e in events[:first_item])
    names = [e.name for e in events if isinstance(e, Output)]
    assert sorted(names) == ["first_token", "text_tokens"]
    want = captured.run(inputs, walk="chat")
    for name, value in want.items():
        assert torch.equal(result.outputs["r"][name], value), name


def fake_checkpoint(path: Path, template: str | None) -> None:
    """A Qwen3-Omni checkpoint directory without weights: the tiny config and a character
    tokenizer with the chat-format tokens at the config's ids (enough for its profile)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    qwen3_omni.tiny_config().save_pretrained(path)
    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10, "<unk>": 0}
    vocab |= {"<|im_start|>": 250, "<|im_end|>": 251, "system": 245}
    vocab |= {"user": 246, "assistant": 247}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), "<|im_end|>"])
    tok.add_tokens([AddedToken(w) for w in ("system", "user", "assistant")])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    if template is not None:
        (path / "chat_template.jinja").write_text(template)


TEMPLATE = (
    "<|im_start|>system\nBe brief<|im_end|>\n{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\\n' }}"
)  # as Qwen's templates write the header (jinja drops a template's last newline)


@pytest.mark.parametrize(
    "template, system",
    [(None, False), (TEMPLATE, True), (TEMPLATE + "<think>", False)],
    ids=["no-template", "its-template", "template-without-the-header"],
)
def test_checkpoint_profile_uses_its_tokenizer_and_template(
    tmp_path: Path, template: str | None, system: bool
) -> None:
    """The checkpoint's template when it ends with the assistant header the talker needs,
    else ChatML; ids from its own tokenizer, equal to the adapter's prompt builder."""
    fake_checkpoint(tmp_path, template)
    p = profile_for(str(tmp_path))  # dispatched by model_type
    assert p.text is not None and p.speech is not None and p.chat_audio is not None
    config = qwen3_omni.tiny_config()
    ids = p.text.encode(p.text.chat_template([("user", "Hi")]))
    want = qwen3_omni.chat_prompt(config, list(b"\nHi"), 10)[0].tolist()
    head = [250, 245, *b"\nBe brief", 251, 10] if system else []
    assert ids == head + want
    assert p.text.decode([72, 105, 251]) == "Hi" and p.text.eos_id == config.im_end_token_id
    assert p.speech.voices is not None and p.speech.voices.default == "ethan"
    assert p.transcription is None  # no preprocessor_config.json: no feature extractor


def test_checkpoint_profile_transcribes_with_its_feature_extractor(tmp_path: Path) -> None:
    """With the checkpoint's ``preprocessor_config.json``, transcription over ``chat_audio``:
    its Whisper extractor, the prompt laid out as upstream's processor expands the clip."""
    from transformers import WhisperFeatureExtractor

    from walkserve.adapters.omni_transcribe import instruction

    fake_checkpoint(tmp_path, None)
    WhisperFeatureExtractor(feature_size=16).save_pretrained(tmp_path)
    task = profile_for(str(tmp_path)).transcription
    assert task is not None and task.walk == "chat_audio" and task.sample_rate == 16000
    features, mask = task.features(torch.zeros(8000))  # 0.5 s
    assert features.shape == (1, 16, 50) and mask.dtype == torch.int64 and int(mask.sum()) == 50
    config = qwen3_omni.tiny_config()
    thinker = config.thinker_config
    n = int(qwen3_omni.audio_token_count(50, thinker.audio_config.n_window))
    clip = [thinker.audio_start_token_id, *[thinker.audio_token_id] * n, thinker.audio_end_token_id]
    said = list(instruction("fr", "bonjour").encode())
    want = qwen3_omni.chat_prompt(config, [10, *clip, *said], 10)[0].tolist()
    assert task.prompt(50, "fr", "bonjour") == want


def test_checkpoint_chat_media_with_its_preprocessors(tmp_path: Path) -> None:
    """Chat takes audio with the checkpoint's feature extractor, images with the image
    processor fields of the same ``preprocessor_config.json`` (as Qwen3-Omni's holds both)."""
    import json

    from transformers import WhisperFeatureExtractor

    from walkserve.adapters.omni_chatmedia import tiny_image_processor

    fake_checkpoint(tmp_path, None)
    WhisperFeatureExtractor(feature_size=16).save_pretrained(tmp_path)
    media = profile_for(str(tmp_path)).chat_media
    assert media is not None and media.audio is not None and media.image is None
    vision = qwen3_omni.tiny_config().thinker_config.vision_config
    file = tmp_path / "preprocessor_config.json"
    both = json.loads(file.read_text()) | tiny_image_processor(vision).to_dict()
    file.write_text(json.dumps(both))
    media = profile_for(str(tmp_path)).chat_media
    assert media is not None and media.audio is not None and media.image is not None
    inputs, ids = media.image.inputs([torch.zeros(16, 24, 3, dtype=torch.uint8)])  # one part
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]] and [len(i) for i in ids] == [2 + 6]
    # Videos: the vision tower's sizes, the processor's frame sizes, read at its 1 fps.
    assert media.video is not None and media.video.walk == "chat_video"
    assert list(media.video_frames(30, 3.0)) == list(range(0, 30, 3))
    file.write_text(json.dumps(both | {"patch_size": 14}))
    with pytest.raises(ValueError, match="not the vision tower's"):
        profile_for(str(tmp_path))


def test_built_in_names_find_the_profiles() -> None:
    """``walkserve serve --model tiny-qwen3-omni`` (a registry name) gets the same routes."""
    for name in ("tiny-qwen3-omni", "tiny-qwen25-omni", "tiny-orpheus"):
        p = profile_for(name)
        assert p.name == name and p.speech is not None and p.speech.voices is not None
    assert profile_for("tiny-orpheus").chat_audio is None
    assert profile_for("tiny-qwen25-omni").chat_audio is not None
