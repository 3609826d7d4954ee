"""Each block's semantics, composition, errors, and recursion deeper than Python's stack."""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml
from monadl.fold import (
    AllOf,
    Block,
    Build,
    Fold,
    ForwardDeclaration,
    Function,
    InputTransform,
    Map,
    OneOf,
    Optional,
    Record,
    Reduce,
    Scalar,
    Vector,
    Zeros,
    _run,
    _stack,
    call,
)
from monadl.fold._stack import evaluate


def value(layer: ml.Layer[Any, Any]) -> Any:
    return anyio.run(layer.predict)


def test_scalar_vector_and_zeros_are_constant_rows_of_their_dtype() -> None:
    s, v, z = Scalar()(2.5), Vector(3, np.float64)([1, 2, 3]), Zeros((2, 3), np.float64)("ignored")
    assert value(s).dtype == np.float32 and value(s).tolist() == [2.5]
    assert value(v).dtype == np.float64 and value(v).tolist() == [[1.0, 2.0, 3.0]]
    assert value(z).shape == (1, 2, 3) and not value(z).any()
    with pytest.raises(ValueError, match=r"Vector\(3\) was given 2 numbers"):
        Vector(3)([1.0, 2.0])


def test_function_trains_the_weights_it_uses() -> None:
    w = ml.Weight(np.array([[2.0]]), optimizer=ml.optim.sgd(0.5))
    square = Scalar(np.float64) >> Function(lambda x: ml.sum(ml.matmul(ml.reshape(x, (1, 1)), w) ** 2))
    loss = square(3.0)
    assert float(anyio.run(loss.train)) == 36.0
    assert w.data.tolist() == [[2.0 - 0.5 * 2 * 6.0 * 3.0]]  # d(3w)^2/dw = 18w


def test_map_fold_and_reduce_over_sequences() -> None:
    assert Map(InputTransform[str, str](lambda s: s * 2))(["a", "b"]) == ["aa", "bb"]
    assert Map(InputTransform[str, int](len))([]) == []
    digits = Fold(
        InputTransform[tuple[int, int], int](lambda sx: sx[0] * 10 + sx[1]), InputTransform[None, int](lambda _: 0)
    )
    assert digits([4, 0, 2]) == 402 and digits([]) == 0
    pair = InputTransform[tuple[str, str], str](lambda ab: f"({ab[0]}{ab[1]})")
    assert Reduce(pair)("a") == "a"
    assert Reduce(pair)("abcdefgh") == "(((ab)(cd))((ef)(gh)))"  # balanced: depth log2(8) = 3
    assert Reduce(pair)("abcdefg") == "(((ab)(cd))((ef)g))"
    with pytest.raises(ValueError, match="empty"):
        Reduce(pair)([])


def test_fold_is_an_rnn_with_the_hand_written_values_and_gradients() -> None:
    w = ml.Weight(np.array([[0.5, -0.3], [0.2, 0.7]]))

    def step(sx: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
        return ml.tanh(ml.matmul(sx[0], w) + sx[1])

    cell = Function(step)
    rnn = Map(Vector(2, np.float64)) >> Fold(cell, Zeros((2,), np.float64))
    xs = [[1.0, 0.0], [0.5, -1.0], [0.0, 2.0]]
    h = np.zeros((1, 2))
    for x in xs:
        h = np.tanh(h @ w.data + np.array([x]))
    out = rnn(xs)
    np.testing.assert_allclose(value(out), h, rtol=1e-14)
    (grad,) = anyio.run(ml.gradients, ml.sum(out), [w])
    eps, numeric = 1e-6, np.zeros_like(w.data)
    for i in np.ndindex(w.data.shape):
        for sign in (1, -1):
            w2 = w.data.copy()
            w2[i] += sign * eps
            h = np.zeros((1, 2))
            for x in xs:
                h = np.tanh(h @ w2 + np.array([x]))
            numeric[i] += sign * h.sum() / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6)


def test_one_of_optional_all_of_and_record() -> None:
    even, odd = InputTransform[int, str](lambda n: "even"), InputTransform[int, str](lambda n: "odd")
    parity = OneOf(lambda n: n % 2, {0: even, 1: odd})
    assert parity.batch([1, 2, 3]) == ["odd", "even", "odd"]
    with pytest.raises(KeyError, match="no case for key 'x'"):
        OneOf(str, {"y": InputTransform(len)})("x")
    maybe = Optional(Vector(2, np.float64), Zeros((2,), np.float64))
    assert value(maybe(None)).tolist() == [[0.0, 0.0]] and value(maybe([3, 4])).tolist() == [[3.0, 4.0]]
    assert AllOf(InputTransform(len), InputTransform(str.upper), InputTransform(str.lower))("aB") == (2, "AB", "ab")
    assert Record(InputTransform[str, int](len), InputTransform[int, int](abs))(("abc", -2)) == (3, 2)
    assert AllOf[str, tuple[()]]()("x") == ()


