"""``serve(model, placement)``: start a ``Server``. Resolve the model source, lower it for the
placement, start the workers (spawned, on other hosts, or Ray actors), then the conductor loop
(``runtime.server``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typeguard import typechecked

from walkserve.capture.model import CapturedModel
from walkserve.lowering.placement import LOCAL_HOST, Placement
from walkserve.runtime.config import LaunchConfig, LoweringConfig, PoolConfig, SchedulingConfig
from walkserve.runtime.limits import WalkLimits
from walkserve.runtime.pool import WorkerPool

if TYPE_CHECKING:
    from walkserve.runtime.server import Server

__all__ = ["serve"]

log = logging.getLogger("walkserve.server")


@typechecked
def serve(
    model: str | CapturedModel,
    placement: Placement | str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    threads: int | None = None,
    lowering: LoweringConfig | None = None,
    scheduling: SchedulingConfig | None = None,
    pool_config: PoolConfig | None = None,
    launch: LaunchConfig | None = None,
    limits: WalkLimits | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> Server:
    """Start serving ``model``: a model source (a built-in model's name, a local checkpoint
    directory, ``module:factory``: ``adapters.registry`` resolves it) or a ``CapturedModel``
    made by ``registry.capture_model`` (it remembers its source and seed). The model is lowered
    for ``placement`` (a ``Placement``, a YAML/JSON file, or None for everything on one rank)
    and one worker process per rank is started; workers load the same weights themselves.
    ``threads``: torch threads per worker (default: the cores but one divided by the ranks).

    The rest is composed of small configs (``runtime.config``): ``lowering`` (device, glue,
    batch buckets), ``scheduling`` (speculation, stream buffers, batches in flight),
    ``pool_config`` (the processes, sockets, shared memory, KV pools, other hosts: its
    ``bind``, ``remote_ranks``, ``keys_dir`` and ``remote_data`` put ranks on other hosts,
    ``runtime.net``) and ``launch`` (spawned processes, or Ray actors: ``backend="ray"``, then
    ``bind`` defaults to ``tcp://127.0.0.1:0``; with a ``ray_address``, give a ``bind`` the
    cluster can reach). ``limits``: how much one request may ask for (input lengths, loop
    bounds, rows: ``runtime.limits``; none by default). ``on_stage`` is told as each step begins ("lowering", "starting N
    workers")."""
    lowering = lowering or LoweringConfig()
    scheduling = scheduling or SchedulingConfig()
    pool_config = pool_config or PoolConfig()
    launch = launch or LaunchConfig()
    from walkserve.lowering.lower import lower
    from walkserve.runtime.server import Server  # which imports this module at its end
    from walkserve.runtime.source import DEFAULT_CAPTURE, resolve

    if isinstance(model, str):
        captured = resolve(DEFAULT_CAPTURE)(model, seed)
    else:
        captured = model
    if captured.origin is None:
        raise ValueError(
            "serve() needs to know how worker processes load the model: pass its name (a built-in "
            "model, a checkpoint directory or module:factory), or capture it with "
            "walkserve.adapters.registry.capture_model(name, seed)"
        )
    name, seed = captured.origin
    if placement is None:
        placement = Placement.default(1)
    elif not isinstance(placement, Placement):
        placement = Placement.from_file(placement)
    stage = on_stage or (lambda name: None)
    stage("lowering")
    plan = lower(
        captured,
        captured.sample_inputs,
        placement,
        device=lowering.device,
        glue=lowering.glue,
        max_batch=lowering.max_batch,
        check_capture=lowering.device != "cpu",
    )
    for module in captured.model.modules():  # lowering ran the model: drop its KV pools here
        release = getattr(module, "release_kv", None)  # an engine with a KV pool says so
        if callable(release):
            release()
    launcher: Any = None
    if launch.backend == "ray":
        from walkserve.runtime.net.ray_backend import RayLauncher

        if pool_config.bind is None and launch.ray_address is not None:
            raise ValueError(
                "backend='ray' with a ray_address needs PoolConfig(bind='tcp://HOST:0') with a "
                "HOST the cluster's nodes can reach (the default binds 127.0.0.1 only)"
            )
        keys_dir = pool_config.keys_dir or tempfile.mkdtemp(prefix="walkserve-keys-")
        pool_config = dataclasses.replace(
            pool_config,
            bind=pool_config.bind or "tcp://127.0.0.1:0",
            remote_ranks=tuple(range(placement.ranks)),
            keys_dir=keys_dir,
        )
        launcher = RayLauncher(keys_dir, launch.ray_address)
    away = {r: placement.host_of(r) for r in range(placement.ranks)}
    away = {r: h for r, h in away.items() if h != LOCAL_HOST}
    if away and pool_config.bind is None:
        raise ValueError(
            f"the placement puts ranks {sorted(away)} on other hosts ({sorted(set(away.values()))}); "
            "serve with PoolConfig(bind='tcp://HOST:PORT') and start 'walkserve worker' there, "
            "or drop 'hosts'"
        )
    if placement.hosts and pool_config.bind is not None and not pool_config.remote_ranks:
        # ranks the placement puts on another host are awaited, not spawned
        remote = tuple(r for r in range(placement.ranks) if placement.host_of(r) != LOCAL_HOST)
        pool_config = dataclasses.replace(pool_config, remote_ranks=remote)
    stage(f"starting {placement.ranks} worker{'s' if placement.ranks != 1 else ''}")
    try:
        pool = WorkerPool(
            name,
            seed,
            captured,
            plan,
            placement.ranks,
            threads=threads,
            config=pool_config,
            on_listening=None if launcher is None else launcher.launch,
            speculate=scheduling.speculate,
            stream_buffer_limit=scheduling.stream_buffer_limit,
            hold=True,
        )
    except BaseException:
        if launcher is not None:
            launcher.close()
        raise
    try:
        server = Server(
            captured,
            plan,
            pool,
            speculate=scheduling.speculate,
            stream_buffer_limit=scheduling.stream_buffer_limit,
            max_inflight=scheduling.max_inflight,
            limits=limits,
        )
        if launcher is not None:
            server.closers.append(launcher.close)
        if placement.hosts:
            from walkserve.runtime.net.link import cross_host_edges, format_edges

            server.cross_host_edges = cross_host_edges(
                captured, plan, placement, pool.links, direct=pool.passes_rank_to_rank()
            )
            if server.cross_host_edges:
                log.warning("edges that cross hosts:\n%s", format_edges(server.cross_host_edges))
        return server
    except BaseException:
        pool.close()
        if launcher is not None:
            launcher.close()
        raise
