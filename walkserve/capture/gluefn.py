"""Glue functions: plain Python functions that a walk calls on traced values and that capture
records as one glue op, without tracing into them.

Owns the registry of such functions. What crosses the boundary: ``@glue_function`` on a
module-level function (it stays callable as before); ``registered(name)`` for the interpreter,
which resolves an IR target ``function:<module>.<qualname>`` to the function only if it was
registered (an IR cannot name any other Python function); ``fusible(target)`` for the split
pass.

Why: some per-request glue is plain Python over a request's values that fx cannot trace (a
loop over rows with a seeded generator each, as the speech adapters' token samplers draw).
As a component it would cost a dispatch of its own after every forward; as a glue function it
runs per request inside the dispatch of the component before it (``fuse=True``, the default),
like an ``argmax``::

    @glue_function
    def pick(logits: Tensor, temperature: float, seed: int) -> Tensor: ...

    token = pick(out.logits[:, -1:], temperature, seed)   # in a walk or loop body

The function must be deterministic in its arguments (it runs once per request, on the rank of
the component it follows, and again in the reference interpreter), and must not keep state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.fx

__all__ = ["fusible", "glue_function", "registered"]

F = TypeVar("F", bound=Callable[..., Any])

_FUNCTIONS: dict[str, Callable[..., Any]] = {}
_FUSIBLE: set[str] = set()


def _proxy_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.Proxy | None:
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.fx.Proxy):
                return item
    return None


def glue_function(fn: F | None = None, *, fuse: bool = True) -> Any:
    """Register ``fn`` as a glue function (see the module docstring). ``fuse``: may run inside
    the preceding component's dispatch (else it is a glue node of its own)."""

    def register(f: F) -> F:
        name = f"{f.__module__}.{f.__qualname__}"
        if "<" in name:
            raise ValueError(f"glue functions must be module-level functions, got {name}")

        @functools.wraps(f)
        def call(*args: Any, **kwargs: Any) -> Any:
            proxy = _proxy_in(args, kwargs)
            if proxy is not None:  # capturing: one op, not traced into
                return proxy.tracer.create_proxy("call_function", call, args, kwargs)
            return f(*args, **kwargs)

        _FUNCTIONS[name] = call
        if fuse:
            _FUSIBLE.add(f"function:{name}")
        return call  # type: ignore[return-value]

    return register(fn) if fn is not None else register


def registered(name: str) -> Callable[..., Any] | None:
    """The glue function registered as ``<module>.<qualname>``, or None."""
    return _FUNCTIONS.get(name)


def fusible(target: str) -> bool:
    """Whether the IR op target ``function:<name>`` is a glue function that may fuse."""
    return target in _FUSIBLE
