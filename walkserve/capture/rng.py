"""Random numbers in walks: a ``torch.Generator`` made and seeded inside a walk, as state.

A diffusion sampler starts from seeded noise::

    @walk
    def sample(self, prompt_ids, steps: int, seed: int):
        g = torch.Generator().manual_seed(seed)                    # a constant or a walk input
        z = torch.randn(prompt_ids.shape[0], 4, 8, 8, generator=g)  # [B, 4, 8, 8]

A generator is a mutable object, which a dataflow graph cannot hold: requests run their ops
out of program order, on several ranks, batched with other requests. So capture records the
generator as a *value*, its state (the tensor ``Generator.get_state()`` returns), and every
draw as one glue op that reads a state and returns the sample and the next state::

    g = torch.Generator().manual_seed(seed)    ->  state0 = glue rng.seed_state(seed)
    z = torch.randn(b, 4, 8, 8, generator=g)   ->  draw = glue rng.draw(state0, "function:torch.randn", (b, 4, 8, 8), {})
                                                   z = draw[0]; state1 = draw[1]

Each request gets its own stream, and a draw returns exactly what eager PyTorch returns for
the same seed and the same sequence of draws (a draw rebuilds a CPU generator from the state
and calls the same function). What crosses the boundary: ``TracedGenerator`` (what
``torch.Generator()`` returns in a walk while capturing, see ``shims``), ``seed_state`` and
``draw`` (the glue functions an IR names), ``DrawMode`` (routes torch calls that name a traced
generator to the tracer).

Not supported, each a ``CaptureError`` that says what to do instead: a draw inside a ``@loop``
body from a generator made outside it (draw every step's noise before the loop and index it,
``noise[k]``); ``Generator.seed()`` and ``initial_seed()`` (not reproducible); a generator made
outside the walk (its state would be shared by all requests); a generator on another device;
an in-place draw into a tensor that is not traced (``torch.empty(...).normal_(generator=g)``:
write ``torch.randn(..., generator=g)``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from walkserve.capture.errors import CaptureError, user_source
from walkserve.capture.gluefn import glue_function

if TYPE_CHECKING:
    from walkserve.capture.tracer import WalkTracer

REAL_GENERATOR: type[torch.Generator] = torch.Generator
SUPPORTED = (
    "g = torch.Generator().manual_seed(seed) in the walk (seed: a Python int or an int walk "
    "input), then torch.randn/rand/randint/randn_like/normal/... (..., generator=g) or "
    "x.normal_(generator=g) on a traced x, in the walk body"
)


@glue_function
def seed_state(seed: int | torch.Tensor) -> torch.Tensor:
    """The state of a CPU generator seeded with ``seed``: uint8 [5056]."""
    return REAL_GENERATOR().manual_seed(int(seed)).get_state()


@glue_function
def draw(
    state: torch.Tensor, target: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[Any, torch.Tensor]:
    """``target(*args, **kwargs, generator=g)`` with ``g`` in ``state``: (sample, next state).
    ``target`` is ``function:<allowlisted name>`` or ``method:<public Tensor method>``."""
    g = REAL_GENERATOR()
    g.set_state(state)
    value = _resolve(target)(*args, **kwargs, generator=g)
    return value, g.get_state()


def _resolve(target: str) -> Callable[..., Any]:
    from walkserve.capture.convert import resolve_function  # convert imports the tracer

    kind, _, name = target.partition(":")
    if kind == "function":
        return resolve_function(name)  # type: ignore[no-any-return]
    if kind == "method" and name.isidentifier() and not name.startswith("_"):
        return lambda obj, *a, **k: getattr(obj, name)(*a, **k)
    raise ValueError(f"rng.draw cannot call {target!r}")


def _fresh_state() -> torch.Tensor:
    return REAL_GENERATOR().get_state()


class TracedGenerator(torch.Generator):
    """What ``torch.Generator()`` returns in a walk while capturing: its ``state`` is a traced
    value (or a tensor for a constant seed) that every draw replaces. It is a real
    ``torch.Generator`` only so that torch's argument parser lets it through to ``DrawMode``."""

    def __new__(cls, tracer: WalkTracer) -> TracedGenerator:
        return super().__new__(cls)

    def __init__(self, tracer: WalkTracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.state: Any = _fresh_state()

    def manual_seed(self, seed: Any) -> TracedGenerator:  # type: ignore[override]
        if isinstance(seed, torch.fx.Proxy):
            try:  # an int walk input, or + - * // % of them: not a tensor's value
                self.tracer._trip_expr(seed, "manual_seed")
            except CaptureError:
                raise CaptureError(
                    "rng-seed",
                    "manual_seed() needs a Python int or an int walk input (or + - * // % of "
                    "them), not a value computed from tensors",
                    user_source(),
                ) from None
            self.state = self.tracer.create_proxy("call_function", seed_state, (seed,), {})
        elif isinstance(seed, int) and not isinstance(seed, bool):
            self.state = seed_state(seed)
        else:
            raise CaptureError(
                "rng-seed",
                f"manual_seed() needs a Python int or an int walk input, got {type(seed).__name__}",
                user_source(),
            )
        return self

    def get_state(self) -> Any:
        return self.state

    def set_state(self, new_state: Any) -> TracedGenerator:  # type: ignore[override]
        self.state = new_state
        return self

    def seed(self) -> int:
        raise _not_reproducible("seed()")

    def initial_seed(self) -> int:
        raise _not_reproducible("initial_seed()")


def _not_reproducible(what: str) -> CaptureError:
    return CaptureError(
        "rng-seed",
        f"Generator.{what} in a walk cannot be captured: a served request must draw what eager "
        f"PyTorch draws for the same inputs. Seed it from the request instead: {SUPPORTED}",
        user_source(),
    )


def generator_outside_walk() -> CaptureError:
    return CaptureError(
        "rng-generator",
        "a torch.Generator made outside the walk is used in it; its state would be shared by "
        f"every request. Make and seed the generator inside the walk: {SUPPORTED}",
        user_source(),
    )


def target_of(func: Any) -> str:
    """The ``draw`` target naming a torch function or Tensor method called with a generator."""
    from walkserve.capture.convert import target_name

    name = getattr(func, "__name__", None)
    if name and getattr(torch.Tensor, name, None) is func:
        return f"method:{name}"
    try:
        return f"function:{target_name(func)}"
    except ValueError:
        raise CaptureError(
            "rng-generator",
            f"{name or func!r} is called with a traced generator but is not a torch function "
            f"capture can name; supported: {SUPPORTED}",
            user_source(),
        ) from None


def new_generator(tracer: WalkTracer, *args: Any, **kwargs: Any) -> TracedGenerator:
    device = kwargs.get("device", args[0] if args else "cpu")
    if torch.device(device).type != "cpu":
        raise CaptureError(
            "rng-device",
            f"torch.Generator(device={device!r}) in a walk: capture supports CPU generators "
            "(a draw rebuilds the generator from its state on whichever rank runs it); draw "
            "on the CPU and move the tensor: torch.randn(..., generator=g).to(device)",
            user_source(),
        )
    return TracedGenerator(tracer)


def trace_draw(
    tracer: WalkTracer, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.fx.Proxy:
    """One traced draw from the generator in ``kwargs``; advances its state."""
    gen: TracedGenerator = kwargs["generator"]
    rest = {k: v for k, v in kwargs.items() if k != "generator"}
    state = gen.state
    if isinstance(state, torch.fx.Proxy) and state.node.graph is not tracer.graph:
        raise CaptureError(
            "rng-in-loop",
            "a draw inside a @loop body from a torch.Generator made outside it; the "
            "generator's state would have to be carried from iteration to iteration. Draw "
            "every iteration's noise before the loop and index it per step: "
            "`noise = torch.randn(steps, *shape, generator=g)`, then pass `noise[k]` to "
            "the body",
            user_source(),
        )
    if (
        target.startswith("method:")
        and target.endswith("_")
        and not (args and isinstance(args[0], torch.fx.Proxy))
    ):
        raise CaptureError(
            "rng-in-place",
            f"{target.removeprefix('method:')}(generator=g) fills a tensor that is not traced "
            "(made from constants), which capture would bake into the graph; draw a new "
            "tensor instead: torch.randn(shape, generator=g), or "
            "torch.randn_like(x, generator=g)",
            user_source(),
        )
    out = tracer.create_proxy("call_function", draw, (state, target, tuple(args), rest), {})
    gen.state = tracer.create_proxy("call_function", operator.getitem, (out, 1), {})
    return tracer.create_proxy("call_function", operator.getitem, (out, 0), {})


class DrawMode(TorchFunctionMode):
    """Active while a walk is traced: a torch call that passes a ``TracedGenerator`` becomes a
    traced draw, even when no other argument is traced (``torch.randn(1, 4, generator=g)``
    would otherwise run once at capture time and be baked in as a constant)."""

    def __init__(self, tracer: WalkTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if isinstance(gen, TracedGenerator):
            return self.tracer.draw(target_of(func), args, kwargs)
        if isinstance(gen, REAL_GENERATOR):
            raise generator_outside_walk()
        return func(*args, **kwargs)
