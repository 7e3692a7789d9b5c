"""The OpenAI API as clients use it, over HTTP with the official ``openai`` client against one
``walkserve serve`` of the default model, started as ``vllm serve`` users start theirs (the
model positional, the rest from a ``--config`` YAML: two served names, a max model length,
CORS). Every numeric result is checked against the upstream Hugging Face Llama the model wraps
(``default.text_lm``): logprobs against its ``log_softmax``, penalties and logit bias against a
greedy loop written here with OpenAI's formula; structured outputs against their schema with
``jsonschema``. Bad bodies (issue 17's list, and hypothesis-made ones on every route) get a 4xx
with the JSON error shape, never a 5xx, and the server stays healthy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from walkserve.adapters import default  # noqa: E402
from walkserve.adapters.tokenizer import ByteTokenizer  # noqa: E402
from walkserve.api.metrics import read_metric  # noqa: E402
from walkserve.api.profile import plain_chat  # noqa: E402

MODEL = "walkserve-default"
ALIAS = "tiny-assistant"
MAX_MODEL_LEN = 768
ORIGIN = "https://ui.example"
TEXT = ByteTokenizer(default.TEXT_VOCAB)


@pytest.fixture(scope="module")
def server(walkserve_serve: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    config = tmp_path_factory.mktemp("config") / "serve.yaml"
    config.write_text(
        f"served-model-name: [{ALIAS}, {MODEL}]\n"
        f"max-model-len: {MAX_MODEL_LEN}\n"
        f"allowed-origins: '[\"{ORIGIN}\"]'\n"
        "max-num-seqs: 8\n"
    )
    with walkserve_serve(MODEL, "--config", str(config)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def upstream() -> Any:
    return default.text_lm(0)  # the same weights the served model wraps, HF's own attention


def logits_of(upstream: Any, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.no_grad():
        return upstream(torch.tensor([ids])).logits[0].float()


def chat_ids(text: str) -> list[int]:
    return TEXT.encode(plain_chat([("user", text)]))


# ---------------------------------------------------------------- CLI, names


def test_served_names_and_cors(server: Any, client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [ALIAS, MODEL]
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.model == ALIAS  # answers carry the first served name
    r = httpx.options(
        f"{server.url}/v1/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert r.headers.get("access-control-allow-origin") == ORIGIN
    with pytest.raises(openai.BadRequestError, match="max model length of 768"):
        client.completions.create(model=ALIAS, prompt=[5] * 400, max_tokens=400)


# ---------------------------------------------------------------- logprobs


def test_completion_logprobs_equal_the_upstream_log_softmax(client: Any, upstream: Any) -> None:
    prompt = TEXT.encode("Logprobs")
    out = client.completions.create(
        model=ALIAS, prompt=prompt, max_tokens=6, logprobs=3, extra_body={"return_token_ids": True}
    )
    choice = out.choices[0]
    tokens = choice.model_extra["token_ids"]
    want = torch.log_softmax(logits_of(upstream, prompt + tokens), -1)[len(prompt) - 1 :]
    assert len(choice.logprobs.token_logprobs) == len(tokens) == 6
    for i, token in enumerate(tokens):
        assert abs(choice.logprobs.token_logprobs[i] - want[i, token].item()) < 1e-4
        # The top entries are keyed by their text (ids of one byte-fold share a key): each
        # value is one of the three largest upstream log-probabilities.
        top = torch.topk(want[i], 3).values.tolist()
        for value in choice.logprobs.top_logprobs[i].values():
            assert min(abs(value - t) for t in top) < 1e-4
        assert token == int(want[i].argmax())  # greedy: the sampled token is the top one
    assert choice.logprobs.tokens == [TEXT.decode([t]) for t in tokens]


def test_chat_logprobs_streamed_and_not(client: Any, upstream: Any) -> None:
    messages = [{"role": "user", "content": "Stream logprobs"}]
    args: dict[str, Any] = {"model": ALIAS, "messages": messages, "max_tokens": 5}
    out = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    ids = chat_ids("Stream logprobs")
    tokens = [TEXT.specials + c.bytes[0] for c in content]  # byte tokens: one byte each
    want = torch.log_softmax(logits_of(upstream, ids + tokens), -1)[len(ids) - 1 :]
    for i, entry in enumerate(content):
        assert abs(entry.logprob - want[i, tokens[i]].item()) < 1e-4
        assert len(entry.top_logprobs) == 2
        top = torch.topk(want[i], 2)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            top.values.tolist(), abs=1e-4
        )
    chunks = list(
        client.chat.completions.create(**args, logprobs=True, top_logprobs=2, stream=True)
    )
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


# ---------------------------------------------------------------- penalties and logit_bias


def reference_greedy(
    upstream: Any,
    prompt: list[int],
    n: int,
    presence: float = 0.0,
    frequency: float = 0.0,
    bias: dict[int, float] | None = None,
) -> list[int]:
    """Greedy decoding with OpenAI's formula: logit[j] += bias[j] - c[j] * frequency -
    (c[j] > 0) * presence, c[j] the count of j among the generated tokens; stops at EOS."""
    out: list[int] = []
    for _ in range(n):
        logits = logits_of(upstream, prompt + out)[-1]
        for token, b in (bias or {}).items():
            logits[token] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[0])
        logits = logits - counts * frequency - (counts > 0).float() * presence
        token = int(logits.argmax())
        if token == default.EOS_ID:
            break
        out.append(token)
    return out


def test_penalties_and_logit_bias_equal_the_reference_loop(client: Any, upstream: Any) -> None:
    prompt = TEXT.encode("Repeat repeat repeat")
    plain = reference_greedy(upstream, prompt, 12)
    bias = {plain[1]: -100.0, TEXT.encode("z")[0]: 4.0}
    for presence, frequency, logit_bias in [(1.5, 0.0, None), (0.0, 1.2, None), (0.5, 0.5, bias)]:
        want = reference_greedy(upstream, prompt, 12, presence, frequency, logit_bias)
        out = client.completions.create(
            model=ALIAS,
            prompt=prompt,
            max_tokens=12,
            presence_penalty=presence,
            frequency_penalty=frequency,
            logit_bias={str(k): v for k, v in (logit_bias or {}).items()},
            extra_body={"return_token_ids": True},
        )
        assert out.choices[0].model_extra["token_ids"] == want, (presence, frequency)
    assert want != plain  # the penalties and the bias changed the reply


def test_echo_puts_the_prompt_first_and_user_is_accepted(client: Any) -> None:
    args: dict[str, Any] = {"model": ALIAS, "prompt": "Echo me", "max_tokens": 4, "echo": True}
    out = client.completions.create(**args, user="someone")
    text = out.choices[0].text
    plain = client.completions.create(model=ALIAS, prompt="Echo me", max_tokens=4)
    assert text == "Echo me" + plain.choices[0].text
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_min_tokens_and_ignore_eos_hold_the_eos(client: Any) -> None:
    """A logit bias makes the EOS the first choice: without more the reply is empty; with
    min_tokens 5 it has 5 tokens, then the EOS; with ignore_eos it runs to max_tokens."""
    args: dict[str, Any] = {"model": ALIAS, "prompt": "a", "max_tokens": 20}
    bias = {str(default.EOS_ID): 100.0}
    out = client.completions.create(**args, logit_bias=bias)
    assert out.choices[0].text == "" and out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        **args, logit_bias=bias, extra_body={"min_tokens": 5, "return_token_ids": True}
    )
    assert len(out.choices[0].model_extra["token_ids"]) == 5
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 6
    out = client.completions.create(
        **args, logit_bias=bias, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    assert len(out.choices[0].model_extra["token_ids"]) == 20
    assert out.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- structured output, tools

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client: Any, temperature: float) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "A person, as JSON"}],
        max_tokens=200,
        temperature=temperature,
        seed=5,
        response_format=fmt,
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = client.completions.create(
        model=ALIAS,
        prompt="JSON:",
        max_tokens=200,
        extra_body={"response_format": {"type": "json_object"}, "guided_json": None},
    )
    if out.choices[0].finish_reason == "stop":  # any object: it may run past max_tokens
        assert isinstance(json.loads(out.choices[0].text), dict)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


def test_forced_tool_calls_parse_and_name_the_function(client: Any) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice, names in [
        ("required", {"get_weather", "add"}),
        ({"type": "function", "function": {"name": "add"}}, {"add"}),
    ]:
        out = client.chat.completions.create(
            model=ALIAS, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=120
        )
        call = out.choices[0].message.tool_calls[0]
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name in names
        params = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), params["function"]["parameters"])
        chunks = list(
            client.chat.completions.create(
                model=ALIAS,
                messages=messages,
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=120,
                stream=True,
            )
        )
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas] == [call.function.name]
        assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The call and its result go back as history; auto then answers (text or a call).
    history = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    out = client.chat.completions.create(model=ALIAS, messages=history, tools=TOOLS, max_tokens=8)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_tool_calls_are_parsed_from_the_reply(client: Any) -> None:
    """A logit bias that makes the reply begin with a hermes call shows auto parsing of what
    the model wrote (the random model would not write one by itself)."""
    out = client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "Add"}],
        tools=TOOLS,
        max_tokens=200,
        extra_body={
            "guided_regex": r'<tool_call>\n\{"name":"add","arguments":\{"a":1,"b":2\}\}\n</tool_call>'
        },
    )
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert out.choices[0].finish_reason == "tool_calls"


# ---------------------------------------------------------------- content parts


def test_text_parts_work_and_an_image_part_is_refused(client: Any) -> None:
    as_string = client.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": "Hi\nthere"}], max_tokens=6
    )
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    as_parts = client.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": parts}], max_tokens=6
    )
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match=r"content\[1\]: content part 'image_url'"):
        client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": [parts[0], image]}], max_tokens=6
        )
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match=r"takes text only, not video") as e:
        client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": [video]}], max_tokens=6
        )
    assert e.value.body["param"] == "messages[0].content[0]"  # a model without video


# ---------------------------------------------------------------- refused fields, bad bodies

REFUSED = [
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "a list of prompts"),
    ("/v1/completions", {"no_such_field": 1}, "unknown field 'no_such_field'"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions is not supported"),
    ("/v1/chat/completions", {"prediction": {"type": "content"}}, "prediction is not supported"),
    ("/v1/chat/completions", {"store": True}, "store is not supported"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice needs tools"),
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "cannot be used",
    ),
    (
        "/v1/chat/completions",
        {"stream_options": {"continuous_usage_stats": True}},
        "continuous_usage_stats",
    ),
    ("/v1/audio/speech", {"instructions": "cheerful"}, "instructions is not supported"),
    ("/v1/images/generations", {"style": "vivid"}, "style is not supported"),
]
BASE = {
    "/v1/completions": {"model": ALIAS, "prompt": "a", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 2,
    },
    "/v1/audio/speech": {"model": ALIAS, "input": "a"},
    "/v1/images/generations": {"model": ALIAS, "prompt": "a"},
}


@pytest.mark.parametrize(("path", "extra", "message"), REFUSED, ids=[r[2][:30] for r in REFUSED])
def test_unimplemented_fields_get_a_400_naming_them(
    server: Any, path: str, extra: dict[str, Any], message: str
) -> None:
    r = httpx.post(f"{server.url}{path}", json={**BASE[path], **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.text


DEEP = "[" * 100_000 + "]" * 100_000
EXT = {
    "input_ids": [[5, 6]],
    "max_new_tokens": 2,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "seed": 0,
}
BAD_BODIES = [
    ("/v1/completions", {"top_k": 2**64}, 200, None),  # beyond the vocabulary: all tokens
    (
        "/v1/completions",
        '{"model": "m", "prompt": "a", "max_tokens": ' + "9" * 5000 + "}",
        400,
        "digits",
    ),
    ("/v1/completions", '{"model": "m", "prompt": ' + DEEP + "}", 400, "nests deeper"),
    ("/v1/completions", '{"model": "m", "prompt": "\\ud800"}', 400, "surrogate"),
    ("/v1/completions", {"prompt": [True, 5]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"temperature": 1e-300}, 200, None),  # below 1e-5: greedy
    ("/v1/completions", {"seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"logit_bias": {"-1": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"7": 500}}, 400, "logit_bias"),
    ("/v1/completions", '{"model": "m", "prompt": "a", "temperature": NaN}', 400, "not valid JSON"),
    ("/v1/completions", '{"model": "m", "prompt": "a", "temperature": 1e999}', 400, "too large"),
    (
        "/v1/walks/generate",
        {
            "inputs": {
                "prompt_ids": [[1]],
                "noise": {"b64": "", "dtype": "float32", "shape": [2**32, 2**32, 2**32]},
            }
        },
        400,
        "elements",
    ),
    (
        "/v1/walks/speak",
        {"inputs": {"prompt_ids": [[1, True]], "max_new_tokens": 4}},
        400,
        "prompt_ids",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "message"), BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))]
)
def test_bad_bodies_get_a_4xx_naming_the_problem(
    server: Any, path: str, body: Any, status: int, message: str | None
) -> None:
    if isinstance(body, dict):
        base = BASE.get(path, {})
        r = httpx.post(f"{server.url}{path}", json={**base, **body}, timeout=60)
    else:
        r = httpx.post(f"{server.url}{path}", content=body.replace('"m"', f'"{ALIAS}"'), timeout=60)
    assert r.status_code == status, r.text
    if message is not None:
        assert message in r.json()["error"]["message"], r.text
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_nan_in_a_walk_output_is_json(server: Any) -> None:
    """The image walk of a huge (finite) noise: its output is NaN, answered as JSON null,
    plain and streamed."""
    body = {"inputs": {"prompt_ids": [[1]], "noise": [[[[3e38] * 8] * 8] * 4]}}
    r = httpx.post(f"{server.url}/v1/walks/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    image = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert image["outputs"]["image"][0][0][0][0] is None
    body["stream"] = True
    with httpx.stream("POST", f"{server.url}/v1/walks/generate", json=body, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: {")]
    for line in lines:
        json.loads(line.removeprefix("data: "), parse_constant=lambda c: pytest.fail(c))


def test_a_path_cannot_inject_a_metric_line(server: Any) -> None:
    before = httpx.get(f"{server.url}/metrics", timeout=30).text
    for path in (
        "/v1/x%0Afake_unauth_metric%2042",
        '/v1/x"}%0Awalkserve:kv_pages 999999',
        "/v1/a",
        "/v1/b",
    ):
        r = httpx.get(f"{server.url}{path}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert not any(
        line.startswith(("fake_unauth_metric", "walkserve:kv_pages ")) for line in text.splitlines()
    )
    assert read_metric(text, "walkserve:kv_pages") != 999999
    assert read_metric(
        text, "walkserve:http_requests_total", route="unmatched", code="404"
    ) == 4 + (
        read_metric(before, "walkserve:http_requests_total", route="unmatched", code="404") or 0
    )
    assert read_metric(text, "walkserve:prompt_tokens_total", model_name=ALIAS) is not None
    ok = read_metric(text, "walkserve:http_requests_total", route="/v1/completions", code="200")
    assert ok is not None and ok >= 1


# ---------------------------------------------------------------- fuzz

ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/audio/speech"),
    ("POST", "/v1/images/generations"),
    ("POST", "/v1/images/edits"),
    ("POST", "/v1/walks/speak"),
    ("POST", "/v1/walks/prefill_ext"),
    ("GET", "/v1/models"),
]
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "seed",
    "stop", "stream", "logprobs", "top_logprobs", "logit_bias", "response_format", "tools",
    "tool_choice", "input", "voice", "size", "inputs", "echo", "presence_penalty", "min_tokens",
    "guided_regex", "stream_options", "content", "role", "unknown",
]  # fmt: skip
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)
    ),
    max_leaves=12,
)
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6).map(
    lambda d: {"model": ALIAS, **d} if "model" not in d else d
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
@given(route=st.sampled_from(ROUTES), body=BODIES | JSON)
def test_fuzzed_bodies_never_get_a_5xx(server: Any, route: tuple[str, str], body: Any) -> None:
    method, path = route
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = (
            min(body["max_tokens"], 4) if body["max_tokens"] > 0 else body["max_tokens"]
        )
    if isinstance(body, dict) and isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    r = httpx.request(method, f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code < 500, (path, body, r.text)
    if r.headers.get("content-type", "").startswith("application/json"):
        assert r.status_code == 200 or "error" in r.json()


def test_the_server_is_healthy_after_everything(server: Any, client: Any) -> None:
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    out = client.completions.create(model=ALIAS, prompt="still here", max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert read_metric(text, "walkserve:num_requests_running", model_name=ALIAS) == 0
