"""A run's streamed pieces of consecutive steps, kept in the blocks the rank holds them in.

A cohort's steps of a streamed channel reach the rank's conductor as one stacked tensor
(``looprun.streamed_items``): ``StepBlock`` is one run's rows of it, a sequence of one piece
per step that is never cut into those pieces unless something reads them one by one (a
client's stream items, a stream forwarded to another rank). A stream buffer that chunks them
takes a block whole, as one piece of all its steps (``frames.Stream.extend``): a window of a
token stream is then one narrow of it, not a ``cat`` of one-token pieces. ``StepValues`` is the
run's items of several reports in order, single pieces and blocks alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch

__all__ = ["StepBlock", "StepValues", "segments"]


class _Steps(Sequence[Any]):
    """One piece per step, read by index (``_at``, a step in range)."""

    __slots__ = ()

    def _at(self, k: int) -> Any:
        raise NotImplementedError

    @overload
    def __getitem__(self, k: int) -> Any: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[Any]: ...
    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return list(self)[k]
        n = len(self)
        if not -n <= k < n:
            raise IndexError(k)
        return self._at(k % n)


class StepBlock(_Steps):
    """Consecutive steps' pieces as one tensor, steps first: ``self[k]`` is step k's."""

    __slots__ = ("block",)

    def __init__(self, block: torch.Tensor) -> None:
        self.block = block  # [steps, *piece]

    def __len__(self) -> int:
        return int(self.block.shape[0])

    def _at(self, k: int) -> Any:
        return self.block[k]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.block.unbind(0))


class StepValues(_Steps):
    """A run's items of consecutive steps, as the sequences that brought them (lists of
    single pieces, ``StepBlock``s), in order."""

    __slots__ = ("n", "parts")

    def __init__(self, first: Sequence[Any]) -> None:
        self.parts: list[Sequence[Any]] = []
        self.n = 0
        self.add(first)

    def add(self, more: Sequence[Any]) -> None:
        """``more`` after the items so far: a block kept whole, single pieces joined to the
        single pieces before them (one list, taken at once)."""
        self.n += len(more)
        if isinstance(more, StepBlock):
            self.parts.append(more)
        elif self.parts and isinstance(self.parts[-1], list):
            self.parts[-1].extend(more)
        else:
            self.parts.append(list(more))

    def __len__(self) -> int:
        return self.n

    def _at(self, k: int) -> Any:
        for part in self.parts:
            if k < len(part):
                return part[k]
            k -= len(part)
        raise IndexError(k)

    def __iter__(self) -> Iterator[Any]:
        for part in self.parts:
            yield from part


def segments(values: Sequence[Any]) -> list[Sequence[Any]]:
    """``values`` as the sequences it is made of: a ``StepValues``' parts, else itself."""
    return values.parts if isinstance(values, StepValues) else [values]
