"""The block type and its kinds: composition, routes (forward declarations,
`OneOf`), parallel blocks (`AllOf`), immediate blocks, and blocks that build.

A block is a description, like a layer: applying it to a Python input builds
monadl layers (it computes nothing). Each block says how to build its output
as a generator, `Block._build`: it ``yield``s a request ``(block, input)``
whenever it needs a sub-block's output, and receives that output back. Most
blocks are of a kind the runner (`monadl.fold._run`) knows, named by the class
attribute ``_kind``, and run without a generator: that is where the time of
building a Fold model per node goes.
"""

from __future__ import annotations

import reprlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Hashable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Final, Generic, TypeVar, cast, final

import numpy as np

from monadl.fold._inputs import shown, unordered
from monadl.fold._kinds import BUILD, COMPOSITION, IMMEDIATE, PARALLEL, ROUTE
from monadl.fold._run import run
from monadl.layers._site import caller_site

if TYPE_CHECKING:
    from monadl.layers._operation import Operation

X = TypeVar("X")
Y = TypeVar("Y")
Z = TypeVar("Z")
In = TypeVar("In", contravariant=True)
Out = TypeVar("Out", covariant=True)

Request = tuple["Block[Any, Any]", Any]
"""A sub-block and the input to apply it to."""
Build = Generator[Request, Any, Y]
"""How a block builds its output of type ``Y``: a generator of requests that
is sent each request's output and returns the block's output."""


class Block(ABC, Generic[In, Out]):
    """A typed function from Python inputs ``In`` to layers ``Out`` (a layer, a
    tuple or list of layers, any structure of them), as in TF Fold (Looks et
    al. 2017, section 3).

    Blocks compose with ``>>``: ``a >> b`` feeds ``a``'s output to ``b``,
    and mypy rejects it unless ``a``'s output type is ``b``'s input type.
    ``block(x)`` builds the layers of one input; ``block.batch(xs)`` those of
    many, in one graph, so the runtime's dynamic batching groups equal
    operations across the inputs.

    >>> import anyio, monadl as ml
    >>> from monadl.fold import Function, Scalar
    >>> double = Scalar("float64") >> Function(lambda x: 2.0 * x)
    >>> anyio.run(double(1.5).predict)
    array([3.])
    """

    __slots__ = ("__weakref__",)  # (a batch's error names its block: `monadl.layers._batch_site`)
    _kind: ClassVar[str] = BUILD  # how the runner runs it (`monadl.fold._run`)
    _shown: ClassVar[tuple[str, ...] | None] = None
    """The attributes its repr shows, as its constructor takes them (``*``: a
    tuple spread as arguments); None: not known (``MyBlock(...)``)."""

    @abstractmethod
    def _build(self, x: In) -> Build[Out]:
        """Build the output of one input, yielding a request per sub-block output."""

    def _step(self, build: Mapping[str, Any]) -> str:
        """Where an error's path goes through this block: the part of its
        input its build was at (``[2]``, ``['children']``), read from the
        build's live variables ``build`` (its ``_build``'s names, beside it),
        and only on an error's way out; empty where the block passes its
        input on whole. A block of one's own is shown by its class."""
        return f"<{type(self).__name__}>"

    @final
    def __repr__(self) -> str:
        """Its constructor's call, short: a declaration by its name, never its
        block (so a recursive block prints finitely), nesting and long
        argument lists cut with ``...``.

        >>> from monadl.fold import InputTransform, Map
        >>> Map(InputTransform(len) >> InputTransform(str))
        Map(InputTransform(len) >> InputTransform(str))
        """
        return describe(self, LEVELS)

    @final
    def __call__(self, x: In) -> Out:
        """The output built for one input.

        >>> from monadl.fold import InputTransform
        >>> InputTransform(len)("abc")
        3
        """
        return run(self, [x], batch=False)[0]

    @final
    def batch(self, xs: Iterable[In]) -> list[Out]:
        """The outputs of many inputs: one graph, whose equal operations the
        runtime's dynamic batching groups across the inputs.

        >>> from monadl.fold import InputTransform
        >>> InputTransform(len).batch(["a", "bc"])
        [1, 2]
        """
        why = unordered(xs)  # (as `Map` refuses them)
        if why is not None:
            raise TypeError(f"{self!r}.batch takes a sequence of inputs, and was given {shown(xs)}, {why}")
        return run(self, xs, site=caller_site())

    @final
    def __rshift__(self, other: Block[Out, Z]) -> Block[In, Z]:
        """Composition: this block's output is ``other``'s input.

        >>> from monadl.fold import InputTransform
        >>> (InputTransform(str.split) >> InputTransform(len))("a b c")
        3
        """
        return Composition(self, other)


LEVELS: Final = 3
"""How deep a block's repr spells out the blocks inside it; one level further
each shows only its arguments that are no blocks (``Map(...)``,
``Scalar('float32')``), and deeper ones are ``...``."""
WIDTH: Final = 6
"""Arguments, cases and composed blocks that a repr shows of one block."""


