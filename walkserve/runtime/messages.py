"""Control-plane messages: every struct that crosses a ZeroMQ socket, and their one codec.

Owns the message vocabulary and its wire form (msgpack via msgspec, no pickle). Each message
is a frozen ``msgspec.Struct`` tagged by a ``"type"`` field; ``Message`` is their union, and
``decode`` accepts exactly its members:

    data = encode(RunNode(["r1"], "denoiser", 3, [ref]))   # b'\\x85\\xa4type\\xa7RunNode...'
    match decode(data):                                    # MessageError if malformed
        case RunNode(request_ids=ids, inputs=refs): ...

Values travel as ``wirevalues`` writes them: tensors as ``TensorRef`` (small ones ``Inline``,
large ones as an ``ShmHandle`` into a pool the receiver attached at start-up, ``AttachPools``;
a receiver of a handle sends ``Ack`` to the pool's owner once it no longer needs the slot),
Python scalars and None as themselves, tuples/lists/``torch.Size`` as ``Seq``, and objects that
cannot be encoded (a Hugging Face cache) as ``ObjectRef``: a handle into the per-request object
store of the worker that made the object. Objects never cross a process; only that worker
resolves the handle.

Direction (C: conductor, W: worker):

    W->C  Join, Hello, Heartbeat, Fatal, NodeDone, NodeFailed, BatchDone, BatchFailed,
          RegionEvents, RankStatsReply
    C->W  WorkerSetup, RunNode, RunBatch, StartRegions, DropRuns, Cancel, StatsQuery, Shutdown
    both  AttachPools (the sender's own pools), Ack (to the owner of the handles' pool)

Worker start-up: ``Join`` (connected) -> ``WorkerSetup`` -> ``AttachPools`` (the worker's output
pool) -> ``Hello`` (ready for ``RunBatch``).

To add a message: subclass ``_Msg`` (repeat ``frozen=True``) and add it to ``Message``.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

import msgspec

from walkserve.runtime.net.handles import MooncakeHandle
from walkserve.runtime.shm import ShmHandle, ShmPoolSpec
from walkserve.runtime.wirevalues import (
    Name,
    NonNegInt,
    ObjectKey,
    PosInt,
    RequestId,
    TensorRef,
    Value,
)


class MessageError(ValueError):
    """Bytes that are not a valid ``Message`` (bad msgpack, unknown type, wrong field)."""


class BatchItem(msgspec.Struct, frozen=True):
    """One request's share of a ``RunBatch``: the values the node reads, by name.
    ``item`` tells items of one batch apart (one request may appear twice: two iterations)."""

    item: NonNegInt
    request_id: RequestId
    inputs: dict[Name, Value]


class ItemOutput(msgspec.Struct, frozen=True):
    """The values a node produced for one item that are read outside the node, by name."""

    item: NonNegInt
    values: dict[Name, Value]


class ItemError(msgspec.Struct, frozen=True):
    """Why an item failed; ``error`` is a message fit for a client."""

    item: NonNegInt
    error: str


# ---------------------------------------------------------------------------- messages


class _Msg(msgspec.Struct, frozen=True, tag=True, tag_field="type"):
    """Base of all messages: the tag is the class name."""


class Hello(_Msg, frozen=True):
    """A worker is up and ready for ``AttachPools``."""

    rank: NonNegInt
    pid: PosInt


class AttachPools(_Msg, frozen=True):
    """The shared-memory pools whose handles this worker may receive."""

    pools: list[ShmPoolSpec]


class Shutdown(_Msg, frozen=True):
    """Stop: drop in-flight work, release everything, exit."""


class KVStats(msgspec.Struct, frozen=True):
    """One paged KV pool of a worker (a ``PagedLM`` component), as of the sender's last look."""

    component: str
    pages_in_use: NonNegInt
    pages_cached: NonNegInt
    num_pages: NonNegInt
    live_sequences: NonNegInt
    evictions: NonNegInt
    prefix_hits: NonNegInt


class Heartbeat(_Msg, frozen=True):
    """Liveness. ``t`` is the sender's ``time.monotonic()`` (comparable on one host); ``kv``:
    the worker's paged KV pools (empty when it hosts none)."""

    rank: NonNegInt
    t: float
    kv: list[KVStats] = []


class RunNode(_Msg, frozen=True):
    """Run ``node`` once for a batch of requests. ``inputs`` are in the node's parameter
    order, each batched over ``request_ids``; ``iteration`` counts loop steps from 0."""

    request_ids: list[RequestId]
    node: Name
    iteration: NonNegInt
    inputs: list[TensorRef]


class NodeDone(_Msg, frozen=True):
    """``node`` ran for ``request_ids`` at ``iteration``; ``outputs`` in the node's order."""

    request_ids: list[RequestId]
    node: Name
    iteration: NonNegInt
    outputs: list[TensorRef]


class NodeFailed(_Msg, frozen=True):
    """``node`` raised for ``request_ids``; ``error`` is a message fit for a client."""

    request_ids: list[RequestId]
    node: Name
    error: str


