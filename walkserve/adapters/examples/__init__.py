"""The built-in example models, by name: small, seeded, random-weight models that exercise every
structure walkserve captures (parallel guidance branches, bounded and dynamic loops, streams
with fixed and left-context chunks, multi-walk requests with carried KV state).

    name                 model            walks
    example-cfg-image    CFGImageModel    generate(prompt_ids, noise), edit(prompt_ids, image, noise)
    example-speech       SpeechModel      speak(prompt_ids, max_new_tokens)
    example-world        WorldModel       rollout(frames, actions, horizon)
    example-text         TextModel        prefill(prompt_ids) -> decode(token, k_cache, v_cache,
                                                                          max_new_tokens)

Each builder takes a seed and returns ``(model, sample_inputs)``: the model in eval mode without
gradients, and a flat dict of request inputs by name (tensors, or Python ints such as
``max_new_tokens``). A walk takes the inputs its signature names; inputs of a later walk (the
text model's ``max_new_tokens``) are in the same dict. Same seed, same weights and inputs.

Placement files for them live in ``placements/`` as ``<name>.1rank.yaml`` (every model) and
``<name>.<n>ranks.yaml``; ``example_placement(name, ranks)`` finds one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from torch import nn

from walkserve.adapters.examples import cfg_image, speech, text, world


class ExampleBuilder(Protocol):
    """``build(seed=0) -> (model, sample_inputs)``; callable with no argument too."""

    def __call__(self, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]: ...


EXAMPLES: dict[str, ExampleBuilder] = {
    "example-cfg-image": cfg_image.build,
    "example-speech": speech.build,
    "example-world": world.build,
    "example-text": text.build,
}


def build_example(name: str, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """Build the example model ``name`` with weights and sample inputs drawn from ``seed``."""
    builder = EXAMPLES.get(name)
    if builder is None:
        raise ValueError(f"unknown example model {name!r}; expected one of: {', '.join(EXAMPLES)}")
    return builder(seed)


PLACEMENTS_DIR = Path(__file__).parent / "placements"


def example_placement(name: str, ranks: int = 1) -> Path:
    """The shipped placement file of example model ``name`` on ``ranks`` ranks."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown example model {name!r}; expected one of: {', '.join(EXAMPLES)}")
    path = PLACEMENTS_DIR / f"{name}.{ranks}{'rank' if ranks == 1 else 'ranks'}.yaml"
    if not path.is_file():
        shipped = sorted(p.name for p in PLACEMENTS_DIR.glob(f"{name}.*.yaml"))
        raise ValueError(
            f"no {ranks}-rank placement is shipped for {name}; shipped: {', '.join(shipped)}"
        )
    return path
