"""The OpenAI API layer's pure parts, no server: the sampler's transforms (penalties, logit
bias, min_tokens, grammar masks, logprobs) against hand-written formulas, the grammar
constraints' wire form, tool-call parsing (whole and streamed), safe JSON, strict schemas and
refused fields, chat prompts from content parts, route-template metric labels, and the CLI's
config file."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from walkserve.api import chatprompt, jsonsafe, structured, tools
from walkserve.api.context import validate
from walkserve.api.errors import ApiError
from walkserve.api.metrics import Metrics, read_metric
from walkserve.api.middleware import route_template
from walkserve.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from walkserve.runtime.kv import grammar
from walkserve.runtime.kv.sampling import (
    SamplingParams,
    apply_penalties,
    sample_row,
    token_logprobs,
)

V = 16


# ---------------------------------------------------------------- sampling


def test_penalties_follow_openais_formula() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))
    generated = [3, 3, 5, 3]
    got = apply_penalties(logits, generated, presence=0.5, frequency=0.25)
    want = logits.clone()
    want[3] -= 3 * 0.25 + 0.5
    want[5] -= 1 * 0.25 + 0.5
    assert torch.allclose(got, want)


def test_greedy_row_with_bias_min_tokens_and_a_mask() -> None:
    logits = torch.arange(V, dtype=torch.float32)  # argmax: V - 1
    seen = [1, 2, 3]
    assert sample_row(logits, SamplingParams(), None, seen) == V - 1
    biased = SamplingParams(logit_bias=((V - 1, -100.0), (4, 50.0)))
    assert sample_row(logits, biased, None, seen) == 4
    held = SamplingParams(stop_token_ids=(V - 1,), min_tokens=2)
    assert sample_row(logits, held, None, seen, generated=[7]) == V - 2  # EOS held back
    assert sample_row(logits, held, None, seen, generated=[7, 8]) == V - 1
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[2, 6]] = True
    assert sample_row(logits, SamplingParams(), None, seen, allowed=allowed) == 6
    only_stop = torch.zeros(V, dtype=torch.bool)
    only_stop[V - 1] = True  # the grammar allows only the stop id: it wins over min_tokens
    assert sample_row(logits, held, None, seen, generated=[], allowed=only_stop) == V - 1
    tiny = SamplingParams(temperature=1e-300)
    assert tiny.greedy and sample_row(logits, tiny, None, seen) == V - 1


def test_token_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    values, ids = token_logprobs(logits, 3, 4)
    want = torch.log_softmax(logits, -1)
    assert ids[0] == 3 and torch.allclose(values[0], want[3])
    top = torch.topk(want, 3)
    assert ids[1:].tolist() == top.indices.tolist()
    assert torch.allclose(values[1:], top.values)
    assert token_logprobs(logits, 3, 0)[0].numel() == 0


# ---------------------------------------------------------------- grammar


def test_constraints_travel_as_json_bytes() -> None:
    c = grammar.Constraints(grammar='{"grammars": []}', logit_bias=[(3, 1.5)])
    wire = grammar.encode(c)
    assert wire.dtype == torch.uint8 and wire.shape[0] == 1
    assert grammar.decode(wire) == c
    assert grammar.decode(grammar.encode(grammar.Constraints())).empty
    assert grammar.encode(grammar.Constraints()).shape == (1, 0)
    bad = torch.frombuffer(bytearray(b'{"pickle": 1}'), dtype=torch.uint8)[None]
    with pytest.raises(ValueError, match="bad constraints"):
        grammar.decode(bad)


def test_a_regex_grammar_masks_every_step() -> None:
    """Byte tokens: 3 specials, then one id per byte; the mask allows exactly the bytes the
    regex allows next, then only EOS."""
    vocab = grammar.ByteVocabulary(3 + 256, specials=3, eos=2)
    cache = grammar.GrammarCache(vocab)
    guide = cache.guide(structured.regex_grammar("ab|ac", "guided_regex"), 3 + 256)
    allowed = guide.allowed()
    assert allowed is not None and allowed.nonzero().flatten().tolist() == [3 + ord("a")]
    guide.advance(3 + ord("a"))
    assert guide.allowed().nonzero().flatten().tolist() == [3 + ord("b"), 3 + ord("c")]  # type: ignore[union-attr]
    guide.advance(3 + ord("c"))
    assert guide.allowed().nonzero().flatten().tolist() == [2]  # type: ignore[union-attr]
    for i in range(grammar.CACHE_SIZE + 5):  # the cache stays bounded
        cache.guide(structured.regex_grammar(f"x{i}", "guided_regex"), 3 + 256)
    assert len(cache._fresh) == grammar.CACHE_SIZE


def test_request_grammar_refuses_two_constraints_and_bad_schemas() -> None:
    fmt = SimpleNamespace(type="json_object", json_schema=None)
    assert structured.request_grammar(fmt, None, None, None) is not None
    with pytest.raises(ValueError, match="not several"):
        structured.request_grammar(fmt, None, "a+", None)
    with pytest.raises(ValueError, match="cannot be used"):
        structured.request_grammar(None, {"type": "nope"}, None, None)
    choice = structured.request_grammar(None, None, None, ["a b", "c.d", "(x)"])
    assert choice is not None


# ---------------------------------------------------------------- tools


def test_hermes_and_llama3_calls_parse() -> None:
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call> done'
    content, calls = tools.parse_calls(text, "hermes")
    assert [c.name for c in calls] == ["f"] and json.loads(calls[0].arguments) == {"x": 1}
    assert content == "ok  done"
    content, calls = tools.parse_calls("<tool_call>not json</tool_call>", "hermes")
    assert calls == [] and content == "<tool_call>not json</tool_call>"
    content, calls = tools.parse_calls('{"name": "g", "parameters": {"y": 2}}', "llama3_json")
    assert content is None and calls[0].name == "g" and json.loads(calls[0].arguments) == {"y": 2}
    assert tools.parse_calls("plain text", "llama3_json") == ("plain text", [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_streamed_calls_equal_the_whole_reply_parsed(size: int) -> None:
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call> <tool_ca'
    parser = tools.StreamParser("hermes")
    content, calls = "", []
    for i in range(0, len(text), size):
        piece, new = parser.feed(text[i : i + size])
        content, calls = content + piece, calls + new
    piece, new = parser.feed("", final=True)
    content, calls = content + piece, calls + new
    whole_content, whole_calls = tools.parse_calls(text, "hermes")
    assert content == whole_content and [c.name for c in calls] == [c.name for c in whole_calls]


def test_a_forced_call_grammar_compiles_for_both_formats() -> None:
    params = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for fmt in ("hermes", "llama3_json"):
        assert tools.call_grammar([("f", params), ("g", None)], fmt)  # type: ignore[arg-type]


# ---------------------------------------------------------------- JSON and schemas


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
        (b'{"a": ' + b"9" * 5000 + b"}", "digits"),
        (b'{"a": "\\ud800"}', "surrogate"),
        (b'{"a": NaN}', "not valid JSON"),
        (b'{"a": 1e999}', "too large"),
        (b"\xff", "not UTF-8"),
    ],
)
def test_safe_json_refuses_what_would_hurt(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        jsonsafe.loads(body)


def test_dumps_writes_non_finite_floats_as_null() -> None:
    assert json.loads(jsonsafe.dumps({"a": [1.0, float("nan"), float("inf")]})) == {
        "a": [1.0, None, None]
    }


def test_schemas_are_strict_and_name_refused_fields() -> None:
    base: dict[str, Any] = {"model": "m", "prompt": "a"}
    for extra, message in [
        ({"max_tokens": True}, "max_tokens"),
        ({"prompt": [True]}, "prompt"),
        ({"n": "2"}, "n"),
        ({"wat": 1}, "unknown field 'wat'"),
        ({"stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats is not"),
    ]:
        with pytest.raises(ApiError, match=message):
            validate({**base, **extra}, CompletionRequest)
    ok = validate({**base, "stream_options": {"continuous_usage_stats": False}}, CompletionRequest)
    assert ok.stream_options is not None and not ok.stream_options.include_usage
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}]}
    assert validate({**chat, "store": False, "service_tier": "auto"}, ChatCompletionRequest)
    for extra, message in [({"store": True}, "store is not supported"), ({"store": 0}, "store")]:
        with pytest.raises(ApiError, match=message):
            validate({**chat, **extra}, ChatCompletionRequest)


def test_chat_prompts_join_text_parts_and_refuse_media() -> None:
    task = SimpleNamespace(chat_template=lambda turns: repr(turns), tool_template=None)
    parts = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert chatprompt.render(task, [parts], None, "m") == repr([("user", "a\nb")])  # type: ignore[arg-type]
    image = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    )
    with pytest.raises(ApiError, match=r"messages\[0\]\.content\[0\]: content part 'image_url'"):
        chatprompt.render(task, [image], None, "m")  # type: ignore[arg-type]
    tool = ChatMessage.model_validate({"role": "tool", "tool_call_id": "c", "content": "3"})
    with pytest.raises(ApiError, match="no chat template that renders"):
        chatprompt.render(task, [tool], None, "m")  # type: ignore[arg-type]


# ---------------------------------------------------------------- metrics


def test_metric_routes_are_templates_and_labels_are_escaped() -> None:
    from walkserve.api.routes import ROUTERS

    routes = [route for router in ROUTERS for route in router.routes]
    scope = {"type": "http", "path": "/v1/walks/speak", "method": "POST"}
    assert route_template(routes, scope) == "/v1/walks/{walk}"
    assert route_template(routes, {**scope, "method": "GET"}) == "/v1/walks/{walk}"  # a 405
    assert route_template(routes, {**scope, "path": "/x\nfake 1"}) == "unmatched"
    name = 'odd"name\nfake_metric 42'
    metrics = Metrics(name)
    metrics.count("unmatched", 404)
    from walkserve.runtime.conductor import ConductorStats

    text = metrics.render(0, None, ConductorStats(0, 0, 0, 0, 0, 0, {}))
    assert not any(line.startswith("fake_metric") for line in text.splitlines())
    assert (
        read_metric(text, "walkserve:http_requests_total", model_name=name, route="unmatched") == 1
    )


# ---------------------------------------------------------------- checkpoints with a tokenizer

HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>"
    " answer with <tool_call>{json}</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }}</tool_call>"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def fake_checkpoint(path: Any, template: str | None) -> None:
    """A weightless checkpoint: a Llama config and a byte-level BPE tokenizer (trained here
    on a few words), with ``template`` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    LlamaConfig(
        vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, eos_token_id=2
    ).save_pretrained(path)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["hello world tool call weather", "yes no maybe"] * 20, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="</s>", bos_token="<s>", pad_token="<pad>"
    )
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(path)


