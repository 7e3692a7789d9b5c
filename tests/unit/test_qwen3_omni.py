"""Qwen3-Omni walks against the upstream model: the captured walk (reference interpreter)
equals upstream ``generate()`` token for token (thinker text, talker codec frames), and the
waveform equals upstream code2wav on the same codes: exactly ``chunked_decode`` with the
walk's own LeftContext sizes (the streamed relation), and, with upstream's sizes (300, 25),
exactly the waveform ``generate()`` returns."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from walkserve import capture
from walkserve.adapters import qwen3_omni as q

pytest.importorskip("transformers")

# User turns of the test requests: (tokens, thinker max_new_tokens, max_audio_tokens). Their
# talkers stop at codec EOS or run into max_audio_tokens, at different lengths.
REQUESTS = [
    ([10, 11, 12, 13, 14], 16, 40),
    ([44, 45], 6, 30),
    ([120, 7, 99, 3], 12, 24),
    ([150, 151, 152, 5, 6, 7], 9, 30),
]


@pytest.fixture(scope="module")
def tiny() -> tuple[q.Qwen3OmniWalks, dict[str, Any], capture.CapturedModel]:
    walks, sample = q.tiny()
    return walks, sample, capture.trace(walks, sample)


def request(walks: q.Qwen3OmniWalks, i: int, speaker: str = "ethan") -> dict[str, Any]:
    user, max_new, max_audio = REQUESTS[i]
    config = walks.upstream.config
    return {
        "input_ids": q.chat_prompt(config, user),
        "max_new_tokens": max_new,
        "max_audio_tokens": max_audio,
        "speaker_id": config.talker_config.speaker_id[speaker],
    }


def upstream_generate(
    walks: q.Qwen3OmniWalks, r: dict[str, Any], speaker: str = "ethan"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upstream ``generate()``, greedy: (new text tokens, codes, waveform)."""
    return q.upstream_speech(walks, r, speaker)


def test_speech_walk_equals_upstream_generate_token_for_token(tiny: Any) -> None:
    walks, _, captured = tiny
    frames = set()
    for i in range(len(REQUESTS)):
        r = request(walks, i)
        text, codes, _ = upstream_generate(walks, r)
        got = captured.run(r, walk="speak")
        assert torch.equal(torch.cat([got["first_token"], got["text_tokens"]], 1), text), i
        assert torch.equal(got["codes"], codes), i
        frames.add(codes.shape[-1])
        # Streamed relation of LeftContext(L, C): chunk k decodes frames
        # [max(0, kC - L), (k + 1) C) and drops its context's samples, which is exactly
        # upstream chunked_decode(codes, C, L).
        want = walks.code2wav.chunked_decode(
            codes, chunk_size=q.TINY_CHUNK, left_context_size=q.TINY_CONTEXT
        )
        assert torch.equal(got["waveform"], want), i
    assert len(frames) > 2  # talkers stopped at different lengths (codec EOS and max)


def test_chat_walk_equals_upstream_thinker_generate(tiny: Any) -> None:
    walks, _, captured = tiny
    for i in range(len(REQUESTS)):
        r = request(walks, i)
        want = walks.upstream.thinker.generate(
            r["input_ids"],
            max_new_tokens=r["max_new_tokens"],
            eos_token_id=walks.eos,
            do_sample=False,
        )
        inputs = {k: r[k] for k in ("input_ids", "max_new_tokens")}
        got = captured.run(inputs, walk="chat")
        text = torch.cat([got["first_token"], got["text_tokens"]], dim=1)
        assert torch.equal(text, want[:, r["input_ids"].shape[1] :]), i


def test_upstream_chunk_sizes_give_upstream_waveform_exactly(tiny: Any) -> None:
    walks, sample, _ = tiny
    full = q.Qwen3OmniWalks(walks.upstream, walks.eos)  # LeftContext(25, 300), as upstream
    captured = capture.trace(full, sample)
    r = request(walks, 2, speaker="chelsie")
    _, codes, waveform = upstream_generate(walks, r, speaker="chelsie")
    got = captured.run(r, walk="speak")
    assert torch.equal(got["codes"], codes)
    assert torch.equal(got["waveform"], waveform)


