"""The Walk Graph IR: what capture produces and every later layer reads.

A ``WalkGraph`` is a set of components, a set of named walks, and the transitions between
walks. A walk's body is a ``Block``: an ordered list of nodes in SSA form (every node produces
one value named after the node; arguments refer to values by name with ``Ref``). There are three
node kinds, a closed set like torch.fx's node ops:

- ``Op(kind="component")``: one call of a component (a marked nn.Module, named by its module
  path in the model): a transformer forward, a VAE decode.
- ``Op(kind="glue")``: one small tensor operation between components (``torch.cat``,
  ``operator.getitem``, a method call); lowering groups them.
- ``LoopNode``: a loop whose body is its own ``Block``, traced once. Its parameters are
  *carried* (initial value outside, new value from the previous iteration), *per-step* (one
  value per iteration: a constant table, an affine index, a slice of a tensor, a stream chunk)
  or *invariant*. It produces *terminal* channels (the last iteration's value) and
  *accumulated* channels (every iteration's value joined with cat/stack); their names are
  disjoint. A ``DynamicLoop`` adds a stop value in the body and a required ``max_iters``.

A loop's trip count is a constant, an int walk input, an integer expression of walk inputs
(``ExprTrips``: ``range(points - 1)``), or the chunks of a stream; ``loopsem`` evaluates it per
request for every executor. Each ``WalkInput`` carries an ``InputSpec`` (what a valid value is),
checked before a request is admitted (``inputs.check_inputs``).

Streaming edges are listed per walk: the accumulated channel of a producer loop flows into a
consumer loop chunk by chunk under a chunk policy. ``Parallel`` and ``Sequential`` are not
stored: they follow from the dataflow and are derived by ``sections()``: component nodes that
cannot reach each other form a ``Parallel`` section.

Printed form of the CFG example's ``generate`` walk (``walkserve trace``, glue abridged)::

    walk generate(prompt_ids, noise) -> image
      full_like = glue torch.full_like(prompt_ids, 0)
      parallel
        text_encoder = component text_encoder(prompt_ids)
        text_encoder_1 = component text_encoder(full_like)
      loop euler_step x19
        carried     z <- noise, next add_2
        per step    t = self.sigmas[i], t_next = self.sigmas[1 + i]
        invariant   text_ctx = text_encoder, img_ctx = expand, ...
        terminal    euler_step.z = add_2
        parallel
          denoiser = component denoiser(z, t, text_ctx, img_ctx)
          denoiser_1 = component denoiser(z, t, null_text_ctx, img_ctx)
          denoiser_2 = component denoiser(z, t, null_text_ctx, null_img_ctx)
        ...
        add_2 = glue operator.add(z, mul_2)
      decoder = component decoder(euler_step.z)
      return image = decoder
      streamed: none; at the end: image

Everything here is a msgspec Struct: ``walkserve.capture.serialize`` exports and imports the
IR as JSON that round-trips exactly, ``lint()`` checks every structural invariant, and
``dataflow`` says which values each node reads and defines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

IR_VERSION = 2

# ------------------------------------------------------------------------------ arguments


class Ref(msgspec.Struct, frozen=True, tag="ref"):
    """A value by name: a walk input, a node's output, a loop parameter or channel."""

    name: str


class Const(msgspec.Struct, frozen=True, tag="const"):
    """A JSON scalar constant. Non-finite floats use ``FloatConst``."""

    value: int | float | bool | str | None


class FloatConst(msgspec.Struct, frozen=True, tag="float"):
    """A float written as text (``"inf"``, ``"-inf"``, ``"nan"``, or any repr) for exactness."""

    repr: str


class ListArg(msgspec.Struct, frozen=True, tag="list"):
    items: list[Arg]


class TupleArg(msgspec.Struct, frozen=True, tag="tuple"):
    items: list[Arg]


class DictArg(msgspec.Struct, frozen=True, tag="dict"):
    items: dict[str, Arg]


class SliceArg(msgspec.Struct, frozen=True, tag="slice"):
    start: Arg
    stop: Arg
    step: Arg


class DTypeArg(msgspec.Struct, frozen=True, tag="dtype"):
    """A torch dtype by name (``float32``)."""

    name: str


class DeviceArg(msgspec.Struct, frozen=True, tag="device"):
    name: str


class EllipsisArg(msgspec.Struct, frozen=True, tag="ellipsis"):
    pass


class TensorConst(msgspec.Struct, frozen=True, tag="tensor"):
    """A tensor constant made during tracing, stored in ``WalkGraph.constants``."""

    name: str


class ModelAttr(msgspec.Struct, frozen=True, tag="attr"):
    """A parameter or buffer of the model, by its dotted path (read at run time)."""

    path: str


