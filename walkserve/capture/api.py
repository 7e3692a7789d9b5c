"""The model author's API: mark components, walks, loops and streams on ordinary PyTorch code.

Everything here is a no-op in eager execution: a decorated model runs exactly as before (the
examples' tests compare eager output with the captured graph's, bit for bit). During
``capture.trace`` the active tracer intercepts loop-body calls, ``stream`` and ``iterations``
through a context-local hook; this module knows nothing of the tracer beyond that hook.

    @component(engine="stateless")          # a class: every instance is one graph node
    class Denoiser(nn.Module): ...
    register_component(LlamaForCausalLM, engine="kv_cache")   # a class you cannot edit

    class Model(nn.Module):
        @walk(next=None)                     # a named request phase; returns a dict of outputs
        def generate(self, prompt_ids, noise):
            cond = self.text_encoder(prompt_ids)
            z = noise
            for k in range(49):              # an ordinary Python loop ...
                z = self.step(z, self.sigmas[k], self.sigmas[k + 1], cond)
            return {"image": self.decoder(z)}

        @loop                                # ... whose body is traced once, not unrolled
        def step(self, z, t, t_next, cond): ...

Conventions the tracer relies on (each violation is a capture error naming the source line):
- a loop body returns its carried values first, in the order of the parameters that receive
  them, then any other per-iteration outputs;
- a data-dependent stop is written ``if <traced bool>: break`` right after the body call, and
  needs ``@loop(max_iters=...)`` (an int, or the name of a walk input holding one);
- per-iteration values accumulate in a Python list joined after the loop with ``torch.cat`` or
  ``torch.stack``; the list holds every iteration's value, the stopping one included;
- ``stream(x, policy, dim)`` hands ``x`` (a loop's accumulated output) to a consumer loop
  chunk by chunk; for ``LeftContext`` each chunk comes with its context length.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

import torch
from torch import nn
from typeguard import typechecked

from walkserve.capture.chunk import ChunkPolicy, LeftContext, split

EngineKind = Literal["stateless", "kv_cache"]
F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)


@dataclass(frozen=True)
class ComponentSpec:
    """How the runtime treats one component: its engine, batch dimension, and whether a
    DynamicLoop may run it speculatively (one step past a stop that is not yet known)."""

    engine: EngineKind = "stateless"
    batch_dim: int = 0
    speculative: bool = True

    def __post_init__(self) -> None:
        if self.engine not in ("stateless", "kv_cache"):
            raise ValueError(f"engine must be 'stateless' or 'kv_cache', got {self.engine!r}")
        if self.batch_dim < 0:
            raise ValueError(f"batch_dim must be >= 0, got {self.batch_dim}")


_CLASS_SPECS: dict[type, ComponentSpec] = {}
_INSTANCE_ATTR = "__walkserve_component__"


@overload
def component(cls: C) -> C: ...
@overload
def component(
    *, engine: EngineKind = "stateless", batch_dim: int = 0, speculative: bool = True
) -> Callable[[C], C]: ...
def component(
    cls: Any = None,
    *,
    engine: EngineKind = "stateless",
    batch_dim: int = 0,
    speculative: bool = True,
) -> Any:
    """Class decorator: every instance of this ``nn.Module`` class is one graph node (a leaf
    for the tracer; its forward is never traced into)."""

    def mark(c: C) -> C:
        register_component(c, engine=engine, batch_dim=batch_dim, speculative=speculative)
        return c

    return mark if cls is None else mark(cls)


@typechecked
def register_component(
    cls: type,
    *,
    engine: EngineKind = "stateless",
    batch_dim: int = 0,
    speculative: bool = True,
) -> None:
    """Mark a class you cannot edit (a Hugging Face model class) as a component."""
    if not issubclass(cls, nn.Module):
        raise TypeError(f"a component must be an nn.Module subclass, got {cls.__qualname__}")
    _CLASS_SPECS[cls] = ComponentSpec(engine, batch_dim, speculative)


@typechecked
def mark_component(
    module: nn.Module,
    *,
    engine: EngineKind = "stateless",
    batch_dim: int = 0,
    speculative: bool = True,
) -> nn.Module:
    """Mark one module instance as a component; returns it."""
    object.__setattr__(module, _INSTANCE_ATTR, ComponentSpec(engine, batch_dim, speculative))
    return module


def component_spec(module: nn.Module) -> ComponentSpec | None:
    """The component spec of ``module`` (instance mark first, then its class's), or None."""
    spec = module.__dict__.get(_INSTANCE_ATTR)
    if isinstance(spec, ComponentSpec):
        return spec
    for klass in type(module).__mro__:
        if klass in _CLASS_SPECS:
            return _CLASS_SPECS[klass]
    return None


# ---------------------------------------------------------------------------------- walks


@dataclass(frozen=True)
class Dim:
    """A dimension of a tensor walk input whose size varies between requests: any size in
    ``[min, max]`` (``max`` None: unbounded). Capture holds every other non-batch dimension to
    its size in the sample request."""

    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.min, bool) or not isinstance(self.min, int) or self.min < 0:
            raise ValueError(f"Dim min must be an int >= 0, got {self.min!r}")
        if self.max is not None and (
            isinstance(self.max, bool) or not isinstance(self.max, int) or self.max < self.min
        ):
            raise ValueError(f"Dim max must be an int >= min ({self.min}), got {self.max!r}")


