"""Qwen3-Omni (``transformers.Qwen3OmniMoeForConditionalGeneration``) as walks: thinker ->
talker (with its multi-token code predictor) -> code2wav, streamed stage to stage.

The upstream thinker, talker, code predictor and code2wav are used unmodified, as components;
this package writes the loops that upstream ``generate()`` hides, around their forward methods,
and reproduces what ``generate()`` feeds the talker. What crosses its boundary: walk inputs
``input_ids`` [1, P] int64 (a chat prompt ending with ``<|im_start|> assistant \\n``),
``max_new_tokens`` (thinker), ``max_audio_tokens`` (talker, counted as upstream
``talker_max_new_tokens``) and ``speaker_id`` (a codec speaker id from
``config.talker_config.speaker_id``), the sampling inputs (below, all with greedy defaults);
for audio input (walks ``chat_audio``, ``speak_audio``)
also ``input_features`` [1, mel, T] float and ``feature_attention_mask`` [1, T] int64, for an
image (``chat_image``, ``speak_image``) ``pixel_values`` [patches, C * T * p * p] float and
``image_grid_thw`` [1, 3] int64, with the prompt's placeholders laid out as upstream's
processor does (``audio_chat_prompt``, ``image_request``), for videos (``chat_video``, text
out: ``video_walk``) ``pixel_values_videos``, ``video_grid_thw``, ``video_second_per_grid``;
outputs ``first_token`` [1, 1]
(t0, from the prefill), ``text_tokens`` [1, n - 1] (t1 .. t{n-1}, streamed token by token),
``codes`` [1, G, frames] and ``waveform`` [1, 1, samples] (both streamed).

Media: the thinker's prefill takes the encoder inputs (its own audio / vision towers run
inside it); the talker's prefill puts ``hidden_projection`` of the thinker prefill's
``accept_hidden_layer`` states at the media placeholders (``TalkerPrompt``). Images move the
rotary positions of thinker and talker (``MropePositions``, from upstream ``get_rope_index``);
upstream keeps that offset on the modules (``rope_deltas``), the walks carry it per request
into every decode step (``step_positions``), so no request reads another's state.

    thinker  prefill -> t0; decode t1 .. t{n-1} (EOS / max_new_tokens)
             feeds:   t1 t2 ... t{n-2} <eos>            (the item of the last token is the
                                                         tts_eos marker, as generate() builds
                                                         ``trailing_text_hidden``)
    talker   prefill(user text, assistant header, t0, speaker) -> c0
             per feed item (stream, FixedChunk(1)): one talker step; on the <eos> item, more
             steps on tts_pad until codec EOS / max_audio_tokens. Each step first runs the code
             predictor (G - 1 residual codes of the previous code) as a nested loop, then the
             talker on sum(code embeddings) + text feed -> the next code.
    code2wav stream(codes, LeftContext(L=25, C=300)) (upstream ``chunked_decode`` sizes):
             chunk i decodes frames [max(0, 300 i - 25), 300 (i + 1)) and drops the context's
             samples, so the joined waveform equals ``code2wav.chunked_decode(codes, 300, 25)``.

Greedy by default: equal to upstream ``generate(..., thinker_do_sample=False,
talker_do_sample=False, talker_repetition_penalty=r)`` with the walk input
``talker_repetition_penalty`` = r (default 1). Sampling (``speech_sampling``): per-request inputs
with greedy defaults, ``temperature`` / ``top_p`` / ``top_k`` (thinker), ``talker_*`` (talker),
``predictor_*`` (code predictor) and one ``seed``; each of the three samplers draws its own
stream seeded by ``(seed, row, step)``, so a request's tokens do not depend on its batch
(upstream's draws, from the global RNG, are not reproduced). Not reproduced: video input (and
audio in video), speech out for audio and images in one prompt (upstream ``generate()``
fails on it; ``chat_media`` gives text), batches of several rows in one request. Several clips
and images in one prompt: ``media_walks``.

The package, by concept: ``decoders`` (thinker, talker and code predictor on the paged KV pool,
called as the upstream modules), ``inputs`` (what the decoders are fed, built as ``generate()``
builds it), ``walks`` (``Qwen3OmniWalks``), ``media_walks`` (its walks with media), ``instances`` (the tiny model, request builders,
the upstream reference, the checkpoint loader) and ``profiles`` (HTTP). Every public name is
importable from the package.
"""

