"""A toy byte-level tokenizer for the built-in random-weight models. Not a real tokenizer: it
exists so that the HTTP API can take and return text for models that have none. A local Hugging
Face checkpoint uses its own tokenizer (``AutoTokenizer`` on the checkpoint directory).

Ids below ``specials`` are reserved (0 pad, 1 bos, 2 eos); byte ``b`` of the UTF-8 text is id
``specials + b % (vocab_size - specials)``. With ``vocab_size >= specials + 256`` that is
lossless; a smaller vocabulary folds bytes together (``decode`` then returns the lowest byte
of each fold, so text does not round-trip):

    vocab_size 259, specials 3:   "hi" -> bytes 104 105 -> ids 107 108 -> "hi"
    vocab_size 64,  specials 3:   "hi" -> bytes 104 105 -> ids  46  47 -> "+,"
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ByteTokenizer:
    vocab_size: int
    specials: int = 3

    def __post_init__(self) -> None:
        if self.specials < 0 or self.vocab_size <= self.specials:
            raise ValueError(
                f"ByteTokenizer needs vocab_size > specials, got {self.vocab_size}, {self.specials}"
            )

    @property
    def lossless(self) -> bool:
        return self.vocab_size - self.specials >= 256

    def encode(self, text: str) -> list[int]:
        span = self.vocab_size - self.specials
        return [self.specials + b % span for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        data = bytes(i - self.specials for i in ids if self.specials <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")
