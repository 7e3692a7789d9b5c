"""The Orpheus adapter against the upstream models, in process: the captured ``speak`` walk
(reference interpreter) against ``LlamaForCausalLM.generate(do_sample=False)`` and
``snac.SNAC.decode``; the ``decode`` walk against ``snac.decode`` on all codes; the streamed
waveform against the relation its ``SlidingWindow(28, 7)`` policy implies."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from walkserve import capture
from walkserve.adapters import orpheus
from walkserve.adapters.orpheus_tiny import TINY_TOKENS
from walkserve.adapters.orpheus_tokens import (
    FRAME,
    ORPHEUS_TOKENS,
    OrpheusTokens,
    audio_frames,
    orpheus_prompt,
)

T = TINY_TOKENS


@pytest.fixture(scope="module")
def tiny() -> tuple[orpheus.OrpheusTTS, dict[str, Any], capture.CapturedModel]:
    model, sample = orpheus.tiny()
    return model, sample, capture.trace(model, sample)


def prompt(n_text: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 256, (n_text,), generator=g).tolist()
    return torch.tensor([orpheus_prompt(text, T)])  # [1, P]


REFERENCES: dict[int, Any] = {}


def upstream_tokens(model: orpheus.OrpheusTTS, ids: torch.Tensor, n: int, eos: int) -> list[int]:
    """Upstream ``generate(do_sample=False)`` on a copy of the model's LM (on SDPA attention:
    the model's own LM attends through the paged pool)."""
    if id(model) not in REFERENCES:
        REFERENCES[id(model)] = (model, orpheus.reference_lm(model))
    out = REFERENCES[id(model)][1].generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return [int(t) for t in out[0, ids.shape[1] :]]


def orpheus_levels(frames: list[list[int]], tokens: OrpheusTokens) -> list[torch.Tensor]:
    """Orpheus's frame layout written out per frame, independently of the adapter."""
    l0: list[int] = []
    l1: list[int] = []
    l2: list[int] = []
    for f in frames:
        c = [t - tokens.audio_offset - k * tokens.codebook for k, t in enumerate(f)]
        l0.append(c[0])
        l1 += [c[1], c[4]]
        l2 += [c[2], c[3], c[5], c[6]]
    return [torch.tensor([x]) for x in (l0, l1, l2)]


@pytest.mark.parametrize(("n_text", "max_new", "seed"), [(5, 42, 0), (2, 30, 1), (9, 57, 2)])
def test_speak_tokens_equal_generate(tiny: Any, n_text: int, max_new: int, seed: int) -> None:
    model, _, captured = tiny
    ids = prompt(n_text, seed)
    out = captured.run({"input_ids": ids, "max_new_tokens": max_new}, walk="speak")
    want = upstream_tokens(model, ids, max_new, T.end_of_speech)
    assert out["tokens"].tolist() == [want]
    # The steered tiny LM emits well-formed frames (the adapter's decode would silence others).
    assert all(
        T.audio_offset + (i % FRAME) * T.codebook
        <= t
        < T.audio_offset + (i % FRAME + 1) * T.codebook
        for i, t in enumerate(want)
    )
    assert out["waveform"].dtype == torch.float32


