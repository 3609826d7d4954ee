"""Typed blocks in the style of TF Fold (Looks et al. 2017, section 3): a
typed language for the graphs of dynamic networks, built over monadl layers.

A `Block[In, Out]` turns a Python input (a tree, a sequence, a record) into
layers. ``a >> b`` composes blocks, and mypy rejects it unless ``a``'s output
type is ``b``'s input type. `Scalar`, `Vector` and `Zeros` make constant
rows; `Function` applies a function over layers (a cell using weights);
`InputTransform` pre-processes plain data; `Identity` passes its input on
(an RNN step's state, in a `Record`); `Map`, `Fold` (left, an RNN) and
`Reduce` (balanced, depth log n) run over sequences; `OneOf` dispatches on
the input, `Optional` maps None to a default, `AllOf` and `Record` make
tuples; `ForwardDeclaration` lets a block use itself (recursion over trees).

mypy reads a block's types from the function it wraps: give `Function` and
`InputTransform` a ``def`` with annotations, or name the types of a lambda
(``InputTransform[Node, int](lambda n: n.symbol)``), since mypy does not
infer a lambda's parameter from the ``>>`` that follows it.

``block(x)`` builds one input's layers, an ordinary monadl graph whose equal
operations the runtime's dynamic batching (``ml.settings(batching=...)``)
groups; ``block.batch(xs)`` builds many inputs' as TF Fold's loom does
(`monadl.fold._loom`): the calls of its `Function` blocks are recorded, not
built as nodes, and run as one node of the graph that computes them per
depth and function as one batched call each (forward and backward), with
the values, gradients, steps and errors of the same calls built one input at
a time; ``await loss.train()`` trains it as any graph. (Batching off, or
``check_finite`` on: the calls run one by one; a call whose arguments are
not the batch's own outputs and data, a float say, is built as a node.)
Blocks run as nested Python
calls, compiled once per ``batch``; past a depth of recursion (32 routes
and builds open) the rest of an input runs on an explicit stack (each block is a
generator of requests for its sub-blocks' outputs), so recursion as deep as
the input never reaches Python's recursion limit; a recursion that makes no
progress (a declaration resolved to itself, a case that applies its own
declaration to the same input, an input that contains itself) raises
`RecursionError`, as Python's would: on the explicit stack at once where a
declaration meets the same input object it is already building (see
`ForwardDeclaration`), else at a million levels.

A block of one's own subclasses `Block` and writes ``_build``, a generator
typed `Build` of its output that asks for a sub-block's output with
``y = yield from call(block, x)``; a sub-block's error is raised there, so
the build may catch it.

`Scalar`, `Vector` and `Zeros` make float32 rows unless given a dtype
(``Vector(2, "float64")`` beside float64 weights: an operation's operands
share one float dtype).

The example below passes ``mypy --strict`` as it is (its lambdas' types named):

>>> import anyio, numpy as np, monadl as ml
>>> from monadl.fold import Function, Map, Reduce, Vector
>>> w = ml.Weight(np.ones((2, 2)))
>>> Pair = tuple[ml.ArrayLayer, ml.ArrayLayer]
>>> encode = Map(Vector(2, "float64") >> Function[ml.ArrayLayer, ml.ArrayLayer](lambda v: ml.tanh(v @ w)))
>>> total = encode >> Reduce(Function[Pair, ml.ArrayLayer](lambda ab: ab[0] + ab[1]))
>>> round(float(anyio.run(ml.sum(total([[0.0, 0.0], [1.0, -1.0], [0.5, 0.5]])).predict)), 6)
1.523188

A tree whose nodes have any number of children (an n-ary Tree-LSTM's
shape): `AllOf` pairs the children's outputs (`Map` over them, recursively)
with the node's own input, and a leaf maps no children:

>>> from monadl.fold import AllOf, ForwardDeclaration, InputTransform
>>> Node = tuple[list[float], list["Node"]]  # a node's features, its children
>>> def children(n: Node) -> list[Node]:
...     return n[1]
>>> def features(n: Node) -> list[float]:
...     return n[0]
>>> def combine(kids_and_x: tuple[list[ml.ArrayLayer], ml.ArrayLayer]) -> ml.ArrayLayer:
...     kids, x = kids_and_x
...     return ml.tanh(sum(kids, start=x) @ w)  # (a leaf: x alone)
>>> node = ForwardDeclaration[Node, ml.ArrayLayer]()
>>> both = AllOf(InputTransform(children) >> Map(node), InputTransform(features) >> Vector(2, "float64"))
>>> node.resolve_to(both >> Function(combine))
>>> tree = ([1.0, 0.0], [([0.0, 1.0], []), ([0.5, 0.5], []), ([1.0, 1.0], [([0.0, -1.0], [])])])
>>> round(float(anyio.run(ml.sum(node(tree)).predict)), 6)
1.999793
"""

from monadl.fold._block import Block, Build, Composition, ForwardDeclaration, call
from monadl.fold._blocks import Fold, Function, Identity, InputTransform, Map, Reduce, Scalar, Vector, Zeros
from monadl.fold._structure import AllOf, OneOf, Optional, Record

__all__ = [
    "AllOf",
    "Block",
    "Build",
    "Composition",
    "Fold",
    "ForwardDeclaration",
    "Function",
    "Identity",
    "InputTransform",
    "Map",
    "OneOf",
    "Optional",
    "Record",
    "Reduce",
    "Scalar",
    "Vector",
    "Zeros",
    "call",
]
