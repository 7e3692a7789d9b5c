"""``walkserve`` command line: ``trace`` (print a model's Walk Graph) and ``demo`` (trace and
run every built-in model's walks through the reference interpreter; the main job until the
HTTP server lands). Heavy imports happen inside the commands, so ``--help`` is instant."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="walkserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("trace", help="capture a model and print its Walk Graph")
    p.add_argument(
        "--model",
        default="example-cfg-image",
        help="built-in name, checkpoint dir, or module:factory",
    )
    p.add_argument("--walk", help="only this walk (default: all)")
    p.add_argument("--format", choices=("text", "json", "dot"), default="text")
    p.add_argument(
        "--svg", metavar="FILE", help="also write an SVG of --walk (needs graphviz 'dot')"
    )

    pl = sub.add_parser("plan", help="lower a model for a placement and print the plan")
    pl.add_argument(
        "--model",
        default="example-cfg-image",
        help="built-in name, checkpoint dir, or module:factory",
    )
    pl.add_argument(
        "--placement", metavar="FILE", help="YAML or JSON placement (default: all on rank 0)"
    )
    pl.add_argument(
        "--device", default="cpu", help="cpu or cuda (decides compile and CUDA-graph plans)"
    )
    pl.add_argument("--glue", choices=("fuse", "separate"), default="fuse")
    pl.add_argument("--max-batch", type=int, default=32)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument(
        "--skip-capture-check",
        action="store_true",
        help="do not check which nodes can be graph-captured (faster)",
    )

    d = sub.add_parser("demo", help="trace and run the walks of every built-in model")
    d.add_argument("--model", action="append", help="only these models (repeatable)")

    args = parser.parse_args(argv)
    try:
        if args.command == "trace":
            return _trace(args)
        if args.command == "plan":
            return _plan(args)
        return _demo(args)
    except (ValueError, KeyError, OSError) as e:
        print(f"walkserve: error: {e}", file=sys.stderr)
        return 2


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
    from walkserve.lowering.placement import Placement, PlacementWarning, resolve

    captured, _, sample = _capture(args.model)
    placement = Placement.from_file(args.placement) if args.placement else Placement.default(1)
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


def _demo(args: argparse.Namespace) -> int:
    import torch

    from walkserve.adapters.registry import model_names

    print("walkserve demo: the HTTP server is not built yet; this traces every built-in model")
    print("and runs its walks through the reference interpreter, checking them against eager.\n")
    for name in args.model or model_names():
        t0 = time.perf_counter()
        captured, model, sample = _capture(name)
        t1 = time.perf_counter()
        print(f"== {name}: captured {len(captured.walks)} walk(s) in {1000 * (t1 - t0):.0f} ms")
        for walk in captured.graph.entry_walks():
            t2 = time.perf_counter()
            out = captured.run(sample, walk=walk)
            ms = 1000 * (time.perf_counter() - t2)
            with torch.no_grad():
                eager = _eager(model, captured, walk, sample)
            same = all(
                torch.equal(out[k], eager[k]) for k in eager if isinstance(eager[k], torch.Tensor)
            )
            print(f"   walk {walk}: {ms:.0f} ms, {'equal to' if same else 'DIFFERENT from'} eager")
            for key, value in out.items():
                print(f"      {key}: {_describe(value)}")
        print()
    return 0


def _eager(model: Any, captured: Any, walk: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Run the walk chain by calling the model's own methods (what capture must reproduce)."""
    from walkserve.capture.api import walk_specs

    specs = walk_specs(model)
    state = dict(inputs)
    client: dict[str, Any] = {}
    current: str | None = walk
    while current is not None:
        method, spec = specs[current]
        fn = getattr(model, method)
        import inspect

        params = list(inspect.signature(fn).parameters)
        out = fn(**{p: state[p] for p in params})
        out = out if isinstance(out, dict) else {"output": out}
        state.update(out)
        client.update({k: v for k, v in out.items() if k not in spec.state})
        current = captured.next_walk(state, current, out)
    return client


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
