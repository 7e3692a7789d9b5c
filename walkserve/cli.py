"""``walkserve`` command line: ``serve`` (the HTTP API, with ``vllm serve``'s flags where they
apply: ``walkserve serve MODEL --served-model-name NAME --max-model-len N ...``, ``--config
FILE`` for the same flags as YAML), ``trace`` (print a model's Walk Graph),
``plan`` (lower it for a placement), ``demo`` (serve every built-in model on worker processes
and run its walks) and ``bench`` (drive a running server with the load generator in
``benchmarks/loadgen.py``; needs a source checkout). Heavy imports happen inside the commands, so
``--help`` is instant."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from walkserve.api import mediafetch
from walkserve.cliargs import parse


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every option belongs to the load generator
        return _bench(argv[1:])
    try:
        args = parse(argv)
        if args.command == "trace":
            return _trace(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "worker":
            return _worker(args)
        return _demo(args)
    except (ValueError, KeyError, OSError) as e:
        print(f"walkserve: error: {e}", file=sys.stderr)
        return 2


def _bench(argv: list[str]) -> int:
    """Forward to ``benchmarks.loadgen.main``: the load generator lives next to the benchmark
    scripts in the source checkout, not in the installed package."""
    import importlib.util

    if importlib.util.find_spec("benchmarks.loadgen") is None:
        from walkserve.benchmarking import ROOT

        if not (ROOT / "benchmarks" / "loadgen.py").is_file():
            print(
                "walkserve: error: walkserve bench needs a source checkout (benchmarks/loadgen.py"
                " next to walkserve/); run it from the repository",
                file=sys.stderr,
            )
            return 2
        sys.path.insert(0, str(ROOT))
    from benchmarks.loadgen import main as loadgen_main

    return loadgen_main(argv)


def _capture(name: str) -> Any:
    from walkserve import capture
    from walkserve.adapters.registry import load_model

    model, sample = load_model(name)
    return capture.trace(model, sample), model, sample


def _trace(args: argparse.Namespace) -> int:
    from walkserve.capture import render, serialize

    captured, _, _ = _capture(args.model)
    graph = captured.graph
    if args.walk is not None:
        captured.walk(args.walk)  # unknown walk -> KeyError with the list
    if args.format == "json":
        print(serialize.to_json(graph))
    elif args.format == "dot":
        for name in [args.walk] if args.walk else list(graph.walks):
            print(render.render_dot(graph, name))
    else:
        print(render.render_text(graph, args.walk))
    if args.svg:
        if not args.walk:
            raise ValueError("--svg needs --walk")
        svg = render.render_svg(graph, args.walk)
        if svg is None:
            raise ValueError("graphviz 'dot' is not installed (apt-get install graphviz)")
        with open(args.svg, "wb") as f:
            f.write(svg)
        print(f"wrote {args.svg}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    import warnings

    from walkserve.lowering.lower import lower
    from walkserve.lowering.memory import format_memory
    from walkserve.lowering.placement import Placement, PlacementWarning
    from walkserve.lowering.resolved import resolve

    captured, _, sample = _capture(args.model)
    placement = _placement(args, captured) or Placement.default(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlacementWarning)
        plan = lower(
            captured,
            sample,
            placement,
            device=args.device,
            glue=args.glue,
            max_batch=args.max_batch,
            check_capture=not args.skip_capture_check,
        )
        resolved = resolve(placement, captured)
    if args.json:
        print(plan.to_json())
        return 0
    print(plan.format())
    from walkserve.lowering.memory import estimate_memory

    print()
    print(format_memory(estimate_memory(resolved, captured)))
    for message in resolved.warnings:
        print(f"warning: {message}")
    return 0


def _placement(args: argparse.Namespace, captured: Any) -> Any:
    """``--placement FILE``, or ``--tensor-parallel-size N`` as a placement, or None (the
    default: everything on rank 0)."""
    from walkserve.lowering.placement import Placement, tensor_parallel_placement

    sizes = (args.tensor_parallel_size, args.data_parallel_size)
    if sizes != (None, None) and args.placement:
        raise ValueError(
            "give --placement or --tensor-parallel-size / --data-parallel-size, not both"
        )
    if sizes != (None, None):
        return tensor_parallel_placement(captured, sizes[0] or 1, sizes[1] or 1)
    return Placement.from_file(args.placement) if args.placement else None


ROUTES = (
    "GET  /health",
    "GET  /v1/models",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/audio/speech",
    "POST /v1/images/generations",
    "POST /v1/images/edits",
    "POST /v1/walks/{walk}",
    "GET  /metrics",
)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from walkserve.adapters.registry import capture_model, profile_for
    from walkserve.api.app import ApiConfig, create_app
    from walkserve.api.profile import with_limits, without_tokenizer
    from walkserve.progress import StartupProgress
    from walkserve.runtime import heap
    from walkserve.runtime.config import LaunchConfig, LoweringConfig, PoolConfig
    from walkserve.runtime.limits import WalkLimits
    from walkserve.runtime.server import serve

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ: give one")
    model = args.model_tag or args.model or "walkserve-default"
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.dtype not in ("auto", "float32"):
        raise ValueError(
            f"--dtype {args.dtype} is not supported yet: workers load the weights in the"
            " model's own dtype; use auto"
        )
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    names = tuple(args.served_model_name or (model,))
    limits = WalkLimits(  # ValueError naming the field for a bad value
        max_input_length=args.max_walk_input_length,
        max_loop_bound=args.max_walk_loop_bound,
        max_batch=args.max_walk_batch or args.max_num_seqs or 32,
    )
    config = ApiConfig(
        api_key=args.api_key,
        max_queued=args.max_queued,
        served_names=names,
        allowed_origins=_origins(args.allowed_origins),
        walk_limits=limits,
        media=mediafetch.from_args(args),  # ValueError naming the flag
    )
    progress = StartupProgress()
    try:
        profile = profile_for(model, names[0])
        if args.skip_tokenizer_init:
            profile = without_tokenizer(profile)
        if args.chat_template is not None:
            from walkserve.api.chattemplate import with_chat_template

            profile = with_chat_template(profile, _read_template(args.chat_template))
        if args.max_model_len is not None:
            profile = with_limits(profile, args.max_model_len)
        captured = capture_model(model, args.seed, on_stage=progress.stage)
        placement = _placement(args, captured)
        remote = tuple(int(r) for r in args.remote_ranks.split(",") if r.strip())
        pool = PoolConfig(
            kv_pool_tokens=args.kv_pool_tokens,
            kv_page_size=args.kv_page_size,
            kv_step_tokens=args.max_num_batched_tokens,
            bind=args.bind,
            remote_ranks=remote,
            keys_dir=args.keys,
            remote_data=args.remote_data or "inline",
        )
        server = serve(
            captured,
            placement,
            seed=args.seed,
            threads=args.threads,
            lowering=LoweringConfig(device=args.device, max_batch=args.max_num_seqs or 32),
            pool_config=pool,
            launch=LaunchConfig(backend=args.backend, ray_address=args.ray_address),
            on_stage=progress.stage,
        )
    except BaseException:
        progress.abandon()
        raise
    try:
        app = create_app(server, profile, config)
        ranks = len(server.health())
        # the model, the plan and the app live as long as this process: a full collection of
        # the cyclic collector never walks them again (``runtime.heap``)
        heap.freeze()
        progress.stage("ready")
        print(f"walkserve: serving {model} as {', '.join(names)} on {ranks} worker(s)", flush=True)
        scheme = "https" if args.ssl_certfile else "http"
        print(f"walkserve: listening on {scheme}://{args.host}:{args.port}", flush=True)
        for route in ROUTES:
            print(f"    {route}", flush=True)
        # Ctrl-C: uvicorn stops accepting, gives open streams 5 s, then returns here.
        # SIGTERM: a graceful drain (``_DrainingServer``). The app has no startup/shutdown
        # hooks; without the lifespan task, Ctrl-C does not print its cancellation traceback.
        http = _draining_server(
            server,
            args.shutdown_grace,
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                lifespan="off",
                timeout_graceful_shutdown=5,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
            ),
        )
        _stop_when_fatal(server, http)
        http.run()
    finally:
        server.close()  # every worker process shuts down
        print("walkserve: stopped", flush=True)
    if server.fatal is not None:  # a process manager restarts a server that cannot go on
        print(f"walkserve: the conductor stopped: {server.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0


def _draining_server(server: Any, grace_s: float, config: Any) -> Any:
    """A uvicorn server that drains on SIGTERM: new requests get 503 with Retry-After (the
    socket stays open, so clients hear why), the admitted ones get ``grace_s`` seconds to
    finish, then it stops and ``_serve`` closes the workers and returns 0. A second SIGTERM,
    or SIGINT, stops at once (uvicorn's own handling). uvicorn re-raises the signals it caught
    once it stopped, which would kill the process before the workers are closed: a drained
    SIGTERM is not re-raised."""
    import signal
    import threading

    import uvicorn

    class DrainingServer(uvicorn.Server):
        draining = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig != signal.SIGTERM or self.should_exit:
                super().handle_exit(sig, frame)
            elif self.draining:  # a second SIGTERM: stop now
                self.should_exit = True
            else:
                self.draining = True
                threading.Thread(target=self._drain, name="walkserve-drain", daemon=True).start()

        def _drain(self) -> None:
            print(
                f"walkserve: SIGTERM: draining (new requests get 503; {grace_s:g} s for the "
                "requests in flight)",
                flush=True,
            )
            done = server.drain(grace_s)
            if not done:
                print("walkserve: the grace period ended with requests in flight", flush=True)
            time.sleep(0.2)  # the last responses' final bytes leave
            self.should_exit = True

    return DrainingServer(config)


def _stop_when_fatal(server: Any, http: Any) -> None:
    """Stop serving HTTP once the server's conductor loop has stopped (``Server.fatal``)."""
    import threading

    def watch() -> None:
        while not http.should_exit:
            if server.fatal is not None:
                http.should_exit = True
                return
            time.sleep(0.5)

    threading.Thread(target=watch, name="walkserve-fatal-watch", daemon=True).start()


def _origins(value: str | list[str] | None) -> tuple[str, ...]:
    """``--allowed-origins``: a JSON list or comma-separated origins (a YAML list too)."""
    import json

    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(str(v) for v in value)
    if value.strip().startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError("--allowed-origins: a JSON list of strings")
        return tuple(parsed)
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _read_template(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is no file."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    return value


def _worker(args: argparse.Namespace) -> int:
    import logging

    from walkserve.runtime.net.remote import run_remote_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return run_remote_worker(
        args.conductor,
        args.rank,
        args.keys,
        args.threads,
        setup_timeout_s=args.setup_timeout,
        inline_max_bytes=args.inline_max_bytes,
        rejoin_timeout_s=args.rejoin_timeout,
    )


def _demo(args: argparse.Namespace) -> int:
    from walkserve.adapters.examples import PLACEMENTS_DIR
    from walkserve.adapters.registry import capture_model, model_names
    from walkserve.runtime.server import serve

    print("walkserve demo: serves every built-in model on worker processes (two ranks where a")
    print("two-rank placement ships), runs each entry walk on its sample request, and checks the")
    print("result against the reference interpreter.\n")
    failures = 0
    for name in args.model or model_names():
        t0 = time.perf_counter()
        captured = capture_model(name)
        two_ranks = PLACEMENTS_DIR / f"{name}.2ranks.yaml"
        placement = str(two_ranks) if two_ranks.is_file() else None
        with serve(captured, placement) as server:
            ranks = len(server.health())
            print(
                f"== {name}: captured and started {ranks} worker(s) in {time.perf_counter() - t0:.1f} s"
            )
            for walk in captured.graph.entry_walks():
                t1 = time.perf_counter()
                out = server.run(captured.sample_inputs, walk=walk, timeout=600)
                ms = 1000 * (time.perf_counter() - t1)
                ref = captured.run(captured.sample_inputs, walk=walk)
                same = out.keys() == ref.keys() and all(_close(out[k], ref[k]) for k in ref)
                failures += not same
                print(
                    f"   walk {walk}: {ms:.0f} ms, {'matches' if same else 'DIFFERS FROM'} the reference interpreter"
                )
                for key, value in out.items():
                    print(f"      {key}: {_describe(value)}")
        print()
    return 1 if failures else 0


def _close(a: Any, b: Any) -> bool:
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return bool(a == b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not b.is_floating_point():
        return bool(torch.equal(a, b))
    return bool((a - b).abs().max().item() <= 1e-5 * max(b.abs().max().item(), 1e-30))


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        head = value.flatten()[:8].tolist()
        fmt = [round(v, 4) if isinstance(v, float) else v for v in head]
        more = ", ..." if value.numel() > 8 else ""
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)} {fmt}{more}"
    return repr(value)


if __name__ == "__main__":
    raise SystemExit(main())