def test_all_of_runs_in_the_evaluator_as_its_own_build_would() -> None:
    """`AllOf` (a `Parallel` block) is run by the evaluator without its
    generator: nested, composed, through routes, and as deep as the input."""
    length = InputTransform[str, int](len)
    nested = AllOf(AllOf(length, InputTransform(str.upper)), length >> InputTransform(str), AllOf[str, tuple[()]]())
    expected = ((2, "AB"), "2", ())
    assert nested("ab") == expected
    build = nested._build("ab")  # the generator, driven by hand, gives the same
    request = next(build)
    try:
        while True:
            block, x = request
            request = build.send(block(x))
    except StopIteration as done:
        assert done.value == expected
    depth = ForwardDeclaration[tuple[Any, ...] | None, int]()
    first = InputTransform[tuple[Any, ...], Any](lambda t: t[0])
    deeper: Block[Any, int] = AllOf(first >> depth, InputTransform(lambda t: 1)) >> InputTransform(sum)
    depth.resolve_to(OneOf(lambda t: t is None, {True: InputTransform(lambda t: 0), False: deeper}))
    chain: tuple[Any, ...] | None = None
    for _ in range(sys.getrecursionlimit() * 3):
        chain = (chain,)
    assert depth(chain) == sys.getrecursionlimit() * 3
    assert Record({"b": InputTransform(len), "a": InputTransform(len)})({"a": "x", "b": "yy"}) == (2, 1)
    with pytest.raises(ValueError, match="Record of 2 blocks"):
        Record(InputTransform(len), InputTransform(len))(("a",))  # type: ignore[arg-type]  # the runtime check
    with pytest.raises(ValueError, match="not a mapping"):
        Record({"a": InputTransform(len)})(("a",))  # type: ignore[arg-type]  # the runtime check


def test_composition_is_associative_and_typed_through() -> None:
    a, b, c = InputTransform(str.split), InputTransform[list[str], int](len), InputTransform[int, int](lambda n: n * n)
    left: Block[str, int] = (a >> b) >> c
    right: Block[str, int] = a >> (b >> c)
    assert left("x y z") == right("x y z") == 9


def test_routes_pick_per_input_through_chains_of_declarations() -> None:
    """The runner keeps a closure per `OneOf` key and calls a resolved
    declaration's block directly: each input still gets its own case, a
    declaration of a declaration works, a key with no case still fails, and
    recursion through them is counted (deeper than Python's stack)."""
    size = InputTransform[tuple[Any, ...], int](len)
    cases: dict[int, Block[tuple[Any, ...], Any]] = {
        0: size,
        1: size >> InputTransform[int, int](lambda n: -n),
        2: InputTransform[tuple[Any, ...], str](str),
    }
    parity = OneOf[tuple[Any, ...], Any](lambda t: len(t) % 3, cases)
    outer, inner = ForwardDeclaration[tuple[Any, ...], Any](), ForwardDeclaration[tuple[Any, ...], Any]()
    outer.resolve_to(inner)
    inner.resolve_to(parity)
    inputs = [(), (1,), (1, 2), (1, 2, 3), (1,), ()]
    assert outer.batch(inputs) == [0, -1, "(1, 2)", 3, -1, 0]
    with pytest.raises(KeyError, match="no case for key 3"):
        OneOf(len, {0: size, 1: size}).batch([(), (1,), (1, 2, 3)])
    keys: list[int] = []  # the key runs once per input: it may be random, or count
    flips = iter([True, False, False, True, True])

    def flip(n: int) -> bool:
        keys.append(n)
        return next(flips)

    coin = OneOf[int, str](flip, {True: InputTransform(str), False: InputTransform(hex)})
    assert coin.batch([10, 11, 12, 13, 14]) == ["10", "0xb", "0xc", "13", "14"] and keys == [10, 11, 12, 13, 14]

    class ByEquality(Mapping[Any, Block[Any, Any]]):  # cases matched by ==: unhashable keys too
        def __init__(self, pairs: list[tuple[Any, Block[Any, Any]]]) -> None:
            self.pairs = pairs

        def __getitem__(self, key: Any) -> Block[Any, Any]:
            return next(block for k, block in self.pairs if k == key)

        def __contains__(self, key: object) -> bool:
            return any(k == key for k, _ in self.pairs)

        def __iter__(self) -> Iterator[Any]:
            return iter([k for k, _ in self.pairs])

        def __len__(self) -> int:
            return len(self.pairs)

    listed = OneOf[list[int], Any](lambda x: x, ByEquality([([1], InputTransform(str)), ([2], InputTransform(len))]))
    assert listed.batch([[1], [2], [1]]) == ["[1]", 1, "[1]"]
    depth = ForwardDeclaration[Any, int]()
    down = InputTransform[Any, Any](lambda t: t[0]) >> depth >> InputTransform(lambda d: d + 1)
    depth.resolve_to(OneOf(lambda t: t is None, {True: InputTransform(lambda t: 0), False: down}))
    nested: Any = None
    for _ in range(3 * sys.getrecursionlimit()):
        nested = (nested,)
    assert depth.batch([nested, (None,)]) == [3 * sys.getrecursionlimit(), 1]


