"""Loading a Hugging Face checkpoint sharded over a TP group, with the sharding applied from
outside the model (the model's code is not touched; gpt-fast's ``apply_tp`` idea).

Owns ``load_sharded`` and the plan it hands transformers. The plan is transformers' own: the
config's ``base_model_tp_plan`` plus the model class's ``_tp_plan``, resolved by transformers'
``from_pretrained(distributed_config=DistributedConfig(tp_size=N))``, which also reads each
rank's shard straight from the safetensors files (``get_slice``: a rank never reads, let alone
holds, the rows of a sharded matrix that other ranks own) and hooks the collectives in::

    q_proj k_proj v_proj   colwise       heads split: rank r computes its H/N heads
    o_proj                 rowwise       partial sums, all-reduce
    gate_proj up_proj      colwise       intermediate split
    down_proj              rowwise       all-reduce
    embed_tokens           embedding_rowwise        vocabulary-parallel, partial lookups summed
    lm_head                colwise_gather_output    vocabulary-parallel, logits all-gathered
    experts (MoE)          moe_tp_experts + packed_colwise gate_up / rowwise down:
                           every expert's intermediate split (``experts="tensor"``), or with
                           ``experts="expert"`` transformers' ``ep_plan``: whole experts split
                           across ranks, each rank runs its own on the shared batch, summed
    norms, router          replicated

Which plan holds the experts depends on the transformers release: up to 5.24 the TP plan has the
``moe_tp_experts`` rules and the EP plan the whole-expert ones; from 5.25 only the EP plan names
the experts (``moe_tp_experts`` is deprecated). ``experts="tensor"`` on a model whose TP plan has
no expert rule but whose EP plan does therefore shards whole experts (``expert_sharding``), with
a warning: left to the TP plan alone, every rank would hold every expert whole.

What walkserve changes in that plan, and why: fewer KV heads than ranks (``heads.py``). A
``colwise`` k/v projection would cut a head in pieces, so k_proj and v_proj become
``replicate`` and, once loaded, each rank keeps only the rows of the one KV head its query heads
read (that projection, KVH < N heads, is the only matrix a rank reads whole and then trims).
Nothing else is overridden; a model whose config has no ``base_model_tp_plan`` is refused
(transformers knows no safe split for it), as is one whose heads do not split (``heads.py``).

Out: the model (its parameters DTensors placed on the group's mesh, forward hooks installed by
transformers; ``model.tp_size`` is N), whose forward must run on every rank of the group with
the same inputs (``runner.py``). Logits come out whole on every rank.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from typing import Any, Literal

import torch
from torch import nn

from walkserve.runtime.tp.group import TPGroup
from walkserve.runtime.tp.heads import HeadSplit, split_heads

__all__ = [
    "ShardingError",
    "expert_sharding",
    "load_sharded",
    "reload_sharded",
    "text_config",
]

Experts = Literal["tensor", "expert"]
_KV_PROJECTIONS = ("k_proj", "v_proj")


class ShardingError(ValueError):
    """The model cannot be sharded as asked; the message says why and what would work."""


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_sharded(
    path: str | os.PathLike[str],
    group: TPGroup,
    *,
    model_class: type[nn.Module] | None = None,
    experts: Experts = "tensor",
    **from_pretrained: Any,
) -> nn.Module:
    """This rank's shard of the checkpoint at ``path`` (``model_class`` default:
    ``AutoModelForCausalLM``); ``from_pretrained`` kwargs (``dtype``, ``attn_implementation``)
    pass through. Every rank of ``group`` must call it, in the same order as any other
    collective."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    cls: Any = model_class or AutoModelForCausalLM
    config_class: Any = getattr(model_class, "config_class", None) or AutoConfig
    config = config_class.from_pretrained(path)
    plan, ep_plan = _model_plans(cls, config)
    split = _head_split(config, group)
    override = _kv_override(plan, split)
    sharding = expert_sharding(experts, plan, ep_plan, type(config).__name__)
    tp_plan = override or None
    if sharding == "expert":  # whole experts per rank, each rank's on the shared batch, summed
        distributed = DistributedConfig(
            tp_size=group.size, tp_plan=tp_plan, ep_size=group.size, ep_implementation="all_reduce"
        )
    else:
        distributed = DistributedConfig(tp_size=group.size, tp_plan=tp_plan)
    _bind_device(group)
    model = cls.from_pretrained(path, distributed_config=distributed, **from_pretrained)
    if split is not None and override:
        _trim_replicated_kv(model, override, split, _head_dim(text_config(config)))
    return model.eval()


