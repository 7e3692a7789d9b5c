"""Tiny random-weight checkpoints of the served vision-language families, built from configs in
code (nothing downloaded), for tests and examples: ``save_tiny(kind, path)`` writes what
``walkserve serve PATH`` loads: ``config.json`` and weights (``save_pretrained``), a character
tokenizer with the chat and image tokens, a chat template, and the image processor:

    qwen2-vl    Qwen2VLForConditionalGeneration (2 text layers, M-RoPE; a 2-block vision
                tower, patch 4, merge 2) + Qwen2VLImageProcessorPil (images to <= 32 x 32)
                in preprocessor_config.json. Upstream's Qwen2VLProcessor is not constructible
                here: it needs a video processor, which needs torchvision.
    qwen2.5-vl  Qwen2_5_VLForConditionalGeneration (the same LM and image processor; a 2-block
                vision tower with window attention in block 0, windows of 2 x 2 image tokens,
                full attention in block 1, RMSNorm and a gated MLP)
    llava       LlavaForConditionalGeneration (a 2-layer CLIP vision tower on 28 x 28 images,
                patch 7: 16 image tokens; a 2-layer Llama) + LlavaProcessor (CLIPImageProcessorPil)
                in processor_config.json

Output embeddings are sharpened (``hf_zoo.SHARPEN``) so that greedy picks are no float ties;
Qwen2.5-VL's vision attention and merger are scaled up (``WINDOW_SHARPEN``) so that its image
features, and so the answers, change when the tower's windows are wrong (at random init its
attention is near uniform and the residual stream drowns it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["KINDS", "TEMPLATES", "save_tiny", "tiny_model", "tiny_tokenizer"]

KINDS = ("qwen2-vl", "qwen2.5-vl", "llava")
VOCAB = 300
SPECIALS = {
    "<|im_start|>": 280,
    "<|im_end|>": 281,
    "<|vision_start|>": 282,
    "<|vision_end|>": 283,
    "<|image_pad|>": 284,
    "<image>": 285,
    "<|video_pad|>": 286,
}
EOS = SPECIALS["<|im_end|>"]
#: Qwen2.5-VL tower scales: attention qkv, attention output, merger output (module docstring)
WINDOW_SHARPEN = (4.0, 10.0, 4.0)
_HEAD = "{% for m in messages %}<|im_start|>{{ m.role }}\n"
_PARTS = (
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}IMAGE{% elif c.type == 'text' %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: chat templates as the families' own write an image part (ChatML around them)
TEMPLATES = {
    "qwen2-vl": _HEAD + _PARTS.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>"),
    "qwen2.5-vl": _HEAD + _PARTS.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>"),
    "llava": _HEAD + _PARTS.replace("IMAGE", "<image>"),
}
_TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=EOS,
    bos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _qwen_text() -> dict[str, Any]:
    """A fresh Qwen text config (upstream's config may rewrite the rope dict it is given)."""
    return {**_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}


_QWEN_VISION: dict[str, Any] = dict(
    depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3
)
_QWEN_TOKENS: dict[str, Any] = dict(
    image_token_id=SPECIALS["<|image_pad|>"],
    video_token_id=SPECIALS["<|video_pad|>"],
    vision_start_token_id=SPECIALS["<|vision_start|>"],
    vision_end_token_id=SPECIALS["<|vision_end|>"],
    tie_word_embeddings=False,
)


def tiny_config(kind: str) -> Any:
    import transformers

    if kind == "qwen2-vl":
        return transformers.Qwen2VLConfig(
            text_config=_qwen_text(),
            vision_config=dict(embed_dim=32, hidden_size=64, mlp_ratio=2, **_QWEN_VISION),
            **_QWEN_TOKENS,
        )
    if kind == "qwen2.5-vl":
        return transformers.Qwen2_5_VLConfig(
            text_config=_qwen_text(),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=48,
                out_hidden_size=_TEXT["hidden_size"],
                window_size=16,  # pixels: 2 x 2 image tokens of 2 x 2 patches of 4 x 4
                fullatt_block_indexes=[1],
                **_QWEN_VISION,
            ),
            **_QWEN_TOKENS,
        )
    if kind == "llava":
        return transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=28,
                patch_size=7,
                projection_dim=32,
            ),
            text_config=transformers.LlamaConfig(**_TEXT),
            image_token_index=SPECIALS["<image>"],
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown tiny VLM {kind!r}: expected one of {KINDS}")