class Cancel(_Msg, frozen=True):
    """Drop all state of ``request_ids`` (finished, aborted, failed, or client gone): one
    message for the requests that ended in one conductor pass, so that a burst of exits does
    not wake the rank (and end its fast lane) once per request."""

    request_ids: list[RequestId]


class Ack(_Msg, frozen=True):
    """The sender is done reading these handles; their slots may be reused."""

    handles: list[ShmHandle | MooncakeHandle]


class Join(_Msg, frozen=True):
    """A worker process connected and waits for its ``WorkerSetup``."""

    rank: NonNegInt
    pid: PosInt


class TPJoin(msgspec.Struct, frozen=True):
    """How a worker joins its tensor-parallel group (``runtime.tp.group.TPSetup``'s fields)
    and the components the group runs (``ExecutablePlan.tp_groups``)."""

    ranks: list[NonNegInt]
    rank: NonNegInt
    store: Literal["tcp", "file"]
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    backend: Literal["gloo", "nccl"]
    device: Name
    timeout_s: float
    components: list[Name]


class WorkerSetup(_Msg, frozen=True):
    """Everything a worker builds its part of the plan from. The worker loads the weights
    itself (``registry.load_model(model, seed)``); ``ir`` is ``serialize.to_json`` of the
    captured graph, ``plan`` is ``ExecutablePlan.to_json``; ``pool`` is the conductor's
    shared-memory pool, whose handles the worker will receive. ``data``: how tensors travel
    between this worker and the conductor: ``shm`` (one host), ``inline`` (all in the
    messages) or ``mooncake`` (``runtime.net``: a worker on another host)."""

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    seed: int
    ir: str
    plan: str
    rank: NonNegInt
    pool: ShmPoolSpec
    data: Literal["shm", "inline", "mooncake"] = "shm"
    speculate: bool = True  # the rank scheduler's (see ``rankscheduler``)
    stream_buffer_limit: PosInt = 64
    peers: dict[int, str] = {}  # rank -> its peer socket (``Fetch``); empty: hold nothing
    hold: bool = False  # keep values no one needs the bytes of (the server's conductor asks)
    loader: Name = "walkserve.adapters.registry:load_model"  # module:function(model, seed)
    tp: TPJoin | None = None  # this rank's tensor-parallel group (joined before loading)
    # "mooncake": ranks on other hosts read the tensors this one holds, and it reads theirs,
    # through Mooncake (``ObjectRef.at``); ``exchange_host``: the address its engine listens
    # at when its data path to the conductor has none (a spawned worker)
    exchange: Literal["", "mooncake"] = ""
    exchange_host: Annotated[str, msgspec.Meta(max_length=255)] = "127.0.0.1"


class Fatal(_Msg, frozen=True):
    """A worker cannot go on (its setup failed) and exits; ``error`` says why."""

    rank: NonNegInt
    error: str


class RunBatch(_Msg, frozen=True):
    """Run node ``node`` of walk ``walk`` once for every item (one batched call for a
    component node). ``batch`` is the sender's id; the reply carries it back. ``ops``: run
    only these of the node's ops (in plan order); ``outputs``: the values to send back
    (defaults: the whole node, and the values it makes that are read outside it; with
    ``ops``, every one of them)."""

    batch: NonNegInt
    walk: Name
    node: Name
    items: list[BatchItem]
    ops: list[Name] | None = None
    outputs: list[Name] | None = None


class BatchDone(_Msg, frozen=True):
    """Batch ``batch`` ran on ``rank``; one ``ItemOutput`` per item that ran, in the batch's
    order; ``deferred``: the items its component could not run now (send them again later);
    ``errors``: the items that failed (alone: the others of the batch are in ``outputs``)."""

    batch: NonNegInt
    rank: NonNegInt
    outputs: list[ItemOutput]
    deferred: list[NonNegInt] = []
    errors: list[ItemError] = []


class BatchFailed(_Msg, frozen=True):
    """Batch ``batch`` failed on ``rank``: one ``ItemError`` per item of the batch. The
    worker goes on serving."""

    batch: NonNegInt
    rank: NonNegInt
    errors: list[ItemError]


class RegionStart(msgspec.Struct, frozen=True):
    """Run region ``region`` of ``walk`` for ``request_id`` (the conductor's item ``item``)."""

    item: NonNegInt
    request_id: RequestId
    walk: Name
    region: Name
    inputs: dict[Name, Value]
    stream: bool = True  # report the region's client streams item by item


class StartRegions(_Msg, frozen=True):
    """Region runs for the receiving rank to start; it reports them in ``RegionEvents``.
    ``more``: the conductor pass that sent them sends this rank more (``runtime.burst``)."""

    starts: list[RegionStart]
    more: bool = False


class RegionStreamed(msgspec.Struct, frozen=True, tag="streamed", tag_field="type"):
    """Iteration ``index`` of region item ``item``'s streamed channel committed."""

    item: NonNegInt
    channel: Name
    index: NonNegInt
    value: Value


