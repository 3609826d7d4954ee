"""The cost rule of dynamic batching. Per graph: whether a graph goes to the
batching scheduler (`monadl.runtime.schedule.batched`) at all, decided by
cheap checks only, before any signature is computed. Per group: the sizes
from which a group pays (`MIN_GROUP`). What it decides is logged by
`monadl.runtime.schedule.batched_log`.

A graph that is a chain (each node uses the one before: nothing is ever ready
with anything else) or smaller than `MIN_NODES` runs as before (unless it is a
merge of `MIN_ALIKE` fibers' graphs alike); a marked operation's node counts
as the steps of its program (`ops`). A graph (by the line that built
its last node, and its size) found not worth it, here or by the scheduler
(whose analysis batched nothing), is not analysed again for `REPROBE`
evaluations (a chain), or for 1, 2, 4, ... of them, doubling each time its
analysis batches nothing again (`remember`): the check costs one lookup.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any, Final

from monadl.layers._layer import Layer
from monadl.layers._program import Program
from monadl.layers._weight import Weight
from monadl.runtime.schedule.batched_log import FORCES, unbatched
from monadl.runtime.settings import current_settings

if TYPE_CHECKING:
    from monadl.layers._site import Site
    from monadl.runtime.evaluation import Evaluation

__all__ = [
    "ALONE",
    "ALONE_WHY",
    "BATCHED_SHARE",
    "CHAIN",
    "FACTORED",
    "MAX_MEMBER_SIZE",
    "MIN_ALIKE",
    "MIN_FACTORED",
    "MIN_GROUP",
    "MIN_LARGE",
    "MIN_NODES",
    "MIN_PACKED",
    "MIN_SHARED",
    "NOTHING_PAID",
    "PACKED_WEIGHT",
    "PACKED_WORK",
    "PAID_LITTLE",
    "REPROBE",
    "WEIGHT_READERS",
    "coarse",
    "large",
    "ops",
    "packs",
    "paid",
    "reads_large",
    "remember",
    "saves_kernels",
    "worth_batching",
]

MIN_NODES: Final = 256
"""Automatic mode leaves smaller graphs alone: what batching could save there
(a few microseconds a node) is about what analysing and stacking cost (the
columns benchmark, 30-200 nodes of coarse matrix products, ran 8-10% slower
batched with a limit of 16)."""

MIN_ALIKE: Final = 2
"""A merge of fibers' graphs with this many alike (built at one line, with as
many nodes: the same step of the same model) is analysed below `MIN_NODES`:
each of their operations has that many members of one signature."""


def worth_batching(ev: Evaluation, order: list[Any], alike: int = 1) -> bool:
    """Whether to run ``order`` through the batching scheduler: cheap checks
    only, none that computes a signature.

    ``alike``: for a merge of several fibers' graphs
    (`monadl.runtime.schedule.fibers`), how many of them were built at one
    line with as many nodes; from `MIN_ALIKE` on, their equal signatures pay
    however small the graphs.

    >>> import monadl as ml
    >>> from monadl.runtime.evaluation import Evaluation
    >>> x = ml.Weight(1.0)
    >>> chain = [x * 2.0]
    >>> for _ in range(300):
    ...     chain.append(chain[-1] + 1.0)
    >>> worth_batching(Evaluation(train=True), chain)
    False
    """
    forced = current_settings().batching
    if forced is False or ev.check_finite or len(order) < 2:
        return False
    if forced:
        return True
    key = (order[-1]._site, len(order))
    if len(order) < MIN_NODES and alike < MIN_ALIKE and _small(key, order):
        why = (
            f"fewer than {MIN_NODES} nodes (MIN_NODES), a marked operation's counted as its ops, and fewer than "
            f"{MIN_LARGE} (MIN_LARGE) reading a weight of {MIN_SHARED:,} elements or more"
        )
        unbatched(order, why)
        return False
    verdict = _verdicts.get(key)
    if verdict is not None and verdict[1] % verdict[3]:
        _verdicts[key] = (verdict[0], verdict[1] + 1, verdict[2], verdict[3])
        if not verdict[0]:
            unbatched(order, f"{verdict[2]}, as when it was last judged", _advice(verdict[2]))
        return verdict[0]
    worth = not _is_chain(order)
    remember(key, worth, CHAIN)
    if not worth:
        unbatched(order, CHAIN, _advice(CHAIN))
    return worth


CHAIN: Final = "a chain (each node uses the one before: nothing to group)"
NOTHING_PAID: Final = "its analysis batched nothing (no group of one signature ready together that pays)"
PAID_LITTLE: Final = "its analysis batched too little of it to pay (BATCHED_SHARE)"

BATCHED_SHARE: Final = 3
"""A graph whose groups ran fewer than one in this many of its nodes is
analysed again as one that batched nothing (`PAID_LITTLE`), unless one of
its groups saves more than its members' dispatch (`saves_kernels`): the
analysis costs every node about 2 us (its depth, its signature, its
group's lookup), and a member of a group of small products saves about 4
us. A new user's RNN of 3,000 steps, whose every step's input product
(``xs[t] @ V``, 16 x 128 by 128 x 128) ran in one group beside the
recurrence (one node in five), ran 5-18% slower than node by node; 1,000
steps of ``tanh(h @ U + b + xs[t] @ V)`` with H = 16 to 256 and 4 or 16
rows, 4-23%; with two input products a step (two in seven), up to 31%;
with four (four in nine), -8% to 24% (`benchmarks/cost_rule.py`)."""


def _advice(why: str) -> str:
    """What the log adds to a graph left unbatched: ``batching=True`` only
    where forcing may batch something (a chain has nothing to group)."""
    return "" if why == CHAIN else FORCES


def ops(order: list[Any]) -> int:
    """The ops ``order`` runs: a node each, a marked operation's node as
    many as its program's steps (32 calls of a 12-op attention cell are 384
    ops, and batched ran 3.7x faster than node by node). Read only for graphs
    below `MIN_NODES`: one pass over at most that many nodes.

    >>> import numpy as np, monadl as ml
    >>> cell = ml.operation(lambda x: ml.tanh(x * 2.0) + 1.0)
    >>> ops([cell(ml.Weight(np.ones(2)))])
    3
    """
    count = len(order)
    for node in order:
        op = node._op
        if op is not None and type(op.rule) is Program:
            count += len(op.rule.steps) - 1
    return count


MIN_LARGE: Final = 8
"""A graph below `MIN_NODES` is analysed all the same where this many of its
nodes read a weight of `MIN_SHARED` elements or more (`large`): each such
product costs far more than a node's dispatch (a new user's 10 sequences
through a marked RNN cell of 512 x 512 weights, 87 nodes: 2.2x faster
batched; 16 examples of a 2-layer MLP at 512, 82 nodes: 1.5x). One that
groups nothing is analysed again less and less often (`remember`)."""


def _small(key: tuple[Site, int], order: list[Any]) -> bool:
    """Whether a graph below `MIN_NODES` is left as it is: fewer than
    `MIN_NODES` ops and than `MIN_LARGE` nodes reading a large weight; found
    once in `REPROBE` evaluations per line and count of nodes (two passes
    over its nodes at every evaluation cost a small model's step 3-4%; the
    same code may build its graph over larger weights later)."""
    found = _smalls.get(key)
    if found is None or not found[1] % REPROBE:  # (found again now and then: other weights, the same code)
        if len(_smalls) >= _VERDICTS_LIMIT:
            _smalls.clear()
        small = ops(order) < MIN_NODES and large(order) < MIN_LARGE
        _smalls[key] = (small, 1)
        return small
    _smalls[key] = (found[0], found[1] + 1)
    return found[0]


def large(order: list[Any]) -> int:
    """How many nodes of ``order`` read a weight of `MIN_SHARED` elements or
    more (a product's, a lookup's, a marked operation's). Read only for
    graphs below `MIN_NODES`, and up to `MIN_LARGE` of them."""
    count = 0
    for node in order:
        op = node._op
        reads = op is not None and (op.name in WEIGHT_READERS or type(op.rule) is Program)
        if reads and any(_weight_of(x) is not None for x in node._inputs):
            count += 1
            if count >= MIN_LARGE:
                break
    return count


def _is_chain(order: list[Any]) -> bool:
    """Each node uses the one before: one node per depth, nothing to group."""
    previous = order[0]
    for node in order[1:]:
        for x in node._inputs:
            if x is previous:
                break
        else:
            return False
        previous = node
    return True


REPROBE: Final = 32
"""A graph found not worth batching is analysed again once in at most this
many evaluations: a chain's at once this many, one whose analysis batched
nothing after 1, 2, 4, ... evaluations, each time it batched nothing again
(a graph is known by its last line and its count of nodes: a model's ragged
batch, its examples of different lengths, batches nothing, and its next
batch of one length would otherwise run unbatched 31 times, 2.1x slower in a
new user's trial)."""

_VERDICTS_LIMIT: Final = 4096
_verdicts: dict[
    tuple[Site, int], tuple[bool, int, str, int]
] = {}  # (last site, nodes) -> (worth it, evaluations since, why, evaluations until it is analysed again)
_smalls: dict[tuple[Site, int], tuple[bool, int]] = {}  # (last site, nodes) -> (left alone below MIN_NODES, uses)
_unpaid: dict[tuple[Site, int], int] = {}  # (last site, nodes) -> the wait after its last analysis that batched nothing


def remember(key: tuple[Site, int], worth: bool, why: str) -> int:
    """The verdict on a graph built at the same line with as many nodes, for
    the next evaluations (models rebuild the same graph every step), and why
    (`CHAIN`, `NOTHING_PAID`), for the log; returns how many evaluations
    until it is analysed again."""
    if len(_verdicts) >= _VERDICTS_LIMIT:
        _verdicts.clear()
        _unpaid.clear()
    period = REPROBE
    if why != CHAIN:  # (the first time: the next evaluation analyses it; each time again, twice as late)
        last = _unpaid.get(key)  # (one read: another thread may drop it meanwhile)
        period = _unpaid[key] = 1 if last is None else min(2 * last, REPROBE)
    _verdicts[key] = (worth, 1, why, period)
    return period


def paid(key: tuple[Site, int]) -> None:
    """A graph's analysis batched something: a later one that batches
    nothing is analysed again at the next evaluation."""
    _unpaid.pop(key, None)


# ---- per group ---------------------------------------------------------------------------------
MIN_GROUP: Final = 8
"""The smallest group of one signature that pays, of any primitive (a
marked operation's group: from 2 to 4, `marked_minimum`). Measured
(`OPENBLAS_NUM_THREADS=1`) on this project's VM: a group costs about 40 us
of stacking, splitting and gathering over its members' own work (forward
and backward: 4 to 16 examples of ``tanh(h @ W)``, W of 4 x 4), and a member
about 6 us against 11 us alone, so that from about 8 members a group pays
where its kernel saves nothing. Groups of 2 to 4 products by a weight of 32
x 32 to 256 x 256 ran 0.66-0.97x node by node's speed when they paid from 2
(a new user's attention over examples of different lengths: 0.6x); groups
of 8 ran 1.14-1.39x. Products and lookups by a weight of `MIN_SHARED`
elements or more paid from 4 until the thirty-second session (a group
replaced a weight-sized outer product per member by one product), though
one product's delta to a weight of 64K elements or more had been kept as
factors since (`monadl.layers._products.outer_rule`): 4 to 7 examples of
``tanh(h @ W)`` through one weight of 256 x 256 or 512 x 512 then ran
0.91-1.55x node by node's time (from 1.19x in float32), and with 8 as the
minimum 0.97-1.03x; through 128 x 128 (no factors) 0.72-1.14x, and
0.99-1.04x. Where each member multiplies 2 rows or more, a group packs
the weight once for all (`packs`, `MIN_PACKED`): 128 examples of 1 to 32
rows in groups of 4 or 6 of one row count through 512 x 512 ran 1.11x and
1.17x faster than node by node (0.96-0.99x with 8 as the minimum), and
0.97-1.03x through 128 x 128 and 256 x 256 (`benchmarks/small_groups.py`).
In the merged runs of fibers (across control flow), products and lookups
by a weight of `MIN_SHARED` elements or more still pay from 4
(`reads_large`): there a group's delta to its weight is kept as factors,
where a product alone below 64K elements makes a weight-sized one; the
gated network and the parser at batch 32 ran within 1-4% of the rule
before so, and in direct style 0-12% slower with 8 for all (two runs)."""


MIN_PACKED: Final = 4
"""The smallest group that pays of products whose members each multiply 2
rows or more by one large weight (`packs`)."""

PACKED_WEIGHT: Final = 1 << 18
"""Elements of a weight from which `packs` counts its products (512 x 512,
as measured; smaller weights' packs cost about what a group does)."""

PACKED_WORK: Final = 1 << 20
"""Multiply-adds of a member's product (its rows times the weight's
elements) from which a group of them pays from `MIN_PACKED`."""


def packs(node: Any, records: Any, where: dict[Any, Any]) -> bool:
    """Whether a group of ``node``'s signature pays from `MIN_PACKED`
    members: a product (``dense`` too) of 2 rows or more by a weight (or
    ``ml.as_layer(w)``, its transpose, a reshape) of `PACKED_WEIGHT`
    elements or more, `PACKED_WORK` multiply-adds or more. For each call of
    more than one row OpenBLAS packs the weight, so one call for the group
    saves a pack per member (NumPy's OpenBLAS, one thread, a forward product
    and its delta to the rows: 4 members of 4 rows times 512 x 512, float32
    0.30 ms, float64 0.36 ms; of 2 rows, -0.04 to 0.07 ms; 1 row a member,
    a gemv that packs nothing: none; 8 rows times 256 x 256, 0.03-0.11 ms,
    about a group's own cost). On a GPU a group saves its members' launches
    as well. Read for groups of `MIN_PACKED` to ``MIN_GROUP - 1`` members
    only; False where the rows' shape is not known without computing a
    member's value.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((512, 512)))
    >>> packs(np.ones((4, 512)) @ w, {}, {}), packs(np.ones((2, 512)) @ w, {}, {}), packs(np.ones((4, 512)) @ w.T, {}, {})
    (True, False, True)
    """
    inputs = node._inputs
    if node._op.name not in FACTORED or len(inputs) < 2:
        return False
    weight = _weight_of(inputs[1])
    if weight is None or weight.size < PACKED_WEIGHT:
        return False
    rows = _rows(inputs[0], records, where)
    return rows is not None and rows >= 2 and rows * int(weight.size) >= PACKED_WORK


def saves_kernels(node: Any, records: Any, where: dict[Any, Any]) -> bool:
    """Whether a group of ``node``'s signature that ran batched saves more
    than its members' dispatch, so that a graph that batched less than
    `BATCHED_SHARE` of its nodes pays all the same: a marked operation's
    (each member its program's steps), or a product (``dense`` too) by a
    weight of `MIN_SHARED` elements or more of one row a member (a gemv
    each, and a weight-sized outer product for its delta: 1,000 steps of an
    RNN whose input products alone batched, of one row by 128 x 128, ran
    0.8x node by node's time) or that packs its weight (`packs`).

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.ones((128, 128)))
    >>> saves_kernels(np.ones(128) @ w, {}, {}), saves_kernels(np.ones((4, 128)) @ w, {}, {})
    (True, False)
    """
    op = node._op
    if type(op.rule) is Program:
        return True
    inputs = node._inputs
    if op.name not in FACTORED or len(inputs) < 2 or _weight_of(inputs[1]) is None:
        return False
    rows = _rows(inputs[0], records, where)
    return rows == 1 or packs(node, records, where)


def _rows(x: Any, records: Any, where: dict[Any, Any]) -> int | None:
    """The rows a product's left operand ``x`` multiplies (1 for a vector),
    or None where its shape is not known without computing a member's value."""
    if type(x) is Layer:
        place = where.get(x)
        if place is None:  # (a node computed alone: its record holds its value)
            shape = getattr(records[x].value, "shape", None)
        else:  # (a member of an earlier group: its part of the signature, (kind, shape, dtype) for an array)
            part = place[2]
            shape = part[1] if len(part) == 3 and type(part[0]) is type and type(part[1]) is tuple else None
    else:
        shape = getattr(x, "shape", None)
    if shape is None or not shape:
        return None
    return prod(shape[:-1]) if len(shape) >= 2 else 1


def reads_large(node: Any) -> bool:
    """Whether ``node`` is a product or lookup that reads a weight of
    `MIN_SHARED` elements or more (as itself or a view of it)."""
    return node._op.name in WEIGHT_READERS and any(_weight_of(x) is not None for x in node._inputs)


WEIGHT_READERS: Final = frozenset({"matmul", "dense", "embedding"})
"""The primitives that read a weight (a product's matrix, a lookup's table)
`large` counts."""

MIN_SHARED: Final = 1 << 14
"""Elements of a weight from which a product or lookup that reads it counts
as large (`large`, `MIN_LARGE`)."""


_VIEWS: Final = frozenset({"as_layer", "transpose", "reshape"})


def _weight_of(x: Any) -> Weight[Any, Any] | None:
    """The large weight ``x`` is, or shows as a layer (``ml.as_layer(w)``,
    ``w.T``, a reshape of it), through a few such views; None for anything else."""
    for _ in range(3):
        if type(x) is Weight:
            return x if x.size >= MIN_SHARED else None  # (prod of the shape: a tensor's size is a method)
        op = getattr(x, "_op", None)
        if op is None or op.name not in _VIEWS:
            return None
        x = x._inputs[0]
    return None


MAX_MEMBER_SIZE: Final = 1 << 14
"""Automatic mode batches no group whose members' stacked operands exceed this
many elements each: a node that large costs far more than its dispatch, and
stacking would only copy it."""

MIN_FACTORED: Final = 1 << 16
"""Where weights' deltas are kept as factors (the merged runs of
`monadl.runtime.schedule.fibers`), a lone product by a weight of at least
this many elements runs as a group of one: its delta's rows join the other
groups' (one product when the weight is released) instead of a weight-sized
outer product and addition of its own; below, those cost less than a group."""

FACTORED: Final = frozenset({"matmul", "dense"})

ALONE: Final = frozenset({"split", "split_part"})
"""Run node by node here, though they have batching rules (which an
operation's program uses): a part's delta is a `SplitDelta`, its slot of the
input's delta, which a group's delta (gathered into arrays) would make a
whole array of zeros per part; grouped so, an unmarked Tree-LSTM-like graph
that cuts its gates with ``ml.split`` ran slower than with its splits one by
one (512 members, 5 parts, H = 256: 56.7 against 53.2 ms)."""

ALONE_WHY: Final = {
    "split": "a split outside a marked cell runs one by one (its parts' deltas are its slots); slices batch",
    "split_part": "a split's part outside a marked cell runs one by one; slices batch",
}
"""Why the groups of these primitives run node by node, for the log."""


def coarse(args: list[Any], batched: list[bool], n: int, elementwise: bool = False) -> bool:
    """Whether a member's operands are large enough that its own kernel costs
    far more than the runtime's per-node work: then stacking only adds copies.
    An elementwise operation's shared operand counts too, as each member's
    result is at least its size: a 256 x 256 layer scaled by 400 numbers, one
    group, made a 400 x 256 x 256 array (and its delta) where each scaling
    alone costs far more than its node (46 ms and 3x the memory, against
    26 ms node by node)."""
    for a, b in zip(args, batched):
        size = getattr(a, "size", 0)
        if size > n * MAX_MEMBER_SIZE if b else elementwise and size > MAX_MEMBER_SIZE:
            return True
    return False
