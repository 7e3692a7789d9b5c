"""Model names the CLI and the server accept, resolved to ``(model, sample_inputs)``.

walkserve-default                          text, speech and image walks (adapters.default)
example-cfg-image | example-speech | example-world | example-text   built-in examples
tiny-llama | tiny-qwen2 | tiny-qwen3      tiny random-weight Hugging Face causal LMs
tiny-orpheus | tiny-qwen3-omni | ...      tiny random-weight instances of the upstream
                                          architectures the adapters support (``ADAPTERS``)
/path/to/checkpoint                       a local Hugging Face checkpoint directory: a causal
                                          LM, a VLM (Qwen2-VL, Qwen2.5-VL, LLaVA), ...
package.module:factory                    your own decorated model: factory() returns
                                          (model, sample_inputs)

``resolve(name)`` gives a name's ``Entry``: its loader (seed -> model and sample inputs) and its
profile (what the HTTP routes serve: ``api.profile.ModelProfile``). A ``module:factory`` model
describes its tasks with ``<factory>_profile(name)`` beside the factory, or a module-level
``api_profile(name)``; without either it is served through ``/v1/walks/{walk}`` only.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from walkserve.api.profile import ModelProfile

logger = logging.getLogger("walkserve")

DEFAULT_MODEL = "walkserve-default"
TINY_HF = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
#: Built-in names of the upstream-model adapters' tiny instances -> their ``module:factory``.
ADAPTERS = {
    "tiny-orpheus": "walkserve.adapters.orpheus:tiny",
    "tiny-qwen3-omni": "walkserve.adapters.qwen3_omni:tiny",
    "tiny-qwen25-omni": "walkserve.adapters.qwen25_omni:tiny",
    "tiny-janus": "walkserve.adapters.janus:tiny",
    "tiny-sd3": "walkserve.adapters.diffusers_dit:tiny",
    "tiny-vjepa2-ac": "walkserve.adapters.vjepa2_ac:tiny",
    "tiny-pi05": "walkserve.adapters.pi05:tiny",
}


def model_names() -> list[str]:
    from walkserve.adapters.examples import EXAMPLES

    return [DEFAULT_MODEL, *EXAMPLES, *TINY_HF, *ADAPTERS]


@dataclass(frozen=True)
class Entry:
    """A served name: ``load(seed)`` -> ``(model, sample_inputs)``; ``profile(name)`` -> its
    ``ModelProfile`` under the name clients use."""

    load: Callable[[int], tuple[nn.Module, dict[str, Any]]]
    profile: Callable[[str], ModelProfile]


def resolve(name: str) -> Entry:
    """The loader and profile of ``name`` (see the module docstring); ``ValueError`` naming the
    known models for a name that is none of them."""
    from walkserve.adapters.examples import EXAMPLES, build_example

    if name == DEFAULT_MODEL:
        from walkserve.adapters import default

        return Entry(default.build, default.api_profile)
    if name in EXAMPLES:
        return Entry(lambda seed: build_example(name, seed), _walks_only)
    if name in TINY_HF:
        from walkserve.adapters.hf_causal_lm import tiny_profile

        return Entry(lambda seed: tiny_hf_lm(name.removeprefix("tiny-"), seed), tiny_profile)
    target = ADAPTERS.get(name, name)
    if os.path.isdir(target):
        return Entry(
            lambda seed: load_checkpoint(target), lambda served: _checkpoint_profile(target, served)
        )
    if ":" in target:
        module_name, _, factory = target.partition(":")

        def load(seed: int) -> tuple[nn.Module, dict[str, Any]]:
            try:
                obj = getattr(importlib.import_module(module_name), factory)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"cannot load model factory {target!r}: {e}") from None
            result = obj()
            if not (
                isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)
            ):
                raise ValueError(f"{target} must return (model, sample_inputs)")
            return result  # type: ignore[no-any-return]

        return Entry(load, lambda served: _factory_profile(module_name, factory, served))
    raise ValueError(
        f"unknown model {name!r}: expected one of {', '.join(model_names())}, a local checkpoint "
        "directory, or module:factory"
    )


def load_model(name: str, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """Resolve ``name`` (see the module docstring) and build it with ``seed``."""
    return resolve(name).load(seed)


def profile_for(name: str, served_name: str | None = None) -> ModelProfile:
    """The HTTP tasks of model ``name``, under ``served_name`` (default: ``name``)."""
    return resolve(name).profile(served_name or name)


def _walks_only(name: str) -> ModelProfile:
    from walkserve.api.profile import ModelProfile

    return ModelProfile(name)


def _checkpoint_profile(path: str, name: str) -> ModelProfile:
    kind = checkpoint_kind(path)
    if kind == "qwen3-omni":
        from walkserve.adapters import qwen3_omni

        return qwen3_omni.checkpoint_profile(path, name)
    if kind == "qwen25-omni":
        from walkserve.adapters import qwen25_omni

        return qwen25_omni.checkpoint_profile(path, name)
    if kind == "janus":
        from walkserve.adapters.janus.checkpoint import checkpoint_profile as janus_profile

        return janus_profile(path, name)
    if kind == "vlm":
        from walkserve.adapters.vlm.profile import checkpoint_profile as vlm_profile

        return vlm_profile(path, name)
    if kind != "causal-lm":
        return _walks_only(name)  # its walks, through /v1/walks/{walk}
    from walkserve.adapters.hf_causal_lm import checkpoint_profile

    return checkpoint_profile(path, name)  # type: ignore[no-any-return]


def _factory_profile(module_name: str, factory: str, name: str) -> ModelProfile:
    """``<factory>_profile`` beside a ``module:factory`` model, else its module's
    ``api_profile``; a model with neither is served through its walks only."""
    from walkserve.api.profile import ModelProfile

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return ModelProfile(name)
    describe = getattr(module, f"{factory}_profile", None) or getattr(module, "api_profile", None)
    if not callable(describe):
        return ModelProfile(name)
    profile = describe(f"{module_name}:{factory}")
    if not isinstance(profile, ModelProfile):
        raise ValueError(f"{name}: {describe.__name__}() must return a ModelProfile")
    return dataclasses.replace(profile, name=name)  # clients use the name served


def capture_model(name: str, seed: int = 0, on_stage: Callable[[str], None] | None = None) -> Any:
    """``capture.trace`` of ``load_model(name, seed)``, remembering the name and seed so that
    ``runtime.serve`` can have worker processes load the same weights. ``on_stage`` is told as
    each step begins ("loading weights", "checking text engines", one "engine: ..." line per text
    engine with its self-check result, "capturing walks"). A paged engine whose start-up
    self-check fails raises ``hf_engine.SelfCheckFailed``: the server does not start."""
    from walkserve import capture
    from walkserve.adapters.hf_engine import check_engines

    stage = on_stage or (lambda name: None)
    stage("loading weights")
    model, sample = load_model(name, seed)
    stage("checking text engines")
    for path, choice in check_engines(model).items():
        message = f"engine {path or 'model'}: {choice.describe()}"
        logger.info("%s", message)
        stage(message)
    stage("capturing walks")
    captured = capture.trace(model, sample)
    captured.origin = (name, seed)
    return captured


def tiny_hf_lm(arch: str, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A tiny random-weight HF causal LM (grouped-query attention) wrapped in walks."""
    import transformers

    from walkserve.adapters.hf_causal_lm import CausalLMWalks, sample_request

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    lm = model_cls(config).eval()
    from walkserve.runtime.kv.grammar import ByteVocabulary

    vocabulary = ByteVocabulary(256, specials=3, eos=2)  # the profile's ByteTokenizer(256)
    return CausalLMWalks(lm, 2, vocabulary=vocabulary), sample_request([1, 17, 42, 99], 8)


