"""transformers' attention interface, answered by the paged KV pool: every argument honoured, or
the call refused.

Owns the two functions registered under ``ATTN_IMPLEMENTATION`` ("walkserve_paged"): the
attention function (``AttentionInterface``) and the mask function (``AttentionMaskInterface``),
the scoped context that gives them one forward's work (``attention_context``), and the probe that
records what each layer of a model asks for (``probe_attention``).

What a layer may ask, and what happens:

    scaling            the softmax scale, per call (None: 1 / sqrt(head_dim))
    softcap            logit soft cap, per call (Gemma 2)
    s_aux              attention sinks, one logit per head (gpt-oss)
    sliding_window     must equal the window of the layer's mask (below)
    is_causal          True or None; False is refused (no bidirectional attention here)
    dropout            0 only (eval)
    key/value sizes    may differ (multi-head latent attention: K 192, V 128)
    position_ids, use_cache, cache_position, output_hidden_states,
    output_router_logits   ignored: not attention's
    anything else      refused with ``UnsupportedAttention`` naming it, unless it is None

The mask: transformers builds one mask per layer type (``masking_utils``) through the mask
function registered for the implementation. Ours builds no tensor: it checks that the model's mask
is the plain causal mask or the plain sliding-window mask (no overlay such as bidirectional image
tokens, no packed-sequence remapping, no padding) and returns a ``PagedMask`` saying which;
transformers hands that to the layers of that type, so each layer's window is the one its own
mask says. A model whose layers receive no ``PagedMask`` (it builds its masks itself) is refused.
The runner passes an all-ones 2-D ``attention_mask`` with its packed row, so transformers does
not read the packed positions as separate sequences (the window is applied by the backend).

Contexts (a ``ContextVar``, so concurrent forwards in other threads do not mix):

- a ``Probe`` runs the model on a short prompt with plain dense attention and records one
  ``LayerAttention`` per layer (heads, K/V sizes, window, scale, soft cap, sinks): how a pool is
  shaped and grouped (``probe_attention``);
- a step (``AttentionSteps``, the runner's) writes each layer's new K/V into the pool and attends
  over the pages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from walkserve.runtime.kv.attention import ScoreParams
from walkserve.runtime.kv.torch_attention import attend, attend_mask

__all__ = [
    "ATTN_IMPLEMENTATION",
    "IGNORED_KWARGS",
    "AttentionSteps",
    "LayerAttention",
    "ModelAttention",
    "PagedMask",
    "Probe",
    "UnsupportedAttention",
    "attention_context",
    "paged_attention_forward",
    "paged_mask",
    "probe_attention",
    "register",
    "text_config",
    "use_paged_attention",
]

ATTN_IMPLEMENTATION = "walkserve_paged"

IGNORED_KWARGS = frozenset(
    {"position_ids", "use_cache", "output_router_logits", "output_hidden_states", "cache_position"}
)
"""Keyword arguments some models pass to their attention function that do not change attention:
positions are already applied to q and k, and the pool is the cache."""


class UnsupportedAttention(ValueError):
    """The model asks for attention the paged path cannot compute exactly (the message says
    what); serving it on the pool would give wrong tokens."""


@dataclass(frozen=True)
class PagedMask:
    """What the registered mask function returns instead of a mask tensor: the model's mask is
    plain causal (``window`` None) or plain sliding-window causal (query p sees ``(p - W, p]``)."""

    window: int | None


@dataclass(frozen=True)
class LayerAttention:
    """What one layer asked for in a probe forward."""

    layer: int
    num_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None
    scale: float
    softcap: float | None
    sinks: bool


@dataclass(frozen=True)
class ModelAttention:
    """Every attention layer of a model, as a probe saw them (ascending layer index)."""

    layers: tuple[LayerAttention, ...]

    @property
    def windows(self) -> dict[int, int | None]:
        return {a.layer: a.window for a in self.layers}


class AttentionSteps(Protocol):
    """What a context does with one checked layer call."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, Dv]
        window: int | None,
        scores: ScoreParams,
    ) -> torch.Tensor: ...  # [T, H, Dv]


_CONTEXT: ContextVar[AttentionSteps | None] = ContextVar("walkserve_paged_attention", default=None)


@contextmanager
def attention_context(steps: AttentionSteps) -> Iterator[AttentionSteps]:
    """Make ``steps`` answer the registered attention function for the enclosed forward."""
    token = _CONTEXT.set(steps)
    try:
        yield steps
    finally:
        _CONTEXT.reset(token)