class RegionOutput(msgspec.Struct, frozen=True, tag="output", tag_field="type"):
    """Outputs of region item ``item`` that exist before its exit."""

    item: NonNegInt
    outputs: dict[Name, Value]


class RegionDone(msgspec.Struct, frozen=True, tag="done", tag_field="type"):
    """Region item ``item`` finished; ``outputs``: those no ``RegionOutput`` brought."""

    item: NonNegInt
    outputs: dict[Name, Value]


class RegionFailed(msgspec.Struct, frozen=True, tag="failed", tag_field="type"):
    item: NonNegInt
    error: str


class RegionConsumed(msgspec.Struct, frozen=True, tag="consumed", tag_field="type"):
    """Region item ``item`` has ``received`` pieces of fed stream ``stream`` and released its
    items before ``base`` (``closed``: it takes no more)."""

    item: NonNegInt
    stream: Name
    base: NonNegInt
    received: NonNegInt
    closed: bool


RegionEvent: TypeAlias = RegionStreamed | RegionOutput | RegionDone | RegionFailed | RegionConsumed


class FeedStream(_Msg, frozen=True):
    """Items of fed stream ``stream`` for region item ``item`` (of ``request_id``), from
    another region: ``pieces`` in order (held values the receiver pulls from their rank);
    ``finished``: no piece follows."""

    item: NonNegInt
    request_id: RequestId
    stream: Name
    pieces: list[Value]
    finished: bool


class GrantCredit(_Msg, frozen=True):
    """Region item ``item`` may commit items of ``channel`` up to ``items``."""

    item: NonNegInt
    channel: Name
    items: NonNegInt


class RegionEvents(_Msg, frozen=True):
    """What the region runs of ``rank`` did in one engine step, in order."""

    rank: NonNegInt
    events: list[RegionEvent]


class DropRuns(_Msg, frozen=True):
    """The conductor no longer wants these region items (their iteration was discarded):
    drop their runs, report nothing more of them."""

    items: list[NonNegInt]


class StatsQuery(_Msg, frozen=True):
    """Ask for ``RankStatsReply``; answered after every command sent before it."""

    seq: NonNegInt


class RankStatsReply(_Msg, frozen=True):
    """A rank's scheduler and stores, as of the moment it answered ``StatsQuery`` ``seq``."""

    seq: NonNegInt
    rank: NonNegInt
    runs: NonNegInt  # region runs live
    live_values: NonNegInt  # values its region runs hold
    objects: NonNegInt  # objects its per-request store holds
    speculated_steps: NonNegInt
    wasted_steps: NonNegInt
    batch_sizes: dict[int, int]  # items per step -> steps (region runs and node batches)
    # counters of the rank's components that keep some (``components.component_counters``):
    # "component path/counter" -> count since the rank started (an encoder cache's hits)
    counters: dict[str, NonNegInt] = {}


class Release(_Msg, frozen=True):
    """The conductor holds these keys of ``request_id``'s store no more: drop them."""

    request_id: RequestId
    keys: list[ObjectKey]


class Fetch(_Msg, frozen=True):
    """Worker to worker (its peer socket): the values of ``refs`` (this rank's keys of
    ``request_id``), answered by ``Fetched`` with the same ``seq``."""

    seq: NonNegInt
    request_id: RequestId
    keys: list[ObjectKey]


class Fetched(_Msg, frozen=True):
    """The values asked for (in order), or why not; ``pool``: the sender's output pool, which
    the handles among them are in (the reader attaches it once)."""

    seq: NonNegInt
    values: list[Value] = []
    error: str | None = None
    pool: ShmPoolSpec | None = None


class Probe(_Msg, frozen=True):
    """A link measurement (``runtime.net.link``): the worker reads ``value`` through its
    transport and answers ``ProbeReply``; the conductor releases what ``value`` held."""

    seq: NonNegInt
    value: Value


class ProbeReply(_Msg, frozen=True):
    seq: NonNegInt
    rank: NonNegInt


class Wake(_Msg, frozen=True):
    """Nothing to do: work for the rank is on its way (a request is being admitted). A rank
    that slept since its last work starts polling for it now, while the conductor still
    admits the request, instead of being woken by the work itself."""


Message: TypeAlias = (
    Hello
    | AttachPools
    | Shutdown
    | Heartbeat
    | RunNode
    | NodeDone
    | NodeFailed
    | Cancel
    | Ack
    | Join
    | WorkerSetup
    | Fatal
    | RunBatch
    | BatchDone
    | BatchFailed
    | Probe
    | ProbeReply
    | StartRegions
    | RegionEvents
    | DropRuns
    | StatsQuery
    | RankStatsReply
    | Release
    | Fetch
    | Fetched
    | FeedStream
    | GrantCredit
    | Wake
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """The wire form of ``msg``."""
    if not isinstance(msg, _Msg):
        raise TypeError(f"not a control-plane message: {type(msg).__name__}")
    return _encoder.encode(msg)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message ``data`` encodes; ``MessageError`` for anything else."""
    try:
        return _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise MessageError(f"invalid control-plane message: {e}") from e