def test_streamed_chunks_are_code2wav_on_context_plus_new_frames(tiny: Any) -> None:
    """Chunk by chunk: LeftContext(L, C) chunk k is code2wav on frames
    [max(0, kC - L), min((k + 1) C, n)) minus the first min(L, kC) * upsample samples."""
    walks, _, _ = tiny
    outs = [walks.speak(**request(walks, i)) for i in range(len(REQUESTS))]
    out = max(outs, key=lambda o: o["codes"].shape[-1])  # the request with most chunks
    codes, n = out["codes"], out["codes"].shape[-1]
    pieces, start = [], 0
    while start < n:
        ctx = min(q.TINY_CONTEXT, start)
        wav = walks.code2wav(codes[..., start - ctx : start + q.TINY_CHUNK])
        pieces.append(wav[..., ctx * walks.upsample :])
        start += q.TINY_CHUNK
    assert n > q.TINY_CHUNK  # several chunks
    assert torch.equal(out["waveform"], torch.cat(pieces, dim=-1))


def test_a_short_first_chunk_streams_the_same_spans_sooner(tiny: Any) -> None:
    """LeftContext(L, C, first=F): chunk 0 is code2wav on frames [0, F); chunk k >= 1 on
    [max(0, s - L), s + C) with s = F + (k - 1) C, minus the context's samples."""
    walks, sample, _ = tiny
    streaming = q.Qwen3OmniWalks(
        walks.upstream, walks.eos, q.TINY_CHUNK, q.TINY_CONTEXT, first_chunk=q.TINY_FIRST
    )
    captured = capture.trace(streaming, sample)
    r = max((request(walks, i) for i in range(len(REQUESTS))), key=lambda r: r["max_audio_tokens"])
    got = captured.run(r, walk="speak")
    codes, n = got["codes"], got["codes"].shape[-1]
    assert torch.equal(codes, walks.speak(**r)["codes"])  # the chunking changes no code
    pieces, start, size = [], 0, q.TINY_FIRST
    while start < n:
        ctx = min(q.TINY_CONTEXT, start)
        wav = walks.code2wav(codes[..., start - ctx : start + size])
        pieces.append(wav[..., ctx * walks.upsample :])
        start, size = start + size, q.TINY_CHUNK
    assert n > q.TINY_FIRST + q.TINY_CHUNK  # the first chunk and at least one full one
    assert torch.equal(got["waveform"], torch.cat(pieces, dim=-1))


def test_an_eos_frame_decodes_to_silence(tiny: Any) -> None:
    """A talker whose first code is codec EOS leaves a frame that is not a code: its chunk plays
    as silence (upstream decodes no frame then) instead of failing the request; valid chunks are
    code2wav's samples exactly."""
    walks, _, _ = tiny
    codes = torch.randint(0, q.TINY_CODEBOOK, (1, 4, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(
        walks.decode_chunk(codes, 2), walks.code2wav(codes)[..., 2 * walks.upsample :]
    )
    eos = codes[..., :1].clone()
    eos[:, 0] = walks.tokens.codec_eos
    silent = walks.decode_chunk(eos, 0)
    assert silent.shape[-1] > 0 and not silent.any()


def test_bad_prompt_is_refused(tiny: Any) -> None:
    walks, sample, _ = tiny
    with pytest.raises(ValueError, match="assistant header"):
        text = {k: sample[k] for k in ("max_new_tokens", "max_audio_tokens", "speaker_id")}
        walks.speak(**text, input_ids=sample["input_ids"][:, :-1])


def test_loader_reads_a_local_checkpoint(tiny: Any, tmp_path: Any) -> None:
    walks, _, _ = tiny
    walks.upstream.save_pretrained(tmp_path)
    loaded, sample = q.load_qwen3_omni(str(tmp_path), speaker="Chelsie")
    assert sample["speaker_id"] == q.TINY_SPEAKER + 1
    r = request(walks, 0)
    got = capture.trace(loaded, sample).run(r, walk="chat")
    want = walks.upstream.thinker.generate(
        r["input_ids"],
        max_new_tokens=r["max_new_tokens"],
        eos_token_id=loaded.eos,
        do_sample=False,
    )
    text = torch.cat([got["first_token"], got["text_tokens"]], dim=1)
    assert torch.equal(text, want[:, r["input_ids"].shape[1] :])
    with pytest.raises(ValueError, match="unknown speaker"):
        q.load_qwen3_omni(str(tmp_path), speaker="nobody")
