"""What the blocks that read numbers take, and how errors name the input
that failed, deep in a structure as at the top of a batch."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.fold import ForwardDeclaration, Function, InputTransform, Map, OneOf, Reduce, Scalar, Vector


def value(layer: ml.Layer[Any, Any]) -> Any:
    return anyio.run(layer.predict)


@pytest.mark.parametrize("x", [2, 2.5, np.float32(2.5), np.int64(2), np.float64(2.5), np.array(2.5)])
def test_scalar_takes_a_real_number(x: Any) -> None:
    out = value(Scalar("float64")(x))
    assert out.shape == (1,) and out.tolist() == [float(x)]


@pytest.mark.parametrize(
    ("x", "hint"),
    [
        (None, "given None$"),  # (a JSON null routed to the number case: it was NaN, and trained on)
        ("3", r"given '3' \(a str\); parse a number's text first"),  # (it was parsed)
        ([1.0, 2.0], r"given \[1.0, 2.0\] \(a list\)$"),  # (it was a (1, 2) row)
        (True, r"given True \(a bool\); for flags as numbers, convert them"),
        (np.bool_(False), r"\(a bool\); for flags as numbers"),
        (1 + 2j, r"\(a complex\)$"),
        (np.ones(1), "given a float64 array of shape \\(1,\\)$"),
    ],
)
def test_scalar_refuses_anything_else_naming_itself_and_the_input(x: Any, hint: str) -> None:
    with pytest.raises(TypeError, match=r"(?m)^Scalar\('float32'\) takes a real number .*" + hint):
        Scalar()(x)


@pytest.mark.parametrize("x", [[1, 2], (1.0, 2.0), np.array([1.0, 2.0]), np.array([1, 2], np.int8), range(1, 3)])
def test_vector_takes_n_real_numbers_flat(x: Any) -> None:
    out = value(Vector(2, "float64")(x))
    assert out.shape == (1, 2) and out.tolist() == [[1.0, 2.0]]


@pytest.mark.parametrize(
    ("x", "error", "given"),
    [
        # Any shape of n numbers was flattened: a column, a matrix; a nested list was refused as "1 numbers".
        (np.ones((2, 1)), ValueError, r"a float64 array of shape \(2, 1\); np.ravel\(x\) if its numbers are one row"),
        (np.ones((1, 2)), ValueError, r"a float64 array of shape \(1, 2\)"),
        ([[1.0, 2.0]], ValueError, r"\[\[1.0, 2.0\]\] \(a list\) of shape \(1, 2\); np.ravel"),
        ([[1.0], [2.0, 3.0]], TypeError, r"\[\[1.0\], \[2.0, 3.0\]\] \(a list\)$"),  # (ragged)
        (["1", "2"], TypeError, r"\['1', '2'\] \(a list\); parse a number's text first"),  # (they were parsed)
        ([None, 1.0], TypeError, r"\[None, 1.0\] \(a list\)$"),
        ([True, False], TypeError, r"\[True, False\] \(a list\); for flags as numbers"),
        ({1.0: 0, 2.0: 0}, TypeError, r"\{1.0: 0, 2.0: 0\} \(a dict\)$"),
        (3.0, TypeError, r"3.0 \(a float\)$"),
    ],
)
def test_vector_refuses_anything_else_naming_itself_and_the_input(x: Any, error: type[Exception], given: str) -> None:
    takes = r"(?m)^Vector\(2\) takes 2 real numbers in a flat sequence or a 1-D array, and was given "
    with pytest.raises(error, match=takes + given):
        Vector(2)(x)


def test_a_wrong_count_of_numbers_is_said_in_words() -> None:
    with pytest.raises(ValueError, match=r"(?m)^Vector\(2\) was given 1 number: \[1.0\] \(a list\)$"):
        Vector(2)([1.0])
    three: Any = np.ones(3)  # (an array: no Sequence[float] to mypy, though Vector takes a 1-D one)
    with pytest.raises(ValueError, match=r"(?m)^Vector\(4\) was given 3 numbers: a float64 array of shape \(3,\)$"):
        Vector(4)(three)


Pair = tuple[ml.ArrayLayer, ml.ArrayLayer]


@pytest.mark.parametrize("depth", [None, 0])
def test_a_one_of_with_no_case_names_the_input_it_was_given_deep_in_the_structure(
    depth: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error named the OneOf and the batch's input, not the sub-input
    four levels down that has no case (through nested calls, ``depth``
    None, and the explicit stack, 0: all of it there)."""
    from monadl.fold import _run

    if depth is not None:
        monkeypatch.setattr(_run, "DEPTH", depth)
    node = ForwardDeclaration[Any, ml.ArrayLayer]("node")
    leaf = InputTransform[float, list[float]](lambda x: [x]) >> Vector(1, "float64")
    inner = Map(node) >> Reduce(Function[Pair, ml.ArrayLayer](lambda ab: ab[0] + ab[1]))
    node.resolve_to(OneOf(type, {float: leaf, list: inner}))
    good = [[1.0, 2.0], [3.0, [4.0, 5.0]]]
    assert value(node(good)).tolist() == [[15.0]]
    with pytest.raises(KeyError) as info:
        node.batch([good, [[1.0, 2.0], [3.0, [4.0, "five"]]]])
    assert str(info.value) == repr(
        "OneOf(type, ...): no case for key <class 'str'>, the key of its input 'five' (a str); "
        "the keys of its cases: [<class 'float'>, <class 'list'>]"
    )
    assert info.value.__notes__ == [
        "monadl.fold: while building input 1 (a list) of the batch with ForwardDeclaration('node'), "
        "at input 1[1][1]<case <class 'list'> of OneOf>[1]: 'five' (a str), given to ForwardDeclaration('node')"
    ]


def test_scalar_refuses_an_int_past_every_float_naming_itself() -> None:
    with pytest.raises(ValueError, match=r"Scalar\('float32'\) was given .* past the largest float32"):
        Scalar()(10**400)
