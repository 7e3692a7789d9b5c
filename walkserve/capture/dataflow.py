"""Dataflow of the IR: which values each node reads and defines, and every node of a block.

The IR (``ir``) is SSA: a node defines values by name and reads values by ``Ref``. These are
the queries every later layer asks of it, answered in one place::

    node_inputs(node)    outer-scope values a node reads (an op's Refs; a loop's initial,
                         invariant and per-step sources, and the streamed channel it chunks)
    node_outputs(node)   values it defines in its enclosing scope (an op: its name; a loop:
                         its terminal and accumulated channels)
    arg_refs(arg)        the Refs inside one argument (lists, tuples, dicts, slices)
    role_args/role_refs  the outer arguments and values one loop parameter is made from
    expr_inputs(expr)    the walk inputs an integer expression (a trip count) reads
    iter_nodes(block)    every node of a block and, recursively, of its loop bodies
    is_component(node)   an ``Op`` of kind ``component``

What crosses the boundary: IR structs in, names (``str``), ``ir.Arg`` and ``ir.Node`` out.
``sections``, ``lint``, ``interpret`` and ``render``, lowering's ``valueflow`` and the
runtime's walk specs are built on these.
"""

from __future__ import annotations

from walkserve.capture import ir


def arg_refs(arg: ir.Arg) -> list[str]:
    """Names of all values an argument refers to."""
    if isinstance(arg, ir.Ref):
        return [arg.name]
    if isinstance(arg, (ir.ListArg, ir.TupleArg)):
        return [r for item in arg.items for r in arg_refs(item)]
    if isinstance(arg, ir.DictArg):
        return [r for item in arg.items.values() for r in arg_refs(item)]
    if isinstance(arg, ir.SliceArg):
        return [*arg_refs(arg.start), *arg_refs(arg.stop), *arg_refs(arg.step)]
    return []


def node_inputs(node: ir.Node) -> list[str]:
    """Outer-scope values a node reads (for a loop: its initial, invariant, per-step sources)."""
    if isinstance(node, ir.Op):
        refs = [r for a in node.args for r in arg_refs(a)]
        refs += [r for a in node.kwargs.values() for r in arg_refs(a)]
        return refs
    return [r for p in node.params for r in role_refs(p.role)]


def role_args(role: ir.ParamRole) -> list[ir.Arg]:
    """The outer arguments a loop parameter is made from (none for affine steps and stream
    chunks, which come from the iteration index and the streaming edge)."""
    if isinstance(role, ir.Carried):
        return [role.init]
    if isinstance(role, ir.Invariant):
        return [role.value]
    if isinstance(role.source, ir.SelectStep):
        return [role.source.source]
    if isinstance(role.source, ir.TableStep):
        return list(role.source.values)
    return []


def role_refs(role: ir.ParamRole, *, streams: bool = True) -> list[str]:
    """Outer values a loop parameter reads; with ``streams``, a stream chunk reads the
    streamed channel."""
    refs = [r for a in role_args(role) for r in arg_refs(a)]
    if streams and isinstance(role, ir.PerStep) and isinstance(role.source, ir.ChunkStep):
        refs.append(role.source.source)
    return refs


def node_outputs(node: ir.Node) -> list[str]:
    """Values a node defines in its enclosing scope."""
    return [node.name] if isinstance(node, ir.Op) else node.channels()


def expr_inputs(expr: ir.IntExpr) -> list[str]:
    """Names of the walk inputs an integer expression reads, in order, without repeats."""
    if isinstance(expr, ir.IntInput):
        return [expr.name]
    if isinstance(expr, ir.IntSize):
        return [expr.input]
    if isinstance(expr, ir.IntLit):
        return []
    return list(dict.fromkeys([*expr_inputs(expr.left), *expr_inputs(expr.right)]))


def iter_nodes(block: ir.Block) -> list[ir.Node]:
    """All nodes of a block and, recursively, of its loop bodies."""
    out: list[ir.Node] = []
    for node in block.nodes:
        out.append(node)
        if isinstance(node, ir.LoopNode):
            out += iter_nodes(node.body)
    return out


def is_component(node: ir.Node) -> bool:
    return isinstance(node, ir.Op) and node.kind == "component"