def test_speak_stops_at_end_of_speech(tiny: Any) -> None:
    """A copy of the LM whose end_of_speech output row is token ``x``'s plus a small margin on
    the frame-position channel that selects ``x``'s range: greedy decoding then ends where
    ``x`` first appears (mid-frame), in the walk as in ``generate``; the window holding
    end_of_speech is silent."""
    model, _, _ = tiny
    ids = prompt(4, 3)
    free = upstream_tokens(model, ids, 45, eos=T.end_of_speech)
    assert len(free) == 45
    cut = next(i for i in range(30, 45) if free.index(free[i]) == i)
    lm = copy.deepcopy(model.upstream_lm)
    head = lm.get_output_embeddings().weight
    with torch.no_grad():
        head[T.end_of_speech] = head[free[cut]]
        head[T.end_of_speech, (cut - 1) % FRAME] += 0.01
    stopped = orpheus.OrpheusTTS(lm, model.codec.snac, T).eval()
    captured = capture.trace(stopped, orpheus.sample_inputs(T, 40))
    out = captured.run({"input_ids": ids, "max_new_tokens": 45}, walk="speak")
    want = [*free[:cut], T.end_of_speech]
    assert out["tokens"].tolist() == [upstream_tokens(stopped, ids, 45, T.end_of_speech)] == [want]
    s = model.samples_per_frame
    wav = out["waveform"][0]
    full = 1 + (cut + 1 - 28) // FRAME  # full windows of the cut + 1 tokens
    for i in range(full):  # a window holding end_of_speech is silent, the others are not
        silent = torch.equal(wav[i * s : (i + 1) * s], torch.zeros(s))
        assert silent == (7 * i + 28 > cut), i
    assert torch.equal(wav[full * s :], torch.zeros(wav.shape[0] - full * s))


def test_decode_walk_equals_snac_decode_on_all_codes(tiny: Any) -> None:
    model, _, captured = tiny
    ids = prompt(6, 4)
    generated = upstream_tokens(model, ids, 60, T.end_of_speech)
    frames = audio_frames(generated, T)  # [1, F, 7]
    assert frames.shape[1] == 60 // FRAME
    wav = captured.run({"frames": frames}, walk="decode")["waveform"]
    with torch.no_grad():
        want = model.codec.snac.decode(orpheus_levels(frames[0].tolist(), T))  # [1, 1, F * S]
    assert torch.equal(wav, want[:, 0])


def test_folded_weight_norm_decodes_as_upstream_snac(tmp_path: Any) -> None:
    """``fold_weight_norm`` stores each weight-normalized weight once: the decode of a SNAC
    that recomputes them per call (upstream, untouched) is reproduced bit for bit, also by a
    SNAC that ``load_snac`` reads from a checkpoint in upstream's layout."""
    import json

    from safetensors.torch import save_file
    from snac import SNAC

    config = {
        "sampling_rate": 24000,
        "encoder_dim": 8,
        "encoder_rates": [2, 4, 4],
        "decoder_dim": 64,
        "decoder_rates": [4, 4, 2],
        "attn_window_size": None,
        "codebook_size": T.codebook,
        "codebook_dim": 4,
        "vq_strides": [4, 2, 1],
        "noise": False,
        "depthwise": True,
    }

    def upstream() -> Any:
        torch.manual_seed(3)
        return SNAC(**config).eval()

    reference, folded = upstream(), orpheus.fold_weight_norm(upstream())
    assert any(".parametrizations." in k for k in reference.state_dict())
    assert not any(".parametrizations." in k for k in folded.state_dict())
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in reference.state_dict().items()},
        str(tmp_path / "model.safetensors"),
    )
    loaded = orpheus.load_snac(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    frames = [torch.randint(0, T.codebook, (2, 5 * n), generator=g) for n in (1, 2, 4)]
    with torch.no_grad():
        want = reference.decode(frames)
        assert torch.equal(folded.decode(frames), want)
        assert torch.equal(loaded.decode(frames), want)


def test_streamed_waveform_is_each_windows_second_frame(tiny: Any) -> None:
    """SlidingWindow(28, 7), end=pad: window i holds tokens [7i, 7i + 28) and gives samples
    [iS, (i+1)S) of the waveform, equal to snac.decode(window i)[S:2S]; a window with a token
    that is not an audio code of its position (here the -1 padding) gives S zeros."""
    model, _, captured = tiny
    ids = prompt(3, 5)
    n = 45  # 6 frames + 3 tokens: windows 0..2 full, window 3 is [21, 45) padded
    out = captured.run({"input_ids": ids, "max_new_tokens": n}, walk="speak")
    tokens = out["tokens"][0].tolist()
    s = model.samples_per_frame
    wav = out["waveform"][0]
    full = 1 + (n - 28) // 7
    assert wav.shape == ((full + 1) * s,)
    for i in range(full):
        window = tokens[7 * i : 7 * i + 28]
        with torch.no_grad():
            decoded = model.codec.snac.decode(
                orpheus_levels([window[k : k + 7] for k in range(0, 28, 7)], T)
            )[0, 0]  # [4S]
        assert torch.equal(wav[i * s : (i + 1) * s], decoded[s : 2 * s]), i
    assert torch.equal(wav[full * s :], torch.zeros(s))
    # Distinct windows really were decoded (not one repeated chunk).
    chunks = wav[: full * s].reshape(full, s)
    assert not torch.equal(chunks[0], chunks[1])


def test_short_request_gives_one_silent_chunk(tiny: Any) -> None:
    model, _, captured = tiny
    out = captured.run({"input_ids": prompt(2, 6), "max_new_tokens": 10}, walk="speak")
    assert out["tokens"].shape == (1, 10)
    assert torch.equal(out["waveform"], torch.zeros(1, model.samples_per_frame))


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="outside the audio token range"):
        OrpheusTokens(**{**T.__dict__, "end_of_speech": T.audio_offset + 3})
    model, _ = orpheus.tiny()
    with pytest.raises(ValueError, match="does not hold the audio tokens"):
        orpheus.OrpheusTTS(model.upstream_lm, model.codec.snac, ORPHEUS_TOKENS)


