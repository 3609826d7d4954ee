"""An index out of range (an embedding's, a segment id, a label, a gather's
``h[src]``) is its own error, `ml.IndexRangeError`: it names the value, its
place in the indices, the range and the user's line, the same node by node,
batched, inside an operation and in a Fold block, and no weight changes."""

from __future__ import annotations

import traceback
from typing import Any, NoReturn

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.fold import AllOf, ForwardDeclaration, Function, InputTransform, OneOf

HERE = __file__


def line_of(marker: str) -> int:
    with open(HERE) as source:
        return next(i for i, text in enumerate(source, 1) if marker in text and "line_of" not in text)


def weights(rows: int = 20, width: int = 4) -> dict[str, ml.Weight[Any, Any]]:
    rng = np.random.default_rng(0)
    return {
        "L": ml.Weight(rng.standard_normal((rows, width))),  # TABLE
        "W": ml.Weight(rng.standard_normal((2 * width, width))),
        "b": ml.Weight(np.zeros(width)),
    }


def snapshot(ws: dict[str, ml.Weight[Any, Any]]) -> dict[str, np.ndarray]:
    return {k: np.array(w.data, copy=True) for k, w in ws.items()}


def unchanged(ws: dict[str, ml.Weight[Any, Any]], before: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(w.data, before[k]) for k, w in ws.items())


def test_the_error_is_a_shape_error_and_an_index_error() -> None:
    assert issubclass(ml.IndexRangeError, ml.ShapeError)
    assert issubclass(ml.IndexRangeError, IndexError)
    assert issubclass(ml.IndexRangeError, ValueError)
    assert issubclass(ml.IndexRangeError, ml.MonadlError)


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize(
    ("bad", "note"), [(25, ""), (20, ""), (-1, "; negative indices are refused, not counted from the end")]
)
def test_a_sentence_with_a_word_out_of_range_names_the_word_node_by_node_and_batched(
    bad: int, note: str, batching: bool
) -> None:
    ws = weights()
    before = snapshot(ws)
    sentences = [np.array([1, 2, 3, 4]) + i for i in range(8)]
    sentences[5] = np.array([1, 2, bad, 4])
    losses = [ml.sum(ml.embedding(ws["L"], words)) for words in sentences]  # LOOKUP
    loss = ml.sum(ml.stack(losses))
    with ml.settings(batching=batching), pytest.raises(ml.IndexRangeError) as info:
        anyio.run(loss.train)
    assert str(info.value) == (
        f"embedding: index {bad} at indices[2] out of range for a table of 20 rows"
        f" (indices must lie in [0, 20){note}); layer built at {HERE}:{line_of('LOOKUP')};"
        f" operand 0 is the weight float64[20, 4] built at {HERE}:{line_of('TABLE')}"
    )
    assert unchanged(ws, before)


def test_the_place_of_an_index_in_a_matrix_of_indices() -> None:
    table = ml.Weight(np.zeros((5, 2)))
    rows = ml.embedding(table, np.array([[0, 1, 2], [3, 9, 4]]))  # MATRIX
    with pytest.raises(ml.IndexRangeError) as info:
        anyio.run(ml.sum(rows).predict)
    assert str(info.value).startswith(
        "embedding: index 9 at indices[1, 1] out of range for a table of 5 rows (indices must lie in [0, 5));"
        f" layer built at {HERE}:{line_of('MATRIX')}"
    )


def leaf_states(ws: dict[str, ml.Weight[Any, Any]], tree: Any) -> ml.ArrayLayer:
    """A recursive net's encoder, one lookup per word, unmarked."""
    if isinstance(tree, int):
        return ml.embedding(ws["L"], np.array([tree]))  # ONE-WORD
    left, right = (leaf_states(ws, t) for t in tree)
    return ml.tanh(ml.dense(ml.concatenate([left, right], axis=1), ws["W"], ws["b"]))


def test_a_single_word_into_a_weight_is_refused_where_the_lookup_is_built() -> None:
    ws = weights()
    trees: list[Any] = [((1, 2), 3), (4, (5, (6, 25)))]
    with pytest.raises(ml.IndexRangeError) as info:
        [leaf_states(ws, t) for t in trees]
    assert str(info.value) == (
        "embedding: index 25 out of range for a table of 20 rows (indices must lie in [0, 20));"
        f" operand 0 is the weight float64[20, 4] built at {HERE}:{line_of('TABLE')}"
    )
    # The traceback goes through the recursion (the tree), down to the line of the lookup.
    frames = traceback.extract_tb(info.value.__traceback__)
    mine = [f for f in frames if f.filename == HERE]
    assert [f.name for f in mine].count("leaf_states") == 4
    assert mine[-1].lineno == line_of("ONE-WORD")


