"""Qwen2.5-Omni walks against the upstream model: the captured walk (reference interpreter)
equals upstream ``generate()`` token for token (thinker text, talker codec tokens), for talkers
that stop at codec EOS, at ``max_audio_tokens``, and before the text ends; upstream token2wav
on the walk's codes gives ``generate()``'s waveform (same seed: its DiT starts from noise), and
so does the walk's own token2wav stage under the request's ``seed``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from walkserve import capture
from walkserve.adapters import qwen25_omni as q
from walkserve.adapters.qwen3_omni import chat_prompt

pytest.importorskip("transformers")

REQUESTS = [([10, 11, 12, 13], 12, 30), ([5, 6, 7], 10, 30), ([44, 45], 20, 15), ([120, 7], 8, 40)]


@pytest.fixture(scope="module")
def tiny() -> tuple[q.Qwen25OmniWalks, capture.CapturedModel]:
    walks, sample = q.tiny()
    return walks, capture.trace(walks, sample)


def upstream_generate(
    walks: q.Qwen25OmniWalks, r: dict[str, Any], seed: int, speaker: str = "Chelsie"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new text tokens [1, n], talker tokens [1, m], waveform [samples]) of greedy generate()."""
    return q.upstream_speech(walks, r, seed, speaker)


def test_speech_walk_equals_upstream_generate_token_for_token(tiny: Any) -> None:
    walks, captured = tiny
    stops = set()
    for i, (user, max_new, max_audio) in enumerate(REQUESTS):
        r = {
            "input_ids": chat_prompt(q._Ids(), user),
            "max_new_tokens": max_new,
            "max_audio_tokens": max_audio,
            "text_bos_id": q.TINY_SPEAKER_BOS,
        }
        text, codes, waveform = upstream_generate(walks, r, seed=i)
        got = captured.run(r, walk="speak")
        mine = torch.cat([got["first_token"], got["second_token"], got["text_tokens"]], dim=1)
        assert torch.equal(mine, text), i
        walk_codes = torch.cat([got["first_code"], got["codes"]], dim=1)
        assert torch.equal(walk_codes, codes), i
        ended = bool(torch.isin(codes[0, -1], torch.tensor(walks.codec_eos)))
        stops.add((ended, codes.shape[1] < text.shape[1]))
        # Non-streamed decode of the walk's codes (up to the codec EOS) with upstream token2wav.
        length = codes.shape[1] - int(ended)
        speaker = walks.upstream.speaker_map["Chelsie"]
        torch.manual_seed(i)
        wav = walks.upstream.token2wav(
            walk_codes[:, :length],
            conditioning=speaker["cond"].float(),
            reference_mel=speaker["ref_mel"].float(),
        )
        assert torch.equal(wav.reshape(-1).float(), waveform), i
    assert len(stops) >= 2, stops  # EOS and max_audio_tokens stops, short and long talkers


def test_walk_waveform_is_generate_waveform_under_the_same_seed(tiny: Any) -> None:
    """The walk's token2wav stage runs upstream token2wav under a forked RNG seeded with the
    request's ``seed``: ``torch.manual_seed(seed)`` just before ``generate()`` (greedy thinker
    and talker draw nothing from the RNG before token2wav) gives the same waveform, with the
    conditioning of the speaker that ``text_bos_id`` names; the caller's RNG is untouched."""
    walks, captured = tiny
    speakers = [("Chelsie", q.TINY_SPEAKER_BOS), ("Ethan", q.TINY_SPEAKER_BOS_2)]
    waves = {}
    for i, (speaker, bos) in enumerate(speakers):
        user, max_new, max_audio = REQUESTS[i]
        r = {
            "input_ids": chat_prompt(q._Ids(), user),
            "max_new_tokens": max_new,
            "max_audio_tokens": max_audio,
            "text_bos_id": bos,
            "seed": 1000 + i,
        }
        _, codes, waveform = upstream_generate(walks, r, seed=1000 + i, speaker=speaker)
        state = torch.random.get_rng_state()
        got = captured.run(r, walk="speak")
        assert torch.equal(torch.random.get_rng_state(), state)
        assert torch.equal(torch.cat([got["first_code"], got["codes"]], dim=1), codes), i
        assert got["waveform"].shape == (1, 1, waveform.shape[0])
        assert torch.equal(got["waveform"][0, 0], waveform), (i, speaker)
        waves[i] = got["waveform"]
    # The other speaker's conditioning on the same codes and seed: another waveform.
    r0 = {
        "input_ids": chat_prompt(q._Ids(), REQUESTS[0][0]),
        "max_new_tokens": REQUESTS[0][1],
        "max_audio_tokens": REQUESTS[0][2],
        "seed": 1000,
    }
    other = captured.run({**r0, "text_bos_id": q.TINY_SPEAKER_BOS_2}, walk="speak")
    same = captured.run({**r0, "text_bos_id": q.TINY_SPEAKER_BOS}, walk="speak")
    assert torch.equal(same["waveform"], waves[0])
    if torch.equal(other["codes"], same["codes"]):  # the talker's prompt has the bos token too
        assert not torch.equal(other["waveform"], same["waveform"])
    with pytest.raises(Exception, match="names no speaker"):
        captured.run({**r0, "text_bos_id": 3}, walk="speak")


def test_loader_reads_a_local_checkpoint_with_its_speakers(tiny: Any, tmp_path: Any) -> None:
    walks, _ = tiny
    walks.upstream.save_pretrained(tmp_path)
    torch.save(walks.upstream.speaker_map, tmp_path / "spk_dict.pt")
    loaded, sample = q.load_qwen25_omni(str(tmp_path), thinker_eos_id=walks.eos)
    assert sample["text_bos_id"] == q.TINY_SPEAKER_BOS
    # The sample holds every walk's inputs (the media walks' too): speak takes its own.
    speak = {k: sample[k] for k in ("max_new_tokens", "max_audio_tokens", "text_bos_id")}
    r = {**speak, "input_ids": chat_prompt(q._Ids(), [10, 11, 12, 13])}
    got, want = loaded.speak(**r), walks.speak(**r)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    media = {k: sample[k] for k in ("input_ids", *q.MEDIA_INPUTS, "max_new_tokens")}
    got, want = loaded.chat_media(**media), walks.chat_media(**media)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    with pytest.raises(ValueError, match="unknown speaker"):
        q.load_qwen25_omni(str(tmp_path), speaker="Nobody")
