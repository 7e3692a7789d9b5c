"""Forbidding pickle in a process (a worker's hardening, ``WorkerConfig.forbid_pickle``):
nothing on walkserve's data path pickles, and this makes sure of it."""

from __future__ import annotations


def forbid_pickle() -> None:
    """From now on, every pickle entry point in this process raises (and so does reducing a
    tensor). Nothing on walkserve's data path pickles; this makes sure of it."""
    import _pickle
    import pickle

    import torch

    def forbidden(*args: object, **kwargs: object) -> None:
        raise RuntimeError("pickle is forbidden in walkserve workers")

    for module in (pickle, _pickle):
        for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
            setattr(module, name, forbidden)
    torch.Tensor.__reduce_ex__ = forbidden  # type: ignore[method-assign,assignment]


__all__ = ["forbid_pickle"]
