"""Qwen3-Omni's decoders on the paged KV pool, served by real worker processes on two ranks:
eight speech requests submitted together (text, audio clips of different lengths, images whose
rotary offsets differ) each give upstream ``generate()``'s thinker text and talker codes, and
upstream code2wav's waveform of those codes; the batch-size histogram shows steps of several
requests (which the pool runs as one packed forward: ``test_qwen3_omni_media`` counts them);
every pool is empty again once the requests are done. With the thinker as a TP=2 group on two
ranks and the talker and code2wav on a third (``qwen3-omni.tp2.yaml``), text, audio and image
requests still give ``generate()``'s text and codes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from walkserve.adapters import qwen3_omni as q
from walkserve.runtime.server import serve

pytest.importorskip("transformers")

FACTORY = "walkserve.adapters.qwen3_omni:tiny"
PLACEMENT = Path(q.__file__).parents[1] / "placements_omni" / "qwen3-omni.2ranks.yaml"


def work(config: Any) -> list[tuple[dict[str, Any], str]]:
    def limits(i: int) -> dict[str, int]:
        return {"max_new_tokens": 6 + 2 * i, "max_audio_tokens": 14 + 3 * i}

    speaker = {"speaker_id": q.TINY_SPEAKER}
    out: list[tuple[dict[str, Any], str]] = []
    for i, user in enumerate([[10, 11, 12], [44, 45], [120, 7, 99, 3]]):
        r = {"input_ids": q.chat_prompt(config, user), **limits(i), **speaker}
        out.append((r, "speak"))
    for i, (frames, pad, user) in enumerate([(230, 0, [5, 6]), (64, 0, [44]), (150, 7, [9])]):
        r = {**q.audio_request(config, frames, user, padding=pad, seed=i), **limits(i + 3)}
        out.append(({**r, **speaker}, "speak_audio"))
    for i, grid in enumerate([(8, 12), (4, 4)]):
        r = {**q.image_request(config, grid, [10, 11], seed=i), **limits(i + 6), **speaker}
        out.append((r, "speak_image"))
    return out


def test_eight_mixed_speech_requests_share_forwards_and_equal_upstream_generate() -> None:
    walks, _ = q.tiny()
    requests = work(walks.upstream.config)
    assert len(requests) == 8
    with serve(FACTORY, PLACEMENT) as server:
        handles = [server.submit(r, walk) for r, walk in requests]
        outs = [h.result(timeout=300) for h in handles]
        sizes = server.batch_sizes
        stats = server.stats()
    for i, ((r, _), got) in enumerate(zip(requests, outs)):
        text, codes, _ = q.upstream_speech(walks, r)
        assert torch.equal(torch.cat([got["first_token"], got["text_tokens"]], 1), text), i
        assert torch.equal(got["codes"], codes), i
        want = walks.code2wav.chunked_decode(
            codes, chunk_size=q.TINY_CHUNK, left_context_size=q.TINY_CONTEXT
        )
        torch.testing.assert_close(got["waveform"], want, rtol=0, atol=1e-5 * want.abs().max())
    shared = sum(n for size, n in sizes.items() if size > 1)
    assert shared > 10, sizes  # steps of several requests, not one request per forward
    assert stats.live_requests == 0 and stats.live_values == 0


def test_eight_qwen25_omni_speech_requests_share_forwards_and_equal_upstream_generate() -> None:
    """Qwen2.5-Omni (text input: its walks take no media): thinker text and talker codes of
    each of eight concurrent requests equal ``generate()``'s, the waveform its waveform under
    the request's seed."""
    from walkserve.adapters import qwen25_omni

    walks, sample = qwen25_omni.tiny()
    users = [[10, 11, 12, 13], [5, 6, 7], [44, 45], [120, 7], [9], [30, 31, 32], [77, 3], [8, 8]]
    requests = [
        {
            **sample,
            "input_ids": q.chat_prompt(qwen25_omni._Ids(), user),
            "max_new_tokens": 6 + 2 * i,
            "max_audio_tokens": 12 + 3 * i,
            "text_bos_id": qwen25_omni.TINY_SPEAKER_BOS,
            "seed": 100 + i,
        }
        for i, user in enumerate(users)
    ]
    placement = PLACEMENT.parent / "qwen25-omni.2ranks.yaml"
    with serve("walkserve.adapters.qwen25_omni:tiny", placement) as server:
        handles = [server.submit(r, "speak") for r in requests]
        outs = [h.result(timeout=300) for h in handles]
        sizes = server.batch_sizes
    for i, (r, got) in enumerate(zip(requests, outs)):
        text, codes, waveform = qwen25_omni.upstream_speech(walks, r, seed=r["seed"])
        mine = torch.cat([got["first_token"], got["second_token"], got["text_tokens"]], dim=1)
        assert torch.equal(mine, text), i
        assert torch.equal(torch.cat([got["first_code"], got["codes"]], dim=1), codes), i
        # The worker's threads may sum the DiT's products in another order than this process.
        scale = 1e-5 * waveform.abs().max()
        torch.testing.assert_close(got["waveform"][0, 0], waveform, rtol=0, atol=scale)
    assert sum(n for size, n in sizes.items() if size > 1) > 10, sizes


def test_the_thinker_at_tp2_gives_upstream_text_and_codes() -> None:
    """The thinker as a TP=2 group on ranks 0 and 1 (transformers' tp_plan: heads, experts'
    intermediate, vocabulary-parallel embedding and head; its encoders replicated), the talker,
    code predictor and code2wav on rank 2: concurrent text, audio and image requests give
    upstream ``generate()``'s text and codes (on the unsharded model) exactly."""
    walks, _ = q.tiny()
    requests = [work(walks.upstream.config)[i] for i in (2, 3, 6)]  # text, audio, image
    with serve(FACTORY, PLACEMENT.parent / "qwen3-omni.tp2.yaml") as server:
        assert [(g.ranks, g.components) for g in server.plan.tp_groups] == [
            ([0, 1], ["thinker_lm"])
        ]
        handles = [server.submit(r, walk) for r, walk in requests]
        outs = [h.result(timeout=300) for h in handles]
        assert all(h.status == "ready" for h in server.health().values())
    for i, ((r, _), got) in enumerate(zip(requests, outs)):
        text, codes, _ = q.upstream_speech(walks, r)
        assert torch.equal(torch.cat([got["first_token"], got["text_tokens"]], 1), text), i
        assert torch.equal(got["codes"], codes), i
