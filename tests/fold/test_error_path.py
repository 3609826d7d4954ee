"""An error while building names where in the input it came from: the path
of parts the builds were at, and the block the innermost part was given to,
the same on nested calls and on the explicit stack, however deep."""

from __future__ import annotations

import gc
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.fold import (
    AllOf,
    Fold,
    ForwardDeclaration,
    Function,
    Identity,
    InputTransform,
    Map,
    OneOf,
    Record,
    Reduce,
    Vector,
    Zeros,
)

Pair = tuple[ml.ArrayLayer, ml.ArrayLayer]


def add(ab: Pair) -> ml.ArrayLayer:
    return ab[0] + ab[1]


def tree_model() -> ForwardDeclaration[Any, ml.ArrayLayer]:
    node = ForwardDeclaration[Any, ml.ArrayLayer]("node")
    leaf = Record({"x": Vector(2, "float64")}) >> InputTransform[Any, ml.ArrayLayer](lambda t: t[0])
    children = Record({"children": Map(node) >> Reduce(Function(add))}) >> InputTransform[Any, ml.ArrayLayer](
        lambda t: t[0]
    )
    node.resolve_to(OneOf(lambda d: d["kind"], {"leaf": leaf, "op": children}))
    return node


LEAF = {"kind": "leaf", "x": [0.1, 0.2]}


def op(*kids: Any) -> dict[str, Any]:
    return {"kind": "op", "children": list(kids)}