DimDecl = Dim | Literal["dynamic"] | tuple[int, int | None]


@dataclass(frozen=True)
class Input:
    """What a walk input accepts beyond what capture sees in the sample request, declared
    with ``@walk(inputs={name: Input(...)})``; requests are checked against it before they are
    admitted (``capture.inputs.check_inputs``)::

        @walk(inputs={"prompt_ids": Input(dims={1: Dim(max=4096)}, vocab=VOCAB),
                      "steps": Input(min=1, max=1000)})
        def generate(self, prompt_ids, steps: int): ...

    ``dims``: dimension -> its size range (``Dim``, ``"dynamic"`` or ``(min, max)``); dimension
    0, the batch, is free unless given. ``min``/``max``: the value of an int or float input, or
    of every element of an integer tensor. ``vocab``: token ids, ``0 <= id < vocab``, every
    dimension free; an int, or a function of the model returning it (``lambda m:
    m.lm.config.vocab_size``) when only the instance knows. Capture finds the vocabulary by
    itself when an ``nn.Embedding`` reads the input as it is. ``finite``: refuse NaN and
    infinities in a float input (the default)."""

    dims: Mapping[int, DimDecl] = field(default_factory=dict)
    min: int | float | None = None
    max: int | float | None = None
    vocab: int | Callable[[Any], int] | None = None
    finite: bool = True

    def __post_init__(self) -> None:
        dims: dict[int, Dim] = {}
        for d, decl in dict(self.dims).items():
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ValueError(f"Input dims keys are dimensions (ints >= 0), got {d!r}")
            if decl == "dynamic":
                dims[d] = Dim()
            elif isinstance(decl, tuple):
                dims[d] = Dim(*decl)
            elif isinstance(decl, Dim):
                dims[d] = decl
            else:
                raise ValueError(
                    f"Input dims[{d}] must be a Dim, 'dynamic' or (min, max), got {decl!r}"
                )
        object.__setattr__(self, "dims", dims)
        if self.vocab is not None:
            if not callable(self.vocab) and (
                isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 1
            ):
                raise ValueError(f"Input vocab must be an int >= 1, got {self.vocab!r}")
            if self.min is not None or self.max is not None:
                raise ValueError("Input takes vocab or min/max, not both")
        if self.min is not None and self.max is not None and self.max < self.min:
            raise ValueError(f"Input max ({self.max}) is below min ({self.min})")

    def resolve(self, model: Any) -> Input:
        """This declaration with a vocabulary function evaluated on ``model``."""
        if not callable(self.vocab):
            return self
        return Input(dict(self.dims), self.min, self.max, int(self.vocab(model)), self.finite)

    def dim(self, d: int) -> Dim | None:
        """The declared size range of dimension ``d``, or None."""
        decl = self.dims.get(d)
        return decl if isinstance(decl, Dim) else None


@dataclass(frozen=True)
class WalkSpec:
    """A walk's declaration: its name, the walk that follows it by default (None: the request
    ends), which outputs are request state for later walks rather than client outputs, and
    what its inputs accept beyond what capture sees (``Input``)."""

    name: str
    next: str | None = None
    state: tuple[str, ...] = ()
    inputs: tuple[tuple[str, Input], ...] = ()


WALK_ATTR = "__walkserve_walk__"
LOOP_ATTR = "__walkserve_loop__"


def walk(
    fn: Any = None,
    *,
    name: str | None = None,
    next: str | None = None,
    state: tuple[str, ...] | list[str] = (),
    inputs: Mapping[str, Input] | None = None,
) -> Any:
    """Mark a method as a walk. It returns a dict of named outputs (or one tensor, named
    ``output``). ``next`` names the walk that follows by default; a model may instead define
    ``next_walk(self, request, walk, outputs) -> str | None``. ``inputs`` declares what an
    input accepts beyond what the sample request shows (``Input``: dynamic dimensions, value
    ranges, a vocabulary)."""
    declared = dict(inputs or {})
    for key, decl in declared.items():
        if not isinstance(decl, Input):
            raise TypeError(f"@walk inputs[{key!r}] must be a capture.Input, got {decl!r}")

    def mark(f: F) -> F:
        spec = WalkSpec(name or f.__name__, next, tuple(state), tuple(declared.items()))
        _check_walk_spec(spec)
        setattr(f, WALK_ATTR, spec)
        return f

    return mark if fn is None else mark(fn)


