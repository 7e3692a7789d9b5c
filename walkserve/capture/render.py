"""Rendering of the Walk Graph IR for humans: text (``walkserve trace``), Graphviz DOT, SVG.

Text form of a walk (one line per op, loops as indented blocks, sections from ``sections``)::

    walk gen(z, c1, c2) -> z
      loop step x5
        carried     z <- z, next add_1
        per step    t = self.sigmas[i], tn = self.sigmas[1 + i]
        invariant   c1 = c1, c2 = c2
        terminal    step.z = add_1
        sub_1 = glue operator.sub(tn, t)
        parallel
          den = component den(z, t, c1)
          den_1 = component den(z, t, c2)
        sub = glue operator.sub(den_1, den)
        ...
      return z = step.z

Inside a loop body, names drop the ``<loop>/`` prefix they carry in the IR. A dynamic loop's
header adds ``until <stop>, max_iters <n>``; a stream consumer's trips read ``per chunk of
<stream>``, and the walk lists its streams with their chunk policies before the body. The last
line says which client outputs reach a client item by item as their loop commits iterations
(``streamed``, see ``loopsem.streamed_outputs``) and which are sent whole when the walk ends.

DOT form: components are boxes, glue small ellipses, loop parameters and channels plain
labels, each loop a cluster labelled with its kind and trips; a carried value's next value is
a dotted back edge, streaming edges are dashed and labelled with their policy.

Both expect a graph that passes ``lint()``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Mapping

from walkserve.capture import dataflow, ir
from walkserve.capture.loopsem import format_int, streamed_outputs
from walkserve.capture.sections import (
    DynamicLoop,
    Loop,
    NodeRef,
    Parallel,
    Section,
    Sequential,
    sections,
)

INDENT = "  "
TABLE_PREVIEW = 6  # table values shown before "..."

# ---------------------------------------------------------------------------------- pieces


def short(name: str, prefix: str) -> str:
    """``name`` without the enclosing loop body's ``<loop>/`` prefix."""
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


def fmt_arg(arg: ir.Arg, prefix: str = "") -> str:
    """An argument as Python-like text."""
    if isinstance(arg, ir.Ref):
        return short(arg.name, prefix)
    if isinstance(arg, ir.Const):
        return repr(arg.value)
    if isinstance(arg, ir.FloatConst):
        return arg.repr
    if isinstance(arg, ir.ListArg):
        return "[" + ", ".join(fmt_arg(a, prefix) for a in arg.items) + "]"
    if isinstance(arg, ir.TupleArg):
        items = [fmt_arg(a, prefix) for a in arg.items]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(arg, ir.DictArg):
        return "{" + ", ".join(f"{k!r}: {fmt_arg(a, prefix)}" for k, a in arg.items.items()) + "}"
    if isinstance(arg, ir.SliceArg):
        parts = [
            "" if isinstance(a, ir.Const) and a.value is None else fmt_arg(a, prefix)
            for a in (arg.start, arg.stop, arg.step)
        ]
        return ":".join(parts[:2]) + (f":{parts[2]}" if parts[2] else "")
    if isinstance(arg, ir.DTypeArg):
        return f"torch.{arg.name}"
    if isinstance(arg, ir.DeviceArg):
        return f"device({arg.name!r})"
    if isinstance(arg, ir.EllipsisArg):
        return "..."
    if isinstance(arg, ir.TensorConst):
        return f"const {arg.name}"
    return f"self.{arg.path}"


def fmt_call(node: ir.Op, prefix: str) -> str:
    """``component den(z, t, c1)``, ``glue operator.sub(a, b)``, ``glue x.argmax(-1)``."""
    args = [fmt_arg(a, prefix) for a in node.args]
    args += [f"{k}={fmt_arg(a, prefix)}" for k, a in node.kwargs.items()]
    if node.kind == "component":
        return f"component {node.target}({', '.join(args)})"
    kind, _, name = node.target.partition(":")
    if kind == "method" and node.args:
        return f"glue {args[0]}.{name}({', '.join(args[1:])})"
    return f"glue {name}({', '.join(args)})"


def fmt_index(i_start: int, i_step: int) -> str:
    """``start + step*i`` simplified: ``i``, ``1 + i``, ``2*i``, ``3 + 2*i``."""
    term = "i" if i_step == 1 else "0" if i_step == 0 else f"{i_step}*i"
    if i_start == 0:
        return term
    return str(i_start) if term == "0" else f"{i_start} + {term}"


