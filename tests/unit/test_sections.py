"""``sections()``, ``parallel_groups()`` and ``edges()`` on hand-built blocks, plus a property
test: on random DAG blocks the section tree is a valid execution order in which the members of
a ``Parallel`` cannot reach each other."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from walkserve.capture import dataflow, ir
from walkserve.capture.sections import (
    DynamicLoop,
    Edge,
    Loop,
    NodeRef,
    Parallel,
    Section,
    Sequential,
    edges,
    parallel_groups,
    sections,
)

R = ir.Ref


def comp(name: str, *inputs: str) -> ir.Op:
    return ir.Op(name, "component", "net", [R(i) for i in inputs])


def glue(name: str, *inputs: str) -> ir.Op:
    return ir.Op(name, "glue", "function:operator.add", [R(i) for i in inputs])


def C(name: str) -> NodeRef:
    return NodeRef(name, "component")


def G(name: str) -> NodeRef:
    return NodeRef(name, "glue")


def loop_node(
    name: str, init: str, body: list[ir.Node], out: str, stop: str | None = None
) -> ir.LoopNode:
    return ir.LoopNode(
        name=name,
        body=ir.Block([f"{name}/z"], body),
        params=[ir.LoopParam(f"{name}/z", ir.Carried(R(init), 0))],
        outputs=[out],
        terminal={f"{name}.z": 0},
        accumulated={},
        trips=ir.FixedTrips(4),
        stop=stop,
        max_iters=4 if stop else None,
    )


def test_three_independent_components_are_parallel() -> None:
    block = ir.Block(["x"], [comp("a", "x"), comp("b", "x"), comp("c", "x")])
    assert sections(block) == Sequential((Parallel((C("a"), C("b"), C("c"))),))
    assert parallel_groups(block) == [["a", "b", "c"]]


def test_chain_is_sequential() -> None:
    block = ir.Block(["x"], [comp("a", "x"), comp("b", "a"), comp("c", "b")])
    assert sections(block) == Sequential((C("a"), C("b"), C("c")))
    assert parallel_groups(block) == []


def test_dependency_through_glue_orders_components() -> None:
    # a -> g -> b: b is one level deeper than a although it reads only glue.
    block = ir.Block(["x"], [comp("a", "x"), glue("g", "a"), comp("b", "g"), comp("c", "x")])
    assert sections(block) == Sequential((Parallel((C("a"), C("c"))), G("g"), C("b")))


def test_glue_placement() -> None:
    block = ir.Block(
        ["x", "y"],
        [
            comp("a", "x"),
            glue("pre", "x", "y"),  # needs no component: first
            comp("b", "pre"),  # depth 0 (glue on inputs adds no depth)
            glue("mix", "a", "b"),  # after level 0
            comp("c", "mix"),  # depth 1
            glue("post", "c", "x"),  # after level 1
            glue("early", "a"),  # after level 0, though listed late
        ],
    )
    assert sections(block) == Sequential(
        (G("pre"), Parallel((C("a"), C("b"))), G("mix"), G("early"), C("c"), G("post"))
    )


def test_loop_inside() -> None:
    body: list[ir.Node] = [
        comp("L/u", "L/z"),
        comp("L/v", "L/z"),
        glue("L/w", "L/u", "L/v"),
    ]
    block = ir.Block(
        ["x"],
        [
            comp("enc", "x"),
            loop_node("L", "enc", body, "L/w"),
            comp("dec", "L.z"),
            comp("side", "x"),
        ],
    )
    inner = Sequential((Parallel((C("L/u"), C("L/v"))), G("L/w")))
    assert sections(block) == Sequential(
        (Parallel((C("enc"), C("side"))), Loop("L", ir.FixedTrips(4), inner), C("dec"))
    )
    assert parallel_groups(block) == [["enc", "side"], ["L/u", "L/v"]]


def test_dynamic_loop_and_parallel_loops() -> None:
    a = loop_node("A", "x", [comp("A/f", "A/z"), glue("A/done", "A/f")], "A/f", stop="A/done")
    b = loop_node("B", "x", [comp("B/f", "B/z")], "B/f")
    tree = sections(ir.Block(["x"], [a, b, glue("sum", "A.z", "B.z")]))
    (par, tail) = tree.items
    assert isinstance(par, Parallel) and tail == G("sum")
    dyn, plain = par.items
    assert dyn == DynamicLoop("A", ir.FixedTrips(4), 4, Sequential((C("A/f"), G("A/done"))))
    assert plain == Loop("B", ir.FixedTrips(4), Sequential((C("B/f"),)))


def test_edges_plain_and_streaming() -> None:
    producer = ir.LoopNode(
        name="P",
        body=ir.Block(["P/z"], [comp("P/f", "P/z")]),
        params=[ir.LoopParam("P/z", ir.Carried(R("x"), 0))],
        outputs=["P/f"],
        terminal={},
        accumulated={"P.z.all": ir.Accumulated(0, "cat", 1)},
        trips=ir.FixedTrips(3),
    )
    consumer = ir.LoopNode(
        name="Q",
        body=ir.Block(["Q/c", "Q/s"], [comp("Q/g", "Q/c", "Q/s")]),
        params=[
            ir.LoopParam("Q/c", ir.PerStep(ir.ChunkStep("stream.Q", "P.z.all"))),
            ir.LoopParam("Q/s", ir.Invariant(R("x"))),
        ],
        outputs=["Q/g"],
        terminal={},
        accumulated={"Q.out0.all": ir.Accumulated(0, "cat", 1)},
        trips=ir.StreamTrips("stream.Q"),
    )
    stream = ir.StreamEdge("stream.Q", "P.z.all", "Q", 1, {"kind": "fixed", "size": 2})
    meta = ir.TensorMeta([1, None, 4], "float32")
    walk = ir.Walk(
        "w",
        [ir.WalkInput("x")],
        ir.Block(["x"], [producer, consumer]),
        {"y": R("Q.out0.all")},
        streams=[stream],
        values={"P.z.all": meta},
    )
    found = edges(walk)
    plain = [(e.value, e.producer, e.consumer) for e in found if not e.streaming]
    assert plain == [
        ("x", None, "P"),
        ("P/z", None, "P/f"),
        ("x", None, "Q"),
        ("Q/c", None, "Q/g"),
        ("Q/s", None, "Q/g"),
    ]
    (streaming,) = [e for e in found if e.streaming]
    assert streaming == Edge("P.z.all", "P", "Q", meta, stream)


def test_edges_carry_recorded_meta_and_producer() -> None:
    walk = ir.Walk(
        "w",
        [ir.WalkInput("x")],
        ir.Block(["x"], [comp("a", "x"), glue("b", "a", "a")]),
        {"y": R("b")},
        values={"a": ir.TensorMeta([2], "float32")},
    )
    assert edges(walk) == [
        Edge("x", None, "a", None),
        Edge("a", "a", "b", ir.TensorMeta([2], "float32")),  # one edge, though read twice
    ]


# ------------------------------------------------------------------------------ property


@st.composite
def dag_blocks(draw: st.DrawFn) -> ir.Block:
    """Random blocks of components and glue over two inputs, each node reading 1-3 earlier
    values."""
    n = draw(st.integers(min_value=1, max_value=12))
    values = ["x", "y"]
    nodes: list[ir.Node] = []
    for i in range(n):
        reads = draw(st.lists(st.sampled_from(values), min_size=1, max_size=3, unique=True))
        make = comp if draw(st.booleans()) else glue
        nodes.append(make(f"n{i}", *reads))
        values.append(f"n{i}")
    return ir.Block(["x", "y"], nodes)


def _flatten(section: Section) -> list[str]:
    if isinstance(section, NodeRef):
        return [section.name]
    if isinstance(section, (Loop, DynamicLoop)):
        return [section.node_name]
    return [name for item in section.items for name in _flatten(item)]


def _ancestors(block: ir.Block) -> dict[str, set[str]]:
    anc: dict[str, set[str]] = {}
    for node in block.nodes:
        direct = {v for v in dataflow.node_inputs(node) if v in anc}
        anc[node.name] = direct.union(*(anc[v] for v in direct))
    return anc


@settings(max_examples=150, deadline=None)
@given(dag_blocks())
def test_sections_are_a_valid_order_with_independent_parallels(block: ir.Block) -> None:
    tree = sections(block)
    order = _flatten(tree)
    assert sorted(order) == sorted(n.name for n in block.nodes)
    anc = _ancestors(block)
    pos = {name: i for i, name in enumerate(order)}
    for name, before in anc.items():
        assert all(pos[a] < pos[name] for a in before)
    for group in parallel_groups(block):
        assert len(group) > 1
        for a in group:
            assert not any(b in anc[a] for b in group)