def tiny_model(kind: str, seed: int = 0) -> Any:
    """The tiny upstream model of ``kind``, seeded, sharpened, in eval mode."""
    import transformers

    from walkserve.adapters.hf_zoo import SHARPEN

    config = tiny_config(kind)
    cls = {
        "qwen2-vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2.5-vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "llava": transformers.LlavaForConditionalGeneration,
    }[kind]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(SHARPEN)
        if kind == "qwen2.5-vl":  # attention that matters: windowed and full blocks differ
            for block in model.model.visual.blocks:
                block.attn.qkv.weight.mul_(WINDOW_SHARPEN[0])
                block.attn.proj.weight.mul_(WINDOW_SHARPEN[1])
            model.model.visual.merger.mlp[-1].weight.mul_(WINDOW_SHARPEN[2])
    return model


def tiny_tokenizer() -> Any:
    """Characters 32..126 and the new line at their code points, the specials above."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10, "<unk>": 0} | SPECIALS
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")


def tiny_image_processor(kind: str) -> Any:
    from transformers import CLIPImageProcessorPil, Qwen2VLImageProcessorPil

    if kind in ("qwen2-vl", "qwen2.5-vl"):
        return Qwen2VLImageProcessorPil(
            patch_size=4,
            merge_size=2,
            temporal_patch_size=2,
            size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32},
        )
    return CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})


def tiny_processor(kind: str) -> Any:
    """LLaVA's upstream processor (image processor, tokenizer, template); None for the Qwens
    (see the module docstring)."""
    if kind != "llava":
        return None
    from transformers import LlavaProcessor

    return LlavaProcessor(
        image_processor=tiny_image_processor(kind),
        tokenizer=tiny_tokenizer(),
        patch_size=7,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=TEMPLATES[kind],
    )


def save_tiny(kind: str, path: str | Path, seed: int = 0) -> Any:
    """Write the tiny checkpoint of ``kind`` to ``path``; returns the upstream model."""
    path = Path(path)
    model = tiny_model(kind, seed)
    model.save_pretrained(path)
    processor = tiny_processor(kind)
    if processor is not None:
        processor.save_pretrained(path)
    else:
        tok = tiny_tokenizer()
        tok.chat_template = TEMPLATES[kind]
        tok.save_pretrained(path)
        tiny_image_processor(kind).save_pretrained(path)
    return model


def reference_inputs(kind: str, path: str | Path, messages: list[Any], images: list[Any]) -> Any:
    """Upstream's processor inputs of ``messages`` (HF chat messages, image parts as
    ``{"type": "image"}``) and ``images`` (PIL images) for the checkpoint at ``path``: for
    LLaVA its ``LlavaProcessor``; for the Qwens its image processor and tokenizer with each
    ``<|image_pad|>`` expanded to the image's t*h*w/merge^2 tokens, as ``Qwen2VLProcessor``
    does (which needs torchvision for its video processor, so it is not built here). The
    ``generate()`` keyword arguments: ``input_ids``, ``attention_mask``, ``pixel_values`` and
    for Qwen ``image_grid_thw``."""
    import numpy as np
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if kind == "llava":
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return dict(processor(text=[text], images=images or None, return_tensors="pt"))
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = str(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    out: dict[str, Any] = {}
    if images:
        processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        arrays = [np.asarray(i.convert("RGB")) for i in images]
        out = dict(processor(images=arrays, input_data_format="channels_last", return_tensors="pt"))
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(images) + 1, "one <|image_pad|> per image"
        counts = [int(g.prod()) // processor.merge_size**2 for g in out["image_grid_thw"]]
        text = pieces[0] + "".join(
            "<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:])
        )
    ids = torch.tensor([tok.encode(text)])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **out}