def describe(block: Block[Any, Any], levels: int) -> str:
    """``repr(block)`` with the blocks inside it spelt out ``levels`` deep (see `LEVELS`)."""
    if type(block) is Composition:  # ``a >> b >> c``: the chain, flat (iteratively: it may be long)
        stages: list[Block[Any, Any]] = []
        pending: list[Block[Any, Any]] = [block]
        while pending and len(stages) <= WIDTH:
            b = pending.pop()
            if type(b) is Composition:
                pending += (b.second, b.first)
            else:
                stages.append(b)
        shown = [describe(b, levels - 1) if levels >= 0 else "..." for b in stages[:WIDTH]]
        return " >> ".join(shown + ["..."] * (len(stages) > WIDTH))
    if type(block) is ForwardDeclaration:
        return f"ForwardDeclaration({block.name!r})" if block.name else f"ForwardDeclaration({id(block):#x})"
    if block._shown is None:
        return f"{type(block).__name__}(...)"
    parts: list[str] = []
    for name in block._shown:
        value = getattr(block, name.lstrip("*"))
        for v in value if name.startswith("*") else (value,):
            parts.append(_argument(v, levels))
    if len(parts) > WIDTH:
        parts[WIDTH:] = ["..."]
    return f"{type(block).__name__}({', '.join(parts)})"


def _argument(value: Any, levels: int) -> str:
    if isinstance(value, Block):
        return describe(value, levels - 1) if levels >= 0 else "..."
    if isinstance(value, Mapping):  # `OneOf`'s cases, `Record`'s fields
        items = [f"{reprlib.repr(k)}: {_argument(v, levels)}" for k, v in list(value.items())[: WIDTH + 1]]
        if len(items) > WIDTH:
            items[WIDTH:] = ["..."]
        return "{" + ", ".join(items) + "}"
    if isinstance(value, np.dtype):
        return repr(value.name)
    if callable(value):
        return _function_name(value)
    return reprlib.repr(value)


def _function_name(f: Callable[..., Any]) -> str:
    """A function's name as written where it was defined: through an
    operation (`Function`'s) and partials, to the function itself."""
    f = getattr(f, "__wrapped__", f)
    while isinstance(f, partial):
        f = f.func
    name = getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or type(f).__name__
    return str(name).rsplit("<locals>.", 1)[-1]


class Immediate(Block[In, Out]):
    """A block that needs no sub-block: its output straight from its input
    (`Immediate._output`). The evaluator calls it without a build of its own
    (a generator, and the exception that ends it: most of a Fold model's
    building time, per node, before this)."""

    __slots__ = ()
    _kind: ClassVar[str] = IMMEDIATE
    # A `Function`'s operation, whose calls a batch's loom records (`monadl.fold._loom`); None: others.
    _cell: Operation[Any, Any] | None = None

    @abstractmethod
    def _output(self, x: In) -> Out:
        """The output of one input."""

    def _function(self) -> Callable[[In], Out]:
        """``_output`` as the runner calls it (a block that wraps a function: the function, a call less a node)."""
        return self._output

    @final
    def _build(self, x: In) -> Build[Out]:
        return _done(self._output(x))


def _done(y: Y) -> Build[Y]:
    """The build of a block that requests nothing."""
    yield from ()
    return y


def call(block: Block[X, Y], x: X) -> Build[Y]:
    """Inside a `Block._build`: ``y = yield from call(block, x)`` asks the
    evaluator for ``block``'s output on ``x``, typed as ``block``'s output.
    An error of ``block`` is raised there, as a function's error is where
    it is called: a build may catch it (below), and what it does not catch
    goes on to the block that applied it, with the traceback it had. Only
    an `Exception` is thrown in: a `StopIteration` goes straight on (thrown
    into a generator, it would turn into a `RuntimeError`), and so do
    `KeyboardInterrupt` and `SystemExit`, the pending builds closed after.

    >>> from monadl.fold import InputTransform
    >>> list(call(InputTransform(len), "ab"))[0][1]  # the request it yields
    'ab'
    >>> class Parsed(Block[str, int]):  # a number, or -1 where the text is none
    ...     def _build(self, text: str) -> Build[int]:
    ...         try:
    ...             return (yield from call(InputTransform(int), text))
    ...         except ValueError:
    ...             return -1
    >>> Parsed().batch(["12", "x"])
    [12, -1]
    """
    y: Y = yield (block, x)
    return y


class Route(Block[In, Out]):
    """A block that applies another block, chosen from the input
    (`Route._route`), to the same input: a forward declaration, `OneOf`. The
    evaluator follows the route without a build of its own."""

    __slots__ = ()
    _kind: ClassVar[str] = ROUTE
    _declares: ClassVar[bool] = False
    """A forward declaration: where a block may reach itself, so the runner
    refuses to apply it to an input object it is already building."""
    _cases: ClassVar[bool] = False
    """A `OneOf`: an error's path names the case its input took (`_taken`)."""

    @abstractmethod
    def _route(self, x: In) -> Block[In, Out]:
        """The block to apply to ``x``."""

    def _fixed(self) -> Block[In, Out] | None:
        """The block applied to every input, where that is known now (a
        resolved declaration): the runner then calls it directly."""
        return None

    def _keyed(self) -> tuple[Callable[[In], Hashable], Callable[[Hashable, In], Block[In, Out]]] | None:
        """Where the block chosen depends on one value of the input (`OneOf`'s
        key): that value's function, and the block of each value, given the
        value and the input (raising for a value with none, the input named).
        The runner then keeps a closure per value."""
        return None

    @final
    def _build(self, x: In) -> Build[Out]:
        y: Out = yield from call(self._route(x), x)
        return y

    @final
    def _step(self, build: Mapping[str, Any]) -> str:
        return ""

    def _taken(self, chosen: Block[In, Out] | None) -> str:
        """The step of an error's path through this route that took ``chosen``: none (a `OneOf`'s names its case)."""
        return ""


