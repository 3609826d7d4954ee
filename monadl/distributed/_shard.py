"""What a rank holds: its model's weights, found in one order on every rank, and its share of the data."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, overload

import numpy.typing as npt

from monadl._named import named_weights
from monadl.layers import Weight

__all__ = ["find_weights", "shard"]

T = TypeVar("T")


def find_weights(model: object) -> tuple[Weight[Any, Any], ...]:
    """The distinct weights a model holds, in a deterministic order.

    The weights `monadl.checkpoint.named_weights` names, in its order: the
    walk (attributes in ``__dict__`` and ``__slots__``, dataclass fields,
    lists, tuples and dict values in insertion order, without recursion) is
    written once, so that a model ``ml.save`` can save is a model
    `DataParallel` can train.

    Raises:
        CheckpointError: the model holds weights in a set, whose order is
            not the same in every process.

    >>> import numpy as np, monadl as ml
    >>> a, b = ml.Weight(np.zeros(2)), ml.Weight(1.0)
    >>> find_weights({"layers": [a, (b, a)]}) == (a, b)
    True
    """
    return tuple(named_weights(model).values())


@overload
def shard(data: npt.NDArray[Any], rank: int, size: int, *, drop_last: bool = False) -> npt.NDArray[Any]: ...
@overload
def shard(data: Sequence[T], rank: int, size: int, *, drop_last: bool = False) -> Sequence[T]: ...
def shard(data: Any, rank: int, size: int, *, drop_last: bool = False) -> Any:
    """This rank's share of a dataset or batch: every ``size``-th item from ``rank``.

    Shards differ in length by at most one; ``drop_last`` drops the last
    ``len(data) % size`` items so that all are equal (then averaging the
    ranks' mean losses is the full batch's mean, as with PyTorch's
    ``DistributedSampler(drop_last=True)``). A batch of fewer than ``size``
    items leaves some ranks an empty shard (and ``drop_last`` leaves every
    rank one): a mean over it is NaN, with NumPy's warnings, and
    `DataParallel.train` refuses such a step on every rank rather than count
    that rank's zero gradient in the average.

    >>> shard(list(range(7)), 1, 3)
    [1, 4]
    >>> shard(list(range(7)), 0, 3, drop_last=True)
    [0, 3]
    """
    if size < 1:
        raise ValueError(f"shard: size is the number of ranks, at least 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"shard: rank {rank} is not in 0..{size - 1}")
    end = len(data) - len(data) % size if drop_last else len(data)
    return data[rank:end:size]
