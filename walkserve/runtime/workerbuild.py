"""A worker's setup (``WorkerSetup``): its model loaded and placed on its device
(``runtime.device``), its shared-memory pool and transport, its peers on this host and its
exchange with other hosts, its engine loop. ``worker.Worker`` is a ``WorkerBuild``; the setup
runs once, on the main thread, before the engine loop starts::

    plan                 the rank's device (cuda: this process's GPU from now on)
    load_source          the model's weights (a TP member joins its group first: its shard)
    configure_kv         KV pools sized (they allocate on first use, on the device)
    place                this rank's components and the glue's tensors to the device
    ShmPool, transport   outputs out; inputs in, moved to the device as decoded
    peers, exchange      held values of this host's ranks, of other hosts' (Mooncake)
    EngineLoop           runner (the plan's nodes here), rank scheduler (its regions)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from walkserve.runtime import heap
from walkserve.runtime.components import KVEngine, component_counters, configure_kv
from walkserve.runtime.config import KiB, WorkerConfig

if TYPE_CHECKING:
    import torch

    from walkserve.runtime.engine import EngineLoop
    from walkserve.runtime.messages import Message, WorkerSetup
    from walkserve.runtime.peers import PeerClient, PeerServer
    from walkserve.runtime.shm import ShmPool
    from walkserve.runtime.shmreader import ShmReader
    from walkserve.runtime.tp.member import TPMember
    from walkserve.runtime.transport import ObjectStore, ShmTransport

__all__ = ["WorkerBuild"]


class WorkerBuild:
    """The setup of ``Worker`` (see the module docstring)."""

    # the worker's state it sets (declared by Worker)
    rank: int
    address: str
    config: WorkerConfig
    device: torch.device | None
    engine: EngineLoop
    pool: ShmPool
    reader: ShmReader
    objects: ObjectStore
    transport: ShmTransport
    peer_server: PeerServer | None
    peers: PeerClient | None
    pull: Callable[[Any], Any] | None
    tp: TPMember | None
    _kv: list[tuple[str, KVEngine]]

    def _send(self, msg: Message) -> None:
        raise NotImplementedError

    def _tp_broken(self, error: BaseException) -> None:
        raise NotImplementedError

    def _build(self, setup: WorkerSetup) -> None:
        import torch

        from walkserve.capture.model import CapturedModel
        from walkserve.capture.serialize import from_json
        from walkserve.lowering.plan import ExecutablePlan
        from walkserve.runtime.device import place, placed_components, rank_device
        from walkserve.runtime.engine import EngineLoop
        from walkserve.runtime.rankscheduler import RankScheduler
        from walkserve.runtime.regionwalk import region_walks
        from walkserve.runtime.runner import NodeRunner
        from walkserve.runtime.shm import ShmPool, ShmPoolConfig
        from walkserve.runtime.shmreader import ShmReader
        from walkserve.runtime.source import load_source
        from walkserve.runtime.transport import ObjectStore, ShmTransport

        if setup.rank != self.rank:
            raise ValueError(f"setup is for rank {setup.rank}")
        if setup.tp is not None:  # joined first: the loader loads this rank's shard
            from walkserve.runtime.tp.member import join_member

            self.tp = join_member(setup.tp, self._tp_broken)
        plan = ExecutablePlan.from_json(setup.plan)
        device = rank_device(plan.device, self.rank)
        if device.type == "cuda":
            self.device = device  # (``WorkerInbox``) inputs are moved there as decoded
            torch.cuda.set_device(device)  # CUDA graphs, streams, the KV pools: this rank's
        model, _ = load_source(setup.loader, setup.model, setup.seed)
        self._kv = configure_kv(
            model, self.config.kv_pool_tokens, self.config.kv_page_size, self.config.kv_step_tokens
        )
        if self.tp is not None:
            self.tp.attach(model)
        captured = CapturedModel(from_json(setup.ir), model)
        mine = placed_components(plan, self.rank)
        place(model, mine, set(captured.graph.components) - mine, device)
        min_slot = 64 * KiB
        self.pool = ShmPool(
            ShmPoolConfig(
                min_slot_bytes=min_slot,
                max_slot_bytes=max(min_slot, self.config.shm_max_slot_bytes),
                slots_per_class=self.config.shm_slots_per_class,
                when_exhausted="raise",  # a full pool sends inline (transport), never waits
            )
        )
        self.reader = ShmReader([setup.pool])
        self.objects = ObjectStore(self.rank)
        self.transport = ShmTransport(
            self.pool,
            self.reader,
            inline_max_bytes=self.config.inline_max_bytes,
            objects=self.objects,
        )
        if setup.data != "shm":  # a worker on another host (runtime.net)
            from walkserve.runtime.net.remote import remote_transport

            self.transport = remote_transport(
                setup.data, self.address, self.objects, self.config.inline_max_bytes
            )
        if setup.peers and self.rank in setup.peers and setup.data == "shm":
            from walkserve.runtime.peers import PeerClient, PeerServer

            self.peer_server = PeerServer(
                setup.peers[self.rank],
                self.objects,
                self.pool,
                self.reader,
                self.config.inline_max_bytes,
            )
            self.peers = PeerClient(self.rank, dict(setup.peers), self.reader)
        if setup.exchange == "mooncake":  # ranks on other hosts read what this one holds
            self._exchange(setup)
        runner = NodeRunner(captured, plan, self.rank)
        components = component_counters(model)
        scheduler = RankScheduler(
            region_walks(captured, plan, self.rank),
            speculate=setup.speculate,
            stream_buffer_limit=setup.stream_buffer_limit,
            max_batch=plan.max_batch,
            joins=runner.joinable(),
        )
        self.engine = EngineLoop(
            self.rank,
            plan,
            runner,
            scheduler,
            self.transport,
            self.objects,
            self._send,
            hold=setup.hold and (self.peers is not None or self.pull is not None),
            here=frozenset({self.rank, *(setup.peers if self.peers is not None else ())}),
            counters=lambda: components() | heap.counters() | runner.counters(),
        )
        if self.config.freeze_heap:  # what it holds now lives as long as the process
            heap.freeze()

    def _exchange(self, setup: WorkerSetup) -> None:
        """Held tensors exported through Mooncake for readers on other hosts, and theirs
        pulled from them: the engine of the data path to the conductor where there is one (a
        remote rank's), else one listening at ``setup.exchange_host``."""
        from walkserve.runtime.net.mooncake import (
            MooncakeConfig,
            MooncakeEngine,
            MooncakeTransport,
            SendPool,
        )

        if isinstance(self.transport, MooncakeTransport):
            engine = self.transport.engine
        else:
            engine = MooncakeEngine(MooncakeConfig(host=setup.exchange_host))
        self.objects.exports = SendPool(engine)
        self.pull = engine.pull
