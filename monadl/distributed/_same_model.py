"""Whether every rank holds the same model, before the first step of data
parallelism (`monadl.distributed.DataParallel`): the ranks all-gather how
many weights they hold and a digest of each one's name (less any memory
address in it: a dict key's default repr holds one), shape, dtype, its
optimizer's hyperparameters (another learning rate would step the ranks'
copies apart, silently) and the structure of its optimizer state (another
optimizer's differs: a step would fail on one rank after all agreed to
step, and the ranks part); where these differ, no rank steps and each raises `RankFailure` naming the first
weight that differs and what it is on each rank (an all-reduce of unequal
buffers would broadcast one into the other, truncate, or hang in MPI).
The digest also covers a checksum of each weight's values and optimizer
state (`checksums`): ranks that build their weights from different seeds,
or where one rank alone loaded a checkpoint, and did not call
``dp.broadcast()``, would step alike from different places and train apart
for good; they are refused with the names of the weights that differ.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from monadl._namespace import is_array, library_name
from monadl.distributed._comm import Communicator, RankFailure
from monadl.errors import DeviceError, DTypeError, OperandError, ShapeError
from monadl.layers import Weight
from monadl.layers._replace import replace_state, structure
from monadl.optim._spec import spec

__all__ = ["checksums", "describe", "fitting_states", "label", "same_model", "shape_of"]


def shape_of(data: Any) -> tuple[int, ...]:
    return tuple(data.shape) if hasattr(data, "shape") else ()


def _dtype(data: Any) -> Any:
    return data.dtype if hasattr(data, "dtype") else np.dtype(np.float64)


def describe(name: str, data: Any, state: Any = None, optimizer: Any = None) -> str:
    """A weight as `same_model` compares it: ``'layers.0.bias' float64[8]`` (no
    name for a bare weight), its optimizer and hyperparameters
    (`monadl.optim._spec`: another learning rate would step the ranks'
    copies apart, silently), and the structure of its optimizer state where
    it has one (`structure`: after a step taken alike on every rank, still
    the same).

    >>> import monadl as ml
    >>> w = ml.Weight(np.ones(2), optimizer=ml.optim.adam(0.1))
    >>> describe("w", w.data, w.state, w.optimizer).split(FIELDS)
    ["'w' float64[2]", 'optimizer chain(scale_by_adam(b1=0.9, b2=0.999, eps=1e-08), scale(-0.1))', 'optimizer state (AdamState(int, float64[2], float64[2]), None)']
    """
    fields = [(f"{name!r} " if name else "") + f"{_dtype(data)}{list(shape_of(data))}"]
    if optimizer is not None:
        fields.append(f"optimizer {spec(optimizer)}")
    if state is not None:
        fields.append(f"optimizer state {structure(state)}")
    return FIELDS.join(fields)


FIELDS: Final = "\t"
"""Between the parts of a description (a name is a repr: it holds no tab);
where the ranks differ, the parts they share are left out of the error."""


_ADDRESS: Final = re.compile(r"0x[0-9a-fA-F]+")


def label(name: str, i: int) -> str:
    """How messages name a model's weight: its name's repr (``'layers.0.bias'``), or its number if it has none."""
    return repr(name) if name else str(i)


def checksums(weights: Sequence[Weight[Any, Any]]) -> npt.NDArray[np.int64]:
    """Per weight, a checksum of its values and one of its optimizer state's
    arrays and numbers: the sums of their bit patterns as unsigned integers,
    modulo 2**64, computed where the arrays live (a number comes back from
    the device, not the array). Equal values give equal sums on any machine
    (integer sums do not depend on their order); ranks built from different
    seeds differ in every weight. (A permutation of one weight's values would
    go unseen: not what a forgotten broadcast makes.)

    >>> import monadl as ml
    >>> w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    >>> checksums([w]).tolist() == checksums([ml.Weight(np.array([1.0, 2.0]))]).tolist()
    True
    """
    sums = [(_bits_sum(w._data), sum(_bits_sum(leaf) for leaf in _leaves(w._state)) % (1 << 64)) for w in weights]
    return np.array(sums, np.uint64).reshape(len(weights), 2).view(np.int64)


def _bits_sum(value: Any) -> int:
    array = value if is_array(value) else np.asarray(value)
    if library_name(array) not in ("numpy", "cupy"):  # (a tensor's view takes a dtype of its own: read it on the host)
        try:
            array = np.from_dlpack(array)
        except (TypeError, RuntimeError, BufferError, ValueError):
            array = np.asarray(array)
    size = array.dtype.itemsize
    unsigned = f"u{math.gcd(size, 8)}"
    if math.gcd(size, 8) != size:  # (complex128, longdouble: read as several integers, which needs one block)
        array = array.reshape(-1)
    return int(array.view(unsigned).sum(dtype="u8"))


def _leaves(state: Any) -> list[Any]:
    """The arrays and numbers of an optimizer state's tree of tuples."""
    leaves, stack = [], [state]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(reversed(node))
        elif is_array(node) or isinstance(node, (bool, int, float, np.generic)):
            leaves.append(node)
    return leaves


