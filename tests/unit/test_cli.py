"""The ``walkserve`` command line, run in-process through ``cli.main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from walkserve.capture import ir, serialize
from walkserve.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_trace_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "trace", "--model", "example-cfg-image", "--walk", "generate")
    assert code == 0
    assert "walk generate(prompt_ids, noise) -> image" in out
    assert "loop euler_step x19" in out
    assert out.count("= component denoiser(") == 3


def test_trace_json_is_the_documented_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "trace", "--model", "example-speech", "--format", "json")
    assert code == 0
    graph = serialize.from_json(out)
    assert list(graph.walks) == ["speak"]
    assert json.loads(out)["version"] == ir.IR_VERSION


def test_trace_dot(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "trace", "--model", "example-world", "--format", "dot")
    assert code == 0 and out.lstrip().startswith("digraph") and "cluster" in out


def test_trace_local_hf_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    code, out, _ = run(capsys, "trace", "--model", str(tmp_path))
    assert code == 0
    assert "walk prefill(input_ids, temperature, top_p, top_k, seed, repetition_penalty" in out
    assert "walk decode(" in out and "walk prefill_ext(input_ids, constraints," in out


def test_unknown_model_and_walk(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "trace", "--model", "no-such-model")
    assert code == 2 and "unknown model 'no-such-model'" in err and "example-text" in err
    code, _, err = run(capsys, "trace", "--model", "example-text", "--walk", "nope")
    assert code == 2 and "unknown walk 'nope'" in err


def test_demo_serves_on_workers_and_checks_the_reference(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "demo", "--model", "example-speech")
    assert code == 0
    assert "started 2 worker(s)" in out  # the shipped two-rank placement
    assert (
        "walk speak" in out and "matches the reference interpreter" in out and "DIFFERS" not in out
    )


def test_plan_prints_ranks_and_memory_for_every_example_placement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from walkserve.adapters.examples import PLACEMENTS_DIR

    files = sorted(PLACEMENTS_DIR.glob("*.yaml"))
    assert len(files) >= 6
    for path in files:
        model = path.name.split(".")[0]
        fast = [] if path.name == "example-speech.2ranks.yaml" else ["--skip-capture-check"]
        code, out, err = run(capsys, "plan", "--model", model, "--placement", str(path), *fast)
        assert code == 0, err
        ranks = int(path.name.split(".")[1].removesuffix("ranks").removesuffix("rank"))
        for rank in range(ranks):
            assert f"rank {rank}:" in out
        assert "weights" in out and "KV pool" in out and "total" in out


def test_plan_json_and_bad_placement(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from walkserve.lowering.plan import ExecutablePlan

    code, out, _ = run(capsys, "plan", "--model", "example-text", "--json", "--skip-capture-check")
    assert code == 0 and ExecutablePlan.from_json(out).walks.keys() == {"prefill", "decode"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("ranks: 1\nnodes:\n  no_such_component: [0]\n")
    code, _, err = run(capsys, "plan", "--model", "example-text", "--placement", str(bad))
    assert code == 2 and "no_such_component" in err


def test_bench_forwards_to_the_load_generator(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "--concurrency" in out and "--burstiness" in out and "--slo" in out
    # options are checked before anything is sent (no server runs here)
    code, _, err = run(capsys, "bench", "--model", "m", "--rate", "0")
    assert code == 2 and "--rate must be > 0" in err
    code, _, err = run(capsys, "bench", "--model", "m", "--slo", "latency=1")
    assert code == 2 and "ttft" in err


def test_serve_flags_from_a_config_file(tmp_path: Path) -> None:
    from walkserve.cli import _origins, parse

    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: tiny-llama\nserved-model-name: [a, b]\nmax-model-len: 64\nport: 9\nthreads: 2\n"
    )
    args = parse(["serve", "--config", str(config), "--port", "8001"])
    assert args.model_tag == "tiny-llama" and args.served_model_name == ["a", "b"]
    assert args.threads == 2
    assert args.max_model_len == 64 and args.port == 8001  # the command line wins
    args = parse(["serve", "tiny-qwen2", "--config", str(config)])
    assert args.model_tag == "tiny-qwen2"
    config.write_text("no-such-flag: 1\n")
    with pytest.raises(ValueError, match="unknown flag 'no-such-flag'"):
        parse(["serve", "--config", str(config)])
    assert _origins('["https://a", "https://b"]') == ("https://a", "https://b")
    assert _origins("https://a, https://b") == ("https://a", "https://b")


def test_serve_refuses_flags_it_cannot_honour(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "serve", "tiny-llama", "--dtype", "float16")
    assert code == 2 and "--dtype float16 is not supported" in err
    code, _, err = run(capsys, "serve", "tiny-llama", "--model", "tiny-qwen2")
    assert code == 2 and "differ" in err
    code, _, err = run(capsys, "serve", "tiny-llama", "--ssl-keyfile", "k.pem")
    assert code == 2 and "go together" in err
    code, _, err = run(capsys, "serve", "tiny-llama", "--threads", "0")
    assert code == 2 and "--threads must be >= 1, got 0" in err


def test_serve_threads_reach_the_workers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--threads N`` is each worker's torch threads (``serve(threads=N)``); without it the
    pool's default (None)."""
    from walkserve.runtime import server

    seen: list[object] = []

    def fake_serve(*args: object, **kwargs: object) -> None:
        seen.append(kwargs["threads"])
        raise ValueError("stop here")

    monkeypatch.setattr(server, "serve", fake_serve)
    assert run(capsys, "serve", "walkserve-default", "--threads", "3")[0] == 2
    assert run(capsys, "serve", "walkserve-default")[0] == 2
    assert seen == [3, None]


def test_a_server_without_tokenizer_says_to_send_token_ids() -> None:
    """--skip-tokenizer-init: text prompts and chats get a 400 that says what to send."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from walkserve.adapters.registry import profile_for
    from walkserve.api.app import create_app
    from walkserve.api.profile import without_tokenizer

    profile = without_tokenizer(profile_for("tiny-llama"))
    app = create_app(SimpleNamespace(captured=None), profile)  # type: ignore[arg-type]
    client = TestClient(app)
    r = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi"})
    assert r.status_code == 400 and "send the prompt as token ids" in r.json()["error"]["message"]
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "use /v1/completions with token ids" in r.text


def test_tensor_parallel_size_plans_every_component_on_n_ranks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    args = ("--model", str(tmp_path), "--tensor-parallel-size", "2")
    code, out, err = run(capsys, "plan", *args, "--skip-capture-check")
    assert code == 0, err
    assert "rank 0:" in out and "rank 1:" in out
    assert "tensor-parallel group ranks [0, 1] (leader 0): lm" in out
    code, out, err = run(capsys, "plan", *args, "--data-parallel-size", "2", "--skip-capture-check")
    assert code == 0, err
    assert "group ranks [0, 1] (leader 0)" in out and "group ranks [2, 3] (leader 2)" in out
    code, _, err = run(capsys, "plan", *args, "--placement", "x.yaml")
    assert code == 2 and "not both" in err
    code, _, err = run(capsys, "serve", "--data-parallel-size", "0", "--placement", "x.yaml")
    assert code == 2 and "not both" in err
