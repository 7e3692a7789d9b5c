"""``TPRunner``: one batched component run by every rank of a TP group on the same batch, with
one dispatch in (to the group's leader) and one result out (the leader's).

Owns the control channel of a group (each batch broadcast from the leader over the group's
gloo ``cpu_group``, encoded with msgspec: tensors as raw bytes, never pickle), the table of
objects the component returned (a ``PagedKV``: state that lives on every rank, one per rank),
and the order in which those objects are released. What crosses its boundary:

- in (leader): ``run(calls)``, ``calls`` as a batched component's ``forward_batch`` takes them
  (``[(args, kwargs), ...]``: tensors, ints, floats, bools, strings, None, lists, tuples, dicts
  of str, and ``TPObject`` handles this runner returned earlier);
- out (leader): the leader's results, in which every object the component returned is a
  ``TPObject`` (the same handle each time the same object comes back); ``DEFER`` and tensors as
  the component gave them; a dataclass result (a ``ModelOutput``) as a record of its type
  with its fields so mapped;
- followers: ``follow()`` runs every broadcast batch until the leader's ``close()``.

One step::

    worker (leader)         leader rank 0                        follower rank 1..N-1
    run(calls)  ------->    encode(releases, calls)
                            broadcast ------------------------>  decode
                            release handles, resolve handles      release handles, resolve
                            component.forward_batch(calls)  <==>  component.forward_batch(calls)
                                   (the model's collectives pair up inside)
                            handles for new objects               handles for new objects
    results  <----------    results (objects -> TPObject)         results dropped

Every rank must make the same decisions (a ``PagedLM`` defers, evicts and reuses prefixes by
its pool's state): so every rank's state must be a function of the broadcast stream alone.
Hence objects are released only at a step boundary, in the order the leader's handles were
dropped, on every rank alike (a ``TPObject`` going out of scope only queues its handle); and
logits reach every rank whole (``shard.py``), so sampling agrees. ``verify=True`` checks it:
after each step every rank's results are hashed and compared (one more collective; for tests).

Failure: a component error that every rank raises alike (bad input, before any collective)
is returned to the caller and the group goes on. A collective that fails (a peer died, or
timed out after ``TPSetup.timeout_s``) breaks the group for good: ``TPGroupError``, on this
and every later call. The group cannot heal: its surviving ranks must be stopped and its
requests failed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from walkserve.lowering.batched import Deferred
from walkserve.runtime.tensorcodec import TensorHeader, from_bytes, to_bytes
from walkserve.runtime.tp.group import TPGroup

__all__ = ["TPGroupError", "TPObject", "TPRunner"]

Call = tuple[Sequence[Any], dict[str, Any]]
BatchFn = Callable[[Sequence[Call]], Sequence[Any]]


class TPGroupError(RuntimeError):
    """A collective of the group failed: a rank died or timed out. The group is unusable."""


class TPObject:
    """An object the component returned, living on every rank of the group (the leader's
    caller holds this handle instead). Pass it back in a later call of the same runner; when
    the last reference goes, the objects are released on every rank at the next step."""

    __slots__ = ("__weakref__", "handle")

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return f"TPObject({self.handle})"


# ------------------------------------------------------------------------------ wire form


class _Tensor(msgspec.Struct, tag="t", frozen=True):
    header: TensorHeader
    data: bytes


class _Handle(msgspec.Struct, tag="h", frozen=True):
    handle: int


class _Seq(msgspec.Struct, tag="s", frozen=True):
    items: list[Value]
    is_tuple: bool


class _Map(msgspec.Struct, tag="m", frozen=True):
    items: dict[str, Value]


Value = bool | int | float | str | _Tensor | _Handle | _Seq | _Map | None


class _WireCall(msgspec.Struct, frozen=True):
    args: list[Value]
    kwargs: dict[str, Value]


class _Step(msgspec.Struct, tag="step", frozen=True):
    release: list[int]
    calls: list[_WireCall]


class _Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


_Message = _Step | _Stop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Message)


# ------------------------------------------------------------------------------ the runner


class TPRunner:
    """Run ``component`` (its ``forward_batch``, or ``forward_batch`` itself) on every rank of
    ``group``; see the module docstring. The leader calls ``run`` and ``close``; each
    follower calls ``follow``, which returns when the leader closes."""

    def __init__(self, group: TPGroup, component: Any, *, verify: bool = False) -> None:
        self.group = group
        self._batch: BatchFn = getattr(component, "forward_batch", component)
        self.verify = verify
        self._objects: dict[int, Any] = {}  # handle -> the component's object on this rank
        self._handles: dict[int, int] = {}  # id(object) -> handle
        self._next = 0
        self._proxies: weakref.WeakValueDictionary[int, TPObject] = weakref.WeakValueDictionary()
        self._dropped: deque[int] = deque()  # leader: handles whose TPObject went away
        self._lock = threading.Lock()  # leader: one step at a time
        self._broken: BaseException | None = None
        self._closed = False
        self.steps = 0

    @property
    def live_objects(self) -> int:
        return len(self._objects)

    @property
    def broken(self) -> bool:
        """A collective failed: the group is unusable."""
        return self._broken is not None

    # -------------------------------------------------------------------------- leader

    def run(self, calls: Sequence[Call]) -> list[Any]:
        """One step on every rank; the leader's results (objects as ``TPObject``). An empty
        ``calls`` only releases the objects whose handles were dropped."""
        if not self.group.is_leader:
            raise RuntimeError("run() is the leader's; a follower calls follow()")
        with self._lock:
            self._check_usable()
            release = []
            while self._dropped:
                release.append(self._dropped.popleft())
            step = _Step(release, [_WireCall(_enc_list(a), _enc_dict(k)) for a, k in calls])
            self._send(step)
            results, error = self._execute(step)
            if error is not None:
                raise error
            return [self._export(r) for r in results]

    def close(self) -> None:
        """Leader: tell the followers to return from ``follow`` (idempotent). The group itself
        stays joined (``TPGroup.close``)."""
        with self._lock:
            if self._closed or not self.group.is_leader:
                self._closed = True
                return
            self._closed = True
            if self._broken is None:
                self._send(_Stop())
            self._drop_all()

    # -------------------------------------------------------------------------- follower

    def follow(self) -> int:
        """Follower: run every step the leader broadcasts until it closes; returns the number
        of steps run. Component errors are the leader's to report; a failed collective raises
        ``TPGroupError``."""
        if self.group.is_leader:
            raise RuntimeError("follow() is a follower's; the leader calls run()")
        while True:
            message = self._receive()
            if isinstance(message, _Stop):
                self._closed = True
                self._drop_all()
                return self.steps
            self._execute(message)

    # -------------------------------------------------------------------------- one step

    def _execute(self, step: _Step) -> tuple[list[Any], Exception | None]:
        """Release, resolve, run, register: the same on every rank."""
        for handle in step.release:  # the last reference goes here, at the step boundary
            self._handles.pop(id(self._objects.get(handle)), None)
            self._objects.pop(handle, None)
        self.steps += 1
        error: Exception | None = None
        try:  # an error here happens alike on every rank; the leader reports it
            calls = [
                ([self._dec(v) for v in c.args], {k: self._dec(v) for k, v in c.kwargs.items()})
                for c in step.calls
            ]
            results = list(self._batch(calls)) if calls else []  # [] only releases
        except TPGroupError:
            raise
        except Exception as e:
            results, error = [], e
        if error is None:
            results = [self._register(r) for r in results]
        if self.verify:
            self._verify(results, error)
        return results, error

    def _register(self, value: Any) -> Any:
        """``value`` with each object replaced by its handle (new ones get the next handle)."""
        if value is None or isinstance(value, (bool, int, float, str, torch.Tensor, Deferred)):
            return value
        if _is_record(value):
            return _rebuild(value, self._register)
        if isinstance(value, (list, tuple)):
            items = [self._register(v) for v in value]
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, dict):
            return {k: self._register(v) for k, v in value.items()}
        handle = self._handles.get(id(value))
        if handle is None:
            handle, self._next = self._next, self._next + 1
            self._objects[handle] = value
            self._handles[id(value)] = handle
        return _Handle(handle)

    def _export(self, value: Any) -> Any:
        """Leader: handles in a result become ``TPObject`` proxies (one per handle)."""
        if isinstance(value, _Handle):
            proxy = self._proxies.get(value.handle)
            if proxy is None:
                proxy = TPObject(value.handle)
                self._proxies[value.handle] = proxy
                weakref.finalize(proxy, self._dropped.append, value.handle)
            return proxy
        if _is_record(value):
            return _rebuild(value, self._export)
        if isinstance(value, (list, tuple)):
            items = [self._export(v) for v in value]
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, dict):
            return {k: self._export(v) for k, v in value.items()}
        return value

    def _dec(self, value: Value) -> Any:
        if isinstance(value, _Tensor):
            return from_bytes(value.header, value.data)
        if isinstance(value, _Handle):
            if value.handle not in self._objects:
                raise ValueError(f"TPObject({value.handle}) was released or is not this runner's")
            return self._objects[value.handle]
        if isinstance(value, _Seq):
            items = [self._dec(v) for v in value.items]
            return tuple(items) if value.is_tuple else items
        if isinstance(value, _Map):
            return {k: self._dec(v) for k, v in value.items.items()}
        return value

    def _drop_all(self) -> None:
        self._objects.clear()
        self._handles.clear()

    # -------------------------------------------------------------------------- checks

    def _verify(self, results: list[Any], error: Exception | None) -> None:
        digest = hashlib.blake2b(digest_size=8)
        digest.update(repr(type(error)).encode())
        _digest(results, digest)
        mine = torch.tensor([int.from_bytes(digest.digest(), "little") >> 1], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.group.size)]
        self._collective(lambda: dist.all_gather(every, mine, group=self.group.cpu_group))
        if any(not torch.equal(e, every[0]) for e in every):
            raise TPGroupError(
                f"step {self.steps}: the ranks of {self.group} returned different results "
                f"(digests {[int(e) for e in every]}): their states diverged"
            )

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TPGroupError(f"{self.group} failed earlier: {self._broken}") from self._broken
        if self._closed:
            raise RuntimeError("this TPRunner is closed")

    # -------------------------------------------------------------------------- channel

    def _send(self, message: _Step | _Stop) -> None:
        payload = _encoder.encode(message)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._collective(lambda: dist.broadcast(size, src=0, group=self.group.cpu_group))
        self._collective(lambda: dist.broadcast(data, src=0, group=self.group.cpu_group))

    def _receive(self) -> _Step | _Stop:
        size = torch.zeros(1, dtype=torch.int64)
        self._collective(lambda: dist.broadcast(size, src=0, group=self.group.cpu_group))
        data = torch.empty(int(size[0]), dtype=torch.uint8)
        self._collective(lambda: dist.broadcast(data, src=0, group=self.group.cpu_group))
        return _decoder.decode(data.numpy().tobytes())

    def _collective(self, op: Callable[[], Any]) -> None:
        try:
            op()
        except Exception as e:  # gloo: peer closed or timed out; NCCL: timeout or abort
            self._broken = e
            raise TPGroupError(f"{self.group}: a collective failed: {e}") from e


# ------------------------------------------------------------------------------ records


def _is_record(value: Any) -> bool:
    """A dataclass instance a component returned (a transformers ``ModelOutput``): its fields
    are registered one by one, so its tensors come back as tensors and the objects in it
    (a cache) as handles, in a record of the same type."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _rebuild(value: Any, each: Callable[[Any], Any]) -> Any:
    fields = {f.name: each(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    return type(value)(**fields)


# ------------------------------------------------------------------------------ encoding


def _enc(value: Any) -> Value:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        header, data = to_bytes(value.detach().cpu())
        return _Tensor(header, data)
    if isinstance(value, TPObject):
        return _Handle(value.handle)
    if isinstance(value, (list, tuple)):
        return _Seq(_enc_list(value), isinstance(value, tuple))
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return _Map(_enc_dict(value))
    raise TypeError(
        f"a TP call argument must be a tensor, a scalar, a string, None, a list, tuple or "
        f"str-keyed dict of those, or a TPObject; got {type(value).__name__}"
    )


def _enc_list(values: Sequence[Any]) -> list[Value]:
    return [_enc(v) for v in values]


def _enc_dict(values: dict[str, Any]) -> dict[str, Value]:
    return {k: _enc(v) for k, v in values.items()}


def _digest(value: Any, digest: Any) -> None:
    if isinstance(value, torch.Tensor):
        header, data = to_bytes(value.detach().cpu())
        digest.update(repr(header).encode())
        digest.update(data)
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for v in value:
            _digest(v, digest)
        digest.update(b"]")
    elif _is_record(value):
        digest.update(type(value).__name__.encode())
        _digest({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, digest)
    elif isinstance(value, dict):
        for k in sorted(value):
            digest.update(k.encode())
            _digest(value[k], digest)
    else:
        digest.update(repr(value).encode())