async def same_model(
    comm: Communicator,
    described: Sequence[str],
    values: npt.NDArray[np.int64] | None = None,
    labels: Sequence[str] = (),
) -> None:
    """Raise the same `RankFailure` on every rank unless all hold weights of
    the same names, shapes and dtypes (`describe`), in the same order, and,
    given their ``values`` (`checksums`; ``labels`` name the weights), the
    same values and optimizer states.

    One all-gather of three numbers per rank (the number of weights, the
    descriptions' length and an 8-byte digest of them and of the values);
    the descriptions themselves, then the values, are all-gathered only
    when these differ, to say how.
    """
    # (a name is a repr: it holds no newline; an address in it, a dict key's default repr's, differs
    # between processes: not compared)
    text = "\n".join([_ADDRESS.sub("0x...", d) for d in described]).encode()
    hashed = hashlib.blake2b(text, digest_size=8)
    if values is not None:
        hashed.update(values.tobytes())
    digest = int.from_bytes(hashed.digest(), "little", signed=True)
    header = np.array([[len(described), len(text), digest]], np.int64)
    headers = (await comm.allgather(header, [1] * comm.size)).reshape(comm.size, 3)
    if (headers == headers[0]).all():
        return
    lengths = [int(n) for n in headers[:, 1]]
    gathered = await comm.allgather(np.frombuffer(text, np.uint8).copy(), lengths)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    models = [gathered[bounds[r] : bounds[r + 1]].tobytes().decode() for r in range(comm.size)]
    if len(set(models)) > 1 or values is None:
        raise RankFailure({}, _difference([m.split("\n") if m else [] for m in models]))
    every = await comm.allgather(values, [len(values)] * comm.size)
    raise RankFailure({}, _other_values(every.reshape(comm.size, len(values), 2), labels))


_SHOWN: Final = 8  # weights named in a message; the rest counted


def _other_values(values: npt.NDArray[np.int64], labels: Sequence[str]) -> str:
    """Which weights' values differ (``values``: rank, weight, values or state), and which ranks hold which."""
    differ = (values != values[0]).any(axis=0)
    which = np.flatnonzero(differ.any(axis=1)).tolist()
    shown = [labels[i] + ("" if differ[i, 0] else " (its optimizer state)") for i in which[:_SHOWN]]
    more = f" and {len(which) - _SHOWN} more" if len(which) > _SHOWN else ""
    groups: dict[bytes, list[int]] = {}
    for rank, held in enumerate(values):
        groups.setdefault(held.tobytes(), []).append(rank)
    first, *others = [
        (f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}", len(rs)) for rs in groups.values()
    ]
    held = ", ".join(
        [f"{first[0]} {'hold' if first[1] > 1 else 'holds'} one set of values"] + [f"{o} another" for o, _ in others]
    )
    return (
        f"the ranks hold different values of weight{'s' if len(which) > 1 else ''} {', '.join(shown)}{more} "
        f"({held}); call dp.broadcast() "
        "before the first step, to give every rank the root's weights and optimizer state (or load the same "
        "checkpoint on every rank)"
    )


def _difference(models: Sequence[Sequence[str]]) -> str:
    """How the ranks' models (each a list of `describe`'d weights) differ, first difference first."""

    def at(model: Sequence[str], i: int) -> str:
        return model[i] if i < len(model) else "absent"

    counts = [len(m) for m in models]
    i = next((i for i in range(max(counts)) if len({at(m, i) for m in models}) > 1), min(counts))
    described = [at(m, i).split(FIELDS) for m in models]
    present = [d for d, m in zip(described, models) if i < len(m)]
    if len({len(d) for d in present}) == 1:  # (the weight, and the parts where the ranks holding it differ)
        shown = [0] + [f for f in range(1, len(present[0])) if len({d[f] for d in present}) > 1]
        described = [[d[f] for f in shown] if len(d) == len(present[0]) else d for d in described]
    ranks: dict[str, list[int]] = {}
    for rank, fields in enumerate(described):
        ranks.setdefault(", ".join(fields), []).append(rank)
    where = ", ".join(
        f"{what} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for what, rs in ranks.items()
    )
    text = f"the ranks hold different models: weight {i} is {where}"
    if len(set(counts)) > 1:
        held = (f"{n} weight{'' if n == 1 else 's'} on rank {rank}" for rank, n in enumerate(counts))
        text += f" ({', '.join(held)})"
    return text + (
        "; every rank must build the same model (the same weights, shapes and dtypes, in the same containers, "
        "with the same optimizers and hyperparameters)"
    )


def fitting_states(
    weights: Sequence[Weight[Any, Any]], labels: Sequence[str], states: Sequence[Any]
) -> tuple[list[Any], str]:
    """The root's optimizer ``states`` checked against this rank's weights'
    (as ``ml.load`` checks a checkpoint's), and what does not fit ("" if all
    do): another optimizer's state would fail this rank's step after every
    rank agreed to step. (`same_model` has compared the states' structures;
    this also checks their arrays' libraries.)"""
    fitted: list[Any] = []
    for weight, name, state in zip(weights, labels, states):
        try:
            fitted.append(replace_state(weight._state, state, f"weight {name}'s"))
        except (OperandError, ShapeError, DTypeError, DeviceError) as exc:
            return (
                fitted,
                f"the root's optimizer state does not fit here: {exc}; build every rank's weights with the same optimizers",
            )
    return fitted, ""
