"""A semiring's arithmetic on arrays: elementwise plus, and the product of a
rule's operands contracted over the indices absent from the head (an einsum
whose sum is the semiring's plus). In max-times and min-plus the contraction
keeps back-pointers: for each output entry, where its best term came from."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, final

import numpy as np

from monadl.dyna.semiring import LOG_REAL, MAX_TIMES, MIN_PLUS, REAL, Semiring, coefficient
from monadl.dyna.syntax import Rule

__all__ = ["Array", "ArrayAlgebra", "Operand", "array_plus", "best_contract", "contract"]

_TERMS = 1 << 16
"""How many terms the log-real sum of underflowed entries builds at once (512 KiB)."""

Array: TypeAlias = np.ndarray[Any, np.dtype[Any]]
Operand: TypeAlias = tuple[str, Array]
"""An einsum operand: its subscripts (one letter per axis) and its array."""

_PLUS: dict[str, Callable[[Array, Array], Array]] = {
    REAL.name: np.add,
    LOG_REAL.name: np.logaddexp,
    MAX_TIMES.name: np.maximum,
    MIN_PLUS.name: np.minimum,
}


def array_plus(semiring: Semiring) -> Callable[[Array, Array], Array]:
    """The semiring's plus on arrays, elementwise.

    >>> array_plus(MIN_PLUS)(np.array([1.0, 5.0]), np.array([2.0, 3.0]))
    array([1., 3.])
    """
    if not any(semiring == known for known in (REAL, LOG_REAL, MAX_TIMES, MIN_PLUS)):
        raise ValueError(f"batched items need the real, log-real, max-times or min-plus semiring, not {semiring.name}")
    return _PLUS[semiring.name]


def contract(
    semiring: Semiring, coeff: float, operands: Sequence[Operand], out: str, sizes: Mapping[str, int]
) -> Array:
    """``coeff`` times the einsum of ``operands`` into subscripts ``out``, in the
    real or log-real semiring (an output letter absent from the operands
    broadcasts, with the size in ``sizes``).

    >>> contract(REAL, 2.0, [("ij", np.ones((2, 3))), ("j", np.arange(3.0))], "i", {})
    array([6., 6.])
    >>> contract(LOG_REAL, 0.0, [("i", np.log(np.array([1.0, 3.0])))], "", {})  # log(1 + 3)
    array(1.38629436)
    """
    present = {c for s, _ in operands for c in s}
    ones = [(c, np.ones(sizes[c])) for c in out if c not in present]
    spec = ",".join(s for s, _ in [*operands, *ones]) + "->" + out
    if semiring == REAL:
        result: Array = np.asarray(coeff * np.einsum(spec, *(x for _, x in [*operands, *ones])))
        return result
    if semiring != LOG_REAL:
        raise ValueError(f"an einsum sums in the real or log-real semiring, not {semiring.name}")
    if present <= set(out):  # (nothing summed: each entry is one term, exact as it stands)
        return np.asarray(_terms(coeff, operands, out, _sizes(operands, sizes), np.add)[1])
    # One einsum of the operands, each shifted by its own largest entry: it holds no more than
    # the operands and the output, where every term (n^3 for a matrix product) would not fit.
    shift, scaled = coeff, []
    for _, x in operands:
        top = float(np.max(x, initial=-np.inf))  # (an empty operand: no terms, the sum is -inf)
        top = top if math.isfinite(top) else 0.0
        scaled.append(np.exp(x - top))
        shift += top
    sums = np.einsum(spec, *scaled, *(x for _, x in ones))
    with np.errstate(divide="ignore"):
        logged: Array = np.asarray(np.log(sums) + shift)
    # Where the operands peak apart, an entry's terms can all fall below the smallest normal
    # float though the entry does not (a(I) * b(I), a = [0, -800], b = [-800, 0] is -799.3):
    # those entries, and only those, are summed again from their terms. (With a margin of
    # 1 / eps: what a term loses below the smallest normal float, even flushed to zero, then
    # weighs no more than rounding in any entry kept.)
    floor = np.finfo(sums.dtype)
    small = sums < floor.tiny / floor.eps
    if not small.any():
        return logged
    # (An entry whose every term is -inf is -inf, rightly: counting its terms above -inf
    # costs one einsum, where summing its terms again cost every one of them.)
    some = np.einsum(spec, *((x > -np.inf).astype(sums.dtype) for _, x in operands), *(x for _, x in ones))
    lost = np.flatnonzero(small & (some > 0))
    if lost.size:
        logged.reshape(-1)[lost] = _log_sums(coeff, operands, out, _sizes(operands, sizes), lost)
    return logged


def _sizes(operands: Sequence[Operand], sizes: Mapping[str, int]) -> dict[str, int]:
    """Every letter's size: the operands' axes', and ``sizes`` for the others."""
    return {**sizes, **{c: n for s, x in operands for c, n in zip(s, np.shape(x))}}