def test_a_deep_run_inside_another_deep_runs_block_stays_within_pythons_stack() -> None:
    """Each run keeps its own frames bounded (`_run.DEPTH`), so a run
    started inside another's block, both deeper than Python's stack, works."""

    def depth_of(leaf: Block[Any, int]) -> Block[Any, int]:
        declared = ForwardDeclaration[Any, int]()
        body: Block[Any, Any] = InputTransform[Any, Any](lambda t: t[0]) >> declared
        for _ in range(6):
            body = body >> InputTransform[Any, Any](lambda v: v)
        declared.resolve_to(OneOf(lambda t: t is None, {True: leaf, False: body >> InputTransform(lambda n: n + 1)}))
        return declared

    deep: Any = None
    for _ in range(2 * sys.getrecursionlimit()):
        deep = (deep,)
    inner = depth_of(InputTransform(lambda t: 0))
    outer = depth_of(InputTransform(lambda t: inner(deep)))
    assert outer(deep) == 4 * sys.getrecursionlimit()


def test_a_long_chain_of_compositions_is_stack_safe() -> None:
    inc = InputTransform[int, int](lambda n: n + 1)
    chain: Block[int, int] = inc
    for _ in range(3 * sys.getrecursionlimit()):
        chain = chain >> inc
    assert chain(0) == 3 * sys.getrecursionlimit() + 1


def test_forward_declaration_recursion_deeper_than_pythons_stack_builds_and_trains() -> None:
    w = ml.Weight(np.array([[1.0]]), optimizer=ml.optim.sgd(1e-6))
    # A linked list (value, rest): h = tanh(w h_rest + value), the empty list is zeros.
    rest = ForwardDeclaration[tuple[float, Any] | None, ml.ArrayLayer]()

    def step(xh: tuple[ml.ArrayLayer, ml.ArrayLayer]) -> ml.ArrayLayer:
        return ml.tanh(ml.matmul(xh[1], w) + xh[0])

    cell = Function(step)
    rest.resolve_to(Optional(Record(Scalar(np.float64), rest) >> cell, Zeros((1,), np.float64)))
    depth = 3 * sys.getrecursionlimit()
    assert depth > 2000
    nested: tuple[float, Any] | None = None
    for k in range(depth):
        nested = (0.1 * (k % 7) - 0.3, nested)
    out = rest(nested)
    h = np.zeros((1, 1))
    for k in range(depth):
        h = np.tanh(h * 1.0 + (0.1 * (k % 7) - 0.3))
    np.testing.assert_allclose(value(out), h, rtol=1e-14)
    anyio.run(ml.sum(out).train)  # the backward pass is stack-safe too
    assert w.data[0, 0] != 1.0


def test_forward_declaration_must_be_resolved_once() -> None:
    later = ForwardDeclaration[str, int]()
    with pytest.raises(ValueError, match="before resolve_to"):
        later("x")
    later.resolve_to(InputTransform(len))
    with pytest.raises(ValueError, match="already resolved"):
        later.resolve_to(InputTransform(len))
    assert later.batch(["a", "bb"]) == [1, 2]