def test_a_single_index_into_a_layer_is_checked_when_it_runs() -> None:
    ws = weights()
    rows = ml.embedding(ws["L"] * 2.0, np.array([20]))  # LAYER-TABLE
    with pytest.raises(ml.IndexRangeError) as info:
        anyio.run(ml.sum(rows).predict)
    assert str(info.value) == (
        "embedding: index 20 out of range for a table of 20 rows (indices must lie in [0, 20));"
        f" layer built at {HERE}:{line_of('LAYER-TABLE')}"
    )


class Cell:
    """A marked lookup and composition, as a recursive net's leaf cell: the words are its data arguments."""

    def __init__(self, ws: dict[str, ml.Weight[Any, Any]]) -> None:
        self.ws = ws
        self.leaf = ml.operation(self._leaf)

    def _leaf(self, words: np.ndarray) -> ml.ArrayLayer:
        h = ml.embedding(self.ws["L"], words)  # STEP
        return ml.tanh(ml.dense(ml.concatenate([h, h], axis=1), self.ws["W"], self.ws["b"]))


@pytest.mark.parametrize("batching", [False, True])
def test_inside_an_operation_the_step_the_operation_and_its_call_are_named(batching: bool) -> None:
    ws = weights()
    before = snapshot(ws)
    cell = Cell(ws)
    words = [np.array([i % 20, (i + 1) % 20]) for i in range(12)]
    words[7] = np.array([3, 25])
    loss = ml.sum(ml.stack([ml.sum(cell.leaf(w)) for w in words]))  # CALL
    with ml.settings(batching=batching), pytest.raises(ml.IndexRangeError) as info:
        anyio.run(loss.train)
    message = str(info.value)
    assert message == (
        "embedding: index 25 at indices[1] out of range for a table of 20 rows (indices must lie in [0, 20));"
        f" layer built at {HERE}:{line_of('STEP')}, inside the operation Cell._leaf"
        f" called at {HERE}:{line_of('CALL')}"
    )
    assert "do not fit together" not in message and "#" not in message
    assert unchanged(ws, before)


@ml.operation
def inner_lookup(table: ml.ArrayOperand, words: np.ndarray) -> ml.ArrayLayer:
    return ml.embedding(table, words)  # INNER-STEP


@ml.operation
def outer_cell(table: ml.ArrayOperand, words: np.ndarray) -> ml.ArrayLayer:
    return ml.tanh(inner_lookup(table, words))  # INNER-CALL


def test_an_operation_inside_an_operation_names_each_call() -> None:
    table = ml.Weight(np.zeros((3, 2)))
    loss = ml.sum(outer_cell(table, np.array([0, 1, 3])))  # OUTER-CALL
    with pytest.raises(ml.IndexRangeError) as info:
        anyio.run(loss.predict)
    assert str(info.value) == (
        "embedding: index 3 at indices[2] out of range for a table of 3 rows (indices must lie in [0, 3));"
        f" layer built at {HERE}:{line_of('INNER-STEP')}, inside the operation inner_lookup"
        f" called at {HERE}:{line_of('INNER-CALL')}, inside the operation outer_cell"
        f" called at {HERE}:{line_of('OUTER-CALL')}"
    )


def test_other_errors_of_an_operation_name_its_function_without_a_counter() -> None:
    @ml.operation
    def misfit(x: ml.ArrayLayer) -> ml.ArrayLayer:
        return x + np.ones(3)  # MISFIT

    bad = misfit(ml.Weight(np.ones(2)) * 1.0)  # MISFIT-CALL
    with pytest.raises(ml.ShapeError) as info:
        anyio.run(ml.sum(bad).predict)
    message = str(info.value)
    assert message.startswith(
        "test_other_errors_of_an_operation_name_its_function_without_a_counter.<locals>.misfit"
        f" (called on float64[2]): add of float64[2], float64[3] at {HERE}:{line_of('MISFIT')}: "
    )
    assert "#" not in message and "#" not in repr(bad)


Tree = Any


