"""``CapturedModel``: the Walk Graph IR together with the model whose components it calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from walkserve.capture import ir


class CapturedModel:
    """What ``capture.trace`` returns: ``graph`` (the IR) and ``model`` (the nn.Module whose
    components and parameters the IR names by path). Tensor constants made while tracing are
    kept in ``graph.constants`` and materialized once here."""

    def __init__(self, graph: ir.WalkGraph, model: nn.Module) -> None:
        self.graph = graph
        self.model = model
        self._constants: dict[str, torch.Tensor] = {}
        # Set by capture: the sample inputs it traced with (lowering runs them again); set by
        # ``adapters.registry.capture_model``: the (model name, seed) that rebuilds the same
        # weights, which worker processes use to load their own copy.
        self.sample_inputs: dict[str, Any] = {}
        self.origin: tuple[str, int] | None = None

    @property
    def walks(self) -> dict[str, ir.Walk]:
        return self.graph.walks

    def walk(self, name: str) -> ir.Walk:
        try:
            return self.graph.walks[name]
        except KeyError:
            raise KeyError(
                f"unknown walk {name!r}; the model has {sorted(self.graph.walks)}"
            ) from None

    def constant(self, name: str) -> torch.Tensor:
        tensor = self._constants.get(name)
        if tensor is None:
            from walkserve.capture.serialize import tensor_from_data

            tensor = self._constants[name] = tensor_from_data(self.graph.constants[name])
        return tensor

    def attr(self, path: str) -> torch.Tensor:
        """A parameter or buffer of the model by dotted path."""
        module_path, _, name = path.rpartition(".")
        module = self.model.get_submodule(module_path) if module_path else self.model
        value = getattr(module, name)
        if not isinstance(value, torch.Tensor):
            raise KeyError(f"{path} is not a tensor attribute of the model")
        return value

    def next_walk(
        self, request: Mapping[str, Any], walk: str, outputs: Mapping[str, Any]
    ) -> str | None:
        """The walk after ``walk``: the model's ``next_walk`` if it defines one, else the
        walk's declared ``next``."""
        # the graph says first: a module's getattr of a name it lacks raises inside, which
        # every walk's end would pay
        custom = getattr(self.model, "next_walk", None) if self.graph.custom_transition else None
        if callable(custom):
            nxt = custom(request, walk, outputs)
            if nxt is not None and nxt not in self.graph.walks:
                raise ValueError(f"next_walk returned unknown walk {nxt!r}")
            return nxt  # type: ignore[no-any-return]
        return self.graph.walks[walk].next

    def run(self, inputs: Mapping[str, Any], walk: str | None = None) -> dict[str, Any]:
        """Run one request through the reference interpreter (see ``interpret``)."""
        from walkserve.capture.interpret import Interpreter

        with torch.no_grad():
            return Interpreter(self).run(inputs, walk)

    def lint(self) -> None:
        from walkserve.capture.lint import lint

        lint(self.graph)

    def to_json(self) -> str:
        from walkserve.capture.serialize import to_json

        return to_json(self.graph)

    def render(self, walk: str | None = None) -> str:
        from walkserve.capture.render import render_text

        return render_text(self.graph, walk)

    def __repr__(self) -> str:
        return f"CapturedModel({self.graph.model}, walks={list(self.graph.walks)})"