def test_a_checkpoint_profile_renders_tools_with_its_template(tmp_path: Any) -> None:
    from walkserve.adapters.hf_causal_lm import checkpoint_profile
    from walkserve.api.schemas import Tool

    fake_checkpoint(tmp_path, HERMES_TEMPLATE)
    text = checkpoint_profile(str(tmp_path), "ckpt").text
    assert text.tool_template is not None and text.tool_format == "hermes"
    assert text.structured_output and text.has_tokenizer
    tool = Tool.model_validate({"type": "function", "function": {"name": "get_weather"}})
    history = [
        ChatMessage.model_validate({"role": "user", "content": "hi"}),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            }
        ),
        ChatMessage.model_validate({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
    ]
    prompt = chatprompt.render(text, history, [tool], "ckpt")
    assert prompt.startswith("<tools>get_weather </tools>")
    assert "<tool_call>get_weather</tool_call>" in prompt and "<|tool|>sunny" in prompt
    assert prompt.endswith("<|assistant|>")
    llama = HERMES_TEMPLATE.replace("<tool_call>{json}</tool_call>", '{"name", "parameters"}')
    llama = llama.replace("<tool_call>{{", "<|python_tag|>{{").replace("}}</tool_call>", "}}")
    fake_checkpoint(tmp_path, llama)
    assert checkpoint_profile(str(tmp_path), "ckpt").text.tool_format == "llama3_json"
    fake_checkpoint(tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert checkpoint_profile(str(tmp_path), "ckpt").text.tool_template is None


def test_a_checkpoint_vocabulary_masks_by_its_own_tokens(tmp_path: Any) -> None:
    """``HFVocabulary``: the grammar engine reads the checkpoint's tokenizer; under the regex
    ``yes|no`` every allowed id decodes to a prefix of one of the two."""
    from transformers import AutoTokenizer

    fake_checkpoint(tmp_path, None)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    guide = grammar.GrammarCache(grammar.HFVocabulary(str(tmp_path), eos=2)).guide(
        structured.regex_grammar("yes|no", "guided_regex"), 300
    )
    allowed = guide.allowed()
    assert allowed is not None
    ids = allowed.nonzero().flatten().tolist()
    assert ids and all(
        "yes".startswith(tok.decode([i])) or "no".startswith(tok.decode([i])) for i in ids
    )


def test_a_chat_template_flag_replaces_the_models_own() -> None:
    """--chat-template: a Jinja template (sandboxed) renders plain chats and chats with tools."""
    from walkserve.adapters.registry import profile_for
    from walkserve.api.chattemplate import with_chat_template
    from walkserve.api.schemas import Tool

    source = (
        "{% if tools %}[{{ tools | length }} tools]{% endif %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    )
    text = with_chat_template(profile_for("tiny-llama"), source).text
    plain = ChatMessage.model_validate({"role": "user", "content": "hi"})
    assert chatprompt.render(text, [plain], None, "m") == "<user>hi<assistant>"
    tool = Tool.model_validate({"type": "function", "function": {"name": "f"}})
    assert chatprompt.render(text, [plain], [tool], "m") == "[1 tools]<user>hi<assistant>"
    with pytest.raises(ValueError, match="does not compile"):
        with_chat_template(profile_for("tiny-llama"), "{% for %}")
    sneaky = with_chat_template(profile_for("tiny-llama"), "{{ ''.__class__.__mro__ }}").text
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        chatprompt.render(sneaky, [plain], None, "m")


def test_incremental_detokenization_equals_decoding_everything() -> None:
    """TextAssembler decodes a window of recent tokens per token (vLLM's offsets method):
    its text equals decoding all tokens at once, for a byte tokenizer (partial UTF-8
    characters), a byte-level BPE and a Metaspace (SentencePiece-style) one, stop strings
    included."""
    import random

    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from walkserve.adapters.tokenizer import ByteTokenizer
    from walkserve.api.textgen import TextAssembler

    corpus = ["héllo wörld tool call weather ☃", "yes no maybe ünïcode"] * 20
    decoders_: list[tuple[int, Any]] = [(259, ByteTokenizer(259).decode)]
    for pre, dec in (
        (pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()),
        (pre_tokenizers.Metaspace(), decoders.Metaspace()),
    ):
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer, bpe.decoder = pre, dec
        alphabet = (
            pre_tokenizers.ByteLevel.alphabet() if isinstance(dec, decoders.ByteLevel) else []
        )
        bpe.train_from_iterator(
            corpus, trainers.BpeTrainer(vocab_size=200, initial_alphabet=alphabet)
        )
        decoders_.append((bpe.get_vocab_size(), lambda ids, b=bpe: b.decode(ids)))
    rng = random.Random(0)
    for vocab, decode in decoders_:
        task = SimpleNamespace(eos_id=None, decode=decode)
        for trial in range(40):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
            stops = [decode(ids[3:5])[:2]] if trial % 3 == 0 and decode(ids[3:5])[:2] else []
            text = TextAssembler(task, stops, len(ids))  # type: ignore[arg-type]
            streamed = ""
            for t in ids:
                done = text.feed(t)
                streamed += text.take()
                if done:
                    break
            text.finish()
            streamed += text.take()
            want = decode(text.tokens)
            if stops and stops[0] in want:
                want = want[: want.find(stops[0])]
            assert streamed == text.text == want, (vocab, ids, stops)
