"""Model sources: how a worker process gets the model it serves.

The runtime never names a model or imports the adapters. A captured model remembers its
*source*: a loader (``module:function``, called with the model's name and a seed, returning
``(model, sample_inputs)``), the name it was given, and the seed; every worker calls the same
loader with the same arguments and so builds the same weights. The adapters' registry is the
default loader (``walkserve.adapters.registry:load_model``: built-in models, checkpoint
directories, ``module:factory``); a deployer may name another.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

DEFAULT_LOADER = "walkserve.adapters.registry:load_model"
DEFAULT_CAPTURE = "walkserve.adapters.registry:capture_model"

__all__ = ["DEFAULT_CAPTURE", "DEFAULT_LOADER", "load_source", "resolve"]


def resolve(path: str) -> Callable[..., Any]:
    """The function ``module:function`` names; ValueError when there is none."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"a loader is named module:function, got {path!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {path!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable")
    return fn  # type: ignore[no-any-return]


def load_source(loader: str, name: str, seed: int) -> tuple[Any, dict[str, Any]]:
    """``(model, sample_inputs)`` from ``loader(name, seed)``."""
    return resolve(loader)(name, seed)  # type: ignore[no-any-return]