def fmt_per_step(
    src: ir.AffineStep | ir.TableStep | ir.SelectStep | ir.ChunkStep, outer: str
) -> str:
    """What iteration ``i`` receives."""
    if isinstance(src, ir.AffineStep):
        return fmt_index(src.start, src.step)
    if isinstance(src, ir.TableStep):
        shown = [fmt_arg(v, outer) for v in src.values[:TABLE_PREVIEW]]
        if len(src.values) > TABLE_PREVIEW:
            shown.append(f"... ({len(src.values)} values)")
        return "[" + ", ".join(shown) + "][i]"
    if isinstance(src, ir.SelectStep):
        lead = ":, " * src.dim
        return f"{fmt_arg(src.source, outer)}[{lead}{fmt_index(src.start, src.step)}]"
    what = "chunk i" if src.part == "data" else "context length of chunk i"
    return f"{what} of {src.stream}"


def fmt_trips(node: ir.LoopNode) -> str:
    trips = node.trips
    if isinstance(trips, ir.FixedTrips):
        text = f"x{trips.count}"
    elif isinstance(trips, ir.InputTrips):
        text = f"x {trips.input} (walk input)"
    elif isinstance(trips, ir.ExprTrips):
        text = f"x ({format_int(trips.expr)}) (of walk inputs)"
    else:
        text = f"per chunk of {trips.stream}"
    if node.stop is not None:
        text += f" until {short(node.stop, node.name + '/')}, max_iters {node.max_iters}"
    if not node.speculative:
        text += ", no speculation"
    return text


def loop_kind(node: ir.LoopNode) -> str:
    return "dynamic loop" if node.dynamic else "loop"


def fmt_policy(policy: Mapping[str, object]) -> str:
    """``fixed(size=2, end=flush)``; ``pad_value`` only when the end rule pads."""
    fields = [
        f"{k}={v}"
        for k, v in policy.items()
        if k != "kind" and (k != "pad_value" or policy.get("end") == "pad")
    ]
    return f"{policy.get('kind')}({', '.join(fields)})"


def fmt_meta(meta: ir.ValueMeta | None) -> str:
    if isinstance(meta, ir.TensorMeta):
        dims = ", ".join("?" if d is None else str(d) for d in meta.shape)
        return f"{meta.dtype}[{dims}]"
    if isinstance(meta, ir.ScalarMeta):
        return meta.kind
    return "" if meta is None else meta.kind


# ---------------------------------------------------------------------------------- text


def render_text(graph: ir.WalkGraph, walk: str | None = None, *, meta: bool = False) -> str:
    """All walks (with a model header), or the walk named ``walk``. ``meta``: append each op's
    recorded shape and dtype as a comment."""
    if walk is not None and walk not in graph.walks:
        raise ValueError(f"unknown walk {walk!r}; the graph has {sorted(graph.walks)}")
    parts: list[str] = []
    if walk is None:
        head = [f"model {graph.model}"]
        for c in graph.components.values():
            head.append(
                f"{INDENT}component {c.path}: {c.cls} ({c.engine}, batch dim {c.batch_dim})"
            )
        parts.append("\n".join(head))
    for name in [walk] if walk is not None else list(graph.walks):
        parts.append("\n".join(_TextWalk(graph, graph.walks[name], meta).lines()))
    return "\n\n".join(parts) + "\n"


