"""What a rank holds: its model's weights, found in one order on every rank, and its share of the data."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar, overload

import numpy.typing as npt

from monadl.layers import Weight

__all__ = ["find_weights", "shard"]

T = TypeVar("T")


def find_weights(model: object) -> tuple[Weight[Any, Any], ...]:
    """The distinct weights a model holds, in a deterministic order.

    Walks attributes, dataclass fields, lists, tuples and dict values (in
    insertion order), without recursion.

    >>> import numpy as np, monadl as ml
    >>> a, b = ml.Weight(np.zeros(2)), ml.Weight(1.0)
    >>> find_weights({"layers": [a, (b, a)]}) == (a, b)
    True
    """
    found: dict[int, Weight[Any, Any]] = {}
    seen: set[int] = set()
    stack: list[object] = [model]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Weight):
            found.setdefault(id(item), item)
            continue
        children: Iterable[object]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            children = [getattr(item, f.name) for f in dataclasses.fields(item)]
        elif hasattr(item, "__dict__") and not isinstance(item, type) and type(item).__module__ != "builtins":
            children = vars(item).values()
        else:
            continue
        stack.extend(reversed(list(children)))  # popped in their own order
    return tuple(found.values())


@overload
def shard(data: npt.NDArray[Any], rank: int, size: int, *, drop_last: bool = False) -> npt.NDArray[Any]: ...
@overload
def shard(data: Sequence[T], rank: int, size: int, *, drop_last: bool = False) -> Sequence[T]: ...
def shard(data: Any, rank: int, size: int, *, drop_last: bool = False) -> Any:
    """This rank's share of a dataset or batch: every ``size``-th item from ``rank``.

    Shards differ in length by at most one; ``drop_last`` drops the last
    ``len(data) % size`` items so that all are equal (then averaging the
    ranks' mean losses is the full batch's mean, as with PyTorch's
    ``DistributedSampler(drop_last=True)``).

    >>> shard(list(range(7)), 1, 3)
    [1, 4]
    >>> shard(list(range(7)), 0, 3, drop_last=True)
    [0, 3]
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    end = len(data) - len(data) % size if drop_last else len(data)
    return data[rank:end:size]