from __future__ import annotations

from walkserve.adapters.qwen3_omni.decoders import (
    PredictorOnPool,
    TalkerOnPool,
    ThinkerOnPool,
)
from walkserve.adapters.qwen3_omni.inputs import (
    AUDIO_INPUTS,
    FEED_EOS,
    FEED_PAD,
    GREEDY,
    MAX_TALKER_STEPS,
    MAX_THINKER_STEPS,
    PREDICTOR_SAMPLING,
    SEQUENCE,
    TALKER_HEADER,
    TALKER_SAMPLING,
    AudioPlaceholders,
    ImagePlaceholders,
    MropePositions,
    OmniTokens,
    StepInput,
    TalkerPrompt,
    TalkerText,
    audio_token_count,
    step_positions,
    user_mask,
)
from walkserve.adapters.qwen3_omni.instances import (
    MEDIA_INPUTS,
    TINY_CHUNK,
    TINY_CODEBOOK,
    TINY_CONTEXT,
    TINY_FIRST,
    TINY_SPEAKER,
    TINY_VOCAB,
    audio_chat_prompt,
    audio_request,
    chat_prompt,
    image_request,
    load_qwen3_omni,
    media_sample,
    shard_thinker,
    streaming,
    tiny,
    tiny_config,
    tiny_eos,
    tiny_upstream,
    upstream_speech,
)
from walkserve.adapters.qwen3_omni.profiles import (
    AUDIBLE_GAIN,
    TINY_FIRST_SPECIAL,
    TINY_NEWLINE,
    checkpoint_profile,
    from_env,
    from_env_profile,
    qwen3_chat_ids,
    qwen3_voices,
    qwen3_walk_names,
    streaming_profile,
    tiny_audible,
    tiny_audible_profile,
    tiny_profile,
)
from walkserve.adapters.qwen3_omni.video_walk import VideoMropePositions, VideoWalk
from walkserve.adapters.qwen3_omni.walks import (
    Qwen3OmniWalks,
)

__all__ = [
    "AUDIBLE_GAIN",
    "AUDIO_INPUTS",
    "AudioPlaceholders",
    "FEED_EOS",
    "FEED_PAD",
    "GREEDY",
    "ImagePlaceholders",
    "MAX_TALKER_STEPS",
    "MAX_THINKER_STEPS",
    "MEDIA_INPUTS",
    "MropePositions",
    "OmniTokens",
    "PREDICTOR_SAMPLING",
    "PredictorOnPool",
    "Qwen3OmniWalks",
    "SEQUENCE",
    "StepInput",
    "TALKER_HEADER",
    "TALKER_SAMPLING",
    "TINY_CHUNK",
    "TINY_CODEBOOK",
    "TINY_CONTEXT",
    "TINY_FIRST",
    "TINY_FIRST_SPECIAL",
    "TINY_NEWLINE",
    "TINY_SPEAKER",
    "TINY_VOCAB",
    "TalkerOnPool",
    "TalkerPrompt",
    "TalkerText",
    "ThinkerOnPool",
    "audio_chat_prompt",
    "audio_request",
    "audio_token_count",
    "chat_prompt",
    "checkpoint_profile",
    "from_env",
    "from_env_profile",
    "image_request",
    "load_qwen3_omni",
    "media_sample",
    "qwen3_chat_ids",
    "qwen3_voices",
    "qwen3_walk_names",
    "shard_thinker",
    "step_positions",
    "streaming",
    "streaming_profile",
    "tiny",
    "tiny_audible",
    "tiny_audible_profile",
    "tiny_config",
    "tiny_eos",
    "tiny_profile",
    "VideoMropePositions",
    "VideoWalk",
    "tiny_upstream",
    "upstream_speech",
    "user_mask",
]
