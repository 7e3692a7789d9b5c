"""Text, DOT and SVG renderings of a small captured model: a guidance loop with two parallel
denoiser calls, a dynamic decode loop, and a loop that consumes the decoder's hidden states as
a stream."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from torch import nn

from walkserve import capture
from walkserve.capture import FixedChunk, component, ir, loop, stream, walk
from walkserve.capture.render import fmt_arg, fmt_index, render_dot, render_svg, render_text


@component
class Den(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, z: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.l(z) * t + c


@component(engine="kv_cache")
class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(10, 4)
        self.o = nn.Linear(4, 10)

    def forward(self, tok: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h2 = torch.tanh(self.e(tok) + h)
        return self.o(h2), h2


class M(nn.Module):
    sigmas: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.den = Den()
        self.lm = LM()
        self.register_buffer("sigmas", torch.linspace(1, 0, 6))

    @walk
    def gen(self, z: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor) -> dict[str, torch.Tensor]:
        for k in range(5):
            z = self.step(z, self.sigmas[k], self.sigmas[k + 1], c1, c2)
        return {"z": z}

    @loop
    def step(self, z, t, tn, c1, c2):  # type: ignore[no-untyped-def]
        a = self.den(z, t, c1)
        b = self.den(z, t, c2)
        v = a + 0.5 * (b - a)
        return z + (tn - t) * v

    @walk
    def dec(self, tok: torch.Tensor, h: torch.Tensor, eos: int) -> dict[str, torch.Tensor]:
        toks = []
        hs = []
        for _ in range(20):
            tok, h, hid = self.dstep(tok, h)
            toks.append(tok)
            hs.append(hid)
            if (tok == eos).all():
                break
        hid = torch.stack(hs, 1)
        outs = []
        for ch in stream(hid, FixedChunk(2), dim=1):
            outs.append(self.post(ch))
        return {"toks": torch.cat(toks, 1), "out": torch.cat(outs, 1)}

    @loop(max_iters=20)
    def dstep(self, tok, h):  # type: ignore[no-untyped-def]
        logits, h2 = self.lm(tok, h)
        return logits.argmax(-1), h2, h2

    @loop
    def post(self, ch):  # type: ignore[no-untyped-def]
        return ch * 2


@pytest.fixture(scope="module")
def graph() -> ir.WalkGraph:
    torch.manual_seed(0)
    inputs = {
        "z": torch.randn(1, 4),
        "c1": torch.randn(1, 4),
        "c2": torch.randn(1, 4),
        "tok": torch.tensor([[1]]),
        "h": torch.zeros(1, 1, 4),
        "eos": 3,
    }
    return capture.trace(M(), inputs).graph


GEN = """\
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
    mul = glue operator.mul(0.5, sub)
    add = glue operator.add(den, mul)
    mul_1 = glue operator.mul(sub_1, add)
    add_1 = glue operator.add(z, mul_1)
  return z = step.z
  streamed: none; at the end: z
"""

DEC = """\
walk dec(tok, h, eos) -> toks, out
  stream stream.post: dstep.out2.all -> post along dim 1, fixed(size=2, end=flush)
  dynamic loop dstep x20 until all_1, max_iters 20
    carried     tok <- tok, next argmax
    carried     h <- h, next getitem_1
    invariant   stop_eos = eos
    accumulated dstep.tok.all = cat(argmax, dim=1), dstep.out2.all = stack(getitem_1, dim=1)
    lm = component lm(tok, h)
    getitem = glue operator.getitem(lm, 0)
    getitem_1 = glue operator.getitem(lm, 1)
    argmax = glue getitem.argmax(-1)
    eq = glue operator.eq(argmax, stop_eos)
    all_1 = glue eq.all()
  loop post per chunk of stream.post
    per step    ch = chunk i of stream.post
    accumulated post.out0.all = cat(mul, dim=1)
    mul = glue operator.mul(ch, 2)
  return toks = dstep.tok.all, out = post.out0.all
  streamed: toks (loop dstep), out (loop post); at the end: none
