"""The HTTP profile of a Janus checkpoint directory (``walkserve serve DIR`` with
``model_type: janus``): image understanding as chat, prepared as upstream's ``JanusProcessor``
(loaded from the directory with ``AutoProcessor``) prepares it:

    prompt        the processor's chat template over the messages, image parts as its
                  ``<image_placeholder>``; its tokenizer with BOS first (as it tokenizes the
                  whole text); DEFAULT_SYSTEM_PROMPT first with ``use_default_system_prompt``
    image         its image processor -> pixel_values [1, 3, H, W]; placeholders BOI, image
                  token x ``num_image_tokens``, EOI (``JanusProcessor.replace_image_token``)

The chat walks (``chat``, ``chat_image``) are greedy (``chat.chat_tasks``). Image generation
over ``/v1/images/generations`` (the ``generate`` walk) takes its prompt and pixels from the
same processor (``image_generation``). A directory without a loadable processor (tokenizer and
``processor_config.json``) is served through its walks only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from walkserve.adapters.janus.chat import ImageIds, chat_tasks
from walkserve.adapters.janus.image_generation import image_task
from walkserve.api.errors import bad
from walkserve.api.profile import ModelProfile

__all__ = ["TINY_TEMPLATE", "checkpoint_profile", "save_tiny"]

log = logging.getLogger("walkserve")
_MARK = re.compile("(\x00media\\d+\x00)")  # api.chatmedia's marks of media parts


def checkpoint_profile(path: str, name: str) -> ModelProfile:
    """The chat and image generation profile of the Janus checkpoint at ``path`` (module
    docstring)."""
    from transformers import AutoConfig, AutoProcessor
    from transformers.models.janus.processing_janus import DEFAULT_SYSTEM_PROMPT

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        log.warning("%s: no Janus processor (%s); served through its walks only", path, e)
        return ModelProfile(name)
    tok = processor.tokenizer
    count = int(config.vision_config.num_image_tokens)
    if int(processor.num_image_tokens) != count:
        raise ValueError(
            f"{path}: the processor expands an image to {processor.num_image_tokens} tokens, "
            f"the vision tower makes {count}"
        )
    image_id = int(tok.convert_tokens_to_ids(processor.image_token))
    if image_id != int(config.image_token_id):
        raise ValueError(
            f"{path}: the tokenizer's {processor.image_token!r} is id {image_id}, the config's "
            f"image_token_id {config.image_token_id}"
        )
    ids = ImageIds(
        int(tok.convert_tokens_to_ids(processor.image_start_token)),
        image_id,
        int(tok.convert_tokens_to_ids(processor.image_end_token)),
        count,
    )
    first = (tok.bos_token or "") if tok.encode("") else ""  # what tokenizing the text adds
    system = DEFAULT_SYSTEM_PROMPT if processor.use_default_system_prompt else ""
    placeholder = str(processor.image_token)

    def render(messages: Sequence[tuple[str, str]]) -> str:
        hf = [{"role": role, "content": _parts(content)} for role, content in messages]
        text = str(processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False))
        marks = _MARK.findall("".join(content for _, content in messages))
        if text.count(placeholder) != len(marks):
            raise bad(f"a message's text may not hold {placeholder!r}", "messages")
        for mark in marks:  # each image part's placeholder -> the part's mark, in order
            text = text.replace(placeholder, mark, 1)
        return first + system + text

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def decode(token_ids: list[int]) -> str:
        return str(tok.decode(token_ids, skip_special_tokens=True))

    eos = int(config.text_config.eos_token_id)
    vocab = int(config.text_config.vocab_size)
    text, media = chat_tasks(
        encode, decode, eos, vocab, processor.image_processor, ids, chat_template=render
    )
    image = image_task(processor, config, path)
    return ModelProfile(name, text=text, image=image, chat_media=media)


def _parts(content: str) -> list[dict[str, str]]:
    """A rendered message's content (media parts as marks) as HF content parts."""
    out = []
    for piece in _MARK.split(content):
        if _MARK.fullmatch(piece):
            out.append({"type": "image"})
        elif piece:
            out.append({"type": "text", "text": piece})
    return out


#: the tiny checkpoint's chat template, in the shape of Janus's own (content parts, image parts
#: as ``<image_placeholder>`` on their own line, ``<|User|>`` / ``<|Assistant|>`` turns)
TINY_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}<|User|>: {% else %}"
    "{{ m.role | capitalize }}: {% endif %}{% for c in m.content %}"
    "{% if c.type == 'image' %}{% if not loop.first %}{{ '\\n' }}{% endif %}<image_placeholder>"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% else %}{{ c.text }}{% endif %}{% endfor %}"
    "{{ '\\n\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|Assistant|>:{% endif %}"
)
_SPECIALS = {"<image_placeholder>": 300, "<begin_of_image>": 301, "<end_of_image>": 302}


def save_tiny(path: str, seed: int = 0, **generation: Any) -> Any:
    """Write the tiny Janus (``build.tiny_janus``) as a checkpoint directory: weights, the
    generation config upstream ``generate`` reads (``generation``: further fields of it, such
    as ``guidance_scale``), a character tokenizer (BOS 1, EOS 2, PAD 0, the image specials at
    ``build``'s ids) and a ``JanusProcessor`` with ``TINY_TEMPLATE``. Returns the upstream
    model."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from walkserve.adapters.janus.build import TINY, TINY_EOS, TINY_IDS, tiny_janus

    model: Any = tiny_janus(seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=TINY_IDS.bos,
        pad_token_id=TINY_IDS.pad,
        eos_token_id=TINY_EOS,
        generation_kwargs={"boi_token_id": TINY_IDS.boi},
        **generation,
    )
    model.save_pretrained(path)
    specials = {"<pad>": TINY_IDS.pad, "<bos>": TINY_IDS.bos, "<eos>": TINY_EOS, **_SPECIALS}
    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10} | specials
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(s, special=True) for s in specials])
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", TINY_IDS.bos)]
    )
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={
            "image_token": "<image_placeholder>",
            "boi_token": "<begin_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )
    side = TINY.image_size
    processor = transformers.JanusProcessor(
        image_processor=transformers.JanusImageProcessorPil(size={"height": side, "width": side}),
        tokenizer=tok,
        chat_template=TINY_TEMPLATE,
        num_image_tokens=(side // 16) ** 2,
    )
    processor.save_pretrained(path)
    return model
