"""The JSON export of the IR: it matches the JSON Schema (checked by a small validator of the
schema subset msgspec emits), every object of a tagged union carries a documented ``type``
tag, the round trip is exact, and docs/ir-schema.{json,md} agree with the code."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from walkserve import capture
from walkserve.adapters.examples import build_example
from walkserve.capture import ir, serialize
from walkserve.capture.lint import lint
from walkserve.capture.render import render_text
from walkserve.capture.schema import json_schema, schema_text

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def graphs() -> dict[str, ir.WalkGraph]:
    found = {}
    for name in ("example-speech", "example-text"):
        model, sample = build_example(name)
        found[name] = capture.trace(model, sample).graph
    found["hand-built"] = every_argument_graph()
    return found


def every_argument_graph() -> ir.WalkGraph:
    """One glue op whose arguments use every argument tag, and a tensor constant."""
    args: list[ir.Arg] = [
        ir.Ref("x"),
        ir.TupleArg([ir.SliceArg(ir.Const(None), ir.Const(2), ir.Const(None)), ir.EllipsisArg()]),
        ir.ListArg(
            [ir.Const(1), ir.Const(2.5), ir.Const(True), ir.Const("s"), ir.FloatConst("-inf")]
        ),
        ir.DictArg({"dtype": ir.DTypeArg("float16"), "device": ir.DeviceArg("cpu")}),
        ir.TensorConst("w.c0"),
        ir.ModelAttr("scale"),
    ]
    body = ir.Block(["x"], [ir.Op("f", "glue", "function:torch.add", args, {}, "m.py:1")])
    walk = ir.Walk(
        "w",
        [ir.WalkInput("x", ir.TensorMeta([None, 3], "bfloat16"))],
        body,
        {"y": ir.Ref("f")},
        values={"f": ir.OpaqueMeta("varies"), "x": ir.ScalarMeta("int")},
    )
    data = ir.TensorData("int16", [3], bytes([1, 0, 2, 0, 255, 255]))
    return ir.WalkGraph("m.M", {}, {"w": walk}, {"w.c0": data}, custom_transition=True)


# ------------------------------------------------------------------------------ validator


def validate(value: Any, schema: dict[str, Any], defs: dict[str, Any], path: str = "$") -> None:
    """Check ``value`` against the JSON Schema subset msgspec emits; objects with declared
    properties may hold no other keys (msgspec writes exactly its fields)."""
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        validate(value, defs[name], defs, path)
        return
    if "anyOf" in schema:
        disc = schema.get("discriminator")
        if disc is not None:
            assert isinstance(value, dict) and disc["propertyName"] in value, f"{path}: no tag"
            tag = value[disc["propertyName"]]
            assert tag in disc["mapping"], f"{path}: unknown tag {tag!r}"
            validate(value, {"$ref": disc["mapping"][tag]}, defs, path)
            return
        errors = []
        for option in schema["anyOf"]:
            try:
                validate(value, option, defs, path)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{path}: matches no option: {errors}")
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    kind = schema.get("type")
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    if kind is not None:
        assert checks[kind](value), f"{path}: {value!r} is not {kind}"
    if schema.get("contentEncoding") == "base64":
        base64.b64decode(value, validate=True)
    if kind == "object":
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key!r}"
        for key, item in value.items():
            if key in props:
                validate(item, props[key], defs, f"{path}.{key}")
            elif "additionalProperties" in schema:
                validate(item, schema["additionalProperties"], defs, f"{path}.{key}")
            else:
                raise AssertionError(f"{path}: unexpected key {key!r}")
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            validate(item, schema["items"], defs, f"{path}[{i}]")


def tagged_structs() -> dict[str, list[str]]:
    """Struct name -> tag, for every tagged Struct of ``ir`` (members of tagged unions)."""
    tags: dict[str, list[str]] = {}
    for name, obj in vars(ir).items():
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
            tag = obj.__struct_config__.tag
            if isinstance(tag, str):
                tags.setdefault(tag, []).append(name)
    return tags


def all_objects(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        return [value, *(o for v in value.values() for o in all_objects(v))]
    if isinstance(value, list):
        return [o for v in value for o in all_objects(v)]
    return []


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", ["example-speech", "example-text", "hand-built"])
def test_export_matches_schema(graphs: dict[str, ir.WalkGraph], name: str) -> None:
    schema = json_schema()
    exported = json.loads(serialize.to_json(graphs[name]))
    validate(exported, schema, schema["$defs"])


@pytest.mark.parametrize("name", ["example-speech", "example-text", "hand-built"])
def test_export_type_tags_are_documented(graphs: dict[str, ir.WalkGraph], name: str) -> None:
    tags = tagged_structs()
    doc = (DOCS / "ir-schema.md").read_text()
    documented = {t for t in tags if re.search(rf"^\| `{t}` \|", doc, re.M)}
    assert documented == set(tags), f"undocumented type tags: {set(tags) - documented}"
    objects = all_objects(json.loads(serialize.to_json(graphs[name])))
    # StreamEdge.policy is a plain dict; its "kind" is not a tag.
    seen = {o["type"] for o in objects if "type" in o}
    assert seen <= set(tags)
    nodes = [o for o in objects if "target" in o or "trips" in o]
    assert nodes and all(o["type"] in ("op", "loop") for o in nodes)


@pytest.mark.parametrize("name", ["example-speech", "example-text", "hand-built"])
def test_round_trip_is_exact(graphs: dict[str, ir.WalkGraph], name: str) -> None:
    g = graphs[name]
    back = serialize.from_json(serialize.to_json(g))
    assert back == g
    assert serialize.to_json(back) == serialize.to_json(g)
    lint(back)


def test_hand_built_graph_lints(graphs: dict[str, ir.WalkGraph]) -> None:
    lint(graphs["hand-built"])


def test_committed_schema_matches_code() -> None:
    committed = json.loads((DOCS / "ir-schema.json").read_text())
    assert committed == json_schema(), (
        "docs/ir-schema.json is stale: python -m walkserve.capture.schema > docs/ir-schema.json"
    )
    assert (DOCS / "ir-schema.json").read_text() == schema_text()


def test_doc_example_decodes_lints_and_renders() -> None:
    doc = (DOCS / "ir-schema.md").read_text()
    example = re.search(r"```json\n(.*?)```", doc, re.S)
    rendered = re.search(r"render_text\(graph, \"generate\"\)`\):\n\n```\n(.*?)```", doc, re.S)
    assert example is not None and rendered is not None
    graph = serialize.from_json(example.group(1))
    lint(graph)
    validate(json.loads(example.group(1)), json_schema(), json_schema()["$defs"])
    assert render_text(graph, "generate") == rendered.group(1)


def test_from_json_rejects_other_versions(graphs: dict[str, ir.WalkGraph]) -> None:
    data = json.loads(serialize.to_json(graphs["example-text"]))
    data["version"] = ir.IR_VERSION + 1
    with pytest.raises(ValueError, match="not supported"):
        serialize.from_json(json.dumps(data))


def test_validator_rejects_malformed_exports(graphs: dict[str, ir.WalkGraph]) -> None:
    schema = json_schema()
    good = json.loads(serialize.to_json(graphs["example-text"]))

    def broken(change: Any) -> dict[str, Any]:
        data = json.loads(json.dumps(good))
        change(data)
        return data

    node = ("walks", "decode", "body", "nodes", 0)

    def at(data: dict[str, Any], keys: tuple[Any, ...]) -> Any:
        for k in keys:
            data = data[k]
        return data

    cases = [
        lambda d: at(d, node).pop("type"),  # a node without its tag
        lambda d: at(d, node).__setitem__("type", "while"),  # an unknown tag
        lambda d: at(d, (*node, "trips")).__setitem__("input", 3),  # wrong type
        lambda d: at(d, node).__setitem__("extra", 1),  # a field the IR does not have
        lambda d: d.pop("walks"),
    ]
    for change in cases:
        with pytest.raises(AssertionError):
            validate(broken(change), schema, schema["$defs"])
