"""Placement: which ranks run each node of each walk (the review's ``pi(n, w) ⊆ R``, section 6).

Owns the deployer's ``Placement`` (rank rules keyed by component path or ``walk:node``, a
tensor-parallel degree and replica count per rule, the branches that should run concurrently,
per-rank memory budgets) and its file format (YAML or JSON, one schema); ``resolved.resolve()``
gives every op node of every walk of a ``CapturedModel`` its rank list from it. What crosses
the boundary: a mapping or a file in, a frozen ``Placement`` out. Memory estimates of a resolved placement live in
``walkserve.lowering.memory``. A placement only records choices: it does not shard a model
(the runtime's TP groups and the model's loader do, ``runtime.tp``) and does not search for a
good plan.

File format::

    ranks: 2
    nodes:                                    # rule key -> ranks
      text_encoder: [0]                       #   component path: every call of the component
      generate:euler_step/denoiser: [0]       #   walk:node: one node of one walk (wins)
      generate:euler_step/denoiser_1: [1]
    tensor_parallel: {decoder: 1}             # optional, per rule key; divides len(ranks):
                                              #   groups of N consecutive ranks run it as one
    replicas: {decoder: 1}                    # optional; replicas x tensor_parallel = len(ranks)
    concurrent:                               # optional: branches of one Parallel group
      - [generate:euler_step/denoiser, generate:euler_step/denoiser_1]   # to run at once
    memory_budget: {0: 2GiB, 1: 2GiB}         # optional: bytes, or a size with a unit
    hosts: {1: gpu-node-b}                    # optional: the host (or Ray node label) of a
                                              #   rank; unnamed ranks run on the conductor's
"""

from __future__ import annotations

import json
import os
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from typeguard import check_type, typechecked

from walkserve.capture.model import CapturedModel

__all__ = [
    "Placement",
    "PlacementError",
    "PlacementWarning",
    "format_size",
    "parse_size",
    "tensor_parallel_placement",
]


class PlacementError(ValueError):
    """A placement that cannot work for this model; the message says what to change."""


class PlacementWarning(UserWarning):
    """A placement that works but not as the deployer asked (wished-for concurrency lost)."""