def test_load_orpheus_round_trips_local_checkpoints(tmp_path: Any, tiny: Any) -> None:
    """``save_pretrained`` LM + SNAC config.json/safetensors -> the same tokens and audio."""
    import json

    from safetensors.torch import save_file

    model, _, _ = tiny
    model.upstream_lm.save_pretrained(tmp_path / "lm")
    snac = model.codec.snac
    (tmp_path / "snac").mkdir()
    config = {
        "sampling_rate": 24000,
        "encoder_dim": snac.encoder_dim,
        "encoder_rates": list(snac.encoder_rates),
        "decoder_dim": snac.decoder_dim,
        "decoder_rates": list(snac.decoder_rates),
        "attn_window_size": None,
        "codebook_size": snac.codebook_size,
        "codebook_dim": snac.codebook_dim,
        "vq_strides": [4, 2, 1],
        "noise": False,
        "depthwise": True,
    }
    (tmp_path / "snac" / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in snac.state_dict().items()},
        str(tmp_path / "snac" / "model.safetensors"),
    )
    loaded, _ = orpheus.load_orpheus(str(tmp_path / "lm"), str(tmp_path / "snac"), T)
    for k, v in model.upstream_lm.state_dict().items():
        assert torch.equal(loaded.upstream_lm.state_dict()[k], v), k
    ids = prompt(3, 7)
    want = model.speak(ids, 35)
    got = loaded.speak(ids, 35)
    assert torch.equal(got["tokens"], want["tokens"])
    assert torch.equal(got["waveform"], want["waveform"])
    with pytest.raises(ValueError, match="is not a SNAC config"):
        orpheus.load_snac(str(tmp_path / "lm"))
    with pytest.raises(ValueError, match=r"has no config\.json"):
        orpheus.load_snac(str(tmp_path))


def test_factory_profiles() -> None:
    """``profile_for("module:factory")`` asks ``factory_profile``; none means walks only."""
    from walkserve.adapters.registry import profile_for

    profile = profile_for("walkserve.adapters.orpheus:tiny")
    assert profile.speech is not None and profile.text is None and profile.image is None
    assert profile.speech.encode("Hi") == orpheus_prompt([72, 105], T)
    assert (profile.speech.walk, profile.speech.waveform_channel) == ("speak", "waveform")
    assert profile.speech.sample_rate == 24000 and profile.speech.vocab_size == T.vocab_end
    bare = profile_for("walkserve.adapters.hf_causal_lm:load_causal_lm")
    assert (bare.text, bare.speech, bare.image) == (None, None, None)
    # an unknown module: no tasks here (serving it fails later, saying why)
    assert profile_for("walkserve.adapters.no_such_module:tiny").speech is None
