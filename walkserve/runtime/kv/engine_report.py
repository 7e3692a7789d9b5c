"""Which engine serves each language model of a served model, as plain data: ``EngineChoice``.

Text engines (``paged_lm.PagedLM``, the fallback ``hf_cache_lm.HFCacheLM``) carry one as
``engine_choice``; ``engine_choices(model)`` collects them by module path, for the start-up log,
``/health`` and ``/v1/models``. Imports nothing of the runtime or the API, so both may read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from torch import nn

__all__ = ["EngineChoice", "EngineKind", "engine_choices"]

EngineKind = Literal["paged", "hf-cache"]
"""``paged``: requests share packed forwards over the paged KV pool. ``hf-cache``: each request
runs the model's own forward with its own cache (exact, slower; the fallback)."""


@dataclass(frozen=True)
class EngineChoice:
    """``architecture``: the model class; ``reason``: why it is not on the paged engine (None
    when it is); ``self_check``: the start-up check's result, once run."""

    engine: EngineKind
    architecture: str
    reason: str | None = None
    self_check: str | None = None

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.engine == "paged":
            text = f"{self.architecture} on the paged KV pool"
        else:
            text = f"{self.architecture} on the fallback engine (its own cache per request)"
        if self.reason:
            text += f": {self.reason}"
        if self.self_check:
            text += f" (self-check {self.self_check})"
        return text

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def engine_choices(model: nn.Module) -> dict[str, EngineChoice]:
    """Every text engine's choice inside ``model``, by module path ("" for the model itself)."""
    return {
        name: choice
        for name, module in model.named_modules()
        if isinstance(choice := getattr(module, "engine_choice", None), EngineChoice)
    }
