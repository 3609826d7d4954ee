"""A semiring's arithmetic on arrays: elementwise plus, and the product of a
rule's operands contracted over the indices absent from the head (an einsum
whose sum is the semiring's plus). In max-times and min-plus the contraction
keeps back-pointers: for each output entry, where its best term came from."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, final

import numpy as np

from monadl.dyna.semiring import LOG_REAL, MAX_TIMES, MIN_PLUS, REAL, Semiring, coefficient
from monadl.dyna.syntax import Rule

__all__ = ["Array", "ArrayAlgebra", "Operand", "array_plus", "best_contract", "contract"]

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
    if semiring == REAL:
        present = {c for s, _ in operands for c in s}
        ones = [(c, np.ones(sizes[c])) for c in out if c not in present]
        spec = ",".join(s for s, _ in [*operands, *ones]) + "->" + out
        result: Array = np.asarray(coeff * np.einsum(spec, *(x for _, x in [*operands, *ones])))
        return result
    if semiring != LOG_REAL:
        raise ValueError(f"an einsum sums in the real or log-real semiring, not {semiring.name}")
    # Log-sum-exp over the whole terms, shifted by each output entry's largest term: shifting
    # each operand by its own largest entry underflows wherever the operands peak apart
    # (a(I) * b(I) with a = [0, -800], b = [-800, 0] is -799.3, not -inf).
    sizes = {**sizes, **{c: n for s, x in operands for c, n in zip(s, np.shape(x))}}
    letters, total = _terms(coeff, operands, out, sizes, np.add)
    axes = tuple(range(len(out), len(letters)))
    if not axes:
        return np.asarray(total)
    top = np.max(total, axis=axes, keepdims=True, initial=-np.inf)  # (no terms: the sum is -inf)
    top = np.where(np.isfinite(top), top, 0.0)  # (every term -inf: the sum is -inf, not NaN)
    with np.errstate(divide="ignore"):
        logged: Array = np.asarray(np.log(np.sum(np.exp(total - top), axis=axes)) + top.reshape(top.shape[: len(out)]))
    return logged


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
