"""What a rank asks of its model's components, found by what they have (no model named): the
ones that keep a KV pool (``KVEngine``: sized before they allocate, ``configure_kv``) and the
ones that keep counters (``component_counters``, read for each stats query)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["KVEngine", "component_counters", "configure_kv"]


class KVEngine(Protocol):
    """What the worker needs of a component that keeps a KV pool (``runtime.kv``'s engines
    say so by having these): its pool's size, figures for heartbeats, and a release."""

    config_kv: Any  # a dataclass with pool_tokens and page_size

    def kv_stats(self, wait: bool = True) -> Any: ...

    def release_kv(self) -> None: ...


def configure_kv(
    model: Any, pool_tokens: int | None, page_size: int | None, step_tokens: int | None = None
) -> list[tuple[str, KVEngine]]:
    """Size the KV pools of ``model``'s components that keep one (before any allocates), and
    the tokens one forward computes of those that chunk prefills (``max_step_tokens``);
    returns them by name."""
    from dataclasses import replace

    found = []
    for name, module in model.named_modules():
        if all(hasattr(module, a) for a in ("config_kv", "kv_stats", "release_kv")):
            config = module.config_kv
            if pool_tokens is not None:
                config = replace(config, pool_tokens=pool_tokens)
            if page_size is not None:
                config = replace(config, page_size=page_size)
            if step_tokens is not None and hasattr(config, "max_step_tokens"):
                config = replace(config, max_step_tokens=step_tokens)
            module.config_kv = config
            found.append((name, module))
    return found


def component_counters(model: Any) -> Callable[[], dict[str, int]]:
    """What reads the counters of ``model``'s components that keep some (a ``counters()``
    method returning ``{name: count}``, e.g. a vision tower's encoder cache): keys are
    ``"module path/name"``."""
    found = [
        (name, module)
        for name, module in model.named_modules()
        if callable(getattr(module, "counters", None))
    ]

    def read() -> dict[str, int]:
        return {f"{n}/{k}": int(v) for n, m in found for k, v in m.counters().items()}

    return read