class _TextWalk:
    def __init__(self, graph: ir.WalkGraph, walk: ir.Walk, meta: bool) -> None:
        self.graph = graph
        self.walk = walk
        self.meta = meta
        self.nodes = {n.name: n for n in dataflow.iter_nodes(walk.body)}

    def lines(self) -> Iterator[str]:
        w = self.walk
        client = [k for k in w.outputs if k not in w.state]
        head = f"walk {w.name}({', '.join(i.name for i in w.inputs)}) -> {', '.join(client)}"
        if w.state:
            head += f"; state {', '.join(w.state)}"
        if self.graph.custom_transition:
            head += f"; next by next_walk() (default {w.next})"
        elif w.next is not None:
            head += f"; next {w.next}"
        yield head
        for s in w.streams:
            yield (
                f"{INDENT}stream {s.name}: {s.source} -> {s.consumer} along dim {s.dim}, "
                f"{fmt_policy(s.policy)}"
            )
        yield from self.section(sections(w.body), 1, "")
        outs = [k if a == ir.Ref(k) else f"{k} = {fmt_arg(a)}" for k, a in w.outputs.items()]
        yield f"{INDENT}return {', '.join(outs)}"
        streamed = streamed_outputs(w)
        items = ", ".join(f"{out} (loop {loop})" for out, loop in streamed.items()) or "none"
        whole = ", ".join(k for k in client if k not in streamed) or "none"
        yield f"{INDENT}streamed: {items}; at the end: {whole}"

    def section(self, section: Section, depth: int, prefix: str) -> Iterator[str]:
        pad = INDENT * depth
        if isinstance(section, Sequential):
            for item in section.items:
                yield from self.section(item, depth, prefix)
        elif isinstance(section, Parallel):
            yield f"{pad}parallel"
            for item in section.items:
                yield from self.section(item, depth + 1, prefix)
        elif isinstance(section, NodeRef):
            node = self.nodes[section.name]
            assert isinstance(node, ir.Op)
            line = f"{pad}{short(node.name, prefix)} = {fmt_call(node, prefix)}"
            if self.meta and node.name in self.walk.values:
                line += f"  # {fmt_meta(self.walk.values[node.name])}"
            yield line
        else:
            yield from self.loop(section, depth, prefix)

    def loop(self, section: Loop | DynamicLoop, depth: int, outer: str) -> Iterator[str]:
        node = self.nodes[section.node_name]
        assert isinstance(node, ir.LoopNode)
        pad, inner = INDENT * depth, node.name + "/"
        yield f"{pad}{loop_kind(node)} {short(node.name, outer)} {fmt_trips(node)}"
        rows: list[tuple[str, str]] = []
        steps, invariants = [], []
        for p in node.params:
            name, role = short(p.name, inner), p.role
            if isinstance(role, ir.Carried):
                nxt = short(node.outputs[role.output], inner)
                rows.append(("carried", f"{name} <- {fmt_arg(role.init, outer)}, next {nxt}"))
            elif isinstance(role, ir.Invariant):
                invariants.append(f"{name} = {fmt_arg(role.value, outer)}")
            else:
                steps.append(f"{name} = {fmt_per_step(role.source, outer)}")
        if steps:
            rows.append(("per step", ", ".join(steps)))
        if invariants:
            rows.append(("invariant", ", ".join(invariants)))
        if node.terminal:
            terminal = [
                f"{short(ch, outer)} = {short(node.outputs[j], inner)}"
                for ch, j in node.terminal.items()
            ]
            rows.append(("terminal", ", ".join(terminal)))
        if node.accumulated:
            acc = [
                f"{short(ch, outer)} = {a.mode}({short(node.outputs[a.output], inner)}, dim={a.dim})"
                for ch, a in node.accumulated.items()
            ]
            rows.append(("accumulated", ", ".join(acc)))
        for key, text in rows:
            yield f"{pad}{INDENT}{key:<11} {text}"
        yield from self.section(section.body, depth + 1, inner)


# ---------------------------------------------------------------------------------- DOT


