"""On a machine with two or more CUDA devices: the tensor-parallel path of
``tests/integration/test_tp.py`` with NCCL (the model's collectives on ``cuda:0``/``cuda:1``, the
runner's control broadcast on the gloo group beside it): greedy tokens of TP=2 equal one GPU's
for 16 requests on Llama and Qwen3-MoE. Skipped with fewer than two GPUs (NCCL refuses two
ranks on one device). Never run on the machine that wrote it (no GPU there): unverified."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from test_tp import POOL, drive, save_checkpoint, workload  # noqa: E402

from walkserve.runtime.kv import hf  # noqa: E402
from walkserve.runtime.kv.paged_lm import PagedLM  # noqa: E402
from walkserve.runtime.tp.group import Rendezvous, TPGroup, TPGroupSpec, TPSetup  # noqa: E402
from walkserve.runtime.tp.runner import TPRunner  # noqa: E402
from walkserve.runtime.tp.shard import load_sharded  # noqa: E402

MODELS = ("llama", "qwen3_moe")


def on_cuda(batch: Any, device: str) -> Any:
    def run(calls: list[Any]) -> Any:
        return batch([((args[0].to(device), *args[1:]), kw) for args, kw in calls])

    return run


def rank_main(setup: TPSetup, root: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    with TPGroup.join(setup) as group:
        for name in MODELS:
            path = Path(root) / name
            lm = load_sharded(path, group, attn_implementation=hf.register())
            runner = TPRunner(group, PagedLM(lm, POOL), verify=True)
            if not group.is_leader:
                runner.follow()
                continue
            tokens = drive(runner.run, workload())
            runner.close()
            ref = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation=hf.register()
            ).to(setup.device)
            ref_tokens = drive(on_cuda(PagedLM(ref, POOL).forward_batch, setup.device), workload())
            (Path(root) / f"{name}.json").write_text(json.dumps([tokens, ref_tokens]))


@pytest.mark.gpu
def test_nccl_tp2_tokens_equal_one_gpu(tmp_path: Path) -> None:
    for name in MODELS:
        save_checkpoint(name, tmp_path / name)
    spec = TPGroupSpec((0, 1))
    ctx = mp.get_context("spawn")
    with Rendezvous.tcp() as rdv:
        setups = [rdv.setup(spec, r, device=f"cuda:{r}") for r in spec.ranks]
        assert {s.backend for s in setups} == {"nccl"}
        procs = [ctx.Process(target=rank_main, args=(s, str(tmp_path))) for s in setups]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
    assert [p.exitcode for p in procs] == [0, 0]
    for name in MODELS:
        tokens, ref_tokens = json.loads((tmp_path / f"{name}.json").read_text())
        assert tokens == ref_tokens, name