"""


def test_text_of_each_walk(graph: ir.WalkGraph) -> None:
    assert render_text(graph, "gen") == GEN
    assert render_text(graph, "dec") == DEC


def test_text_of_all_walks_has_model_header(graph: ir.WalkGraph) -> None:
    text = render_text(graph)
    assert text.startswith(f"model {graph.model}\n")
    assert "  component lm: " in text and "(kv_cache, batch dim 0)" in text
    assert GEN in text and DEC in text


def test_text_meta_annotations(graph: ir.WalkGraph) -> None:
    lines = render_text(graph, "dec", meta=True).splitlines()
    assert "    argmax = glue getitem.argmax(-1)  # int64[1, 1]" in lines
    assert "    all_1 = glue eq.all()  # bool[]" in lines


def test_text_header_state_next_and_unknown_walk(graph: ir.WalkGraph) -> None:
    g = ir.WalkGraph(
        model="m",
        components={},
        walks={
            "a": ir.Walk(
                "a",
                [ir.WalkInput("x")],
                ir.Block(["x"], []),
                {"y": ir.Ref("x"), "cache": ir.Ref("x")},
                next="b",
                state=["cache"],
            ),
            "b": ir.Walk(
                "b", [ir.WalkInput("cache")], ir.Block(["cache"], []), {"c": ir.Ref("cache")}
            ),
        },
    )
    assert render_text(g, "a").splitlines()[0] == "walk a(x) -> y; state cache; next b"
    with pytest.raises(ValueError, match="unknown walk 'zz'"):
        render_text(g, "zz")


def test_argument_and_index_formatting() -> None:
    sl = ir.SliceArg(ir.Const(None), ir.Const(-1), ir.Const(None))
    assert fmt_arg(ir.TupleArg([sl, ir.Const(0)])) == "(:-1, 0)"
    assert fmt_arg(ir.TupleArg([ir.Ref("loop/a")]), "loop/") == "(a,)"
    assert fmt_arg(ir.DictArg({"k": ir.FloatConst("inf")})) == "{'k': inf}"
    assert fmt_arg(ir.DTypeArg("bfloat16")) == "torch.bfloat16"
    assert fmt_arg(ir.ModelAttr("blocks.0.scale")) == "self.blocks.0.scale"
    assert [
        fmt_index(0, 1),
        fmt_index(1, 1),
        fmt_index(0, 2),
        fmt_index(3, 2),
        fmt_index(4, 0),
    ] == [
        "i",
        "1 + i",
        "2*i",
        "3 + 2*i",
        "4",
    ]


# ------------------------------------------------------------------------------ DOT

NODE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)" \[')
EDGE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)" -> "((?:[^"\\]|\\.)*)"( \[.*\])?;$')


def check_dot(text: str) -> tuple[set[str], list[tuple[str, str, str]]]:
    """Balanced braces; every edge joins declared nodes; nodes are declared before edges."""
    assert text.count("{") == text.count("}")
    depth = 0
    for line in text.splitlines():
        depth += line.count("{") - line.count("}")
        assert depth >= 0
    nodes: set[str] = set()
    found: list[tuple[str, str, str]] = []
    for line in text.splitlines():
        edge = EDGE.match(line)
        if edge:
            found.append((edge.group(1), edge.group(2), edge.group(3) or ""))
        elif (decl := NODE.match(line)) is not None:
            assert not found, f"node declared after the edges: {line}"
            nodes.add(decl.group(1))
    for a, b, _ in found:
        assert a in nodes and b in nodes, (a, b)
    return nodes, found


def test_dot_of_guidance_walk(graph: ir.WalkGraph) -> None:
    text = render_dot(graph, "gen")
    assert text.startswith('digraph "gen" {')
    nodes, found = check_dot(text)
    assert text.count("subgraph ") == 1 and 'subgraph "cluster_step" {' in text
    assert 'label="loop step x5"' in text
    assert '"op:step/den" [label="den", shape=box' in text
    assert '"op:step/sub" [label="sub", tooltip="function:operator.sub", shape=ellipse' in text
    assert {"in:z", "in:c1", "in:c2", "out:z", "ch:step.z"} <= nodes
    assert ("op:step/add_1", "param:step/z") in {(a, b) for a, b, _ in found}  # carried back edge
    assert ("ch:step.z", "out:z") in {(a, b) for a, b, _ in found}


def test_dot_of_streaming_walk(graph: ir.WalkGraph) -> None:
    text = render_dot(graph, "dec")
    _, found = check_dot(text)
    assert 'subgraph "cluster_dstep" {' in text and 'subgraph "cluster_post" {' in text
    assert 'label="dynamic loop dstep x20 until all_1, max_iters 20"' in text
    (streamed,) = [e for e in found if 'style="dashed"' in e[2]]
    assert streamed[:2] == ("ch:dstep.out2.all", "param:post/ch")
    assert 'label="stream.post\\nfixed(size=2, end=flush)"' in streamed[2]


def test_dot_quotes_names() -> None:
    g = ir.WalkGraph(
        model="m",
        components={},
        walks={
            "w": ir.Walk("w", [ir.WalkInput('a"b')], ir.Block(['a"b'], []), {"y": ir.Ref('a"b')})
        },
    )
    nodes, _ = check_dot(render_dot(g, "w"))
    assert 'in:a\\"b' in nodes


# ------------------------------------------------------------------------------ SVG


def test_svg_is_none_without_graphviz(graph: ir.WalkGraph, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert render_svg(graph, "dec") is None


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_svg_with_graphviz(graph: ir.WalkGraph) -> None:
    svg = render_svg(graph, "dec")
    assert svg is not None and b"<svg" in svg and b"cluster_post" in svg
