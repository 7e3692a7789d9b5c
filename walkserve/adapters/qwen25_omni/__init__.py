"""Qwen2.5-Omni (``transformers.Qwen2_5OmniForConditionalGeneration``) as walks: thinker ->
talker, streamed (``FixedChunk(1)``), -> token2wav (not streamed); thinker and talker token for
token equal to upstream ``generate()`` (greedy, text-only input), the waveform equal to
``generate()``'s under the same ``torch.manual_seed``. What crosses its boundary: walk inputs
``input_ids`` [1, P], ``max_new_tokens`` (thinker, >= 3), ``max_audio_tokens`` (talker),
``text_bos_id`` (the speaker's ``bos_token`` from ``model.speaker_map``: it also picks the
speaker's token2wav conditioning and reference mel), and, with defaults, the sampling inputs
``temperature``, ``top_p``, ``top_k`` (thinker), ``talker_temperature``, ``talker_top_p``,
``talker_top_k``, ``talker_repetition_penalty`` (1: off) and ``seed`` (temperature 0: greedy;
see ``speech_sampling``; ``seed`` also seeds token2wav's noise); outputs ``first_token``
[1, 1], ``second_token`` [1, 1], ``text_tokens`` [1, n - 2] (streamed), ``first_code`` [1, 1]
and ``codes`` [1, m - 1] (streamed): the talker's tokens, the final EOS or max-th one included;
``waveform`` [1, 1, samples] float32 at 24 kHz (upstream returns [samples]; here with batch
and channel).

    thinker    prefill -> t0; step feeding t0 -> reply0, t1; loop feeding t1 .. t{n-2}:
               each step emits reply_i = last hidden + input embedding of t_i, flagged if its
               output t{i+1} is the last token (EOS / max_new_tokens)
    talker     prefill(prompt hidden + embeds, speaker bos, reply0) -> c0; one step per
               streamed reply_i; after the flagged one, a step on the text-EOS embedding, then
               steps on the text-pad embedding until a codec EOS / max_audio_tokens (as
               generate() does)
    token2wav  after the talker: the codes up to the first codec EOS, decoded at once by
               ``SeededToken2Wav`` under the request's seed (on the talker's rank)

Not streamed: the waveform. Upstream token2wav is a DiT flow-matching model that starts from
random noise and attends over the *whole* code sequence, then BigVGAN; chunking it would change
its output, so the waveform is the walk's last, non-streamed stage. Its noise comes from the
global RNG upstream: ``SeededToken2Wav`` forks the RNG and seeds it with the request's ``seed``,
so the waveform depends on the request alone, and equals upstream ``generate()``'s when
``torch.manual_seed(seed)`` is called just before ``generate()`` with greedy thinker and talker
(nothing else in ``generate()`` draws from the RNG before token2wav).

Media in (walks ``chat_audio``, ``chat_image``, ``chat_media``, text out, and ``speak_audio``,
``speak_image``, ``speak_media``, audio out; several clips and images in one prompt):
``media_walks``; videos (``chat_video``, text out): ``video_walk``.

The package, by concept: ``decoders`` (thinker and talker on the paged KV pool), ``walks``
(``Qwen25OmniWalks``, ``SeededToken2Wav``), ``media_walks`` (its walks with media),
``video_walk`` (its walk with videos),
``instances`` (the tiny model, the sample request, the upstream references, the checkpoint
loader) and ``profiles`` (HTTP). Every public name is importable from the package.
"""

from __future__ import annotations

from walkserve.adapters.qwen25_omni.decoders import TalkerOnPool, ThinkerOnPool
from walkserve.adapters.qwen25_omni.instances import (
    TINY_SPEAKER_BOS,
    TINY_SPEAKER_BOS_2,
    TINY_SPECIALS,
    _Ids,
    load_qwen25_omni,
    media_sample,
    tiny,
    tiny_config,
    tiny_processor,
    upstream_speech,
)
from walkserve.adapters.qwen25_omni.media_walks import (
    MEDIA_INPUTS,
    MediaWalks,
    Qwen25AudioPlaceholders,
    RopePositions,
    audio_token_count,
    step_positions,
)
from walkserve.adapters.qwen25_omni.profiles import (
    AUDIBLE_GAIN,
    QWEN_IM_END,
    checkpoint_profile,
    qwen25_voices,
    qwen25_walk_names,
    tiny_audible,
    tiny_audible_profile,
    tiny_profile,
    with_qwen25_chat_media,
)
from walkserve.adapters.qwen25_omni.video_walk import VIDEO_INPUTS, VideoRopePositions, VideoWalk
from walkserve.adapters.qwen25_omni.walks import (
    MAX_TALKER_STEPS,
    MAX_THINKER_STEPS,
    TALKER_SAMPLING,
    Qwen25OmniWalks,
    SeededToken2Wav,
)

__all__ = [
    "AUDIBLE_GAIN",
    "MAX_TALKER_STEPS",
    "MAX_THINKER_STEPS",
    "MEDIA_INPUTS",
    "MediaWalks",
    "QWEN_IM_END",
    "Qwen25AudioPlaceholders",
    "Qwen25OmniWalks",
    "RopePositions",
    "SeededToken2Wav",
    "TALKER_SAMPLING",
    "TINY_SPEAKER_BOS",
    "TINY_SPEAKER_BOS_2",
    "TINY_SPECIALS",
    "TalkerOnPool",
    "VIDEO_INPUTS",
    "VideoRopePositions",
    "VideoWalk",
    "ThinkerOnPool",
    "_Ids",
    "audio_token_count",
    "checkpoint_profile",
    "load_qwen25_omni",
    "media_sample",
    "qwen25_voices",
    "qwen25_walk_names",
    "step_positions",
    "tiny",
    "tiny_audible",
    "tiny_audible_profile",
    "tiny_config",
    "tiny_processor",
    "tiny_profile",
    "upstream_speech",
    "with_qwen25_chat_media",
]
