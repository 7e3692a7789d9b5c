"""Ray places the workers: one actor per rank on a running Ray cluster (``ray.init()`` here, or
``ray_address``), each running the ordinary ``Worker`` against the conductor.

Owns the rank actors (start, placement resources, stop). What crosses its boundary: through
Ray only each actor's start arguments (rank, the conductor's address, the CURVE keys of its
rank as strings) and its exit code; the actors then talk to the conductor over the
CURVE-encrypted ZeroMQ control plane like any remote worker, and tensors go through shared
memory when the actor runs on the conductor's host (same node IP), else inline or Mooncake
(``PoolConfig.remote_data``), never through Ray's object store::

    serve(model, placement, launch=LaunchConfig(backend="ray", ray_address=None))   # -> Server
    walkserve serve --backend ray [--ray-address ray://HOST:10001]

``ray`` is an optional dependency: ``RayLauncher`` raises ``ValueError`` saying how to install
it when it does not import. Actors ask for ``num_cpus`` (default 1) each.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from walkserve.runtime.pool import WorkerPool

log = logging.getLogger("walkserve.net")


def ray_available() -> tuple[bool, str]:
    try:
        import ray  # noqa: F401
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    return True, ""


class _RankActor:
    """The body of a rank actor (wrapped by ``ray.remote`` when launched)."""

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def pid(self) -> int:
        return os.getpid()

    def run(self, conductor: str, rank: int, keys: tuple[str, str, str], threads: int) -> int:
        import torch

        from walkserve.runtime.net.remote import commands_address
        from walkserve.runtime.worker import Worker, WorkerConfig

        torch.set_num_threads(threads)
        config = WorkerConfig(
            threads=threads,
            commands_addr=commands_address(conductor),
            curve_server_key=keys[0],
            curve_public_key=keys[1],
            curve_secret_key=keys[2],
        )
        return Worker(rank, conductor, config).run()


class RayLauncher:
    """Starts one rank actor per remote rank of a pool (``launch``, the pool's
    ``on_listening``) and stops them (``close``, after the pool closed)."""

    def __init__(
        self, keys_dir: str | os.PathLike[str], address: str | None = None, num_cpus: float = 1
    ) -> None:
        ok, why = ray_available()
        if not ok:
            raise ValueError(
                f"the Ray backend needs ray ({why}); install it: pip install 'ray>=2.9'"
            )
        import ray

        if num_cpus <= 0:
            raise ValueError(f"num_cpus must be > 0, got {num_cpus}")
        self.keys_dir = Path(keys_dir)
        self.num_cpus = num_cpus
        self._started_ray = False
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        self._actor_class = ray.remote(num_cpus=num_cpus)(_RankActor)
        self.actors: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}

    def launch(self, pool: WorkerPool) -> None:
        import ray

        from walkserve.runtime.net.auth import load_worker_keys

        here = _this_node_ip(ray)
        for rank in pool.config.remote_ranks:
            actor = self._actor_class.options(name=None).remote()
            self.actors[rank] = actor
        ips = dict(zip(self.actors, ray.get([a.node_ip.remote() for a in self.actors.values()])))
        for rank, actor in self.actors.items():
            same_host = ips[rank] == here
            if same_host:
                pool.set_remote_data(rank, "shm")
            server, pair = load_worker_keys(self.keys_dir, rank)
            threads = max(1, int(self.num_cpus))
            self.runs[rank] = actor.run.remote(
                pool.address, rank, (server, pair.public, pair.secret), threads
            )
            log.info(
                "rank %d: a Ray actor on %s (%s)",
                rank,
                ips[rank],
                "shared memory" if same_host else pool.remote_data(rank),
            )

    def exit_codes(self, timeout_s: float = 30.0) -> dict[int, int | None]:
        """The actors' ``Worker.run`` results (after the pool sent Shutdown)."""
        import ray

        out: dict[int, int | None] = {}
        for rank, ref in self.runs.items():
            try:
                out[rank] = ray.get(ref, timeout=timeout_s)
            except Exception:
                out[rank] = None
        return out

    def close(self) -> None:
        import ray

        self.last_exit_codes = self.exit_codes(10.0)
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
        if self._started_ray:
            ray.shutdown()


def _this_node_ip(ray: Any) -> str:
    return str(ray.util.get_node_ip_address())


__all__ = ["RayLauncher", "ray_available"]
