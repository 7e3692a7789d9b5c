"""Qwen3-Omni served by real worker processes on two ranks (thinker on rank 0; talker, code
predictor and code2wav on rank 1): concurrent speech requests equal the reference interpreter
(``walkserve.testing.assert_outputs_match``), and audio streams: the first waveform chunk of a
long reply reaches the client before the thinker's last text token does (client-side receive
times of ``Server.stream`` items). Qwen2.5-Omni likewise, its waveform (token2wav, the walk's
last stage) included; sampled requests (fixed seeds) equal the interpreter and give the same
tokens served alone as in a batch."""

from __future__ import annotations

import time
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
PLACEMENTS = Path(q.__file__).parents[1] / "placements_omni"


def requests(config: Any, n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        user = torch.randint(0, 200, (2 + i % 4,), generator=g).tolist()
        out.append(
            {
                "input_ids": q.chat_prompt(config, user),
                "max_new_tokens": 4 + 3 * i,
                "max_audio_tokens": 12 + 4 * i,
                "speaker_id": q.TINY_SPEAKER + i % 2,
            }
        )
    return out


def test_concurrent_speech_on_two_ranks_streams_before_the_thinker_ends() -> None:
    walks, sample = q.tiny()
    captured = capture.trace(walks, sample)
    reqs = requests(walks.upstream.config, 6)
    hot = dict(temperature=1.5, top_k=20, talker_temperature=1.2, predictor_temperature=1.0)
    reqs.append({**reqs[2], **hot, "seed": 5})  # sampled: thinker, talker, code predictor
    # A long reply whose talker runs on past one code2wav chunk while the thinker still writes.
    long_reply = {**reqs[0], "input_ids": q.chat_prompt(walks.upstream.config, [120, 7, 99, 3])}
    long_reply.update(max_new_tokens=160, max_audio_tokens=48)
    with serve(FACTORY, PLACEMENTS / "qwen3-omni.2ranks.yaml") as server:
        handles = [server.submit(r, "speak") for r in reqs]
        for handle, r in zip(handles, reqs):
            assert_outputs_match(handle.result(timeout=300), captured.run(r, walk="speak"))
        assert {r: h.status for r, h in server.health().items()} == {0: "ready", 1: "ready"}

        handle = server.submit(long_reply, "speak")
        arrivals = [(time.monotonic(), item) for item in handle.stream(timeout=300)]
        out = handle.result(timeout=300)
        stats = server.stats()
    want = captured.run(long_reply, walk="speak")
    assert_outputs_match(out, want)
    text_times = [t for t, item in arrivals if item.channel == "text_tokens"]
    audio = [(t, item) for t, item in arrivals if item.channel == "waveform"]
    assert len(audio) > 1 and text_times, [item.channel for _, item in arrivals][:20]
    assert audio[0][0] < max(text_times), "no audio before the thinker finished"
    assert torch.equal(torch.cat([item.value for _, item in audio], dim=-1), out["waveform"])
    assert stats.live_requests == 0 and stats.live_values == 0


def test_qwen25_omni_on_two_ranks_streams_codes_before_the_thinker_ends() -> None:
    from walkserve.adapters import qwen25_omni

    walks, sample = qwen25_omni.tiny()
    captured = capture.trace(walks, sample)
    reqs = [
        {**sample, "input_ids": q.chat_prompt(qwen25_omni._Ids(), user), "max_new_tokens": n}
        for user, n in (([5, 6, 7], 10), ([44, 45], 20), ([120, 7, 99, 3], 8), ([1, 2], 120))
    ]
    # Sampled requests (thinker and talker), one seed each; the Ethan one picks the other
    # speaker's token2wav conditioning.
    hot = dict(temperature=1.5, top_k=20, talker_temperature=1.2, talker_top_p=0.9)
    reqs.append({**reqs[0], **hot, "seed": 11})
    reqs.append({**reqs[1], **hot, "seed": 12, "text_bos_id": qwen25_omni.TINY_SPEAKER_BOS_2})
    with serve(
        "walkserve.adapters.qwen25_omni:tiny", PLACEMENTS / "qwen25-omni.2ranks.yaml"
    ) as server:
        handles = [server.submit(r, "speak") for r in reqs]
        arrivals = [(time.monotonic(), item) for item in handles[3].stream(timeout=300)]
        results = [handle.result(timeout=300) for handle in handles]
        for out, r in zip(results, reqs):
            # The waveform (token2wav under the request's seed, on rank 1) included.
            assert_outputs_match(out, captured.run(r, walk="speak"))
        alone = server.submit(reqs[4], "speak").result(timeout=300)
    for key in ("first_token", "second_token", "text_tokens", "first_code", "codes"):
        assert torch.equal(alone[key], results[4][key]), key  # batch-independent draws
    assert_outputs_match(alone, results[4])
    assert not torch.equal(results[4]["text_tokens"], results[0]["text_tokens"])
    text_times = [t for t, item in arrivals if item.channel == "text_tokens"]
    code_times = [t for t, item in arrivals if item.channel == "codes"]
    assert len(text_times) > 100 and code_times
    assert code_times[0] < max(text_times), "no codec token before the thinker finished"