def fold_model(ws: dict[str, ml.Weight[Any, Any]]) -> ForwardDeclaration[Tree, ml.ArrayLayer]:
    node = ForwardDeclaration[Tree, ml.ArrayLayer]()

    def leaf_fn(word: np.ndarray) -> ml.ArrayLayer:
        return ml.embedding(ws["L"], word)  # FOLD-STEP

    def inner_fn(x: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
        return ml.tanh(ml.dense(ml.concatenate([x[0], x[1]], axis=1), ws["W"], ws["b"]))

    leaf: Any = InputTransform(lambda w: np.array([w])) >> Function(leaf_fn)  # FOLD-FUNCTION
    inner: Any = AllOf(InputTransform(lambda t: t[0]) >> node, InputTransform(lambda t: t[1]) >> node) >> Function(
        inner_fn
    )
    node.resolve_to(OneOf(lambda t: isinstance(t, int), {True: leaf, False: inner}))
    return node


@pytest.mark.parametrize("batching", [False, True])
def test_in_a_fold_block_the_step_and_the_block_are_named(batching: bool) -> None:
    ws = weights()
    before = snapshot(ws)
    trees: list[Tree] = [((1, 2), 3), (4, (5, 6)), ((7, 25), 8), (9, 10)]
    model = fold_model(ws)
    states = model.batch(trees)  # (built: the word is its data argument, checked when it runs) FOLD-BATCH
    loss = ml.sum(ml.concatenate(states, axis=0))
    with ml.settings(batching=batching), pytest.raises(ml.ShapeError) as info:
        anyio.run(loss.train)
    assert type(info.value) is ml.IndexRangeError
    assert str(info.value) == (
        "embedding: index 25 out of range for a table of 20 rows (indices must lie in [0, 20));"
        f" layer built at {HERE}:{line_of('FOLD-STEP')}, inside the operation fold_model.<locals>.leaf_fn"
        f" called at {HERE}:{line_of('FOLD-FUNCTION')}, built while {model!r}.batch at {HERE}:{line_of('FOLD-BATCH')}"
        " built input 2 (from 0) of 4"
    )
    # Raised while the batch runs, not while it is built: the message names the input, no note (docs/api/fold.md).
    assert getattr(info.value, "__notes__", None) is None
    assert unchanged(ws, before)


@pytest.mark.parametrize("batching", [False, True])
def test_segment_ids_and_labels_are_named_alike(batching: bool) -> None:
    w = ml.Weight(np.ones((2, 2)))
    sums = [ml.segment_sum(np.ones((3, 2)) @ w, np.array([0, 1, 2]), 3) for _ in range(5)]
    sums.append(ml.segment_sum(np.ones((3, 2)) @ w, np.array([0, 1, 5]), 3))  # SEGMENTS
    with ml.settings(batching=batching), pytest.raises(ml.IndexRangeError) as info:
        anyio.run(ml.sum(ml.stack(sums)).train)
    assert str(info.value).startswith(
        "segment_sum: segment id 5 at segment_ids[2] out of range for 3 segments"
        f" (segment_ids must lie in [0, 3)); layer built at {HERE}:{line_of('SEGMENTS')}"
    )
    logits = [ml.as_layer(np.ones((2, 3))) @ ml.Weight(np.eye(3)) for _ in range(4)]
    labels = [np.array([0, 1]), np.array([2, 1]), np.array([3, 0]), np.array([1, 1])]
    losses = [ml.cross_entropy(x, y) for x, y in zip(logits, labels)]  # LABELS
    with ml.settings(batching=batching), pytest.raises(ml.IndexRangeError) as info:
        anyio.run(ml.sum(ml.stack(losses)).train)
    assert str(info.value).startswith(
        "cross_entropy: label 3 at labels[0] out of range for 3 classes (labels must lie in [0, 3));"
        f" layer built at {HERE}:{line_of('LABELS')}"
    )


@ml.operation
def messages(h: ml.ArrayOperand, src: np.ndarray) -> ml.ArrayLayer:
    return ml.tanh(h[src])  # CELL-GATHER


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("marked", [False, True])
def test_a_gather_by_an_index_array_names_the_index_as_an_embedding_does(batching: bool, marked: bool) -> None:
    """``h[src]``, the tour's spelling of a graph network's gather, raised
    NumPy's bare IndexError, not `ml.IndexRangeError`, node by node, batched
    and inside a cell alike (a new user's report)."""
    w = ml.Weight(np.ones((3, 2)))
    before = w.data.copy()
    hs = [ml.tanh(np.full((4, 3), 0.1 * i) @ w) for i in range(300)]  # (300 members of one shape: they group)
    srcs = [np.array([0, 3, -4]) for _ in range(300)]
    srcs[157] = np.array([0, 1, 4])
    gathered = [messages(h, s) if marked else ml.tanh(h[s]) for h, s in zip(hs, srcs)]  # PER-EXAMPLE
    with ml.settings(batching=batching), pytest.raises(ml.IndexRangeError) as info:
        anyio.run(ml.sum(ml.stack([ml.sum(g) for g in gathered])).train)
    where = (
        f"{HERE}:{line_of('CELL-GATHER')}, inside the operation messages called at {HERE}:{line_of('PER-EXAMPLE')}"
        if marked
        else f"{HERE}:{line_of('PER-EXAMPLE')}"
    )
    assert str(info.value) == (
        "getitem: index 4 at index[2] out of range for axis 0 of length 4 (indices must lie in [-4, 4), a negative"
        f" one counted from the end); layer built at {where}"
    )
    assert np.array_equal(w.data, before)


@pytest.mark.parametrize(
    ("index", "shown"),
    [
        (7, "index 7 out of range for axis 0 of length 4"),
        (-5, "index -5 out of range for axis 0 of length 4"),
        ([1, 9], "index 9 at index[1] out of range for axis 0 of length 4"),
        ((np.array([[0, 1], [2, -9]]), 0), "index -9 at index[0][1, 1] out of range for axis 0 of length 4"),
        ((slice(None), np.array([0, 2])), "index 2 at index[1][1] out of range for axis 1 of length 2"),
        ((..., np.array([5])), "index 5 at index[1][0] out of range for axis 1 of length 2"),
        ((None, 1, 2), "index 2 at index[2] out of range for axis 1 of length 2"),
    ],
)
def test_the_place_and_axis_of_an_index_out_of_range(index: Any, shown: str) -> None:
    h = ml.Weight(np.ones((4, 2))) * 1.0
    with pytest.raises(ml.IndexRangeError) as info:
        anyio.run(ml.sum(h[index]).predict)  # INDEXED
    size = 4 if "axis 0" in shown else 2
    assert str(info.value) == (
        f"getitem: {shown} (indices must lie in [-{size}, {size}), a negative one counted from the end);"
        f" layer built at {HERE}:{line_of('INDEXED')}"
    )
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_other_index_errors_keep_numpy_s_words() -> None:
    h = ml.Weight(np.ones((4, 2))) * 1.0
    with pytest.raises(IndexError) as info:
        anyio.run(ml.sum(h[0, 0, 0]).predict)
    assert type(info.value) is IndexError and "too many indices" in str(info.value)


def test_an_index_array_that_refuses_numpy_is_read_in_its_own_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy refuses to become a NumPy array unasked ("Implicit conversion to
    a NumPy array is not allowed"): reading the index after the library's
    IndexError turned it into that TypeError. array_api_strict stands in
    for it here, made to refuse as CuPy does."""
    import array_api_strict as xs

    def refused(*args: object, **kwargs: object) -> NoReturn:
        raise TypeError("Implicit conversion to a NumPy array is not allowed")

    monkeypatch.setattr(type(xs.asarray([0])), "__array__", refused)
    h = ml.Weight(xs.asarray(np.ones((4, 3)))) * 1.0
    with pytest.raises(ml.IndexRangeError) as info:
        anyio.run(ml.sum(h[xs.asarray([0, 1]), 5]).predict)  # FOREIGN
    assert str(info.value) == (
        "getitem: index 5 at index[1] out of range for axis 1 of length 3 (indices must lie in [-3, 3), a negative"
        f" one counted from the end); layer built at {HERE}:{line_of('FOREIGN')}"
    )
    with pytest.raises(ml.IndexRangeError, match=r"^getitem: index -9 at index\[0\]\[1\] out of range for axis 0 "):
        anyio.run(ml.sum(h[xs.asarray([0, -9]), 1]).predict)
    with pytest.raises(IndexError) as other:  # (too many indices: the library's own words)
        anyio.run(ml.sum(h[xs.asarray([0, 1]), 0, 0]).predict)
    assert type(other.value) is IndexError and "too many indices" in str(other.value)
