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

from typing import TYPE_CHECKING, Any, Final

from monadl.layers._program import Program
from monadl.runtime.schedule.batched_log import FORCES, unbatched
from monadl.runtime.schedule.batched_weights import MIN_SHARED, WEIGHT_READERS, weight_of
from monadl.runtime.settings import current_settings

if TYPE_CHECKING:
    from monadl.layers._site import Site
    from monadl.runtime.evaluation import Evaluation

__all__ = [
    "ALONE",
    "ALONE_WHY",
    "BATCHED_SHARE",
    "CHAIN",
    "MAX_MEMBER_SIZE",
    "MIN_ALIKE",
    "MIN_GROUP",
    "MIN_LARGE",
    "MIN_NODES",
    "NOTHING_PAID",
    "PAID_LITTLE",
    "REPROBE",
    "coarse",
    "large",
    "ops",
    "paid",
    "remember",
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
steps of ``tanh(h @ U + b + xs[t] @ V)`` with H = 16 to 128 and 1 to 16
rows, 3-20% (`benchmarks/cost_rule.py`), now 0-4%; with two input products
a step (two in seven) up to 12%. With four (four in nine, over the share)
they still run 5-9% slower: small products of a few rows save about what
stacking them costs."""


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
        if reads and any(weight_of(x) is not None for x in node._inputs):
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


MAX_MEMBER_SIZE: Final = 1 << 14
"""Automatic mode batches no group whose members' stacked operands exceed this
many elements each: a node that large costs far more than its dispatch, and
stacking would only copy it."""

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