def checkpoint_kind(path: str) -> str:
    """What a local checkpoint directory holds: ``vjepa2-ac`` (``predictor_config.json``),
    ``pi05`` (``pi05_config.json``), ``diffusers`` (``model_index.json``), ``qwen3-omni``, ``qwen25-omni``, ``janus`` or ``vlm``
    (Qwen2-VL, Qwen2.5-VL, LLaVA: ``adapters.vlm``) (by the ``model_type`` of its
    ``config.json``), else ``causal-lm``."""
    import json

    def has(file: str) -> bool:
        return os.path.isfile(os.path.join(path, file))

    if has("predictor_config.json"):
        return "vjepa2-ac"
    if has("pi05_config.json"):
        return "pi05"
    if has("model_index.json"):
        return "diffusers"
    model_type = None
    if has("config.json"):
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    kinds = {"qwen3_omni_moe": "qwen3-omni", "qwen2_5_omni": "qwen25-omni", "janus": "janus"}
    kinds |= {"qwen2_vl": "vlm", "qwen2_5_vl": "vlm", "llava": "vlm"}  # vlm.families.MODEL_TYPES
    return kinds.get(str(model_type), "causal-lm")


def load_checkpoint(path: str) -> tuple[nn.Module, dict[str, Any]]:
    """A local checkpoint directory as walks, by ``checkpoint_kind``."""
    kind = checkpoint_kind(path)
    if kind == "vjepa2-ac":
        from walkserve.adapters.vjepa2_ac import from_checkpoint

        return from_checkpoint(path)
    if kind == "pi05":
        from walkserve.adapters.pi05.loader import from_checkpoint as pi05_checkpoint

        return pi05_checkpoint(path)
    if kind == "diffusers":
        from walkserve.adapters.diffusers_dit import load_pipeline

        return load_pipeline(path)
    if kind == "qwen3-omni":
        from walkserve.adapters.qwen3_omni import load_qwen3_omni

        return load_qwen3_omni(path)
    if kind == "qwen25-omni":
        from walkserve.adapters.qwen25_omni import load_qwen25_omni

        return load_qwen25_omni(path)
    if kind == "janus":
        from walkserve.adapters.janus import load_janus

        return load_janus(path)
    if kind == "vlm":
        from walkserve.adapters.vlm import load_vlm

        return load_vlm(path)
    from walkserve.adapters.hf_causal_lm import load_causal_lm

    return load_causal_lm(path)