# ------------------------------------------------------------------------ the attention function


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D], RoPE (and q norm) applied
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,  # [1, KVH, T, Dv]
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # ([1, T, H, Dv], no weights)
    """The function registered in transformers' ``AttentionInterface``."""
    steps = _CONTEXT.get()
    if steps is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} runs only inside a paged step: use "
            "walkserve.runtime.kv.hf.PagedCausalLMRunner"
        )
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise UnsupportedAttention(
            f"{type(module).__name__} has no integer layer_idx: its K/V have no place in the pool"
        )
    where = f"layer {layer} ({type(module).__name__})"
    if query.shape[0] != 1:
        raise ValueError(f"paged attention takes one packed row, got batch {query.shape[0]}")
    for name, val in kwargs.items():
        if name in IGNORED_KWARGS or val is None:
            continue
        if name == "output_attentions" and not val:
            continue
        raise UnsupportedAttention(
            f"{where} passes {name}={_brief(val)} to its attention function, which paged "
            "attention does not implement"
        )
    if dropout:
        raise UnsupportedAttention(f"{where}: attention dropout {dropout} (serve in eval mode)")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedAttention(f"{where} is not causal; paged attention is causal only")
    if not isinstance(attention_mask, PagedMask):
        raise UnsupportedAttention(
            f"{where} got an attention mask of type {type(attention_mask).__name__}, not one "
            "built by transformers' mask interface: the model makes its own masks, which paged "
            "attention cannot apply"
        )
    window = attention_mask.window
    if sliding_window is not None and sliding_window != window:
        raise UnsupportedAttention(
            f"{where} passes sliding_window={sliding_window} but its mask has window {window}"
        )
    if softcap is not None and not softcap > 0:
        raise UnsupportedAttention(f"{where}: softcap must be > 0 or None, got {softcap}")
    if query.shape[-1] != key.shape[-1]:
        raise UnsupportedAttention(
            f"{where}: query and key head sizes differ ({query.shape[-1]}, {key.shape[-1]})"
        )
    heads = query.shape[1]
    if heads % key.shape[1]:
        raise UnsupportedAttention(
            f"{where}: {heads} query heads are not a multiple of {key.shape[1]} KV heads"
        )
    if s_aux is not None and tuple(s_aux.shape) != (heads,):
        raise UnsupportedAttention(
            f"{where}: sinks of shape {tuple(s_aux.shape)}, expected [{heads}] (one per head)"
        )
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = ScoreParams(scale, None if softcap is None else float(softcap), s_aux)
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, KVH, D]
    v = value[0].transpose(0, 1)  # [T, KVH, Dv]
    out = steps.attend(layer, q.contiguous(), k, v, window, scores)  # [T, H, Dv]
    return out.unsqueeze(0), None


def _brief(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------ the mask function

_PROBE_ROWS = (2**16 + 5, 2**15 + 3)
"""Query positions at which a mask function is evaluated to tell causal from sliding-window."""
_MASK_KINDS: dict[tuple[Any, int | None], int | str | None] = {}
"""(mask function's code, local_size) -> its window, or the reason it is refused."""


def paged_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    local_size: int | None = None,
    **kwargs: Any,
) -> PagedMask:
    """The function registered in transformers' ``AttentionMaskInterface`` (see the module
    docstring). ``allow_is_causal_skip`` is transformers' own statement that nothing was laid
    over the base mask (no or/and mask functions, no packed or blockwise sequences)."""
    if not allow_is_causal_skip or mask_function is None:
        raise UnsupportedAttention(
            "the model's attention mask is not plain causal (transformers adds an overlay: "
            "bidirectional spans such as image tokens, a non-causal config, packed sequences or "
            "a custom mask function; or the model asks for the mask as a tensor, to change it), "
            "which paged attention cannot express"
        )
    on_host = attention_mask is not None and attention_mask.device.type == "cpu"
    if on_host and not bool(attention_mask.all()):  # type: ignore[union-attr]
        raise UnsupportedAttention("padded inputs: paged attention takes unpadded rows")
    code = getattr(mask_function, "__code__", mask_function)
    key = (code, local_size)
    kind = _MASK_KINDS.get(key)
    if kind is None and key not in _MASK_KINDS:
        kind = _MASK_KINDS[key] = _classify(mask_function, local_size)
    if isinstance(kind, str):
        raise UnsupportedAttention(kind)
    return PagedMask(kind)


def _classify(mask_function: Callable[..., Any], local_size: int | None) -> int | str | None:
    """The window of a causal mask function (None: plain causal), by evaluating two query rows;
    or why it is not a plain causal/sliding-window mask."""
    zero = torch.tensor(0)
    try:
        rows = []
        for q in _PROBE_ROWS:
            kv = torch.arange(q + 2)
            row = torch.as_tensor(mask_function(zero, zero, torch.tensor(q), kv)).reshape(-1)
            rows.append((q, row.nonzero().flatten()))
    except Exception as e:  # a mask function that is not index-vectorised
        return f"the model's attention mask function could not be evaluated ({e})"
    windows = set()
    for q, seen in rows:
        lo, hi = int(seen[0]), int(seen[-1])
        if hi != q or len(seen) != hi - lo + 1:
            return (
                "the model's attention mask is not a causal window (a query sees keys other than "
                "a contiguous run ending at itself)"
            )
        windows.add(None if lo == 0 else q - lo + 1)
    if local_size is not None:
        expect = {min(local_size, q + 1) if local_size <= q else None for q, _ in rows}
        if windows != expect:
            return f"the model's sliding-window mask does not match its window {local_size}"
        return int(local_size)
    if windows != {None}:
        return (
            "the model's attention mask limits how far back a query sees in a way that is not "
            "a sliding window (chunked attention?)"
        )
    return None


