"""Qwen3-Omni with audio and image input served by real worker processes on two ranks
(thinker and its encoders on rank 0; talker, code predictor and code2wav on rank 1): speech
and chat requests with audio clips of different lengths, images whose rotary offsets differ,
and a text-only request, submitted together, each equal the reference interpreter (which
``tests/unit/test_qwen3_omni_media.py`` ties to upstream ``generate()``) and, for the speech
requests, upstream ``generate()`` itself (text tokens and codec frames)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from walkserve import capture
from walkserve.adapters import qwen3_omni as q
from walkserve.runtime.server import serve
from walkserve.testing import assert_outputs_match

pytest.importorskip("transformers")

FACTORY = "walkserve.adapters.qwen3_omni:tiny"
PLACEMENT = Path(q.__file__).parents[1] / "placements_omni" / "qwen3-omni.2ranks.yaml"
MEDIA_KEYS = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw")
CHAT_KEYS = ("input_ids", "input_features", "feature_attention_mask", "max_new_tokens")


def test_audio_requests_of_different_lengths_served_together_on_two_ranks() -> None:
    walks, sample = q.tiny()
    captured = capture.trace(walks, sample)
    config = walks.upstream.config
    speech = [
        {
            **q.audio_request(config, frames, user, padding=pad, seed=i),
            "max_new_tokens": max_new,
            "max_audio_tokens": 30,
            "speaker_id": q.TINY_SPEAKER + i % 2,
        }
        for i, (frames, pad, user, max_new) in enumerate(
            [(230, 0, [5, 6], 9), (64, 0, [44, 45], 16), (150, 7, [120, 7], 12)]
        )
    ]
    text = {
        "input_ids": q.chat_prompt(config, [120, 7, 99, 3]),
        "max_new_tokens": 12,
        "max_audio_tokens": 24,
        "speaker_id": q.TINY_SPEAKER,
    }
    images = [
        {
            **q.image_request(config, grid, [10, 11], seed=i),
            "max_new_tokens": 10,
            "max_audio_tokens": 24,
            "speaker_id": q.TINY_SPEAKER,
        }
        for i, grid in enumerate([(8, 12), (4, 4)])  # rotary offsets -18 and -2
    ]
    chat = {k: speech[2][k] for k in CHAT_KEYS}
    chat_image = {
        k: images[0][k] for k in ("input_ids", "pixel_values", "image_grid_thw", "max_new_tokens")
    }
    speech += images
    work: list[tuple[dict[str, Any], str]] = [(r, "speak_audio") for r in speech[:3]]
    work += [(r, "speak_image") for r in images]
    work += [(text, "speak"), (chat, "chat_audio"), (chat_image, "chat_image")]
    with serve(FACTORY, PLACEMENT) as server:
        handles = [server.submit(r, walk) for r, walk in work]
        outs = [h.result(timeout=300) for h in handles]
        assert {r: h.status for r, h in server.health().items()} == {0: "ready", 1: "ready"}
        stats = server.stats()
    for (r, walk), out in zip(work, outs):
        assert_outputs_match(out, captured.run(r, walk=walk))
    model = walks.upstream
    decode = model.code2wav.chunked_decode
    seen: dict[str, torch.Tensor] = {}

    def spy(codes: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen["codes"] = codes
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = spy  # the codes generate() decodes
    for r, out in zip(speech, outs):
        media = {k: v for k, v in r.items() if k in MEDIA_KEYS}
        sequences, _ = walks.upstream.generate(
            r["input_ids"],
            **media,
            speaker="chelsie" if r["speaker_id"] != q.TINY_SPEAKER else "ethan",
            thinker_max_new_tokens=r["max_new_tokens"],
            thinker_eos_token_id=walks.eos,
            thinker_do_sample=False,
            talker_max_new_tokens=r["max_audio_tokens"],
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
        )
        got = torch.cat([out["first_token"], out["text_tokens"]], dim=1)
        assert torch.equal(got, sequences[:, r["input_ids"].shape[1] :])
        assert torch.equal(out["codes"], seen["codes"])
    assert stats.live_requests == 0 and stats.live_values == 0