Arg = (
    Ref
    | Const
    | FloatConst
    | ListArg
    | TupleArg
    | DictArg
    | SliceArg
    | DTypeArg
    | DeviceArg
    | EllipsisArg
    | TensorConst
    | ModelAttr
)

# ------------------------------------------------------------------------------ values


class TensorMeta(msgspec.Struct, frozen=True, tag="tensor"):
    """Shape (None: varies between requests or iterations) and dtype of a tensor value, as
    observed on the sample inputs."""

    shape: list[int | None]
    dtype: str


class ScalarMeta(msgspec.Struct, frozen=True, tag="scalar"):
    kind: Literal["int", "float", "bool"]


class OpaqueMeta(msgspec.Struct, frozen=True, tag="opaque"):
    """Any other Python value (a structured model output, a cache object)."""

    kind: str


ValueMeta = TensorMeta | ScalarMeta | OpaqueMeta

# ------------------------------------------------------------------------------ nodes


class Op(msgspec.Struct, tag="op"):
    """One component call or one glue operation; produces the value named ``name``.

    ``target`` is the component's module path for components; for glue it is
    ``"function:<qualified name>"`` (``function:torch.cat``) or ``"method:<name>"``
    (``method:view``, called on the first argument).
    """

    name: str
    kind: Literal["component", "glue"]
    target: str
    args: list[Arg] = []
    kwargs: dict[str, Arg] = {}
    source: str | None = None  # "file.py:123": the user's line that made this node


class FixedTrips(msgspec.Struct, frozen=True, tag="fixed"):
    count: int


class InputTrips(msgspec.Struct, frozen=True, tag="input"):
    """As many iterations as the walk input ``input`` says (an int per request)."""

    input: str


class StreamTrips(msgspec.Struct, frozen=True, tag="stream"):
    """One iteration per chunk of the walk's streaming edge ``stream``."""

    stream: str


class IntInput(msgspec.Struct, frozen=True, tag="input"):
    """The int walk input ``name`` (a Python int or a one-element integer tensor)."""

    name: str


class IntSize(msgspec.Struct, frozen=True, tag="size"):
    """``input.shape[dim]`` of the tensor walk input ``input``."""

    input: str
    dim: int


class IntLit(msgspec.Struct, frozen=True, tag="lit"):
    value: int


class IntBinOp(msgspec.Struct, frozen=True, tag="binop"):
    """``left <op> right`` with Python's int semantics (``floordiv`` and ``mod`` round toward
    negative infinity)."""

    op: Literal["add", "sub", "mul", "floordiv", "mod"]
    left: IntExpr
    right: IntExpr


IntExpr = IntInput | IntSize | IntLit | IntBinOp


class ExprTrips(msgspec.Struct, frozen=True, tag="expr"):
    """As many iterations as the integer expression ``expr`` of walk inputs says, evaluated
    per request (``range(points - 1)``, ``range(2 * n)``, ``range(x.shape[1])``)."""

    expr: IntExpr


TripCount = FixedTrips | InputTrips | ExprTrips | StreamTrips


class Carried(msgspec.Struct, frozen=True, tag="carried"):
    """Initial value ``init`` (outer scope); later iterations get body output ``output``."""

    init: Arg
    output: int


class Invariant(msgspec.Struct, frozen=True, tag="invariant"):
    value: Arg


class AffineStep(msgspec.Struct, frozen=True, tag="affine"):
    """Iteration ``i`` gets the Python int ``start + i * step``."""

    start: int
    step: int


class TableStep(msgspec.Struct, frozen=True, tag="table"):
    """Iteration ``i`` gets ``values[i]`` (bounded loops only)."""

    values: list[Arg]


class SelectStep(msgspec.Struct, frozen=True, tag="select"):
    """Iteration ``i`` gets ``source.select(dim, start + i * step)``."""

    source: Arg
    dim: int
    start: int
    step: int


class ChunkStep(msgspec.Struct, frozen=True, tag="chunk"):
    """Iteration ``i`` gets chunk ``i`` of streaming edge ``stream``, whose source value is
    ``source`` (``part="context"``: the number of left-context items in the chunk)."""

    stream: str
    source: str
    part: Literal["data", "context"] = "data"


class PerStep(msgspec.Struct, frozen=True, tag="per_step"):
    source: AffineStep | TableStep | SelectStep | ChunkStep


ParamRole = Carried | Invariant | PerStep


class LoopParam(msgspec.Struct, frozen=True):
    name: str  # placeholder name inside the body
    role: ParamRole


class Accumulated(msgspec.Struct, frozen=True):
    """Channel joining body output ``output`` of every iteration with cat/stack on ``dim``."""

    output: int
    mode: Literal["cat", "stack"]
    dim: int