# ------------------------------------------------------------------------------ sizes

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string with a unit: ``2GiB``, ``512 MiB``, ``1.5GB``, ``4096``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PlacementError(f"a size must be an int or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise PlacementError(
                f"cannot read size {value!r}: write a number with an optional unit "
                f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '2GiB'"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise PlacementError(f"a size must be positive, got {value!r}")
    return size


def format_size(n: int) -> str:
    """``n`` bytes in binary units with one decimal (``62.3 KiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------ placement


def split_key(key: str) -> tuple[str | None, str]:
    """``"generate:euler_step/denoiser"`` -> ``("generate", "euler_step/denoiser")``;
    a component path ``"denoiser"`` -> ``(None, "denoiser")``."""
    walk, sep, node = key.partition(":")
    return (walk, node) if sep else (None, key)


@dataclass(frozen=True, eq=True)
class Placement:
    """A deployment of a model on ``ranks`` worker ranks.

    ``rules`` maps a rule key to the ranks its nodes run on; a key is a component path (every
    call of that component) or ``walk:node`` (one node of one walk, which wins over its
    component's rule). Nodes without a rule run on rank 0. ``tensor_parallel`` and
    ``replicas`` are per rule key: a rule's ranks form ``replicas`` groups of
    ``tensor_parallel`` ranks (``tp_groups``); work goes to each group's first rank, its
    leader, and the others run the same batches in lockstep (``runtime.tp``).
    ``concurrent`` lists sets of ``walk:node`` keys that should run at the same time;
    ``memory_budget_bytes`` is a budget per rank (ranks not named are unchecked).
    ``hosts`` names the host of a rank (unnamed: ``LOCAL_HOST``, the conductor's);
    ``runtime.net.link`` reports the edges that cross hosts and their estimated times.
    """

    ranks: int
    rules: Mapping[str, Sequence[int]] = field(default_factory=dict)
    tensor_parallel: Mapping[str, int] = field(default_factory=dict)
    replicas: Mapping[str, int] = field(default_factory=dict)
    concurrent: Sequence[Sequence[str]] = ()
    memory_budget_bytes: Mapping[int, int] | None = None
    hosts: Mapping[int, str] | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        frozen = {
            "rules": MappingProxyType({k: tuple(v) for k, v in self.rules.items()}),
            "tensor_parallel": MappingProxyType(dict(self.tensor_parallel)),
            "replicas": MappingProxyType(dict(self.replicas)),
            "concurrent": tuple(tuple(entry) for entry in self.concurrent),
            "memory_budget_bytes": (
                MappingProxyType(dict(self.memory_budget_bytes))
                if self.memory_budget_bytes
                else None
            ),
            "hosts": MappingProxyType(dict(self.hosts)) if self.hosts else None,
        }
        for name, value in frozen.items():
            object.__setattr__(self, name, value)
        self._validate()

    # -------------------------------------------------------------------------- validation

    def _validate(self) -> None:
        if isinstance(self.ranks, bool) or self.ranks < 1:
            raise PlacementError(f"ranks must be a positive int, got {self.ranks!r}")
        for key, ranks in self.rules.items():
            _check_key(key, "nodes")
            self._check_rank_list(key, ranks)
        for key, degree in self.tensor_parallel.items():
            self._check_tensor_parallel(key, degree)
        for key, count in self.replicas.items():
            self._check_replicas(key, count)
        for entry in self.concurrent:
            _check_concurrent_entry(entry)
        for rank, budget in (self.memory_budget_bytes or {}).items():
            self._check_rank(f"memory_budget[{rank}]", rank)
            if budget <= 0:
                raise PlacementError(f"memory_budget[{rank}] must be positive, got {budget}")
        for rank, host in (self.hosts or {}).items():
            self._check_rank(f"hosts[{rank}]", rank)
            if not re.fullmatch(r"[A-Za-z0-9_.:\[\]-]{1,253}", host):
                raise PlacementError(
                    f"hosts[{rank}] = {host!r} is not a host name (letters, digits, '.-_:')"
                )

    def _check_rank(self, where: str, rank: int) -> None:
        if isinstance(rank, bool) or not 0 <= rank < self.ranks:
            raise PlacementError(
                f"{where} names rank {rank!r}, but the placement has ranks 0..{self.ranks - 1} "
                f"(ranks: {self.ranks}); use a rank in that range or raise 'ranks'"
            )

    def _check_rank_list(self, key: str, ranks: Sequence[int]) -> None:
        if not ranks:
            raise PlacementError(
                f"rule {key!r} has an empty rank list; give at least one rank in "
                f"0..{self.ranks - 1}, or remove the rule to use rank 0"
            )
        for rank in ranks:
            self._check_rank(f"rule {key!r}", rank)
        if len(set(ranks)) != len(ranks):
            raise PlacementError(f"rule {key!r} lists a rank twice: {list(ranks)}")

    def _check_tensor_parallel(self, key: str, degree: int) -> None:
        ranks = self._ruled(key, "tensor_parallel")
        if degree < 1 or len(ranks) % degree:
            raise PlacementError(
                f"tensor_parallel[{key!r}] = {degree} does not divide the {len(ranks)} ranks "
                f"of rule {key!r} {list(ranks)}; use a degree that divides {len(ranks)} or "
                f"change the rank list"
            )

    def _check_replicas(self, key: str, count: int) -> None:
        ranks = self._ruled(key, "replicas")
        degree = self.tensor_parallel.get(key, 1)
        if count < 1 or count * degree != len(ranks):
            raise PlacementError(
                f"replicas[{key!r}] = {count} with tensor_parallel {degree} needs "
                f"{max(count, 0) * degree} ranks, but rule {key!r} has {len(ranks)} "
                f"{list(ranks)}; replicas x tensor_parallel must equal the number of ranks"
            )

    def _ruled(self, key: str, where: str) -> Sequence[int]:
        ranks = self.rules.get(key)
        if ranks is None:
            raise PlacementError(
                f"{where} names {key!r}, which has no rank rule; add '{key}: [ranks]' under 'nodes'"
            )
        return ranks

    # -------------------------------------------------------------------------- queries

    def tensor_parallel_of(self, key: str) -> int:
        return self.tensor_parallel.get(key, 1)

    def host_of(self, rank: int) -> str:
        """The host of ``rank`` (``LOCAL_HOST`` unless ``hosts`` names one)."""
        return (self.hosts or {}).get(rank, LOCAL_HOST)

    def replicas_of(self, key: str) -> int:
        return self.replicas.get(key, len(self.rules[key]) // self.tensor_parallel_of(key))

    def tp_groups(self) -> list[tuple[int, ...]]:
        """The tensor-parallel groups: each rule with ``tensor_parallel`` N > 1 splits its
        ranks into ``replicas`` groups of N consecutive entries (the first of each, its
        leader, is the rank work is dispatched to); rules naming the same ranks share a group.
        Raises ``PlacementError`` when a rank would be in two different groups."""
        groups: dict[tuple[int, ...], None] = {}
        owner: dict[int, tuple[str, tuple[int, ...]]] = {}
        for key, ranks in self.rules.items():
            degree = self.tensor_parallel_of(key)
            if degree == 1:
                continue
            for start in range(0, len(ranks), degree):
                members = tuple(ranks[start : start + degree])
                for rank in members:
                    other = owner.setdefault(rank, (key, members))
                    if other[1] != members:
                        raise PlacementError(
                            f"rank {rank} is in two tensor-parallel groups: {list(other[1])} "
                            f"(rule {other[0]!r}) and {list(members)} (rule {key!r}); a rank "
                            f"belongs to at most one group: give both rules the same ranks or "
                            f"disjoint ranks"
                        )
                groups.setdefault(members, None)
        return list(groups)

    # -------------------------------------------------------------------------- constructors

    @classmethod
    @typechecked
    def default(cls, ranks: int = 1) -> Placement:
        """Every node on rank 0 (a one-rank deployment, or a start to add rules to)."""
        return cls(ranks=ranks)

    @classmethod
    @typechecked
    def from_dict(cls, data: Mapping[str, Any]) -> Placement:
        """A placement from the file schema (see the module docstring)."""
        unknown = [k for k in data if k not in _FILE_KEYS]
        if unknown:
            raise PlacementError(
                f"unknown placement keys {unknown}; the keys are: {', '.join(_FILE_KEYS)}"
            )
        if "ranks" not in data:
            raise PlacementError("a placement needs 'ranks' (the number of worker ranks)")
        budget = data.get("memory_budget")
        hosts = data.get("hosts")
        return cls(
            ranks=_as_int(data["ranks"], "ranks"),
            rules={
                key: [_as_int(r, f"nodes[{key!r}]") for r in _as_list(ranks, f"nodes[{key!r}]")]
                for key, ranks in _as_str_mapping(data.get("nodes", {}), "nodes").items()
            },
            tensor_parallel=_int_values(data.get("tensor_parallel", {}), "tensor_parallel"),
            replicas=_int_values(data.get("replicas", {}), "replicas"),
            concurrent=[
                [_as_str(k, "concurrent") for k in _as_list(entry, "concurrent entry")]
                for entry in _as_list(data.get("concurrent", []), "concurrent")
            ],
            memory_budget_bytes=None if budget is None else _budget(budget),
            hosts=None if hosts is None else _hosts(hosts),
        )

    @classmethod
    @typechecked
    def from_file(cls, path: str | os.PathLike[str]) -> Placement:
        """A placement from a ``.yaml``/``.yml`` or ``.json`` file."""
        path = Path(path)
        if path.suffix not in (".yaml", ".yml", ".json"):
            raise PlacementError(f"{path}: a placement file ends in .yaml, .yml or .json")
        try:
            with path.open() as f:
                data = yaml.safe_load(f) if path.suffix != ".json" else json.load(f)
        except (yaml.YAMLError, json.JSONDecodeError) as e:
            raise PlacementError(f"{path}: not valid {path.suffix[1:].upper()}: {e}") from None
        if not isinstance(data, Mapping):
            raise PlacementError(f"{path}: expected a mapping at the top level")
        try:
            return cls.from_dict(data)
        except PlacementError as e:
            raise PlacementError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The file schema (``from_dict(p.to_dict()) == p``); empty optional keys omitted."""
        out: dict[str, Any] = {"ranks": self.ranks}
        out["nodes"] = {key: list(ranks) for key, ranks in self.rules.items()}
        if self.tensor_parallel:
            out["tensor_parallel"] = dict(self.tensor_parallel)
        if self.replicas:
            out["replicas"] = dict(self.replicas)
        if self.concurrent:
            out["concurrent"] = [list(entry) for entry in self.concurrent]
        if self.memory_budget_bytes:
            out["memory_budget"] = dict(self.memory_budget_bytes)
        if self.hosts:
            out["hosts"] = dict(self.hosts)
        return out

    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Write ``to_dict()`` as YAML or JSON, by the file's suffix."""
        path = Path(path)
        data = self.to_dict()
        if path.suffix == ".json":
            path.write_text(json.dumps(data, indent=2) + "\n")
        else:
            path.write_text(yaml.safe_dump(data, sort_keys=False))


def tensor_parallel_placement(captured: CapturedModel, size: int, replicas: int = 1) -> Placement:
    """``walkserve serve --tensor-parallel-size N --data-parallel-size R``: every component of
    ``captured`` on ranks 0..N*R-1, as R replicas of one tensor-parallel group of degree N
    each (N = R = 1: everything on rank 0)."""
    for flag, value in (("--tensor-parallel-size", size), ("--data-parallel-size", replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlacementError(f"{flag} must be a positive int, got {value!r}")
    if size * replicas == 1:
        return Placement.default(1)
    components = list(captured.graph.components)
    ranks = list(range(size * replicas))
    return Placement(
        ranks=size * replicas,
        rules=dict.fromkeys(components, ranks),
        tensor_parallel=dict.fromkeys(components, size) if size > 1 else {},
        replicas=dict.fromkeys(components, replicas) if replicas > 1 else {},
    )


_FILE_KEYS = (
    "ranks",
    "nodes",
    "tensor_parallel",
    "replicas",
    "concurrent",
    "memory_budget",
    "hosts",
)
LOCAL_HOST = "local"  # the conductor's host, where ranks without a named host run


def check_field_types(obj: Any) -> None:
    """typeguard for a dataclass's generated ``__init__`` (``@typechecked`` cannot see it)."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        check_type(getattr(obj, f.name), hints[f.name])


def _check_key(key: str, where: str) -> None:
    walk, node = split_key(key)
    if not node or walk == "" or ":" in node:
        raise PlacementError(
            f"{where} key {key!r} is malformed: use a component path ('denoiser') or "
            f"'walk:node' ('generate:euler_step/denoiser')"
        )


def _check_concurrent_entry(entry: Sequence[str]) -> None:
    for key in entry:
        _check_key(key, "concurrent")
        if split_key(key)[0] is None:
            raise PlacementError(
                f"concurrent entry {list(entry)}: {key!r} is not a 'walk:node' key; name the "
                f"nodes of one walk, e.g. 'generate:euler_step/denoiser'"
            )
    walks = {split_key(key)[0] for key in entry}
    if len(entry) < 2 or len(set(entry)) != len(entry) or len(walks) > 1:
        raise PlacementError(
            f"concurrent entry {list(entry)} must name two or more distinct nodes of one walk"
        )


# ------------------------------------------------------------------------------ file parsing


def _as_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlacementError(f"{where}: expected an int, got {value!r}")
    return value


def _as_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise PlacementError(f"{where}: expected a string, got {value!r}")
    return value


def _as_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise PlacementError(f"{where}: expected a list, got {value!r}")
    return value


def _as_str_mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise PlacementError(f"{where}: expected a mapping, got {value!r}")
    return {_as_str(k, f"{where} key"): v for k, v in value.items()}


def _int_values(value: Any, where: str) -> dict[str, int]:
    return {k: _as_int(v, f"{where}[{k!r}]") for k, v in _as_str_mapping(value, where).items()}


def _hosts(value: Any) -> dict[int, str]:
    if not isinstance(value, Mapping):
        raise PlacementError(f"hosts: expected a mapping rank -> host name, got {value!r}")
    out = {}
    for rank, host in value.items():
        if isinstance(rank, str) and rank.isdigit():  # JSON object keys are strings
            rank = int(rank)
        out[_as_int(rank, "hosts rank")] = _as_str(host, f"hosts[{rank}]")
    return out


def _budget(value: Any) -> dict[int, int]:
    if not isinstance(value, Mapping):
        raise PlacementError(f"memory_budget: expected a mapping rank -> size, got {value!r}")
    out = {}
    for rank, size in value.items():
        if isinstance(rank, str) and rank.isdigit():  # JSON object keys are strings
            rank = int(rank)
        out[_as_int(rank, "memory_budget rank")] = parse_size(size)
    return out