# ------------------------------------------------------------------------ the probe


@dataclass
class Probe:
    """Dense causal attention over one unpacked prompt, recording each layer's call."""

    seen: dict[int, list[LayerAttention]] = field(default_factory=dict)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
        scores: ScoreParams,
    ) -> torch.Tensor:
        self.seen.setdefault(layer, []).append(
            LayerAttention(
                layer=layer,
                num_heads=q.shape[1],
                kv_heads=k.shape[1],
                head_dim=k.shape[2],
                v_head_dim=v.shape[2],
                window=window,
                scale=scores.scale,
                softcap=scores.softcap,
                sinks=scores.sinks is not None,
            )
        )
        mask = attend_mask(0, q.shape[0], window)  # [T, T]
        out = attend(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            mask,
            scores,
        )  # [1, H, T, Dv]
        return out[0].transpose(0, 1)


def text_config(model: nn.Module) -> Any:
    """The model's text decoder config, through transformers' own ``get_text_config``."""
    config: Any = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


PROBE_TOKENS = 5


@torch.no_grad()
def probe_attention(model: nn.Module, embeds: bool = False) -> ModelAttention:
    """Run ``model`` (loaded with ``attn_implementation=ATTN_IMPLEMENTATION``) on a short prompt
    and return what each of its attention layers asked for; with ``embeds``, the prompt is
    seeded random ``inputs_embeds`` (a base decoder fed embeddings: no token table of its own). Raises ``UnsupportedAttention`` if a
    layer asks for what the pool cannot give, if some decoder layer never called the attention
    interface (recurrent or linear-attention layers, or attention computed by the model itself),
    or if a layer called it more than once per forward."""
    config = text_config(model)
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"the model uses attn_implementation={getattr(config, '_attn_implementation', None)!r};"
            f" load it with attn_implementation={register()!r}"
        )
    vocab = int(config.vocab_size)
    param = next(model.parameters())
    ids = (torch.arange(PROBE_TOKENS) * 7 + 1) % vocab
    probe = Probe()
    inputs: dict[str, torch.Tensor] = {"input_ids": ids.unsqueeze(0).to(param.device)}
    if embeds:
        g = torch.Generator().manual_seed(0)
        noise = torch.randn(1, PROBE_TOKENS, int(config.hidden_size), generator=g)
        inputs = {"inputs_embeds": noise.to(param.device, param.dtype)}
    try:
        with attention_context(probe):
            model(
                **inputs,
                attention_mask=torch.ones(1, PROBE_TOKENS, dtype=torch.long, device=param.device),
                position_ids=torch.arange(PROBE_TOKENS, device=param.device).unsqueeze(0),
                use_cache=False,
            )
    except UnsupportedAttention:
        raise
    except Exception as e:
        raise UnsupportedAttention(
            f"a forward through paged attention failed: {type(e).__name__}: {e}"
        ) from e
    num_layers = int(config.num_hidden_layers)
    missing = [i for i in range(num_layers) if i not in probe.seen]
    if missing:
        types = getattr(config, "layer_types", None)
        kinds = sorted({str(types[i]) for i in missing}) if types else []
        raise UnsupportedAttention(
            f"decoder layers {_ranges(missing)} of {num_layers} never call transformers' "
            "attention interface"
            + (f" (layer types {', '.join(kinds)})" if kinds else "")
            + ": their state (recurrent, linear attention, or attention the model computes "
            "itself) has no place in the paged pool"
        )
    extra = sorted(set(probe.seen) - set(range(num_layers)))
    twice = [i for i, calls in probe.seen.items() if len(calls) > 1]
    if extra or twice:
        raise UnsupportedAttention(
            "attention layers do not map one to one onto decoder layers "
            f"(unexpected layer_idx {extra}, called more than once {twice})"
        )
    return ModelAttention(tuple(probe.seen[i][0] for i in range(num_layers)))


def _ranges(indices: list[int]) -> str:
    return ", ".join(map(str, indices)) if len(indices) <= 8 else f"{indices[:8]}..."


def use_paged_attention(model: nn.Module) -> str:
    """Switch ``model``'s attention to the paged implementation; returns its name. Raises
    ``UnsupportedAttention`` for a model that keeps computing attention itself (transformers
    then leaves its implementation as it was): its attention would never reach the pool."""
    impl = register()
    if getattr(text_config(model), "_attn_implementation", None) != impl:
        try:
            model.set_attn_implementation(impl)  # type: ignore[operator]
        except Exception as e:
            raise UnsupportedAttention(
                f"{type(model).__name__} cannot switch its attention implementation ({e})"
            ) from e
    if getattr(text_config(model), "_attn_implementation", None) != impl:
        raise UnsupportedAttention(
            f"{type(model).__name__} computes attention itself, not through transformers' "
            "AttentionInterface (it keeps its own implementation), so its K/V never reach the pool"
        )
    return impl


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns their
    name, for ``from_pretrained(..., attn_implementation=...)``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask)
    return ATTN_IMPLEMENTATION