@pytest.mark.parametrize("depth", [None, 0])
def test_the_note_has_the_path_to_the_bad_node_and_the_block_given_it(
    depth: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from monadl.fold import _run

    if depth is not None:
        monkeypatch.setattr(_run, "DEPTH", depth)
    node = tree_model()
    empty = op(op(LEAF, LEAF), op(LEAF, op(LEAF, LEAF, op()), LEAF), LEAF)
    with pytest.raises(ValueError) as info:
        node.batch([op(LEAF, LEAF), empty])
    assert str(info.value) == (
        "Reduce(Function(add)) joins one or more elements, and was given [] (a list); an input that may be empty "
        "needs a case of its own (a OneOf on its length, with Zeros for none)"
    )
    assert info.value.__notes__ == [
        "monadl.fold: while building input 1 (a dict) of the batch with ForwardDeclaration('node'), "
        "at input 1['children'][1]['children'][1]['children'][2]<case 'op' of OneOf>['children']: [] (a list), "
        "given to Map(ForwardDeclaration('node')) >> Reduce(Function(add))"
    ]
    missing = op(op(LEAF, LEAF), op(LEAF, {"kind": "leaf", "x": None}))
    with pytest.raises(TypeError) as refused:
        node(missing)
    assert refused.value.__notes__ == [
        "monadl.fold: while building the call's input (a dict) with ForwardDeclaration('node'), "
        "at input 0['children'][1]['children'][1]<case 'leaf' of OneOf>['x']: None, given to Vector(2, 'float64')"
    ]


def test_a_tree_thousands_of_levels_deep_has_its_paths_middle_cut() -> None:
    node = tree_model()
    tree: Any = {"kind": "leaf", "x": [1.0]}  # (one number: Vector(2) refuses it)
    for _ in range(3000):
        tree = op(LEAF, tree)
    with pytest.raises(ValueError, match=r"^Vector\(2\) was given 1 number") as info:
        node(tree)
    (note,) = info.value.__notes__
    step = "['children'][1]"
    assert note == (
        "monadl.fold: while building the call's input (a dict) with ForwardDeclaration('node'), at input 0"
        + step * 5
        + "...5,982 more..."  # (6,002 steps: a level's two, the leaf's case and its field)
        + step * 4
        + "<case 'leaf' of OneOf>['x']: [1.0] (a list), given to Vector(2, 'float64')"
    )


def test_the_steps_of_fold_reduce_and_all_of() -> None:
    w = ml.Weight(np.ones((2, 2)))
    step = Record(Identity[ml.ArrayLayer](), Vector(2, "float64")) >> Function[Pair, ml.ArrayLayer](
        lambda sx: ml.tanh(sx[0] @ w + sx[1])
    )
    rnn = Fold(step, Zeros((2,), "float64"))
    with pytest.raises(ValueError) as info:
        rnn([[1.0, 2.0], [3.0, 4.0], [5.0]])
    assert info.value.__notes__[0].endswith(
        "at input 0[2][1]: [5.0] (a list), given to Vector(2, 'float64')"
    )  # (element 2; the step's Record, field 1)

    def refuse_long(ab: tuple[str, str]) -> str:
        if len(ab[0]) + len(ab[1]) > 4:
            raise ValueError("too long")
        return ab[0] + ab[1]

    joined = Map(InputTransform[str, str](str.strip)) >> Reduce(InputTransform(refuse_long))
    with pytest.raises(ValueError, match="too long") as info:
        joined([" a", "b", "c", "d", "e", "f", "g", "h", "i"])
    assert info.value.__notes__[0].endswith(
        "at input 0[0:8]: ('abcd', 'efgh') (a tuple), given to InputTransform(refuse_long)"
    )  # (the third level's first join: the input's elements 0 to 7, as a slice)
    both = AllOf(InputTransform[list[float], float](len), Vector(2, "float64"))
    with pytest.raises(ValueError) as info:
        Map(both)([[1.0, 2.0], [3.0]])
    assert info.value.__notes__[0].endswith(
        "at input 0[1]<block 1 of AllOf>: [3.0] (a list), given to Vector(2, 'float64')"
    )


def test_a_stop_iteration_marks_no_path_step_through_all_of() -> None:
    """Builds and routes leave a StopIteration unmarked (it is not thrown into
    them); a compiled AllOf marked it, a path that was wrong and depended on
    the input's depth."""
    pair = Map(AllOf(InputTransform[Any, int](lambda it: 1), InputTransform[Any, Any](next)))
    with pytest.raises(StopIteration) as info:
        pair([iter([1]), iter([])])
    assert info.value.__notes__ == [f"monadl.fold: while building the call's input (a list) with {pair!r}"]


def test_the_step_of_one_of_names_its_case() -> None:
    """A `OneOf`'s path step names the case its input took (it named the
    `OneOf`, not which of its blocks the error left)."""
    leaf = InputTransform[dict[str, Any], list[float]](lambda t: [1.0]) >> Vector(1, "float64")
    node = InputTransform[dict[str, Any], list[float]](lambda t: [0.0] * t["size"]) >> Vector(2, "float64")
    chosen = Map(OneOf[dict[str, Any], ml.ArrayLayer](lambda t: t["kind"], {"leaf": leaf, "node": node}))
    with pytest.raises(KeyError) as info:
        chosen([{"kind": "leaf"}, {"kind": "node"}])
    note = info.value.__notes__[0]
    assert note.endswith("at input 0[1]<case 'node' of OneOf>: {'kind': 'node'} (a dict), given to " + repr(node))


@pytest.mark.parametrize(
    ("block", "name"),
    [
        (Map(Vector(1)), "Map(Vector(1, 'float32'))"),
        (Reduce(Function(add)), "Reduce(Function(add))"),
        (Fold(Identity[Any](), Zeros((1,))), "Fold(Identity(), Zeros((1,), 'float32'))"),
    ],
)
def test_a_sequence_block_given_no_sequence_names_itself_and_the_input(block: Any, name: str) -> None:
    for given, text in ((None, "None"), (3, "3 (an int)")):
        with pytest.raises(TypeError) as info:
            block(given)
        assert str(info.value) == f"{name} takes a sequence, and was given {text}"


@pytest.mark.parametrize(
    ("block", "name"),
    [
        (Map(InputTransform(len)), "Map(InputTransform(len))"),
        (Reduce(Function(add)), "Reduce(Function(add))"),
        (Fold(Identity[Any](), Zeros((1,))), "Fold(Identity(), Zeros((1,), 'float32'))"),
    ],
)
def test_a_sequence_block_refuses_a_mapping_and_a_set_saying_what_to_pass(block: Any, name: str) -> None:
    # (a mapping's iteration gives its keys alone: a JSON object sent to a list's case by mistake
    # was read as its keys, silently; a set's order is its hashes')
    with pytest.raises(TypeError) as info:
        block({"ab": [1, 2, 3], "cde": 4})
    assert str(info.value) == (
        f"{name} takes a sequence, and was given {{'ab': [1, 2, 3], 'cde': 4}} (a dict), whose iteration gives "
        "its keys alone: pass list(x.values()), x.items() or list(x)"
    )
    with pytest.raises(TypeError) as info:
        block(frozenset({3}))
    assert str(info.value) == (
        f"{name} takes a sequence, and was given frozenset({{3}}) (a frozenset), which has no order (its "
        "hashes'): pass sorted(x), or list(x) where the order does not matter"
    )
    assert Map(InputTransform(len))(("ab", "c")) == [2, 1]  # (a tuple, a sequence, as before)
    # (a dict's keys and items are in its order: taken, as before)
    assert Map(InputTransform(len))({"ab": 1, "c": 2}.keys()) == [2, 1]  # type: ignore[arg-type]  # (a view: no Sequence)
    assert Map(InputTransform(len))({"ab": 1, "c": 2}.items()) == [2, 2]  # type: ignore[arg-type]  # (a view: no Sequence)


def test_a_batch_of_a_mapping_or_a_set_is_refused_as_a_sequence_block_refuses_them() -> None:
    # (`block.batch(d)` took a dict's keys as its inputs, silently, where `Map` refused it: a new user's)
    block = InputTransform(len)
    with pytest.raises(TypeError) as info:
        block.batch({"ab": 1, "c": 2})  # (mypy takes it: a dict is an Iterable of its keys)
    assert str(info.value) == (
        "InputTransform(len).batch takes a sequence of inputs, and was given {'ab': 1, 'c': 2} (a dict), whose "
        "iteration gives its keys alone: pass list(x.values()), x.items() or list(x)"
    )
    with pytest.raises(TypeError, match=r"was given \{'ab'\} \(a set\), which has no order \(its hashes'\): "):
        block.batch({"ab"})
    assert block.batch({"ab": 1, "c": 2}.keys()) == [2, 1]  # (its keys, in order: taken, as Map takes them)


def _line_of(text: str) -> int:
    """The line of this file holding ``text``."""
    with open(__file__) as f:
        return next(n for n, line in enumerate(f, 1) if text in line)


@pytest.mark.parametrize("setting", [None, True, False])
def test_an_error_when_the_graph_runs_names_the_input_of_the_batch_it_was_built_for(setting: bool | None) -> None:
    table = ml.Weight(np.arange(40.0).reshape(20, 2))
    block = InputTransform[list[int], Any](np.asarray) >> Function(lambda ids: ml.embedding(table, ids))
    outs = block.batch([[1, 2], [3, 4], [5, 25], [6, 7]])  # the batch's line
    loss = ml.sum(ml.stack([ml.sum(o) for o in outs]))
    with ml.settings(batching=setting), pytest.raises(ml.IndexRangeError) as info:
        anyio.run(loss.train)
    batch = f"{__file__}:{_line_of('# the batch' + chr(39) + 's line')}"
    assert str(info.value).endswith(
        f", built while InputTransform(asarray) >> Function(<lambda>).batch at {batch} built input 2 (from 0) of 4"
    )
    assert table.data[5, 0] == 10.0  # nothing changed


def test_an_error_of_a_batch_whose_block_is_freed_names_the_batch_of_a_block() -> None:
    # A block made in a function and dropped before its batch ran: the message read "built while
    # a Fold block (since freed).batch at ..." (a new user's trial).
    table = ml.Weight(np.arange(40.0).reshape(20, 2))

    def batch_of(ids: list[list[int]]) -> list[ml.ArrayLayer]:
        block = InputTransform[list[int], Any](np.asarray) >> Function(lambda i: ml.embedding(table, i))
        return block.batch(ids)  # the freed block's batch

    outs = batch_of([[1, 2], [3, 25]])
    gc.collect()
    with pytest.raises(ml.IndexRangeError) as info:
        anyio.run(ml.sum(ml.stack([ml.sum(o) for o in outs])).train)
    batch = f"{__file__}:{_line_of('# the freed block' + chr(39) + 's batch')}"
    assert str(info.value).endswith(
        f", built while a Fold block's batch (the block since freed) at {batch} built input 1 (from 0) of 2"
    ), str(info.value)


def test_a_run_time_error_names_each_batch_it_was_built_for_outermost_first() -> None:
    node = tree_model()
    inner = InputTransform[list[Any], Any](lambda xs: node.batch(xs)[-1])  # (a batch built inside another's)
    outer = InputTransform[list[Any], Any](lambda xs: xs) >> inner
    trees = [[LEAF], [LEAF, op(LEAF, {"kind": "leaf", "x": [0.5, np.nan]})]]
    outs = outer.batch(trees)  # the outer batch
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as info:
        anyio.run(ml.sum(ml.stack(outs)).predict)
    message = str(info.value)
    outer_at = f"{__file__}:{_line_of('# the outer batch')}"
    inner_at = f"{__file__}:{_line_of('# (a batch built inside')}"
    assert message == (
        f"the data given at {__file__}:{_line_of('leaf = Record')}"
        f", built while InputTransform(<lambda>) >> InputTransform(<lambda>).batch at {outer_at} built input 1 (from 0)"
        f" of 2, built while ForwardDeclaration('node').batch at {inner_at} built input 1 (from 0) of 2"
        " already holds a NaN or an infinity (float64[1, 2])"
    )


def test_layers_of_no_batch_and_of_a_batch_long_gone_name_no_input() -> None:
    from monadl.layers._batch_site import KEPT, built_for

    x = ml.as_layer(np.ones(2))
    assert built_for(x._serial) == ""
    first = InputTransform[float, Any](lambda v: ml.as_layer(np.array([v]))).batch([1.0, 2.0])
    assert built_for(first[1]._serial).endswith("built input 1 (from 0) of 2")
    InputTransform[float, float](float).batch([1.0] * 10)  # (no layer built: not kept)
    assert built_for(first[1]._serial).endswith("built input 1 (from 0) of 2")
    for _ in range(KEPT):
        InputTransform[float, Any](lambda v: ml.as_layer(np.array([v]))).batch([1.0])
    assert built_for(first[1]._serial) == ""


def test_the_kept_batches_hold_a_bounded_number_of_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    from monadl.layers import _batch_site

    monkeypatch.setattr(_batch_site, "KEPT_INPUTS", 100)
    block = InputTransform[float, Any](lambda v: ml.as_layer(np.array([v])))
    old = block.batch([1.0] * 60)
    new = block.batch([1.0] * 60)  # (past 100 inputs: the older batch goes)
    assert _batch_site.built_for(old[0]._serial) == ""
    assert _batch_site.built_for(new[59]._serial).endswith("built input 59 (from 0) of 60")
    big = block.batch([1.0] * 150)  # (the newest is kept whatever its size)
    assert _batch_site.built_for(big[149]._serial).endswith("of 150")
    assert _batch_site.built_for(new[0]._serial) == ""


def test_a_weights_node_built_in_a_batch_names_no_input_of_it() -> None:
    # (the weight's one node, ml.as_layer(w), is built once and reused by every later graph: a NaN in the
    # weight at a later step was named as input 0 of the first batch)
    w = ml.Weight(np.ones(2))
    block = InputTransform[float, Any](lambda v: ml.as_layer(w) * v)
    outs = block.batch([1.0, 2.0])
    w.data = np.array([np.nan, 1.0])
    with ml.settings(check_finite=True), pytest.raises(ml.NonFiniteError) as info:
        anyio.run(ml.sum(ml.stack(outs)).predict)
    assert "built while" not in str(info.value), str(info.value)


def test_a_kept_batch_holds_no_block_alive() -> None:
    import gc
    import weakref

    def model() -> tuple[InputTransform[int, Any], weakref.ref[ml.ArrayWeight]]:
        table = ml.Weight(np.ones((3, 2)))
        return InputTransform[int, Any](lambda i: ml.embedding(table, np.array([i]))), weakref.ref(table)

    block, gone = model()
    assert gone() is not None
    block.batch([0, 1])
    del block
    gc.collect()
    assert gone() is None  # (a model dropped between experiments: its weights go with it)
