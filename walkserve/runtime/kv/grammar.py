"""Structured output: a grammar (JSON schema, regex, Lark) as a mask of the ids a row may draw
next, through llguidance (the grammar engine of vLLM's ``guidance`` backend and llama.cpp;
chosen over xgrammar, which pulls triton and apache-tvm-ffi onto a CPU-only stack, and over
outlines-core, whose index is built per vocabulary and schema ahead of time and covers less of
JSON Schema). The mask is computed on the CPU for each step, one bit per id; the sampler sets
the logits of the ids it leaves out to -inf (on any device).

What crosses the boundary:

- ``Constraints``: what a request asks beyond the sampling scalars, as one JSON object in a
  uint8 tensor walk input (``encode`` / ``decode``; a typed msgspec decoder, never pickle):
  ``grammar`` (an llguidance grammar, e.g. ``LLMatcher.grammar_from_json_schema(...)``) and
  ``logit_bias`` as ``[[id, bias], ...]``. An empty tensor: no constraints.
- ``Vocabulary``: how the worker that runs the LM builds the grammar engine's tokenizer (the
  bytes of every id): ``ByteVocabulary`` for the built-in byte tokenizers, ``HFVocabulary``
  for a checkpoint's own ``tokenizer.json``.
- ``Guide``: one row's grammar state; ``allowed()`` -> bool [V], ``advance(token)``.

A worker keeps at most ``CACHE_SIZE`` compiled grammars (fresh matchers, copied per row), so
a client sending new schemas costs compile time, never unbounded memory. Grammar errors are
the API's to catch first (``check_grammar``, no tokenizer needed)."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

CACHE_SIZE = 64
MAX_CONSTRAINT_BYTES = 1 << 20


class Constraints(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    grammar: str | None = None
    logit_bias: list[tuple[int, float]] = []

    @property
    def empty(self) -> bool:
        return self.grammar is None and not self.logit_bias


_decoder = msgspec.json.Decoder(Constraints)


def encode(constraints: Constraints) -> torch.Tensor:  # [1, L] uint8; [1, 0] when empty
    if constraints.empty:
        return torch.zeros(1, 0, dtype=torch.uint8)
    data = msgspec.json.encode(constraints)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(1, -1).clone()


def decode(value: torch.Tensor | None) -> Constraints:
    """The constraints in a walk input (its first row; ``None`` or empty: none)."""
    if value is None or value.numel() == 0:
        return Constraints()
    if value.dtype != torch.uint8 or value.dim() != 2:
        raise ValueError(
            f"constraints must be a [1, bytes] uint8 tensor, got {value.dtype} {tuple(value.shape)}"
        )
    if value.shape[1] > MAX_CONSTRAINT_BYTES:
        raise ValueError(f"constraints are {value.shape[1]} bytes; at most {MAX_CONSTRAINT_BYTES}")
    try:
        return _decoder.decode(value[0].numpy().tobytes())
    except msgspec.ValidationError as e:
        raise ValueError(f"bad constraints: {e}") from None


def check_grammar(grammar: str) -> str | None:
    """Why llguidance refuses ``grammar`` (None: it is valid)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    return error or None


class Vocabulary(Protocol):
    def tokenizer(self, n_vocab: int) -> Any:
        """An ``llguidance.LLTokenizer`` over ``n_vocab`` ids (the logits' width)."""


@dataclass(frozen=True)
class ByteVocabulary:
    """``adapters.tokenizer.ByteTokenizer``'s ids: ``specials`` reserved ids, then one id per
    byte (those beyond ``specials + 256`` are never allowed)."""

    vocab_size: int
    specials: int
    eos: int

    def tokenizer(self, n_vocab: int) -> Any:
        import llguidance

        specials, eos = self.specials, self.eos
        span = self.vocab_size - specials

        class _Wrapped:
            eos_token_id = eos
            bos_token_id = None
            special_token_ids = list(range(specials))
            tokens = [b"<|special|>"] * specials + [
                bytes([b]) if b < 256 else b"" for b in range(n_vocab - specials)
            ]

            def __call__(self, text: bytes) -> list[int]:
                return [specials + b % span for b in text]

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()), n_vocab=n_vocab)


@dataclass(frozen=True)
class HFVocabulary:
    """A checkpoint directory's fast tokenizer (``tokenizer.json``)."""

    path: str
    eos: int

    def tokenizer(self, n_vocab: int) -> Any:
        import llguidance.hf
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        return llguidance.hf.from_tokenizer(tok, n_vocab=n_vocab, eos_token=self.eos)  # type: ignore[arg-type]


class GrammarCache:
    """Compiled grammars of one worker's LM, at most ``CACHE_SIZE`` (least recently used
    dropped), over one tokenizer made on first use."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        self._tokenizer: Any = None
        self._n_vocab = 0
        self._fresh: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def guide(self, grammar: str, n_vocab: int) -> Guide:
        import llguidance

        with self._lock:
            if self._tokenizer is None or self._n_vocab != n_vocab:
                self._tokenizer, self._n_vocab = self.vocabulary.tokenizer(n_vocab), n_vocab
                self._fresh.clear()
            fresh = self._fresh.pop(grammar, None)
            if fresh is None:
                fresh = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
                if fresh.is_error():
                    raise ValueError(f"the grammar does not compile: {fresh.get_error()}")
            self._fresh[grammar] = fresh
            while len(self._fresh) > CACHE_SIZE:
                self._fresh.popitem(last=False)
            return Guide(fresh.deep_copy(), n_vocab)


class Guide:
    """One row's place in its grammar."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self.matcher, self.n_vocab = matcher, n_vocab

    def allowed(self) -> torch.Tensor | None:  # [V] bool; None: no restriction left to apply
        if self.matcher.is_error():
            return None  # only after a step past the end (a speculative one, discarded)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)
        return torch.from_numpy(mask)

    def advance(self, token: int) -> None:
        if not self.matcher.is_error():
            self.matcher.consume_token(token)