@typechecked
def _check_walk_spec(spec: WalkSpec) -> None:
    if not spec.name.isidentifier():
        raise ValueError(f"walk name must be an identifier, got {spec.name!r}")
    if spec.next is not None and not spec.next.isidentifier():
        raise ValueError(f"walk next= must name a walk, got {spec.next!r}")


def walk_specs(model: nn.Module) -> dict[str, tuple[str, WalkSpec]]:
    """Walks declared on ``model``'s class: walk name -> (method name, spec), in source order."""
    found: dict[str, tuple[str, WalkSpec]] = {}
    for klass in reversed(type(model).__mro__):
        for attr, value in vars(klass).items():
            spec = getattr(value, WALK_ATTR, None)
            if isinstance(spec, WalkSpec):
                found[spec.name] = (attr, spec)
    return found


# ---------------------------------------------------------------------------------- loops


@dataclass(frozen=True)
class LoopSpec:
    """A loop body's declaration. ``max_iters`` bounds a DynamicLoop (required when the loop
    has a data-dependent stop): an int, or the name of a walk input holding one per request.
    ``speculative=False`` forbids planning the next iteration before the stop is known."""

    max_iters: int | str | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_iters, bool) or (
            isinstance(self.max_iters, int) and self.max_iters <= 0
        ):
            raise ValueError(
                f"max_iters must be a positive int or an input name, got {self.max_iters!r}"
            )


class _Hook:
    """What the active tracer provides; eager execution has none."""

    def call_loop(
        self, spec: LoopSpec, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        raise NotImplementedError

    def stream(self, x: Any, policy: ChunkPolicy, dim: int) -> Iterator[Any]:
        raise NotImplementedError

    def iterations(self, n: Any) -> Iterator[int]:
        raise NotImplementedError


ACTIVE_HOOK: contextvars.ContextVar[_Hook | None] = contextvars.ContextVar(
    "walkserve_capture_hook", default=None
)


def loop(
    fn: Any = None,
    *,
    max_iters: int | str | None = None,
    speculative: bool = True,
) -> Any:
    """Mark a method as a loop body: called once per iteration from an ordinary Python loop,
    traced once. See the module docstring for the conventions."""
    spec = LoopSpec(max_iters, speculative)

    def mark(f: F) -> F:
        @functools.wraps(f)
        def body(*args: Any, **kwargs: Any) -> Any:
            hook = ACTIVE_HOOK.get()
            if hook is None:
                return f(*args, **kwargs)
            return hook.call_loop(spec, f, args, kwargs)

        setattr(body, LOOP_ATTR, spec)
        return body  # type: ignore[return-value]

    return mark if fn is None else mark(fn)


# ---------------------------------------------------------------------------------- streams


def stream(x: Any, policy: ChunkPolicy, dim: int = 1) -> Iterator[Any]:
    """Mark ``x`` (the accumulated output of a producer loop) as a streaming edge to the loop
    that iterates over it: the consumer fires chunk by chunk as ``policy`` allows. Yields each
    chunk (a tensor) or, for ``LeftContext``, ``(chunk, context_length)`` pairs."""
    if not isinstance(policy, ChunkPolicy):
        raise TypeError(f"stream() needs a ChunkPolicy, got {type(policy).__name__}")
    hook = ACTIVE_HOOK.get()
    if hook is not None:
        return hook.stream(x, policy, dim)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"stream() needs a tensor, got {type(x).__name__}")
    return _eager_stream(x, policy, dim)


def _eager_stream(x: torch.Tensor, policy: ChunkPolicy, dim: int) -> Iterator[Any]:
    with_context = isinstance(policy, LeftContext)
    for chunk, span in split(x, policy, dim if dim >= 0 else x.dim() + dim):
        yield (chunk, span.context) if with_context else chunk


def iterations(n: Any) -> Iterator[int]:
    """``range(n)`` for a loop whose trip count comes from the request: ``n`` an int walk
    input, or ``+ - * // %`` of int walk inputs, their sizes (``x.shape[1]``) and ints:
    ``for k in iterations(num_steps): z = self.step(z, k)``. Plain ``range(n)`` in a walk means
    the same while capturing; ``iterations`` also works where ``range`` is not patched (a
    helper in another module)."""
    hook = ACTIVE_HOOK.get()
    if hook is not None:
        return hook.iterations(n)
    return iter(range(int(n)))
