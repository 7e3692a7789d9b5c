"""Names capture substitutes in the model's modules while a walk is traced.

Plain Python cannot ask a traced value for a number: ``range(n)`` with ``n`` an int walk input
raises ``'Proxy' object cannot be interpreted as an integer``, ``len(x)`` raises too, and
``torch.Generator().manual_seed(seed)`` refuses a traced seed. While ``capture.trace`` runs,
the globals of every module that defines a walk or a loop body of the model see these instead
(restored afterwards; fx patches globals the same way for ``torch.fx.wrap``):

    range(n)            range(start, n, step): a loop over a traced trip count, i.e.
                        ``iterations(...)``, recorded as an integer expression of walk inputs
    len(x)              ``len`` as a traced value (a trip count when ``x`` is a walk input)
    torch.Generator()   a ``rng.TracedGenerator`` (``torch`` is a thin proxy of the module)
    Generator()         the same, for ``from torch import Generator``

Outside a trace, in other threads, and for untraced arguments each behaves as the original.
What crosses the boundary: ``patched(functions)``, a context manager.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

from walkserve.capture.api import ACTIVE_HOOK
from walkserve.capture.rng import REAL_GENERATOR


def _range(*args: Any) -> Any:
    hook = ACTIVE_HOOK.get()
    if hook is not None and any(isinstance(a, fx.Proxy) for a in args):
        return hook.traced_range(*args)  # type: ignore[attr-defined]
    return builtins.range(*args)


def _len(obj: Any) -> Any:
    if isinstance(obj, fx.Proxy):
        return obj.tracer.create_proxy("call_function", builtins.len, (obj,), {})
    return builtins.len(obj)


def _traced_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        hook = ACTIVE_HOOK.get()
        if hook is None:
            return fn(*args, **kwargs)
        return hook.torch_call(fn, args, kwargs)  # type: ignore[attr-defined]

    return call


class _GeneratorMeta(type):
    """``isinstance(g, torch.Generator)`` keeps working in patched modules."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, REAL_GENERATOR)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, REAL_GENERATOR)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        hook = ACTIVE_HOOK.get()
        if hook is None:
            return REAL_GENERATOR(*args, **kwargs)
        return hook.generator(*args, **kwargs)  # type: ignore[attr-defined]


class Generator(metaclass=_GeneratorMeta):
    """``torch.Generator`` in a patched module."""


class _TorchProxy(types.ModuleType):
    """The ``torch`` module, except ``torch.Generator``, and torch functions that accept
    traced sizes (``torch.randn(x.shape[0], 4)``, ``torch.linspace(1, 0, steps)``: fx alone
    passes a Proxy where torch's argument parser wants an int) and traced generators."""

    def __init__(self) -> None:
        super().__init__("torch")
        self._functions: dict[str, Callable[..., Any]] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "Generator":
            return Generator
        value = getattr(torch, name)
        if not callable(value) or isinstance(value, (type, types.ModuleType)):
            return value
        wrapped = self._functions.get(name)
        if wrapped is None:
            wrapped = self._functions[name] = _traced_call(value)
        return wrapped

    def __dir__(self) -> list[str]:
        return dir(torch)


_TORCH = _TorchProxy()
_MISSING = object()
_SUBSTITUTES: dict[str, Callable[[Any], Any | None]] = {
    # name -> (current global value -> substitute, or None to leave it)
    "range": lambda v: _range if v is _MISSING else None,
    "len": lambda v: _len if v is _MISSING else None,
    "torch": lambda v: _TORCH if v is torch else None,
    "Generator": lambda v: Generator if v is REAL_GENERATOR else None,
}


@contextlib.contextmanager
def patched(functions: list[Callable[..., Any]]) -> Iterator[None]:
    """Substitute the names above in the globals of the modules defining ``functions``."""
    namespaces = {id(g): g for g in (_globals_of(f) for f in functions) if g is not None}
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for ns in namespaces.values():
            for name, pick in _SUBSTITUTES.items():
                old = ns.get(name, _MISSING)
                new = pick(old)
                if new is not None:
                    saved.append((ns, name, old))
                    ns[name] = new
        yield
    finally:
        for ns, name, old in reversed(saved):
            if old is _MISSING:
                ns.pop(name, None)
            else:
                ns[name] = old


def _globals_of(fn: Callable[..., Any]) -> dict[str, Any] | None:
    fn = inspect.unwrap(fn)
    return getattr(fn, "__globals__", None)