def test_a_batch_is_one_graph_and_one_step_per_weight() -> None:
    w = ml.Weight(np.array([1.0, 2.0]), optimizer=ml.optim.sgd(0.1))
    block = Vector(2, np.float64) >> Function(lambda v: ml.sum(v * w))
    outs = block.batch([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    total = outs[0] + outs[1] + outs[2]
    assert float(anyio.run(total.train)) == 1.0 + 2.0 + 3.0
    np.testing.assert_allclose(w.data, [1.0 - 0.1 * 2.0, 2.0 - 0.1 * 2.0])  # one step with the summed gradient


@pytest.mark.parametrize("depth", [0, 3])
def test_calls_and_the_explicit_stack_build_the_same_graph(depth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks run as nested calls up to `_run.DEPTH` routes and builds open,
    then on the explicit stack (``depth`` 0: all of it; 3: a tree's top
    levels as calls, the rest on the stack): the same values and the same
    order of layers either way."""
    from examples.tree_lstm import init_weights, make_trees
    from examples.tree_lstm_fold import FoldTreeLSTM
    from monadl.fold import _run

    trees = make_trees(4, 3, 9, seed=2)
    model = FoldTreeLSTM(init_weights(4, dtype=np.float64))
    model.encoder.batch(trees)  # (traces the cells: their placeholders are layers too)
    calls = model.encoder.batch(trees)
    monkeypatch.setattr(_run, "DEPTH", depth)
    stacked = model.encoder.batch(trees)
    for a, b in zip(calls, stacked, strict=True):
        np.testing.assert_array_equal(value(a), value(b))
        assert a._serial - calls[0]._serial == b._serial - stacked[0]._serial  # as many layers, in the same order


def test_a_function_blocks_nodes_are_built_where_the_block_was_made() -> None:
    w = ml.Weight(np.ones((3, 2)))
    block = Map(Vector(2, np.float64) >> Function(lambda v: ml.matmul(v, w)))  # the line an error names
    made = sys._getframe().f_lineno - 1
    outs = block([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(ml.ShapeError, match=rf"test_blocks.py:{made}\b"):
        anyio.run(ml.sum(ml.concatenate(outs, axis=0)).predict)
    # Its types named, as the docs ask of a lambda: the call goes through typing's generic alias.
    typed = Vector(2, np.float64) >> Function[ml.ArrayLayer, ml.ArrayLayer](lambda v: ml.matmul(v, w))
    made = sys._getframe().f_lineno - 1
    with pytest.raises(ml.ShapeError, match=rf"test_blocks.py:{made}\b"):  # (it named typing.py)
        anyio.run(ml.sum(typed([1.0, 2.0])).predict)


def test_an_error_while_building_names_the_input_of_the_batch() -> None:
    reciprocal = InputTransform[float, float](lambda v: 1.0 / v)
    with pytest.raises(ZeroDivisionError) as info:
        reciprocal.batch([1.0, 2.0, 0.0, 4.0])
    assert info.value.__notes__ == [
        "monadl.fold: while building input 2 (a float) of the batch with InputTransform(<lambda>)"
    ]


def test_an_error_of_the_inputs_themselves_gets_no_note() -> None:
    def inputs() -> Iterator[str]:
        yield "a"
        raise OSError("the file went away")

    with pytest.raises(OSError, match="went away") as info:
        InputTransform(len).batch(inputs())
    assert not hasattr(info.value, "__notes__")


# ---- reprs ------------------------------------------------------------------------------------------
def cell(x: Any) -> Any:
    return x


def test_blocks_print_as_they_were_built() -> None:
    assert repr(Function(cell)) == "Function(cell)"
    assert repr(Map(Function(cell))) == "Map(Function(cell))"
    assert repr(InputTransform(len) >> Function(cell)) == "InputTransform(len) >> Function(cell)"
    assert repr(InputTransform(len) >> (InputTransform(str) >> InputTransform(str.upper))) == (
        "InputTransform(len) >> InputTransform(str) >> InputTransform(str.upper)"
    )
    assert repr(Scalar()) == "Scalar('float32')"
    assert repr(Vector(2, np.float64) >> Function(lambda v: v)) == "Vector(2, 'float64') >> Function(<lambda>)"
    assert repr(Fold(Function(cell), Zeros((2,)))) == "Fold(Function(cell), Zeros((2,), 'float32'))"
    assert repr(Optional(Vector(2), Zeros((2,)))) == "Optional(Vector(2, 'float32'), Zeros((2,), 'float32'))"
    assert repr(Reduce(Function(cell))) == "Reduce(Function(cell))"
    cases: dict[int, Block[Any, Any]] = {0: Scalar(), 1: Map(Scalar())}
    assert repr(OneOf(len, cases)) == "OneOf(len, {0: Scalar('float32'), 1: Map(Scalar('float32'))})"
    assert repr(AllOf(InputTransform(len), InputTransform(str))) == "AllOf(InputTransform(len), InputTransform(str))"
    assert repr(Record(Scalar(), Vector(3))) == "Record(Scalar('float32'), Vector(3, 'float32'))"
    assert repr(Record({"a": Scalar()})) == "Record({'a': Scalar('float32')})"
    assert repr(Function(functools.partial(cell))) == "Function(cell)"  # (the function, through the partial)


def test_a_recursive_declaration_prints_by_its_name_and_finitely() -> None:
    depth = ForwardDeclaration[Any, int]("depth")
    one_more = InputTransform[Any, Any](lambda t: t[0]) >> depth >> InputTransform[int, int](lambda d: d + 1)
    body = OneOf(lambda t: t is None, {True: InputTransform[Any, int](lambda t: 0), False: one_more})
    depth.resolve_to(body)
    assert repr(depth) == "ForwardDeclaration('depth')"
    assert repr(body) == (
        "OneOf(<lambda>, {True: InputTransform(<lambda>), "
        "False: InputTransform(<lambda>) >> ForwardDeclaration('depth') >> InputTransform(<lambda>)})"
    )
    unnamed = ForwardDeclaration[Any, Any]()
    unnamed.resolve_to(Map(unnamed))
    assert repr(unnamed) == f"ForwardDeclaration({id(unnamed):#x})"
    assert repr(Map(unnamed)) == f"Map(ForwardDeclaration({id(unnamed):#x}))"
    with pytest.raises(ValueError, match=r"ForwardDeclaration\('depth'\)\.resolve_to: already resolved"):
        depth.resolve_to(body)


def test_long_and_deep_blocks_are_cut() -> None:
    chain: Block[Any, Any] = Scalar()
    for _ in range(10_000):  # (a chain this long is walked without recursion)
        chain = chain >> InputTransform(str)
    assert repr(chain) == "Scalar('float32')" + " >> InputTransform(str)" * 5 + " >> ..."
    nested: Block[Any, Any] = Scalar()
    for _ in range(10):
        nested = Map(nested)
    assert repr(nested) == "Map(Map(Map(Map(Map(...)))))"
    assert repr(AllOf(*[Scalar()] * 9)) == "AllOf(" + "Scalar('float32'), " * 6 + "...)"
    assert repr(OneOf(int, {k: Scalar() for k in range(9)})).endswith("5: Scalar('float32'), ...})")


def test_a_block_of_your_own_prints_its_class() -> None:
    class Twice(Block[int, int]):
        def _build(self, x: int) -> Build[int]:
            y: int = yield from call(InputTransform[int, int](abs), x)
            return 2 * y

    assert Twice()(-3) == 6
    assert repr(Twice()) == "Twice(...)"


# ---- recursion that makes no progress ---------------------------------------------------------------
def test_a_declaration_resolved_to_itself_is_refused() -> None:
    loop = ForwardDeclaration[int, int]("loop")
    with pytest.raises(ValueError, match=r"ForwardDeclaration\('loop'\)\.resolve_to: resolved to itself"):
        loop.resolve_to(loop)
    a, b = ForwardDeclaration[int, int]("a"), ForwardDeclaration[int, int]("b")
    a.resolve_to(b)
    with pytest.raises(ValueError, match=r"resolved to itself \(through ForwardDeclaration\('a'\)\)"):
        b.resolve_to(a)
    b.resolve_to(InputTransform(abs))  # (the refused one left it unresolved)
    assert a(-2) == 2


def test_a_route_that_reaches_itself_on_the_same_input_raises_recursion_error() -> None:
    """A left-recursive `OneOf` spun for ever on the explicit stack (routes
    leave nothing on it), or filled the memory through a composition; then
    it stopped at `_stack.LIMIT` levels (a million keys computed); now at once,
    where the declaration meets the input it is building."""
    keys = 0

    def positive(n: int) -> bool:
        nonlocal keys
        keys += 1
        return n > 0

    left = ForwardDeclaration[int, int]("left")
    left.resolve_to(OneOf(positive, {True: left, False: InputTransform[int, int](abs)}))
    assert left(-3) == 3
    keys = 0
    with pytest.raises(
        RecursionError,
        match=r"^monadl.fold: ForwardDeclaration\('left'\) was applied to 1 \(an int\) while building that same "
        r"object: a recursion that makes no progress.*a route that reaches itself on the same input",
    ):
        left(1)
    assert keys < 2 * _run.DEPTH  # (the calls' levels, then one on the explicit stack)
    composed = ForwardDeclaration[int, int]("composed")
    composed.resolve_to(
        OneOf(
            lambda n: n > 0, {True: composed >> InputTransform[int, int](lambda n: n + 1), False: InputTransform(abs)}
        )
    )
    with pytest.raises(RecursionError, match=r"ForwardDeclaration\('composed'\)|OneOf") as info:
        composed.batch([0, 1])
    assert info.value.__notes__ == [
        f"monadl.fold: while building input 1 (an int) of the batch with {composed!r}, at input 1<case True of OneOf>: "
        "1 (an int), given to ForwardDeclaration('composed') >> InputTransform(<lambda>)"
    ]


class Node:
    """A node of a graph: a tree, unless it is its own descendant."""

    def __init__(self, *children: Node) -> None:
        self.children = list(children)


@pytest.mark.parametrize("kind", ["map", "all_of"])
def test_an_input_that_contains_itself_raises_recursion_error(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An input that is its own descendant grew the explicit stack without
    bound (through `Map`'s builds, or `AllOf` and compositions, which build
    nothing) to `_stack.LIMIT` levels: a user's JSON list that contains itself
    took 30-60 s and 772 MiB. Now it stops where the declaration meets the
    node it is building, a level of the cycle into the explicit stack."""
    walked = 0

    def children(n: Node) -> list[Node]:
        nonlocal walked
        walked += 1
        return n.children

    size = ForwardDeclaration[Node, int]("size")
    if kind == "map":
        size.resolve_to(InputTransform(children) >> Map(size) >> InputTransform(sum))
    else:
        pair = AllOf(
            InputTransform[Node, Node](lambda n: children(n)[0]) >> size, InputTransform[Node, int](lambda n: 1)
        )
        size.resolve_to(
            OneOf(lambda n: not n.children, {True: InputTransform(lambda n: 1), False: pair >> InputTransform(sum)})
        )
    chain = Node()
    for _ in range(5000):
        chain = Node(chain)
    assert size(chain) == (0 if kind == "map" else 5001)
    with monkeypatch.context() as patched:  # one node twice, side by side (no cycle), on the explicit stack
        patched.setattr(_run, "DEPTH", 0)
        shared = Node()
        assert size(Node(shared, shared)) == (0 if kind == "map" else 2)
    cyclic = Node()
    cyclic.children.append(cyclic)
    walked = 0
    with pytest.raises(
        RecursionError,
        match=r"^monadl.fold: ForwardDeclaration\('size'\) was applied to <.*> \(a Node\) while building that same "
        r"object: .*a cyclic input",
    ):
        size(Node(Node(cyclic)))
    assert walked < _run.DEPTH + 4


def test_a_declaration_whose_error_was_caught_may_build_the_same_input_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the explicit stack, a declaration that an error left is no longer
    open: a build that catches the error may apply it to the same input."""
    monkeypatch.setattr(_run, "DEPTH", 0)
    fails = iter([True, False])

    def once_fails(n: int) -> int:
        if next(fails):
            raise ValueError("the first time")
        return n

    flaky = ForwardDeclaration[int, int]("flaky")
    flaky.resolve_to(InputTransform(once_fails))

    class Again(Block[int, int]):
        def _build(self, n: int) -> Build[int]:
            try:
                return (yield from call(flaky, n))
            except ValueError:
                return (yield from call(flaky, n))

    assert Again()(7) == 7


def test_a_recursion_that_makes_a_new_input_a_level_still_stops_at_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """No object repeats, so no declaration meets its own input: `_stack.LIMIT`
    stops it (lowered here: the test's time), as Python's own recursion would."""
    monkeypatch.setattr(_stack, "LIMIT", 20_000)
    grow = ForwardDeclaration[Any, int]("grow")
    grow.resolve_to(InputTransform[Any, Any](lambda x: [x]) >> grow)
    with pytest.raises(RecursionError, match=r"more than 20,000 levels .*ForwardDeclaration\('grow'\).*no progress"):
        grow(0)


def test_a_tree_of_depth_100_000_still_builds() -> None:
    """The limit is far past a deep tree's levels: a recursion through seven
    compositions (eight levels of the explicit stack per level of the tree)."""
    depth = ForwardDeclaration[Any, int]()
    body: Block[Any, Any] = InputTransform[Any, Any](lambda t: t[0]) >> depth
    for _ in range(6):
        body = body >> InputTransform[Any, Any](lambda v: v)
    depth.resolve_to(
        OneOf(lambda t: t is None, {True: InputTransform(lambda t: 0), False: body >> InputTransform(lambda n: n + 1)})
    )
    deep: Any = None
    for _ in range(100_000):
        deep = (deep,)
    assert depth(deep) == 100_000


# ---- a block of one's own catches a sub-block's error -------------------------------------------------
class Try(Block[Any, Any]):
    """``block(x)``, or ``fallback(x)`` where ``block`` raises ValueError."""

    def __init__(self, block: Block[Any, Any], fallback: Block[Any, Any]) -> None:
        self.block, self.fallback = block, fallback

    def _build(self, x: Any) -> Build[Any]:
        try:
            y = yield from call(self.block, x)
        except ValueError:
            y = yield from call(self.fallback, x)
        return y


class Fails(Block[Any, Any]):
    """A build whose own code raises (after a request), as a parser might."""

    def _build(self, x: Any) -> Build[Any]:
        yield from call(InputTransform(str), x)
        raise ValueError(f"no number in {x!r}")


def parse(text: str) -> int:
    return int(text)  # the user's line an uncaught error names


@pytest.mark.parametrize("depth", [None, 0])
def test_a_build_catches_a_sub_blocks_error(depth: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error is thrown into the build that waits for it (``gen.throw``),
    through nested calls (``depth`` None) and the explicit stack (0: all of
    it there), past the compositions and parallel blocks that waited on it."""
    from monadl.fold import _run

    if depth is not None:
        monkeypatch.setattr(_run, "DEPTH", depth)
    minus_one = InputTransform[Any, int](lambda s: -1)
    safe = Try(InputTransform(parse), minus_one)
    assert safe("12") == 12 and safe("x") == -1
    assert Map(safe)(["1", "x", "3"]) == [1, -1, 3]
    waiting = AllOf(InputTransform(len), InputTransform(str.upper) >> InputTransform(parse) >> InputTransform(str))
    assert Map(Try(waiting, minus_one))(["7", "x"]) == [(1, "7"), -1]
    assert Try(Fails(), minus_one)("x") == -1  # (the build that raised is finished: the error goes to the one below)
    assert Try(Try(InputTransform(parse), Fails()), minus_one)("x") == -1  # a fallback's error, caught further down
    tries = 0

    class Retry(Block[str, int]):  # catches, asks again, and catches again
        def _build(self, text: str) -> Build[int]:
            nonlocal tries
            for attempt in [text, text + "0", "5"]:
                tries += 1
                try:
                    return (yield from call(InputTransform(parse), attempt))
                except ValueError:
                    continue
            raise AssertionError("unreachable")

    assert Retry().batch(["1", "y"]) == [1, 5] and tries == 4
    declared = ForwardDeclaration[Any, Any]()  # caught through a route, deep on the stack
    declared.resolve_to(
        OneOf(lambda t: isinstance(t, tuple), {True: InputTransform[Any, Any](lambda t: t[0]) >> declared, False: safe})
    )
    deep: Any = "x"
    for _ in range(3 * sys.getrecursionlimit()):
        deep = (deep,)
    assert declared.batch([deep, ("4",)]) == [-1, 4]


@pytest.mark.parametrize("depth", [None, 0])
def test_an_error_no_build_catches_is_raised_as_it_was(depth: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its type, the runner's note and the user's line are kept, and the
    builds it went through add no frames (a deep input's would be many)."""
    from monadl.fold import _run

    if depth is not None:
        monkeypatch.setattr(_run, "DEPTH", depth)
    parsed = Map(Try(InputTransform(parse), InputTransform(len) >> InputTransform(lambda n: 1 / (n - 1))))
    assert parsed(["12", "ab"]) == [12, 1.0]
    with pytest.raises(ZeroDivisionError) as info:
        parsed(["1", "a"])
    assert info.value.__notes__ == [  # (where the fallback failed: Try's own step is its class)
        f"monadl.fold: while building the call's input (a list) with {parsed!r}, at input 0[1]<Try>: 'a' (a str), "
        "given to InputTransform(len) >> InputTransform(<lambda>)"
    ]
    assert isinstance(info.value.__context__, ValueError)  # raised while the build handled parse's error
    nested = ForwardDeclaration[Any, Any]()
    each = OneOf(lambda t: isinstance(t, list), {True: nested, False: InputTransform(parse)})
    nested.resolve_to(Map(each))
    for levels in (10, 3 * sys.getrecursionlimit()):
        deep: Any = ["x"]
        for _ in range(levels):
            deep = [deep]
        with pytest.raises(ValueError, match="invalid literal") as caught:
            nested(deep)
        frames = traceback.extract_tb(caught.value.__traceback__)
        assert (
            frames[-1].name == "parse"
            and frames[-1].line == "return int(text)  # the user's line an uncaught error names"
        )
        assert len(frames) < 60  # (as many as the nested calls: never one a level of the input)
        case = "<case False of OneOf>"  # (the innermost OneOf's, the step of the path it adds)
        path = "[0]" * (levels + 1) if levels < 20 else "[0]" * 10 + f"...{levels - 18:,} more..." + "[0]" * 9
        assert caught.value.__notes__ == [
            f"monadl.fold: while building the call's input (a list) with {nested!r}, at input 0{path}{case}: "
            "'x' (a str), given to InputTransform(parse)"  # (the case the OneOf gave the bad element to)
        ]
    with pytest.raises(StopIteration):  # not thrown into the builds: a generator would make it a RuntimeError
        Map(InputTransform[Any, Any](next))([iter([1]), iter([])])


# ---- error messages -----------------------------------------------------------------------------------
def letters(word: str) -> Any:  # (typed Any: mypy rejects a key function that gives an unhashable type)
    return list(word)


def test_a_one_of_key_that_is_unhashable_is_one_clear_error() -> None:
    block = OneOf[str, int](letters, {("a",): InputTransform(len)})
    with pytest.raises(
        TypeError,
        match=r"^OneOf\(letters, \{\('a',\): InputTransform\(len\)\}\): .*\['a'\], a list, which is unhashable",
    ) as info:
        block("a")
    assert info.value.__suppress_context__  # one error, not the lookup's TypeError twice, chained
    with pytest.raises(TypeError, match=r"\['a'\], a list, which is unhashable"):
        evaluate(block, "a")  # (the explicit stack's route)


def test_a_record_given_a_mapping_without_a_key_names_the_block_and_the_key() -> None:
    record = Record({"a": Scalar(), "b": Scalar(), "c": Scalar()})
    with pytest.raises(
        KeyError, match=r"Record\(\{'a': Scalar\('float32'\), .*\}\) was given a dict without the keys 'a', 'c' \(its "
    ) as info:
        record({"b": 1.0})
    assert str(info.value).endswith("(its keys: ['b'])\"") and info.value.__suppress_context__
    with pytest.raises(KeyError, match=r"without the key 'a' \("):
        record({"b": 1.0, "c": 2.0})


def test_constant_rows_are_built_at_the_line_that_made_their_block() -> None:
    """`Scalar`, `Vector` and `Zeros` walked the runner's frames (26 a row on
    average in a new user's JSON trees, a quarter of the build) to find the
    user's line for every row; they find it once, where the block is made,
    as `Function` does."""
    from monadl.layers._site import site_text

    blocks: list[Any] = [Scalar(), Vector(2), Zeros((2,))]  # BLOCKS-MADE
    with open(__file__) as source:
        made = next(i for i, text in enumerate(source, 1) if "BLOCKS-MADE" in text and "next(" not in text)
    for block, x in zip(blocks, [1.0, [1.0, 2.0], None]):
        assert site_text(block(x)._site).endswith(f"test_blocks.py:{made}")


def test_a_batch_leaves_no_cycle_to_collect() -> None:
    # A runner's closures held the runner: a cycle a batch, 13 MB of them in a soak test until the
    # collector (whose threshold monadl raises) came round. (A failed batch's error holds its frames,
    # as any traceback does: freed with it, or by a collection where its frames hold it.)
    import gc

    from monadl.fold._run import _Runner

    block = Map(Vector(2, "float64"))
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            block.batch([[[1.0, 2.0]], [[3.0, 4.0]]])
        alive = sum(type(o) is _Runner for o in gc.get_objects())
    finally:
        gc.enable()
    assert alive == 0


def test_a_recursive_batch_leaves_no_cycle_to_collect() -> None:
    # A recursive route's table of closures holds the route itself (a tree's node, through its
    # children's), and with it the batch's loom and its calls' operands: 8,400 objects a Tree-LSTM batch
    # of 32 trees left to the collector, whose pass came every tenth step and took 40 ms.
    import gc

    from monadl.fold._loom import Loom
    from monadl.fold._run import _Runner

    w = ml.Weight(np.eye(2))
    tree = ForwardDeclaration[Any, ml.ArrayLayer]()
    leaf = InputTransform[Any, ml.Array](lambda t: np.array([float(t), 1.0])) >> Function[ml.Array, ml.ArrayLayer](
        ml.tanh
    )
    pair = AllOf(InputTransform[Any, Any](lambda t: t[0]) >> tree, InputTransform[Any, Any](lambda t: t[1]) >> tree)
    node = pair >> Function[tuple[ml.ArrayLayer, ml.ArrayLayer], ml.ArrayLayer](lambda ab: ml.tanh((ab[0] + ab[1]) @ w))
    tree.resolve_to(OneOf[Any, ml.ArrayLayer](lambda t: isinstance(t, tuple), {False: leaf, True: node}))
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            roots = tree.batch([(1, (2, 3)), ((4, 5), 6)])
        alive = sum(type(o) in (_Runner, Loom) for o in gc.get_objects())
    finally:
        gc.enable()
    assert alive == 0
    np.testing.assert_allclose(
        anyio.run(roots[1].predict), np.tanh(np.tanh(np.tanh([4.0, 1.0]) + np.tanh([5.0, 1.0])) + np.tanh([6.0, 1.0]))
    )
