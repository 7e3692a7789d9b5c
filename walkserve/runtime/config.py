"""Configuration of the runtime's processes: small frozen dataclasses, validated on creation.

    LoweringConfig  how a model is lowered for serving: device, glue policy, batch buckets
    SchedulingConfig  how work is scheduled: speculation, stream buffers, batches in flight
    LaunchConfig    how worker processes are started: spawned here, or Ray actors
    PoolConfig      the server's side of the worker pool: start/stop deadlines, heartbeats,
                    the control sockets' address, shared memory, KV pool sizes, other hosts
    SupervisionConfig  how the pool watches its ranks: the hang deadline, restarts, crash loops
    WorkerConfig    one worker process's settings (JSON on its spawn command line)
    ShmPoolConfig   one shared-memory pool: slot size classes, slots per class, exhaustion

Imports no torch: a spawned worker reads its config before torch loads (``OMP_NUM_THREADS``
must be set first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import msgspec

__all__ = [
    "INLINE_MAX_BYTES",
    "KiB",
    "LaunchConfig",
    "LoweringConfig",
    "MiB",
    "PoolConfig",
    "SchedulingConfig",
    "ShmPoolConfig",
    "SupervisionConfig",
    "WorkerConfig",
    "default_threads",
    "idle_spin",
    "routing_id",
    "routing_rank",
]

KiB = 1 << 10
MiB = 1 << 20
INLINE_MAX_BYTES = 64 * KiB  # a tensor smaller than this travels inside its message
IDLE_SPIN_S = 0.005  # a worker's default idle spin, where the cores allow it (``idle_spin``)
MAX_IDLE_SPIN_S = 1.0
LINK_MAX_UNSENT = 64 * MiB  # a rank link's commands not read yet, at most (``PoolConfig``)


@dataclass(frozen=True)
class ShmPoolConfig:
    """Size classes are the powers of two from ``min_slot_bytes`` to ``max_slot_bytes``.
    ``when_exhausted``: ``"block"`` waits up to ``block_timeout_s`` for an ack to free a slot,
    then raises ``PoolExhausted``; ``"raise"`` raises at once."""

    min_slot_bytes: int = 64 * KiB
    max_slot_bytes: int = 256 * MiB
    slots_per_class: int = 4
    when_exhausted: Literal["block", "raise"] = "block"
    block_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("min_slot_bytes", "max_slot_bytes"):
            value = getattr(self, name)
            if value < 4 * KiB or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 4096, got {value}")
        if self.max_slot_bytes < self.min_slot_bytes:
            raise ValueError(
                f"max_slot_bytes ({self.max_slot_bytes}) < min_slot_bytes ({self.min_slot_bytes})"
            )
        if self.slots_per_class < 1:
            raise ValueError(f"slots_per_class must be >= 1, got {self.slots_per_class}")
        if self.when_exhausted not in ("block", "raise"):
            raise ValueError(
                f"when_exhausted must be 'block' or 'raise', got {self.when_exhausted!r}"
            )
        if not self.block_timeout_s > 0:
            raise ValueError(f"block_timeout_s must be > 0, got {self.block_timeout_s}")

    @property
    def class_sizes(self) -> tuple[int, ...]:
        sizes = []
        size = self.min_slot_bytes
        while size <= self.max_slot_bytes:
            sizes.append(size)
            size *= 2
        return tuple(sizes)


@dataclass(frozen=True)
class SupervisionConfig:
    """How the pool supervises its spawned ranks (``runtime.supervisor``).

    ``hang_deadline_s``: a ready rank that sends nothing (heartbeats come every
    ``PoolConfig.heartbeat_s``) for longer than this is killed (SIGKILL) and treated as dead;
    None: never. ``restart``: a dead rank is started again with the same setup (weights, plan);
    its requests in flight fail, they are not retried. A rank that dies more than
    ``max_restarts`` times within ``restart_window_s`` is not restarted again: it is
    ``failed``. The n-th restart within the window waits ``restart_backoff_s * 2**(n - 2)``
    (the first is at once)."""

    hang_deadline_s: float | None = 10.0
    restart: bool = True
    max_restarts: int = 3
    restart_window_s: float = 60.0
    restart_backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if self.hang_deadline_s is not None and not self.hang_deadline_s > 0:
            raise ValueError(f"hang_deadline_s must be > 0 or None, got {self.hang_deadline_s}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("restart_window_s", "restart_backoff_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class PoolConfig:
    """``address``: ``"ipc"`` (a socket file in a private temporary directory) or ``"tcp"``
    (127.0.0.1, a free port). ``unresponsive_after_s``: a ready worker silent for this long is
    reported ``unresponsive`` (heartbeats come every ``heartbeat_s``). ``forbid_pickle``: make
    pickle raise inside the workers after their setup. ``shm`` configures this process's pool;
    ``worker_shm_slots_per_class`` the slots per size class of each worker's own pool (which
    holds every node output a worker sends until its reader acks it). ``supervision``: hang
    deadlines and restarts of the spawned ranks. ``idle_spin_s``: how long a worker's engine
    polls its command socket without sleeping after its last work (``workerinbox``); None:
    ``IDLE_SPIN_S`` when the host has a core for each rank's threads and one more for this
    process, else 0 (a spinning rank must not take a core that another rank or the conductor
    needs: ``idle_spin``)."""

    start_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    address: Literal["ipc", "tcp"] = "ipc"
    heartbeat_s: float = 1.0
    unresponsive_after_s: float = 10.0
    inline_max_bytes: int = INLINE_MAX_BYTES
    shm: ShmPoolConfig = field(default_factory=lambda: ShmPoolConfig(when_exhausted="raise"))
    forbid_pickle: bool = False
    kv_pool_tokens: int | None = None  # paged KV pools (PagedLM): tokens each (None: default)
    kv_page_size: int | None = None
    kv_step_tokens: int | None = None  # tokens a PagedLM forward computes (chunked prefill)
    worker_shm_slots_per_class: int = 8  # each worker's output pool: slots per size class
    # Beyond one host (``runtime.net``): ``bind`` ``tcp://HOST:PORT`` puts both ROUTERs on TCP
    # (reports at PORT, commands at PORT+1; PORT 0: free ports) as CURVE servers that admit
    # only known keys; ``remote_ranks`` are not spawned but awaited (``walkserve worker``),
    # their tensors travel inline (no shared memory between hosts); ``keys_dir`` holds the
    # server's and the remote ranks' key files (made where missing). ``remote_data``: how
    # tensors travel to and from remote ranks: inline in the messages, or Mooncake transfers.
    # With "mooncake", a value one rank makes and another host's rank reads goes between
    # them (the reader pulls the block the producer exported), not through this process;
    # with "inline", every value a remote rank reads or makes passes through it.
    bind: str | None = None
    remote_ranks: tuple[int, ...] = ()
    keys_dir: str | None = None
    remote_data: Literal["inline", "mooncake"] = "inline"
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    idle_spin_s: float | None = None
    # each worker freezes its heap once set up (``runtime.heap``): the model, torch and the
    # plan never walked again by a full collection of the cyclic collector (False: they are,
    # as in any Python process; a comparison, or a search for a leak among them)
    freeze_heap: bool = True
    # the ranks spawned on this host talk to the conductor over a rank link each (a Unix
    # socket: ``runtime.ranklink``) when ``address`` is "ipc" and there is no ``bind``; False:
    # over ZeroMQ, as remote ranks do (a comparison)
    rank_links: bool = True
    # bytes of commands a rank link may hold that its rank has not read yet: past it a command
    # fails as one to an unreachable rank (ZeroMQ's queue refused past 1000 messages), so a
    # rank that stops reading cannot grow this process's memory until its hang deadline
    link_max_unsent: int = LINK_MAX_UNSENT

    def __post_init__(self) -> None:
        if self.idle_spin_s is not None and not 0 <= self.idle_spin_s <= MAX_IDLE_SPIN_S:
            raise ValueError(
                f"idle_spin_s must be in [0, {MAX_IDLE_SPIN_S}] or None, got {self.idle_spin_s}"
            )
        if self.kv_page_size is not None and self.kv_page_size < 1:
            raise ValueError(f"kv_page_size must be >= 1, got {self.kv_page_size}")
        if self.kv_step_tokens is not None and self.kv_step_tokens < 1:
            raise ValueError(f"kv_step_tokens must be >= 1, got {self.kv_step_tokens}")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < (self.kv_page_size or 1):
            raise ValueError(
                f"kv_pool_tokens must hold at least one page, got {self.kv_pool_tokens}"
            )
        for name in ("start_timeout_s", "stop_timeout_s", "heartbeat_s", "unresponsive_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.address not in ("ipc", "tcp"):
            raise ValueError(f"address must be 'ipc' or 'tcp', got {self.address!r}")
        if self.inline_max_bytes < 0:
            raise ValueError(f"inline_max_bytes must be >= 0, got {self.inline_max_bytes}")
        if self.link_max_unsent < 1:
            raise ValueError(f"link_max_unsent must be >= 1, got {self.link_max_unsent}")
        if self.worker_shm_slots_per_class < 1:
            raise ValueError(
                f"worker_shm_slots_per_class must be >= 1, got {self.worker_shm_slots_per_class}"
            )
        if self.bind is not None:
            from walkserve.runtime.net.remote import parse_tcp

            parse_tcp(self.bind)
        if self.remote_data not in ("inline", "mooncake"):
            raise ValueError(
                f"remote_data must be 'inline' or 'mooncake', got {self.remote_data!r}"
            )
        if self.remote_ranks and (self.bind is None or self.keys_dir is None):
            raise ValueError(
                "remote_ranks need bind='tcp://HOST:PORT' (where remote workers connect) and "
                "keys_dir (where their CURVE keys are written)"
            )


def default_threads(ranks: int, reserved: int = 1) -> int:
    """Torch threads per worker when none are given: the cores this process may use, less
    ``reserved`` for the conductor's process on the same host (its passes, the pool io thread,
    the HTTP API), divided evenly over ``ranks`` workers, at least 1 (vLLM's CPU backend keeps
    one core from its OpenMP threads for its scheduler process the same way,
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``). Oversubscribed cores cost more than idle ones: on 2
    cores, a worker's 2 OpenMP threads beside the conductor's threads made a small model's
    served rollout 1.9x slower than 1 thread did, and the same loop run eagerly with 2 threads
    4.4x slower than with 1 (``bench_loops``)."""
    return max(1, (_cores() - reserved) // max(1, ranks))


def idle_spin(configured: float | None, ranks: int, threads: int) -> float:
    """A worker's ``idle_spin_s``: ``configured``, or by default ``IDLE_SPIN_S`` when the
    cores this process may use hold every rank's ``threads`` and one more (this process's
    passes and io thread), else 0."""
    if configured is not None:
        return configured
    return IDLE_SPIN_S if _cores() >= ranks * threads + 1 else 0.0


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def routing_id(rank: int, generation: int = 0) -> bytes:
    """The ZeroMQ identity of both of rank ``rank``'s sockets; ``generation``: how many times
    the rank was restarted (a stale process of an earlier generation is not heard)."""
    if generation == 0:
        return f"walkserve-rank-{rank}".encode()
    return f"walkserve-rank-{rank}-g{generation}".encode()


def routing_rank(identity: bytes) -> int | None:
    """The rank a ``routing_id`` names (None: not one)."""
    parts = identity.decode(errors="replace").split("-")
    return int(parts[2]) if len(parts) >= 3 and parts[2].isdigit() else None


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Process-level settings, given to the child at spawn as JSON (a plain ``str``: spawn
    pickles its arguments, so they stay plain data). ``forbid_pickle``: after setup, every
    pickle entry point in the worker raises (a hardening and testing aid)."""

    threads: int
    commands_addr: str  # the conductor's command socket (conductor_addr: its report socket)
    heartbeat_s: float = 1.0
    setup_timeout_s: float = 120.0
    inline_max_bytes: int = 64 * KiB
    shm_max_slot_bytes: int = 256 * MiB
    shm_slots_per_class: int = 8
    forbid_pickle: bool = False
    kv_pool_tokens: int | None = None  # PagedLM pools: capacity in tokens (None: the model's)
    kv_page_size: int | None = None
    kv_step_tokens: int | None = None  # PagedLM: tokens one forward computes (None: the model's)
    # CURVE (Z85 keys; empty: none): set by ``net`` when the conductor listens on TCP
    curve_server_key: str = ""
    curve_public_key: str = ""
    curve_secret_key: str = ""
    generation: int = 0  # restarts of this rank before this process (its routing id)
    idle_spin_s: float = 0.0  # the engine polls without sleeping this long after its work
    freeze_heap: bool = True  # ``PoolConfig.freeze_heap``
    link: str = ""  # the conductor's rank link (a Unix socket's path; empty: ZeroMQ's sockets)

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not self.commands_addr:
            raise ValueError("commands_addr must name the conductor's command socket")
        for name in ("heartbeat_s", "setup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.idle_spin_s <= MAX_IDLE_SPIN_S:
            raise ValueError(
                f"idle_spin_s must be in [0, {MAX_IDLE_SPIN_S}], got {self.idle_spin_s}"
            )
        if self.inline_max_bytes < 0:
            raise ValueError(f"inline_max_bytes must be >= 0, got {self.inline_max_bytes}")
        if self.shm_slots_per_class < 1:
            raise ValueError(f"shm_slots_per_class must be >= 1, got {self.shm_slots_per_class}")

    @staticmethod
    def of_pool(
        pool: PoolConfig,
        threads: int,
        commands: str,
        curve: tuple[str, str, str],
        ranks: int,
        link: str = "",
    ) -> WorkerConfig:
        """What each worker of a pool set up with ``pool`` gets: ``commands``, the command
        socket's address; ``curve``, the server's public key and the workers' key pair (Z85;
        empty: none); ``ranks``, the pool's ranks (remote ones included); ``link``, where its
        rank link connects (empty: none)."""
        return WorkerConfig(
            threads=threads,
            commands_addr=commands,
            heartbeat_s=pool.heartbeat_s,
            setup_timeout_s=pool.start_timeout_s,
            inline_max_bytes=pool.inline_max_bytes,
            shm_slots_per_class=pool.worker_shm_slots_per_class,
            forbid_pickle=pool.forbid_pickle,
            kv_pool_tokens=pool.kv_pool_tokens,
            kv_page_size=pool.kv_page_size,
            kv_step_tokens=pool.kv_step_tokens,
            curve_server_key=curve[0],
            curve_public_key=curve[1],
            curve_secret_key=curve[2],
            idle_spin_s=idle_spin(pool.idle_spin_s, ranks - len(pool.remote_ranks), threads),
            freeze_heap=pool.freeze_heap,
            link=link,
        )

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @staticmethod
    def from_json(text: str | bytes) -> WorkerConfig:
        return msgspec.json.decode(text, type=WorkerConfig)


@dataclass(frozen=True)
class LoweringConfig:
    """``device``: cpu or cuda (decides compile and CUDA-graph plans); ``glue``: the glue
    fusion policy (``lowering.split.POLICIES``); ``max_batch``: the largest batch bucket."""

    device: str = "cpu"
    glue: str = "fuse"
    max_batch: int = 32

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.glue not in ("fuse", "separate"):
            raise ValueError(f"glue must be 'fuse' or 'separate', got {self.glue!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")


@dataclass(frozen=True)
class SchedulingConfig:
    """``speculate``: the conductor may start a DynamicLoop's next iteration before the stop
    of the current one is known (loops across ranks; at most one wasted step per stop);
    ``stream_buffer_limit``: items a stream buffer may hold before its producer waits (it must
    hold one chunk of every stream); ``max_inflight``: batches of one KV-cache node out on a
    rank at a time (its items ready meanwhile wait and leave together)."""

    speculate: bool = True
    stream_buffer_limit: int = 64
    max_inflight: int = 1

    def __post_init__(self) -> None:
        if self.stream_buffer_limit < 1:
            raise ValueError(f"stream_buffer_limit must be >= 1, got {self.stream_buffer_limit}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")


@dataclass(frozen=True)
class LaunchConfig:
    """``backend``: ``processes`` (spawned here) or ``ray`` (every rank a Ray actor on the
    cluster at ``ray_address``; None: a local one)."""

    backend: Literal["processes", "ray"] = "processes"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("processes", "ray"):
            raise ValueError(f"backend must be 'processes' or 'ray', got {self.backend!r}")