def _log_sums(coeff: float, operands: Sequence[Operand], out: str, sizes: Mapping[str, int], entries: Array) -> Array:
    """The log-sum-exp of the terms of the output's entries ``entries`` (flat
    indices), each shifted by its own largest term, building at most about
    ``_TERMS`` terms at a time.

    >>> _log_sums(0.0, [("i", np.array([0.0, -800.0])), ("i", np.array([-800.0, 0.0]))], "", {"i": 2}, np.array([0]))
    array([-799.30685282])
    """
    summed = "".join(sorted({c for s, _ in operands for c in s} - set(out)))
    shape = [sizes[c] for c in summed]
    # Each operand's axes in the order of ``out`` then ``summed`` (a letter twice: its diagonal).
    aligned = [(s, np.einsum(f"{s}->{''.join(c for c in out + summed if c in s)}", x)) for s, x in operands]
    step = max(1, _TERMS // max(1, math.prod(shape)))
    parts = []
    for first in range(0, entries.size, step):
        chunk = entries[first : first + step]
        at = np.unravel_index(chunk, [sizes[c] for c in out]) if out else ()
        total = np.full((chunk.size, *shape), coeff)
        for s, x in aligned:
            picked = x[tuple(at[out.index(c)] for c in out if c in s)]
            lead = chunk.size if set(s) & set(out) else 1
            total += picked.reshape([lead] + [n if c in s else 1 for c, n in zip(summed, shape)])
        axes = tuple(range(1, total.ndim))
        top = np.max(total, axis=axes, keepdims=True, initial=-np.inf)
        top = np.where(np.isfinite(top), top, 0.0)  # (every term -inf: the sum is -inf, not NaN)
        np.exp(np.subtract(total, top, out=total), out=total)
        with np.errstate(divide="ignore"):
            parts.append(np.log(np.sum(total, axis=axes)) + top.reshape(-1))
    return np.concatenate(parts)


def _terms(
    coeff: float,
    operands: Sequence[Operand],
    out: str,
    sizes: Mapping[str, int],
    times: Callable[[Array, Array], Array],
) -> tuple[str, Array]:
    """Every term of a rule's product, ``coeff`` times the operands, on the
    axes ``out`` then the summed-out letters (in order), ``sizes`` giving
    every letter's size: the letters and the terms.

    >>> _terms(1.0, [("ij", np.array([[1.0, 2.0]])), ("j", np.array([3.0, 4.0]))], "i", {"i": 1, "j": 2}, np.multiply)
    ('ij', array([[3., 8.]]))
    """
    letters = out + "".join(sorted({c for s, _ in operands for c in s} - set(out)))
    total: Array = np.full(tuple(sizes[c] for c in letters), coeff)
    for s, x in operands:
        # x's axes in the order of ``letters`` (a letter twice: its diagonal), length 1 where it has none.
        own = "".join(c for c in letters if c in s)
        aligned = np.einsum(f"{s}->{own}", x).reshape([sizes[c] if c in s else 1 for c in letters])
        total = times(total, aligned)
    return letters, total


def best_contract(semiring: Semiring, coeff: float, operands: Sequence[Operand], out: str) -> tuple[Array, str, Array]:
    """The max-einsum (max-times) or min-einsum (min-plus): ``coeff`` times
    the product of the operands, then the best over the indices absent from
    ``out``, with back-pointers.

    Returns:
        The values (subscripts ``out``), the summed-out letters, and for each
        output entry the best values of those letters (an integer array of
        the output's shape plus one axis, one entry per summed letter).

    >>> values, summed, where = best_contract(MAX_TIMES, 1.0, [("ij", np.array([[1.0, 4.0], [3.0, 2.0]]))], "i")
    >>> values, summed, where[:, 0]
    (array([4., 3.]), 'j', array([1, 0]))
    """
    sizes = {c: n for s, x in operands for c, n in zip(s, x.shape)}
    missing = [c for c in out if c not in sizes]
    if missing:
        raise ValueError(f"the head's array axes {missing} do not occur in the body")
    times = np.multiply if semiring == MAX_TIMES else np.add
    letters, total = _terms(coeff, operands, out, sizes, times)
    summed = letters[len(out) :]
    out_shape = tuple(sizes[c] for c in out)
    flat = total.reshape((*out_shape, -1))
    pick = np.argmax(flat, axis=-1) if semiring == MAX_TIMES else np.argmin(flat, axis=-1)
    values: Array = np.take_along_axis(flat, pick[..., None], axis=-1)[..., 0]
    if not summed:
        return values, summed, np.zeros((*out_shape, 0), dtype=np.intp)
    where: Array = np.stack(np.unravel_index(pick, tuple(sizes[c] for c in summed)), axis=-1)
    return values, summed, where


@final
@dataclass(frozen=True, slots=True)
class ArrayAlgebra:
    """Arrays of a semiring, for the tape's backward pass: the VJP of a rule's
    einsum is the einsum of the other operands and the adjoint.

    >>> rule = Rule(("y",), [("x", "I"), ("x", "I")])
    >>> algebra = ArrayAlgebra(REAL, {id(rule): (("a", "a"), "")})
    >>> algebra.vjp(rule, [np.array([1.0, 2.0]), np.array([3.0, 4.0])], 0, np.array(1.0))
    array([3., 4.])
    """

    semiring: Semiring
    subscripts: Mapping[int, tuple[tuple[str, ...], str]]
    _add: Callable[[Array, Array], Array] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Looked up once: plus runs for every adjoint the backward pass accumulates.
        object.__setattr__(self, "_add", array_plus(self.semiring))

    def plus(self, a: Array, b: Array) -> Array:
        """The semiring's plus, elementwise."""
        return self._add(a, b)

    def vjp(self, rule: Rule, operands: Sequence[Array], position: int, adjoint: Array) -> Array:
        """The einsum's vector-Jacobian product for one operand."""
        subscripts, out = self.subscripts[id(rule)]
        sizes = {c: n for s, v in zip(subscripts, operands) for c, n in zip(s, np.shape(v))}
        others = [(subscripts[j], v) for j, v in enumerate(operands) if j != position]
        return contract(
            self.semiring,
            coefficient(self.semiring, rule),
            [*others, (out, adjoint)],
            subscripts[position],
            sizes,
        )