class Parallel(Block[In, Out]):
    """Blocks applied to the same input, their outputs as a tuple (`AllOf`).
    The evaluator runs them without a build of its own (a generator per node
    of a tree, and one per block it calls, cost more than the rest of it).
    ``blocks``: the blocks, in order (a subclass's slot)."""

    __slots__ = ()
    _kind: ClassVar[str] = PARALLEL
    blocks: tuple[Block[In, Any], ...]

    @final
    def _build(self, x: In) -> Build[Out]:
        ys = []
        for block in self.blocks:
            ys.append((yield from call(block, x)))
        return cast(Out, tuple(ys))  # (the subclass's constructor types the tuple per block)

    @final
    def _step(self, build: Mapping[str, Any]) -> str:
        return f"<block {len(build['ys'])} of AllOf>"


@final
class Composition(Block[X, Z]):
    """``first >> second`` (what ``>>`` builds).

    >>> from monadl.fold import InputTransform
    >>> Composition(InputTransform(abs), InputTransform(str))(-3)
    '3'
    """

    __slots__ = ("first", "second")
    _kind: ClassVar[str] = COMPOSITION

    def __init__(self, first: Block[X, Y], second: Block[Y, Z]) -> None:
        self.first = first
        self.second = second

    def _build(self, x: X) -> Build[Z]:
        y = yield from call(self.first, x)
        z = yield from call(self.second, y)
        return z

    def _step(self, build: Mapping[str, Any]) -> str:
        return ""


@final
class ForwardDeclaration(Route[X, Y]):
    """A block to be defined later, so that a block may use itself (recursion
    over trees): declare it, use it inside the definition, then
    ``resolve_to`` the definition. Deep recursion is safe: the evaluator
    keeps the pending builds on its own stack, not Python's.

    A declaration applied to an input object that it is already building
    (the same object, further down the same input: an input that contains
    itself, or a case that applies its declaration to its own input) raises
    `RecursionError` at once, where the explicit stack has taken over (past
    `monadl.fold._run.DEPTH` levels): blocks are functions of their input,
    so that recursion would never end. A recursion whose progress the
    input's identity does not show (a random key on the same input, a token
    stream consumed in place) is refused there too: pass each level a new
    object (the stream and a count, say).

    Args:
        name: what its repr, and so an error, calls it (by default its id):
            a declaration is never printed as its block, which uses it.

    It passes ``mypy --strict`` as it is (the lambdas' types named):

    >>> from monadl.fold import InputTransform, OneOf
    >>> Nested = tuple[Any, ...] | None
    >>> depth = ForwardDeclaration[Nested, int]()
    >>> inner = InputTransform[Nested, Nested](lambda t: t[0] if t is not None else None)
    >>> one_more = inner >> depth >> InputTransform[int, int](lambda d: d + 1)
    >>> depth.resolve_to(OneOf(lambda t: t is None, {True: InputTransform[Nested, int](lambda t: 0), False: one_more}))
    >>> nested: Nested = None
    >>> for _ in range(5000):
    ...     nested = (nested,)
    >>> depth(nested)
    5000
    """

    __slots__ = ("_target", "name")
    _declares: ClassVar[bool] = True

    def __init__(self, name: str | None = None) -> None:
        self._target: Block[X, Y] | None = None
        self.name = name

    def resolve_to(self, block: Block[X, Y]) -> None:
        """Define the declared block (once). A declaration resolved to itself,
        or to a declaration that reaches it, is refused: it would apply itself
        to the same input for ever.

        >>> from monadl.fold import InputTransform
        >>> length = ForwardDeclaration[str, int]()
        >>> length.resolve_to(InputTransform(len))
        >>> length("abc")
        3
        """
        if self._target is not None:
            raise ValueError(f"{self!r}.resolve_to: already resolved")
        target: Block[X, Y] | None = block
        while type(target) is ForwardDeclaration:  # (a chain of declarations ends: each was checked so)
            if target is self:
                through = "" if block is self else f" (through {block!r})"
                raise ValueError(
                    f"{self!r}.resolve_to: resolved to itself{through}, it would apply itself to the same input "
                    "for ever; resolve it to a block that uses it on a part of the input"
                )
            target = target._target
        self._target = block

    def _route(self, x: X) -> Block[X, Y]:
        if self._target is None:
            raise ValueError(f"{self!r} was applied before resolve_to defined it")
        return self._target

    def _fixed(self) -> Block[X, Y] | None:
        return self._target
