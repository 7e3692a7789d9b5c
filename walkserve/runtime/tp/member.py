"""A worker process's part in its tensor-parallel group: join it, load the model's shard, run
the group's components on every rank in lockstep.

Owns ``TPMember``: the group a worker joined (``TPGroup``), the one ``TPRunner`` over which
every sharded component of the group travels, and the process's *current group*
(``current_group``), which a model loader reads to load its shard instead of the whole model
(``adapters.hf_causal_lm``: ``shard.load_sharded``). What crosses its boundary: a ``TPSetup``
and the plan's ``TPGroupPlan`` in (from ``WorkerSetup``); out, on the leader, the model with
each sharded component's ``forward_batch`` (or ``forward``) sent through the runner; on a
follower, a thread that runs what the leader sends until the leader stops::

    worker (leader, group rank 0)                  worker (follower, group rank 1..N-1)
    member = TPMember.join(setup, group)           member = TPMember.join(setup, group)
    model = loader(...)   (current_group: shard)   model = loader(...)
    member.attach(model)                           member.attach(model)
      lm.forward_batch := send through the runner     thread: runner.follow()
    engine loop -> lm.forward_batch(calls)  ---->     the same lm.forward_batch(calls)
    member.close(): the followers return           the thread ends; exits with the worker

One runner carries every component of the group: each step's first call is a header naming
the component and how it is called (``forward_batch``, or ``forward`` per call), so the
followers run the same component on the same calls in the same order. A broken group (a rank
died: ``TPGroupError``) cannot heal: ``on_broken`` is called (the worker exits, the pool sees
it dead and fails its requests, other replicas keep serving).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from walkserve.runtime.tp.group import TPGroup, TPSetup
from walkserve.runtime.tp.runner import Call, TPGroupError, TPRunner

__all__ = ["TPMember", "current_group", "join_member"]

log = logging.getLogger("walkserve.tp")

_current: TPGroup | None = None


def current_group() -> TPGroup | None:
    """The TP group this process joined (a loader then loads its shard), or None."""
    return _current


class TPMember:
    """See the module docstring. ``components``: the component paths the group runs."""

    def __init__(
        self,
        group: TPGroup,
        components: Sequence[str],
        on_broken: Callable[[BaseException], None],
    ) -> None:
        self.group = group
        self.components = tuple(components)
        self.on_broken = on_broken
        self._modules: dict[str, nn.Module] = {}
        self._calls: dict[tuple[str, str], Callable[[Sequence[Call]], list[Any]]] = {}
        self.runner = TPRunner(group, self._step)
        self._follower: threading.Thread | None = None

    @classmethod
    def join(
        cls,
        setup: TPSetup,
        components: Sequence[str],
        on_broken: Callable[[BaseException], None],
    ) -> TPMember:
        """Join the group (blocks until every rank has) and make it the current group."""
        global _current
        member = cls(TPGroup.join(setup), components, on_broken)
        _current = member.group
        return member

    @property
    def is_leader(self) -> bool:
        return self.group.is_leader

    def attach(self, model: nn.Module) -> None:
        """Find the group's components in ``model``; on the leader, route their calls through
        the runner; on a follower, start following."""
        for path in self.components:
            module = model.get_submodule(path)
            self._modules[path] = module
            batch = getattr(module, "forward_batch", None)
            if batch is not None:
                self._calls[(path, "batch")] = _batched(batch)
            self._calls[(path, "call")] = _per_call(module.forward)
            if not self.is_leader:
                continue
            if batch is not None:
                setattr(module, "forward_batch", self._sender(path, "batch"))  # noqa: B010
            else:
                setattr(module, "forward", _one(self._sender(path, "call")))  # noqa: B010
        if not self.is_leader:
            self._follower = threading.Thread(
                target=self._follow, name=f"walkserve-tp-follow-{self.group.setup.rank}"
            )
            self._follower.daemon = True
            self._follower.start()

    def _sender(self, path: str, how: str) -> Callable[[Sequence[Call]], list[Any]]:
        def send(calls: Sequence[Call]) -> list[Any]:
            try:
                return self.runner.run([((path, how), {}), *calls])
            except TPGroupError as e:
                self.on_broken(e)
                raise

        return send

    def _step(self, calls: Sequence[Call]) -> list[Any]:
        """Every rank: the header call names the component and the calling convention."""
        (path, how), _ = calls[0]
        return self._calls[(str(path), str(how))](calls[1:])

    def _follow(self) -> None:
        try:
            with torch.no_grad():  # as the leader's engine runs its batches
                steps = self.runner.follow()
            log.info("%s: the leader stopped after %d steps", self.group, steps)
        except TPGroupError as e:
            log.error("%s: %s", self.group, e)
            self.on_broken(e)

    def close(self, timeout_s: float = 5.0) -> None:
        """The leader tells the followers to stop; a follower waits for its thread. The group
        is left only when its collectives ended cleanly (a dead peer's would hang)."""
        global _current
        try:
            if self.is_leader:
                self.runner.close()
            elif self._follower is not None:
                self._follower.join(timeout_s)
        except TPGroupError as e:
            log.warning("%s: closing: %s", self.group, e)
        clean = not self.runner.broken and (self._follower is None or not self._follower.is_alive())
        if clean:
            self.group.close()
        _current = None


def join_member(join: Any, on_broken: Callable[[BaseException], None]) -> TPMember:
    """Join the group a ``messages.TPJoin`` names."""
    setup = TPSetup(
        tuple(join.ranks),
        join.rank,
        join.store,
        join.address,
        join.backend,
        join.device,
        join.timeout_s,
    )
    return TPMember.join(setup, join.components, on_broken)


def _one(send: Callable[[Sequence[Call]], list[Any]]) -> Callable[..., Any]:
    """A ``forward`` that sends its one call through the runner."""
    return lambda *args, **kwargs: send([(args, kwargs)])[0]


def _batched(batch: Callable[[Sequence[Call]], Sequence[Any]]) -> Callable[..., list[Any]]:
    return lambda calls: list(batch(calls))


def _per_call(forward: Callable[..., Any]) -> Callable[[Sequence[Call]], list[Any]]:
    return lambda calls: [forward(*args, **kwargs) for args, kwargs in calls]
