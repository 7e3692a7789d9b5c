"""``lint()``: a hand-built graph that uses every IR construct passes; each broken invariant
raises ``LintError`` naming the walk, the node and the rule.

``valid_graph()`` is built fresh for every case; each case breaks one thing in it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from walkserve.capture import dataflow, ir
from walkserve.capture.lint import LintError, lint

R = ir.Ref
FIXED_POLICY: dict[str, str | int | float] = {
    "kind": "fixed",
    "size": 2,
    "end": "flush",
    "pad_value": 0.0,
}


def op(name: str, target: str, *args: ir.Arg, kind: str = "glue") -> ir.Op:
    return ir.Op(name, kind, target, list(args))  # type: ignore[arg-type]


def valid_graph() -> ir.WalkGraph:
    """prefill(x) -> h, state k; next decode.
    decode(h, k, n): a dynamic loop (carried, invariant, affine, select; stop; input trips)
    streaming into a loop over chunks, then a fixed loop with a table."""
    prefill = ir.Walk(
        "prefill",
        [ir.WalkInput("x")],
        ir.Block(
            ["x"],
            [
                op("enc", "enc", R("x"), kind="component"),
                op("tanh", "function:torch.tanh", R("enc")),
            ],
        ),
        {"h": R("tanh"), "k": R("enc")},
        next="decode",
        state=["k"],
    )
    dstep = ir.LoopNode(
        name="dstep",
        body=ir.Block(
            ["dstep/h", "dstep/k", "dstep/i", "dstep/w"],
            [
                op("dstep/lm", "lm", R("dstep/h"), R("dstep/k"), kind="component"),
                op("dstep/add", "function:operator.add", R("dstep/lm"), R("dstep/w")),
                op("dstep/done", "method:all", R("dstep/add")),
            ],
        ),
        params=[
            ir.LoopParam("dstep/h", ir.Carried(R("h"), 0)),
            ir.LoopParam("dstep/k", ir.Invariant(R("k"))),
            ir.LoopParam("dstep/i", ir.PerStep(ir.AffineStep(0, 1))),
            ir.LoopParam("dstep/w", ir.PerStep(ir.SelectStep(ir.ModelAttr("table"), 0, 0, 1))),
        ],
        outputs=["dstep/add", "dstep/lm"],
        terminal={"dstep.h": 0},
        accumulated={"dstep.out1.all": ir.Accumulated(1, "cat", 1)},
        trips=ir.InputTrips("n"),
        stop="dstep/done",
        max_iters="n",
    )
    post = ir.LoopNode(
        name="post",
        body=ir.Block(
            ["post/ch"],
            [
                op("post/codec", "codec", R("post/ch"), kind="component"),
                op("post/scale", "function:operator.mul", R("post/codec"), ir.TensorConst("c0")),
            ],
        ),
        params=[ir.LoopParam("post/ch", ir.PerStep(ir.ChunkStep("stream.post", "dstep.out1.all")))],
        outputs=["post/scale"],
        terminal={},
        accumulated={"post.out0.all": ir.Accumulated(0, "cat", 1)},
        trips=ir.StreamTrips("stream.post"),
    )
    fixed = ir.LoopNode(
        name="fixed",
        body=ir.Block(
            ["fixed/z", "fixed/t"],
            [op("fixed/mul", "function:operator.mul", R("fixed/z"), R("fixed/t"))],
        ),
        params=[
            ir.LoopParam("fixed/z", ir.Carried(R("dstep.h"), 0)),
            ir.LoopParam("fixed/t", ir.PerStep(ir.TableStep([ir.Const(0.5), ir.Const(0.25)]))),
        ],
        outputs=["fixed/mul"],
        terminal={"fixed.z": 0},
        accumulated={},
        trips=ir.FixedTrips(2),
    )
    decode = ir.Walk(
        "decode",
        [ir.WalkInput("h"), ir.WalkInput("k"), ir.WalkInput("n")],
        ir.Block(["h", "k", "n"], [dstep, post, fixed]),
        {"tokens": R("dstep.h"), "audio": R("post.out0.all"), "z": R("fixed.z")},
        streams=[ir.StreamEdge("stream.post", "dstep.out1.all", "post", 1, dict(FIXED_POLICY))],
        values={
            "h": ir.TensorMeta([1, 4], "float32"),
            "dstep/add": ir.TensorMeta([1, 4], "float32"),
        },
    )
    components = {
        path: ir.ComponentInfo(path, f"m.{path.title()}", engine)  # type: ignore[arg-type]
        for path, engine in (("enc", "stateless"), ("lm", "kv_cache"), ("codec", "stateless"))
    }
    return ir.WalkGraph(
        model="m.Model",
        components=components,
        walks={"prefill": prefill, "decode": decode},
        constants={"c0": ir.TensorData("float32", [2], bytes(8))},
    )


def node(g: ir.WalkGraph, name: str, walk: str = "decode") -> ir.Node:
    return next(n for n in dataflow.iter_nodes(g.walks[walk].body) if n.name == name)


def loop(g: ir.WalkGraph, name: str) -> ir.LoopNode:
    found = node(g, name)
    assert isinstance(found, ir.LoopNode)
    return found


def test_valid_graph_passes() -> None:
    lint(valid_graph())


def test_error_names_walk_node_and_rule() -> None:
    g = valid_graph()
    loop(g, "dstep").body.nodes[1].args[0] = R("nowhere")  # type: ignore[union-attr]
    with pytest.raises(LintError) as info:
        lint(g)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.rule, err.walk, err.node) == ("undefined-ref", "decode", "dstep/add")
    assert str(err).startswith("walk 'decode', node 'dstep/add': argument 0 refers to 'nowhere'")
    assert str(err).endswith("[lint: undefined-ref]")


# ------------------------------------------------------------------------------ mutations
# Each case: (break the graph, expected rule, substring of the message).

Case = tuple[Callable[[ir.WalkGraph], object], str, str]


def _set(obj: object, field: str, value: object) -> None:
    setattr(obj, field, value)


def _replace_param(g: ir.WalkGraph, loop_name: str, i: int, role: ir.ParamRole) -> None:
    lp = loop(g, loop_name)
    lp.params[i] = ir.LoopParam(lp.params[i].name, role)


def _swap_carried(g: ir.WalkGraph) -> None:
    lp = loop(g, "dstep")
    lp.params[1] = ir.LoopParam("dstep/k", ir.Carried(R("k"), 0))
    lp.params[0] = ir.LoopParam("dstep/h", ir.Carried(R("h"), 1))


def _two_carried_one_output(g: ir.WalkGraph) -> None:
    lp = loop(g, "dstep")
    lp.params[1] = ir.LoopParam("dstep/k", ir.Carried(R("k"), 0))


def _rename_post_param_to_h(g: ir.WalkGraph) -> None:
    post = loop(g, "post")
    post.body.params = ["h"]
    post.params = [ir.LoopParam("h", post.params[0].role)]


def _duplicate_role(g: ir.WalkGraph) -> None:
    dstep = loop(g, "dstep")
    dstep.params.append(dstep.params[2])
    dstep.body.params.append("dstep/x")


def _unknown_stream_trips(g: ir.WalkGraph) -> None:
    loop(g, "post").trips = ir.StreamTrips("stream.x")
    g.walks["decode"].streams.clear()


def _stream_source_later(g: ir.WalkGraph) -> None:
    w = g.walks["decode"]
    w.body.nodes = [w.body.nodes[1], w.body.nodes[0], w.body.nodes[2]]


CASES: dict[str, Case] = {
    # graph
    "version": (lambda g: _set(g, "version", 99), "version", "IR version 99"),
    "no-walks": (lambda g: g.walks.clear(), "graph-keys", "no walk"),
    "walk-key": (
        lambda g: g.walks.__setitem__("other", g.walks.pop("prefill")),
        "graph-keys",
        "walk key 'other'",
    ),
    "component-key": (
        lambda g: g.components.__setitem__("enc", g.components["lm"]),
        "graph-keys",
        "component key 'enc'",
    ),
    "constant-bytes": (
        lambda g: g.constants.__setitem__("c0", ir.TensorData("float32", [3], bytes(8))),
        "constant",
        "holds 8 bytes, but float32[3] needs 12",
    ),
    "constant-dtype": (
        lambda g: g.constants.__setitem__("c0", ir.TensorData("float99", [2], bytes(8))),
        "constant",
        "unknown dtype 'float99'",
    ),
    # names and scopes
    "walk-params": (
        lambda g: _set(g.walks["decode"].body, "params", ["h", "k"]),
        "walk-params",
        "are not the walk inputs",
    ),
    "dup-value-op-vs-input": (
        lambda g: _set(g.walks["prefill"].body.nodes[1], "name", "x"),
        "unique-name",
        "value name 'x' is defined twice",
    ),
    "dup-value-body-param-vs-walk-input": (
        _rename_post_param_to_h,
        "unique-name",
        "value name 'h' is defined twice",
    ),
    "dup-body-op-vs-channel": (
        lambda g: _set(loop(g, "post").body.nodes[1], "name", "dstep.h"),
        "unique-name",
        "value name 'dstep.h' is defined twice",
    ),
    "dup-node-name": (
        lambda g: _set(loop(g, "fixed"), "name", "dstep"),
        "unique-name",
        "node name is used twice",
    ),
    "dangling-ref": (
        lambda g: _set(g.walks["prefill"].body.nodes[1], "args", [R("ghost")]),
        "undefined-ref",
        "refers to 'ghost', which nothing defines",
    ),
    "out-of-order": (
        lambda g: g.walks["prefill"].body.nodes.reverse(),
        "undefined-ref",
        "not defined earlier in the same scope",
    ),
    "body-reads-outer-value": (
        lambda g: _set(loop(g, "dstep").body.nodes[0], "args", [R("h")]),
        "undefined-ref",
        "refers to 'h', which is not defined earlier",
    ),
    "outer-reads-body-value": (
        lambda g: _set(g.walks["decode"], "outputs", {"x": R("dstep/add")}),
        "undefined-ref",
        "output 'x' refers to 'dstep/add'",
    ),
    "missing-tensor-const": (
        lambda g: g.constants.clear(),
        "tensor-const",
        "tensor constant 'c0'",
    ),
    # ops
    "op-kind": (
        lambda g: _set(g.walks["prefill"].body.nodes[1], "kind", "magic"),
        "op-kind",
        "neither component nor glue",
    ),
    "unknown-component": (
        lambda g: _set(g.walks["prefill"].body.nodes[0], "target", "dec"),
        "component",
        "component 'dec' is not in graph.components",
    ),
    "glue-prefix": (
        lambda g: _set(g.walks["prefill"].body.nodes[1], "target", "torch.tanh"),
        "glue-target",
        "is not function:<name> or method:<name>",
    ),
    "glue-private-method": (
        lambda g: _set(loop(g, "dstep").body.nodes[2], "target", "method:__reduce__"),
        "glue-target",
        "public method",
    ),
    "glue-module": (
        lambda g: _set(g.walks["prefill"].body.nodes[1], "target", "function:os.system"),
        "glue-target",
        "outside the allowed modules",
    ),
    "glue-builtin": (
        lambda g: _set(g.walks["prefill"].body.nodes[1], "target", "function:builtins.eval"),
        "glue-target",
        "not an allowed builtin",
    ),
    # loop parameters and outputs
    "param-without-role": (
        lambda g: loop(g, "dstep").params.pop(),
        "loop-params",
        "must match one to one",
    ),
    "role-without-param": (
        lambda g: loop(g, "dstep").body.params.pop(),
        "loop-params",
        "must match one to one",
    ),
    "duplicate-role": (
        _duplicate_role,
        "loop-params",
        "must match one to one",
    ),
    "body-output-not-body-value": (
        lambda g: _set(loop(g, "dstep"), "outputs", ["dstep/add", "h"]),
        "loop-outputs",
        "body output 1 names 'h'",
    ),
    "stop-not-body-value": (
        lambda g: _set(loop(g, "dstep"), "stop", "dstep.h"),
        "loop-outputs",
        "stop names 'dstep.h'",
    ),
    "carried-output-range": (
        lambda g: _replace_param(g, "dstep", 0, ir.Carried(R("h"), 5)),
        "carried",
        "receives body output 5, but the body has 2 outputs",
    ),
    "carried-shared-output": (_two_carried_one_output, "carried", "feeds two carried"),
    "carried-order": (_swap_carried, "carried", "expected 0"),
    # channels
    "channels-overlap": (
        lambda g: _set(loop(g, "dstep"), "terminal", {"dstep.out1.all": 1}),
        "channels",
        "both terminal and accumulated",
    ),
    "channel-prefix": (
        lambda g: _set(loop(g, "dstep"), "terminal", {"h_final": 0}),
        "channels",
        "'h_final' is not named dstep.<label>",
    ),
    "terminal-index": (
        lambda g: _set(loop(g, "dstep"), "terminal", {"dstep.h": 2}),
        "channels",
        "reads output 2 of 2",
    ),
    "accumulated-index": (
        lambda g: _set(
            loop(g, "dstep"), "accumulated", {"dstep.x.all": ir.Accumulated(3, "cat", 1)}
        ),
        "channels",
        "reads output 3 of 2",
    ),
    # trips, stop, max_iters
    "fixed-count": (
        lambda g: _set(loop(g, "fixed"), "trips", ir.FixedTrips(0)),
        "trips",
        "int > 0, got 0",
    ),
    "input-trips": (
        lambda g: _set(loop(g, "dstep"), "trips", ir.InputTrips("steps")),
        "trips",
        "'steps' is not a walk input",
    ),
    "table-in-input-loop": (
        lambda g: _replace_param(g, "dstep", 2, ir.PerStep(ir.TableStep([ir.Const(1)]))),
        "trips",
        "fixed loops only",
    ),
    "table-too-short": (
        lambda g: _set(loop(g, "fixed"), "trips", ir.FixedTrips(3)),
        "trips",
        "2 table values for 3 iterations",
    ),
    "stop-without-max-iters": (  # a fixed loop with a stop (input trips bound it themselves)
        lambda g: (
            _set(loop(g, "dstep"), "max_iters", None),
            _set(loop(g, "dstep"), "trips", ir.FixedTrips(20)),
        ),
        "stop",
        "needs max_iters",
    ),
    "max-iters-zero": (
        lambda g: _set(loop(g, "dstep"), "max_iters", 0),
        "stop",
        "got 0",
    ),
    "max-iters-not-input": (
        lambda g: _set(loop(g, "dstep"), "max_iters", "limit"),
        "stop",
        "got 'limit'",
    ),
    # streams
    "stream-trips-unknown": (
        _unknown_stream_trips,
        "stream",
        "not a stream of the walk",
    ),
    "stream-consumer-not-loop": (
        lambda g: _set_stream(g, consumer="dstep/add"),
        "stream",
        "flows to 'dstep/add', not a loop",
    ),
    "stream-consumer-trips": (
        lambda g: _set(loop(g, "post"), "trips", ir.FixedTrips(3)),
        "stream",
        "whose trips are FixedTrips(count=3)",
    ),
    "stream-other-consumer": (
        lambda g: _set(loop(g, "dstep"), "trips", ir.StreamTrips("stream.post")),
        "stream",
        "which flows to 'post'",
    ),
    "chunk-source-mismatch": (
        lambda g: _replace_param(g, "post", 0, ir.PerStep(ir.ChunkStep("stream.post", "dstep.h"))),
        "stream",
        "stream 'stream.post' carries 'dstep.out1.all'",
    ),
    "chunk-in-fixed-loop": (
        lambda g: _replace_param(
            g, "fixed", 1, ir.PerStep(ir.ChunkStep("stream.post", "dstep.out1.all"))
        ),
        "stream",
        "which flows to 'post'",
    ),
    "stream-source-after-loop": (
        _stream_source_later,
        "undefined-ref",
        "the source of stream 'stream.post' refers to 'dstep.out1.all'",
    ),
    "stream-policy": (
        lambda g: _set_stream(g, policy={"kind": "fixed", "size": 0}),
        "stream",
        "bad policy",
    ),
    "stream-policy-kind": (
        lambda g: _set_stream(g, policy={"kind": "zigzag"}),
        "stream",
        "unknown chunk policy kind 'zigzag'",
    ),
    "stream-twice": (
        lambda g: g.walks["decode"].streams.append(g.walks["decode"].streams[0]),
        "stream",
        "declared twice",
    ),
    # walk outputs, state, next
    "output-dangling": (
        lambda g: g.walks["decode"].outputs.__setitem__("extra", R("ghost")),
        "undefined-ref",
        "output 'extra' refers to 'ghost'",
    ),
    "state-not-output": (
        lambda g: _set(g.walks["prefill"], "state", ["k", "cache"]),
        "walk-outputs",
        "state 'cache' is not an output",
    ),
    "next-unknown": (
        lambda g: _set(g.walks["prefill"], "next", "chat"),
        "walk-outputs",
        "next names 'chat'",
    ),
    # recorded metadata
    "values-unknown-name": (
        lambda g: g.walks["decode"].values.__setitem__("ghost", ir.ScalarMeta("int")),
        "values-meta",
        "values records ['ghost']",
    ),
    "carried-dtype": (
        lambda g: g.walks["decode"].values.__setitem__("dstep/add", ir.TensorMeta([1, 4], "int64")),
        "values-meta",
        "starts as a float32 tensor of rank 2 but the body returns a int64 tensor of rank 2",
    ),
    "carried-rank": (
        lambda g: g.walks["decode"].values.__setitem__(
            "dstep/add", ir.TensorMeta([1, 1, 4], "float32")
        ),
        "values-meta",
        "the body returns a float32 tensor of rank 3",
    ),
    "carried-tensor-vs-scalar": (
        lambda g: g.walks["decode"].values.__setitem__("dstep/add", ir.ScalarMeta("float")),
        "values-meta",
        "a Python float",
    ),
}


def _set_stream(g: ir.WalkGraph, **changes: object) -> None:
    old = g.walks["decode"].streams[0]
    fields = {f: getattr(old, f) for f in old.__struct_fields__}
    g.walks["decode"].streams[0] = ir.StreamEdge(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_broken_invariant(case: str) -> None:
    breaker, rule, words = CASES[case]
    g = valid_graph()
    breaker(g)
    with pytest.raises(LintError) as info:
        lint(g)
    assert info.value.rule == rule, str(info.value)
    assert words in str(info.value), str(info.value)


def test_lint_names_node_of_loop_errors() -> None:
    g = valid_graph()
    loop(g, "dstep").max_iters = None
    loop(g, "dstep").trips = ir.FixedTrips(20)
    with pytest.raises(LintError) as info:
        lint(g)
    assert (info.value.walk, info.value.node) == ("decode", "dstep")


def test_opaque_carried_meta_is_not_compared() -> None:
    g = valid_graph()
    g.walks["decode"].values["dstep/add"] = ir.OpaqueMeta("varies")
    lint(g)