def _q(text: str) -> str:
    """A DOT quoted string (newlines become ``\\n`` line breaks)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_dot(graph: ir.WalkGraph, walk: str) -> str:
    """Graphviz DOT of the walk named ``walk``."""
    if walk not in graph.walks:
        raise ValueError(f"unknown walk {walk!r}; the graph has {sorted(graph.walks)}")
    return "\n".join(_DotWalk(graph.walks[walk]).lines()) + "\n"


class _DotWalk:
    """Node ids: ``in:``/``out:`` walk inputs/outputs, ``op:`` ops, ``param:`` loop body
    parameters, ``ch:`` loop channels. Nodes are declared (inside their clusters) before any
    edge, so that Graphviz keeps each node in its cluster."""

    def __init__(self, walk: ir.Walk) -> None:
        self.walk = walk
        self.ids: dict[str, str] = {i.name: f"in:{i.name}" for i in walk.inputs}
        for node in dataflow.iter_nodes(walk.body):
            if isinstance(node, ir.Op):
                self.ids[node.name] = f"op:{node.name}"
            else:
                self.ids.update({p: f"param:{p}" for p in node.body.params})
                self.ids.update({ch: f"ch:{ch}" for ch in node.channels()})
        self.policies = {s.name: s for s in walk.streams}
        self.edges: list[str] = []

    def edge(self, value: str, target: str, **attrs: str) -> None:
        if value not in self.ids:
            return
        extra = ", ".join(f"{k}={_q(v)}" for k, v in attrs.items())
        self.edges.append(
            f"  {_q(self.ids[value])} -> {_q(target)}" + (f" [{extra}]" if extra else "") + ";"
        )

    def lines(self) -> Iterator[str]:
        w = self.walk
        yield f"digraph {_q(w.name)} {{"
        yield f"  label={_q('walk ' + w.name)}; labelloc=t; compound=true;"
        yield '  node [fontname="Helvetica", fontsize=10]; edge [fontname="Helvetica", fontsize=9];'
        for i in w.inputs:
            yield f"  {_q('in:' + i.name)} [label={_q(i.name)}, shape=invhouse];"
        yield from self.block(w.body, "", 1)
        for key, arg in w.outputs.items():
            target = "out:" + key
            yield f"  {_q(target)} [label={_q(key + (' (state)' if key in w.state else ''))}, shape=house];"
            for ref in dict.fromkeys(dataflow.arg_refs(arg)):
                self.edge(ref, target)
        yield from self.edges
        yield "}"

    def block(self, block: ir.Block, prefix: str, depth: int) -> Iterator[str]:
        pad = INDENT * depth
        for node in block.nodes:
            if isinstance(node, ir.Op):
                yield pad + self.op(node, prefix)
                for ref in dict.fromkeys(dataflow.node_inputs(node)):
                    self.edge(ref, self.ids[node.name])
            else:
                yield from self.loop(node, prefix, depth)

    def op(self, node: ir.Op, prefix: str) -> str:
        name = short(node.name, prefix)
        if node.kind == "component":
            label = name if name == node.target else f"{name}\n{node.target}"
            return f"{_q(self.ids[node.name])} [label={_q(label)}, shape=box, style=bold];"
        return (
            f"{_q(self.ids[node.name])} [label={_q(name)}, tooltip={_q(node.target)}, "
            "shape=ellipse, fontsize=8, width=0.3, height=0.2, margin=0.02];"
        )

    def loop(self, node: ir.LoopNode, outer: str, depth: int) -> Iterator[str]:
        pad, inner = INDENT * depth, node.name + "/"
        label = f"{loop_kind(node)} {short(node.name, outer)} {fmt_trips(node)}"
        yield f"{pad}subgraph {_q('cluster_' + node.name)} {{"
        yield f"{pad}{INDENT}label={_q(label)}; style=rounded;"
        for p in node.params:
            pid, role = f"param:{p.name}", p.role
            name = short(p.name, inner)
            if isinstance(role, ir.Carried):
                text = f"{name} (carried)"
                self.edge_from_arg(role.init, pid, label="init")
                self.edge(
                    node.outputs[role.output], pid, style="dotted", constraint="false", label="next"
                )
            elif isinstance(role, ir.Invariant):
                text = f"{name} (invariant)"
                self.edge_from_arg(role.value, pid)
            else:
                src = role.source
                text = f"{name} = {fmt_per_step(src, outer)}"
                if isinstance(src, ir.ChunkStep):
                    stream = self.policies.get(src.stream)
                    policy = fmt_policy(stream.policy) if stream else "?"
                    note = policy if src.part == "data" else "context"
                    self.edge(
                        src.source, pid, style="dashed", color="blue", label=f"{src.stream}\n{note}"
                    )
                elif isinstance(src, ir.SelectStep):
                    self.edge_from_arg(src.source, pid)
                elif isinstance(src, ir.TableStep):
                    for v in src.values:
                        self.edge_from_arg(v, pid)
            yield f"{pad}{INDENT}{_q(pid)} [label={_q(text)}, shape=plaintext];"
        yield from self.block(node.body, inner, depth + 1)
        self.bound_edges(node)
        if node.stop is not None:
            yield f'{pad}{INDENT}{_q(self.ids[node.stop])} [color=red, xlabel="stop"];'
        for ch, j in node.terminal.items():
            yield f"{pad}{INDENT}{_q('ch:' + ch)} [label={_q(short(ch, outer))}, shape=cds];"
            self.edge(node.outputs[j], "ch:" + ch, label="last")
        for ch, acc in node.accumulated.items():
            yield f"{pad}{INDENT}{_q('ch:' + ch)} [label={_q(short(ch, outer))}, shape=cds];"
            self.edge(node.outputs[acc.output], "ch:" + ch, label=f"{acc.mode} dim={acc.dim}")
        yield f"{pad}}}"

    def bound_edges(self, node: ir.LoopNode) -> None:
        """Dotted edges from the walk inputs that bound the loop to its cluster's border."""
        anchor = node.body.params[0] if node.body.params else node.body.nodes[0].name
        bounds: dict[str, list[str]] = {}
        if isinstance(node.trips, ir.InputTrips):
            bounds.setdefault(node.trips.input, []).append("trips")
        if isinstance(node.trips, ir.ExprTrips):
            for name in dataflow.expr_inputs(node.trips.expr):
                bounds.setdefault(name, []).append("trips")
        if isinstance(node.max_iters, str):
            bounds.setdefault(node.max_iters, []).append("max_iters")
        for value, what in bounds.items():
            self.edge(
                value,
                self.ids[anchor],
                style="dotted",
                lhead="cluster_" + node.name,
                label=", ".join(what),
            )

    def edge_from_arg(self, arg: ir.Arg, target: str, **attrs: str) -> None:
        for ref in dict.fromkeys(dataflow.arg_refs(arg)):
            self.edge(ref, target, **attrs)


def render_svg(graph: ir.WalkGraph, walk: str) -> bytes | None:
    """SVG of ``render_dot(graph, walk)`` made by the Graphviz ``dot`` binary; None when it is
    not installed."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    done = subprocess.run(
        [dot, "-Tsvg"], input=render_dot(graph, walk).encode(), capture_output=True, timeout=60
    )
    if done.returncode != 0:
        raise RuntimeError(f"dot failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout
