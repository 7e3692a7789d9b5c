"""Vision-language models served from a checkpoint directory (``walkserve serve DIR``): Qwen2-VL,
Qwen2.5-VL and LLaVA (``LlavaForConditionalGeneration``), by the ``model_type`` of their
``config.json``. The language model runs on the paged KV pool (``paged.PagedVLM``), the vision
tower is its own component with an encoder cache by image content (``encoder.VisionTower``);
an image seen again reuses its encoder output and, through image-keyed prefix ids, the KV
pages of the prompt up to and through it. Chat requests with ``image_url`` parts reach
``prefill_image`` through the checkpoint's image processor (``profile``).

    families   what differs per family (tower call, tokens per image, M-RoPE)
    encoder    VisionTower + EncoderCache
    paged      PagedVLM (PagedLM with image features and image-keyed prefixes)
    walks      VLMWalks: text walks + prefill_image
    profile    the HTTP profile: tokenizer, template, image processor, chat media
    tiny       tiny checkpoints for tests
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_vlm"]


def load_vlm(path: str) -> tuple[Any, dict[str, Any]]:
    """A local VLM checkpoint directory as walks, with capture's sample inputs."""
    from transformers import AutoConfig

    from walkserve.adapters.hf_causal_lm import eos_token_id, has_tokenizer
    from walkserve.adapters.vlm.walks import VLMWalks, sample_request
    from walkserve.runtime.kv.grammar import HFVocabulary

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = _model_class(config).from_pretrained(path, local_files_only=True).eval()
    eos = eos_token_id(model)
    vocabulary = HFVocabulary(path, eos) if has_tokenizer(path) else None
    return VLMWalks(model, eos, vocabulary=vocabulary), sample_request(model)


def _model_class(config: Any) -> Any:
    import transformers

    return {
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "llava": transformers.LlavaForConditionalGeneration,
    }[str(config.model_type)]