def reload_sharded(
    model: nn.Module, group: TPGroup, *, experts: Experts = "tensor", **from_pretrained: Any
) -> nn.Module:
    """This rank's shard of ``model``, a transformers model built in this process (a tiny one
    from a config with seeded weights: every rank of ``group`` must hold the same): its weights
    saved to a private temporary directory and loaded back through ``load_sharded``. The whole
    model was in memory first, so this is for models made in code; a checkpoint on disk is
    loaded with ``load_sharded``, shard by shard."""
    from safetensors.torch import save_model

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ShardingError(f"{type(model).__name__} is not a transformers model: no TP plan")
    # Not model.save_pretrained: under torch.distributed it writes on group rank 0 only.
    with tempfile.TemporaryDirectory(prefix="walkserve-tp-") as path:  # mode 0700
        config.save_pretrained(path)
        save_model(model, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return load_sharded(
            path, group, model_class=type(model), experts=experts, **from_pretrained
        )


def _bind_device(group: TPGroup) -> None:
    """transformers builds its mesh on the machine's accelerator and binds this process to
    ``cuda:$LOCAL_RANK``: point it at the group's device (a worker process is one rank)."""
    accelerator = torch.accelerator.current_accelerator()
    kind = accelerator.type if accelerator is not None else "cpu"
    if kind != group.device.type:
        raise ShardingError(
            f"this TP group runs on {group.device}, but transformers shards over the machine's "
            f"accelerator ({kind}): give the group a {kind} device (TPSetup.device)"
        )
    if kind == "cuda":
        os.environ["LOCAL_RANK"] = str(group.device.index or 0)


def _model_plans(cls: Any, config: Any) -> tuple[dict[str, str], dict[str, str]]:
    """The model's resolved TP and EP plans (names with ``*`` for layer numbers), read from a
    meta instance: transformers merges the config's and the classes' plans when it builds one."""
    with torch.device("meta"):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    plan = dict(model.tp_plan or {})
    ep_plan = dict(getattr(model, "ep_plan", None) or {})
    if not plan:
        raise ShardingError(
            f"{type(model).__name__} has no tensor-parallel plan in transformers "
            f"(config.base_model_tp_plan is empty), so no split of its layers is known to be "
            f"correct; serve it on one rank per replica"
        )
    return plan, ep_plan


def expert_sharding(
    experts: Experts, plan: dict[str, str], ep_plan: dict[str, str], model: str
) -> Experts | None:
    """How the experts of a model with these TP and EP plans are sharded when ``experts`` is
    asked: "tensor" (the TP plan's ``moe_tp_experts`` rules), "expert" (the EP plan), or None
    (no experts: a dense model asked for "tensor"). "tensor" on a model whose experts only the
    EP plan names (transformers 5.25 on) is "expert", with a warning; "expert" on a model with
    no EP plan is refused."""
    tensor_rules = any(style == "moe_tp_experts" for style in plan.values())
    if experts == "expert":
        if not ep_plan:
            raise ShardingError(
                f"experts='expert' needs an MoE model with an expert-parallel plan in "
                f"transformers; {model} has none"
            )
        return "expert"
    if tensor_rules:
        return "tensor"
    if ep_plan:
        warnings.warn(
            f"experts='tensor': transformers' tensor-parallel plan for {model} has no rule for "
            "its experts (its expert-parallel plan has them), so whole experts are split "
            "across the ranks instead (experts='expert')",
            stacklevel=3,
        )
        return "expert"
    return None


def _head_split(config: Any, group: TPGroup) -> HeadSplit | None:
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:
        return None
    kv = getattr(text, "num_key_value_heads", None) or heads
    try:
        return split_heads(int(heads), int(kv), group.size, group.rank)
    except ValueError as e:
        raise ShardingError(f"{type(config).__name__}: {e}") from None


def _kv_override(plan: dict[str, str], split: HeadSplit | None) -> dict[str, str]:
    """With KV heads replicated, k/v projections load whole (then trimmed); else nothing."""
    if split is None or split.kv_replicas == 1:
        return {}
    keys = {k: "replicate" for k, s in plan.items() if k.rsplit(".", 1)[-1] in _KV_PROJECTIONS}
    if not keys or any(plan[k] != "colwise" for k in keys):
        raise ShardingError(
            "fewer KV heads than ranks needs separate colwise k_proj/v_proj rules in the "
            f"model's plan to replicate; it has {sorted(keys) or 'none'}: use a degree that "
            "divides the KV heads"
        )
    return keys


def _trim_replicated_kv(
    model: nn.Module, override: dict[str, str], split: HeadSplit, head_dim: int
) -> None:
    """Keep, in every replicated k/v projection, the rows of this rank's KV heads."""
    rows = slice(split.kv_start * head_dim, (split.kv_start + split.kv_heads) * head_dim)
    patterns = [re.compile(re.escape(k).replace(r"\*", r"\d+")) for k in override]
    for name, module in model.named_modules():
        if not any(p.fullmatch(name) for p in patterns):
            continue
        if not isinstance(module, nn.Linear):
            raise ShardingError(f"{name} is a {type(module).__name__}, not a linear projection")
        module.weight = nn.Parameter(_local(module.weight)[rows].clone(), requires_grad=False)
        if module.bias is not None:
            module.bias = nn.Parameter(_local(module.bias)[rows].clone(), requires_grad=False)
        module.out_features = rows.stop - rows.start


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a replicated DTensor holds the whole tensor
    return to_local() if callable(to_local) else t.detach()


def _head_dim(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