class LoopNode(msgspec.Struct, tag="loop"):
    """A bounded ``Loop`` (``dynamic=False``) or a ``DynamicLoop`` (``stop`` set; it needs
    ``max_iters`` unless it iterates a stream, whose chunks bound it).

    Body outputs ``outputs`` are values of the body block. Channels produced in the outer
    scope: ``terminal`` (channel -> body output index; the last iteration's value) and
    ``accumulated`` (channel -> ``Accumulated``). The stop value, evaluated after each
    iteration, ends the loop when true; the stopping iteration's outputs count.
    """

    name: str
    body: Block
    params: list[LoopParam]
    outputs: list[str]
    terminal: dict[str, int]
    accumulated: dict[str, Accumulated]
    trips: TripCount
    stop: str | None = None
    max_iters: int | str | None = None  # int, or a walk input's name
    speculative: bool = True
    source: str | None = None

    @property
    def dynamic(self) -> bool:
        return self.stop is not None

    def channels(self) -> list[str]:
        return [*self.terminal, *self.accumulated]


Node = Op | LoopNode


class Block(msgspec.Struct):
    """An ordered dataflow region (a walk body or a loop body). ``params`` are the values
    bound on entry; ``nodes`` are in a valid execution order."""

    params: list[str]
    nodes: list[Node]


class StreamEdge(msgspec.Struct, frozen=True):
    """A streaming edge: ``source`` (a producer loop's accumulated channel) flows to the loop
    ``consumer`` chunk by chunk along ``dim`` under ``policy`` (``chunk.ChunkPolicy.to_json``)."""

    name: str
    source: str
    consumer: str
    dim: int
    policy: dict[str, str | int | float]


class DimRange(msgspec.Struct, frozen=True, tag="range"):
    """A tensor dimension whose size may vary between requests, within ``[min, max]``
    (``max`` None: unbounded)."""

    min: int = 1
    max: int | None = None


class InputSpec(msgspec.Struct, frozen=True):
    """What a valid value of a walk input is, checked before a request is admitted
    (``capture.inputs.check_inputs``).

    ``kind``: a tensor, a Python scalar, or ``any`` (an object capture cannot describe: not
    checked). A tensor has ``dtype`` and one entry of ``shape`` per dimension: a fixed size, or
    a ``DimRange`` (dimension 0, the batch, is one; so is any dimension the author declared
    dynamic). ``min``/``max``: the smallest and largest value of an int or float, or of every
    element of a tensor (token ids: ``0 .. vocabulary - 1``); ``bounds`` says where they come
    from. ``finite``: floats must not be NaN or infinite."""

    kind: Literal["tensor", "int", "float", "bool", "any"]
    dtype: str | None = None
    shape: list[int | DimRange] | None = None
    min: int | float | None = None
    max: int | float | None = None
    bounds: str | None = None
    finite: bool = False


class WalkInput(msgspec.Struct, frozen=True):
    """A walk parameter. ``default``: the value of a request that does not give it (the walk
    method's own default; a scalar), None: the input is required. ``spec``: what a valid value
    is (set by capture)."""

    name: str
    meta: ValueMeta | None = None
    default: int | float | bool | None = None
    spec: InputSpec | None = None


def with_defaults(walk: Walk, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` plus the default of every input of ``walk`` that it does not give."""
    filled = dict(inputs)
    for i in walk.inputs:
        if i.default is not None and i.name not in filled:
            filled[i.name] = i.default
    return filled


class Walk(msgspec.Struct):
    """A named request phase. Outputs are client outputs except those in ``state``, which
    are request state handed to later walks by name."""

    name: str
    inputs: list[WalkInput]
    body: Block
    outputs: dict[str, Arg]
    streams: list[StreamEdge] = []
    next: str | None = None
    state: list[str] = []
    values: dict[str, ValueMeta] = {}
    source: str | None = None


class ComponentInfo(msgspec.Struct, frozen=True):
    """A component by module path: its class, engine and batch dimension."""

    path: str
    cls: str
    engine: Literal["stateless", "kv_cache"]
    batch_dim: int = 0
    speculative: bool = True
    params: int = 0  # parameter count, for memory estimates


class TensorData(msgspec.Struct, frozen=True):
    """Raw little-endian bytes of a tensor constant, base64 in JSON."""

    dtype: str
    shape: list[int]
    data: bytes


class WalkGraph(msgspec.Struct):
    """Components, walks and transitions of one model. ``custom_transition``: the model
    defines ``next_walk(request, walk, outputs)``, which overrides each walk's ``next``."""

    model: str
    components: dict[str, ComponentInfo]
    walks: dict[str, Walk]
    constants: dict[str, TensorData] = {}
    custom_transition: bool = False
    version: int = IR_VERSION

    def entry_walks(self) -> list[str]:
        """Walks a request can start at: those no other walk's ``next`` names."""
        targets = {w.next for w in self.walks.values()}
        return [name for name in self.walks if name not in targets]
