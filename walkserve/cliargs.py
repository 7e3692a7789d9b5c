"""The ``walkserve`` command line's options (``parse``): every command's flags, and for
``serve`` the ``--config`` YAML file's values for the flags the command line leaves out. What
each command does is in ``walkserve.cli``."""

from __future__ import annotations

import argparse

from walkserve.api import mediafetch

__all__ = ["parse"]

DESCRIPTION = """``walkserve`` command line: ``serve`` (the HTTP API, with ``vllm serve``'s flags
where they apply: ``walkserve serve MODEL --served-model-name NAME --max-model-len N ...``,
``--config FILE`` for the same flags as YAML), ``trace`` (print a model's Walk Graph), ``plan``
(lower it for a placement), ``worker`` (a remote rank), ``demo`` (serve every built-in model on
worker processes and run its walks) and ``bench`` (drive a running server with the load
generator in ``benchmarks/loadgen.py``; needs a source checkout)."""


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line's arguments; for ``serve``, with its ``--config`` file's values for
    the flags the command line leaves out."""
    parser = argparse.ArgumentParser(prog="walkserve", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    sv = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible routes)")
    sv.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="built-in name, checkpoint dir, or module:factory (default: walkserve-default)",
    )
    sv.add_argument("--model", help="the same as MODEL (kept for older command lines)")
    sv.add_argument(
        "--config",
        metavar="FILE",
        help="YAML of these flags (served-model-name: x, max-model-len: 512, ...); flags given"
        " on the command line win",
    )
    sv.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model names clients send and answers carry (the first); default: MODEL",
    )
    sv.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="prompt plus generated tokens of a text request at most N (default: the model's)",
    )
    sv.add_argument(
        "--dtype",
        default="auto",
        help="weights dtype: auto (the model's own; the only one supported yet) or float32",
    )
    sv.add_argument("--device", default="cpu", help="cpu or cuda (lowering and workers)")
    sv.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template (a file, or the template text) instead of the model's",
    )
    sv.add_argument(
        "--max-num-seqs", type=int, metavar="N", help="at most N requests in one batch (32)"
    )
    sv.add_argument(
        "--allowed-origins",
        metavar="ORIGINS",
        help="CORS: a JSON list ('[\"https://a.example\"]') or comma-separated origins; none by"
        " default",
    )
    mediafetch.add_flags(sv)
    sv.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this key")
    sv.add_argument("--ssl-certfile", metavar="FILE", help="... and this certificate")
    sv.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    sv.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="no tokenizer: prompts as token ids only, answers as token ids (text gets a 400)",
    )
    sv.add_argument(
        "--placement", metavar="FILE", help="YAML or JSON placement (default: all on rank 0)"
    )
    sv.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="every component on ranks 0..N-1 as one tensor-parallel group (not with --placement)",
    )
    sv.add_argument(
        "--data-parallel-size",
        type=int,
        metavar="R",
        help="R replicas of every component (each of --tensor-parallel-size ranks; not with "
        "--placement); requests go to the least busy replica",
    )
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on every route but /health"
    )
    sv.add_argument(
        "--max-queued",
        type=int,
        metavar="N",
        help="admit at most N requests at once (a completion counts its n choices); more "
        "get 503 with Retry-After",
    )
    sv.add_argument(
        "--max-walk-input-length",
        type=int,
        default=32768,
        metavar="N",
        help="a walk's tensor inputs may be at most N long in every dimension the request "
        "chooses but the batch (default 32768; a longer one is a 400 naming the input)",
    )
    sv.add_argument(
        "--max-walk-loop-bound",
        type=int,
        default=65536,
        metavar="N",
        help="a request may make a loop run at most N iterations (a trip count or max_iters "
        "input, e.g. max_new_tokens; default 65536)",
    )
    sv.add_argument(
        "--max-walk-batch",
        type=int,
        metavar="N",
        help="rows (dimension 0) of one walk request at most (default: --max-num-seqs); "
        "--max-queued counts each row",
    )
    sv.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, stop admitting (503 with Retry-After) and give the requests in "
        "flight S seconds to finish before the workers stop (default 30)",
    )
    sv.add_argument("--seed", type=int, default=0, help="weights seed of built-in models")
    sv.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch threads of each worker (default: the usable cores but one, one core left to"
        " the server process, divided over the ranks): a large model's batched forwards gain"
        " from every core, a small model's many small ops lose to the threads' overhead",
    )
    sv.add_argument(
        "--kv-pool-tokens",
        type=int,
        metavar="N",
        help="paged KV pool of each text model, in tokens (default: the model's, e.g. 16384)",
    )
    sv.add_argument("--kv-page-size", type=int, metavar="N", help="tokens per KV page (16)")
    sv.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="tokens one forward of a paged text model computes, all requests together "
        "(default 2048): a longer prompt is prefilled in chunks between the others' steps",
    )
    sv.add_argument(
        "--bind",
        metavar="tcp://HOST:PORT",
        help="control sockets on TCP with CURVE keys (PORT and PORT+1); needed by --remote-ranks",
    )
    sv.add_argument(
        "--remote-ranks",
        metavar="R,R",
        default="",
        help="ranks not started here: they join with 'walkserve worker' from other hosts",
    )
    sv.add_argument(
        "--keys", metavar="DIR", help="CURVE key files (made where missing; 0700 directory)"
    )
    sv.add_argument(
        "--remote-data",
        choices=("inline", "mooncake"),
        default="inline",
        help="tensors to and from remote ranks: inline on the control socket (every value a "
        "remote rank reads or makes goes through the server), or Mooncake (values also go "
        "rank to rank between hosts)",
    )

    sv.add_argument(
        "--backend",
        choices=("processes", "ray"),
        default="processes",
        help="workers as local processes, or as Ray actors (one per rank)",
    )
    sv.add_argument("--ray-address", help="a running Ray cluster (default: start a local one)")

    wk = sub.add_parser("worker", help="join a server as one rank (from another host)")
    wk.add_argument("--conductor", required=True, metavar="tcp://HOST:PORT")
    wk.add_argument("--rank", type=int, required=True)
    wk.add_argument(
        "--keys",
        required=True,
        metavar="DIR",
        help="holds server.public, rank-R.public and rank-R.secret (from the server's --keys)",
    )
    wk.add_argument("--threads", type=int, help="torch threads (default: the usable cores)")
    wk.add_argument(
        "--setup-timeout", type=float, default=300.0, help="seconds to wait for keys and setup"
    )
    wk.add_argument(
        "--inline-max-bytes",
        type=int,
        default=64 << 10,
        help="with Mooncake, smaller tensors still travel inline (default 65536)",
    )
    wk.add_argument(
        "--rejoin-timeout",
        type=float,
        default=300.0,
        help="seconds to keep joining again after the server went away, then exit 1 (default 300)",
    )

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
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="every component on ranks 0..N-1 as one tensor-parallel group (not with --placement)",
    )
    pl.add_argument(
        "--data-parallel-size",
        type=int,
        metavar="R",
        help="R replicas of every component (each of --tensor-parallel-size ranks; not with "
        "--placement); requests go to the least busy replica",
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

    d = sub.add_parser(
        "demo", help="serve every built-in model on worker processes and run its walks"
    )
    d.add_argument("--model", action="append", help="only these models (repeatable)")

    sub.add_parser(
        "bench",
        help="load-test a running server over HTTP (walkserve bench --help for the options)",
    )

    args = parser.parse_args(argv)
    if args.command == "serve":
        args = with_config(parser, sv, argv, args)
    return args


def with_config(
    parser: argparse.ArgumentParser,
    serve: argparse.ArgumentParser,
    argv: list[str],
    args: argparse.Namespace,
) -> argparse.Namespace:
    """``args`` with the ``--config`` YAML's values for the flags the command line does not
    give; an unknown key is an error naming it."""
    import yaml

    if args.config is None:
        return args
    with open(args.config) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {args.config}: expected a mapping of flags to values")
    known = {a.dest: a for a in serve._actions if a.dest not in ("help", "config")}
    defaults = {}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        dest = "model_tag" if dest == "model" else dest
        if dest not in known:
            raise ValueError(f"--config {args.config}: unknown flag {key!r}")
        defaults[dest] = value
    serve.set_defaults(**defaults)
    return parser.parse_args(argv)
