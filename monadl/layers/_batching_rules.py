"""Batching rules: how to run n instances of a primitive as one kernel.

A table keyed by primitive name, beside the primitive table (as JAX keeps
``primitive_batchers`` beside its VJPs). A rule takes the arguments of one
call — the operands, then the parameters — where each position is either
*batched* (the n members' values stacked along a new leading axis) or
*shared* (one value that every member used: a weight, a constant), and
returns the stacked output with one VJP per operand, or None when it cannot
batch that combination (the members then run one by one).

A VJP of a batched operand returns the stacked delta in exactly the stacked
operand's shape; a VJP of a shared operand may return it with the batch axis
(and any broadcasting) still in it: the runtime sums those away with
`unbroadcast`, as for any rule. So a weight shared by a whole group gets one
delta for the group, and the matmul rule makes it one ``X_cat.T @ dY``.

Rules compute with the unbatched rules of `PRIMITIVES` wherever stacking is
enough (elementwise ops, embedding lookups), so the arithmetic stays in one
place; the lookups by index are `monadl.layers._batching_lookups`'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from monadl._namespace import namespace
from monadl.deltas import unbroadcast
from monadl.layers._batching_lookups import batch_embedding, batch_getitem, batch_segment_sum
from monadl.layers._indexing import _checked_indices
from monadl.layers._primitives import PRIMITIVES
from monadl.layers._products import product
from monadl.layers._reductions import _weighted_cross_entropy, binary_cross_entropy_of, pos_weight_misfit

__all__ = ["BATCHING_RULES", "BatchRule"]

Value = Any
Vjp = Callable[[Value], Value]
BatchResult = tuple[Value, tuple[Vjp, ...]]
BatchRule = Callable[[tuple[Any, ...], tuple[bool, ...], int], BatchResult | None]
"""``rule(args, batched, n)``: ``args`` the operands then the parameters,
``batched[i]`` whether ``args[i]`` is stacked, ``n`` the group's size."""


def _ndim(x: Any) -> int:
    return getattr(x, "ndim", 0)


def _elementwise(name: str) -> BatchRule:
    """Any elementwise primitive: stacked operands get unit axes after the
    batch axis up to the result's rank, so that they broadcast against shared
    operands exactly as one member's operands did."""
    rule = PRIMITIVES[name].rule

    def batch(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
        rank = max(_ndim(a) - 1 if b else _ndim(a) for a, b in zip(args, batched))
        padded = []
        fixes: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = []
        for a, b in zip(args, batched):
            if b and a.ndim - 1 < rank:
                shape = (n, *(1,) * (rank - a.ndim + 1), *a.shape[1:])
                padded.append(namespace(a).reshape(a, shape))
                fixes.append((shape, a.shape))
            else:
                padded.append(a)
                fixes.append((a.shape, a.shape) if b else None)
        out, vjps = rule(*padded)
        wrapped = []
        for vjp, fix in zip(vjps, fixes):
            wrapped.append(vjp if fix is None else _fitted(vjp, *fix))
        return out, tuple(wrapped)

    return batch


def _fitted(vjp: Vjp, padded: tuple[int, ...], stacked: tuple[int, ...]) -> Vjp:
    """A batched operand's VJP, its delta summed over the axes it was
    broadcast along (never the batch axis) and shaped as the stack."""

    def fit(g: Value) -> Value:
        d = vjp(g)
        if getattr(d, "shape", None) != padded:
            d = unbroadcast(namespace(d).broadcast_to(d, (padded[0], *d.shape[1:])) if d.ndim else d, padded)
        return d if padded == stacked else namespace(d).reshape(d, stacked)

    return fit


def _matmul(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    a, b = args
    ba, bb = batched
    if ba and not bb and b.ndim == 2 and a.ndim >= 2:
        # Every member's rows times one matrix: one product over all rows.
        xp = namespace(a)
        k, m = b.shape
        rows = xp.reshape(a, (-1, k))
        out = xp.reshape(product(rows, b), (*a.shape[:-1], m))
        a_shape = a.shape
        return out, (
            lambda g: xp.reshape(product(xp.reshape(g, (-1, m)), xp.matrix_transpose(b)), a_shape),
            lambda g: xp.matrix_transpose(rows) @ xp.reshape(g, (-1, m)),
        )
    if ba and not bb and b.ndim == 1 and a.ndim >= 2:
        # Every member's rows (or vector) times one vector: one matrix-vector product.
        xp = namespace(a)
        k = b.shape[0]
        rows = xp.reshape(a, (-1, k))
        return a @ b, (lambda g: g[..., None] * b, lambda g: xp.matrix_transpose(rows) @ xp.reshape(g, (-1,)))
    if bb and not ba and a.ndim == 2 and b.ndim == 2:
        # One matrix times every member's vector: (n, k) @ a.T.
        xp = namespace(b)
        out = b @ xp.matrix_transpose(a)
        return out, (lambda g: xp.matrix_transpose(g) @ b, lambda g: g @ a)
    if bb and not ba and a.ndim == 1 and b.ndim == 2:
        # One vector . every member's vector: (n, k) @ a.
        return b @ a, (lambda g: g @ b, lambda g: g[:, None] * a)
    if bb and not ba and a.ndim <= 2 and b.ndim == 3:
        # One vector or matrix times every member's matrix: a broadcast product.
        xp = namespace(b)
        if a.ndim == 1:  # (k,) @ (n, k, m): the vector's delta sums the members' b @ g
            return a @ b, (
                lambda g: xp.sum(b @ g[:, :, None], axis=0)[:, 0],
                lambda g: a[None, :, None] * g[:, None, :],
            )
        return a @ b, (lambda g: xp.sum(g @ xp.matrix_transpose(b), axis=0), lambda g: xp.matrix_transpose(a) @ g)
    if ba and bb and a.ndim == b.ndim and a.ndim >= 2 and a.shape[:-2] == b.shape[:-2]:
        if a.ndim == 2:  # vector . vector per member
            xp = namespace(a)
            return xp.sum(a * b, axis=-1), (lambda g: g[:, None] * b, lambda g: g[:, None] * a)
        return PRIMITIVES["matmul"].rule(a, b)  # matrix @ matrix per member: a stacked product
    if ba and bb and a.ndim == 3 and b.ndim == 2:
        # A matrix times a vector per member (attention's scores: states @ query).
        xp = namespace(a)
        return (a @ b[:, :, None])[:, :, 0], (
            lambda g: g[:, :, None] * b[:, None, :],
            lambda g: (xp.matrix_transpose(a) @ g[:, :, None])[:, :, 0],
        )
    if ba and bb and a.ndim == 2 and b.ndim == 3:
        # A vector times a matrix per member (attention's mix: weights @ states).
        xp = namespace(a)
        return (a[:, None, :] @ b)[:, 0, :], (
            lambda g: (b @ g[:, :, None])[:, :, 0],
            lambda g: a[:, :, None] * g[:, None, :],
        )
    return None


def _dense(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    """The matmul rule, then the bias through the rule of ``add`` (shared or stacked)."""
    a, b, bias = args
    product = _matmul((a, b), batched[:2], n)
    if product is None:
        return None
    out, (da, db) = product
    summed = _add((out, bias), (True, batched[2]), n)
    assert summed is not None  # the rule of add batches any operands
    total, (d_out, d_bias) = summed
    return total, (lambda g: da(d_out(g)), lambda g: db(d_out(g)), d_bias)


def _member_axis(axis: int, ndim: int) -> int:
    """A member's ``axis`` (of ``ndim``) as an axis of the stack (one more, in
    front); out of range it raises, and the group runs node by node, where
    the node's error names the user's line (wrapped, it named another axis)."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for {ndim} dimensions")
    return axis % ndim + 1


def _reduction(name: str) -> BatchRule:
    """sum, mean, max, logsumexp over given axes (not over everything: the
    batch axis must stay)."""
    rule = PRIMITIVES[name].rule

    def batch(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
        a, axis, keepdims = args
        ndim = a.ndim - 1
        if not batched[0] or ndim == 0:
            return None
        if axis is None:  # every axis of a member: all but the batch axis
            return rule(a, tuple(range(1, a.ndim)), keepdims)
        if isinstance(axis, int):
            return rule(a, _member_axis(axis, ndim), keepdims)
        return rule(a, tuple(_member_axis(ax, ndim) for ax in axis), keepdims)

    return batch


def _per_row(name: str) -> BatchRule:
    """softmax and log_softmax along an axis of each member."""
    rule = PRIMITIVES[name].rule

    def batch(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
        a, axis = args
        if not batched[0]:
            return None
        return rule(a, _member_axis(axis, a.ndim - 1))

    return batch


def _concatenate(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    *arrays, axis = args
    first = next(a for a, b in zip(arrays, batched) if b)
    xp = namespace(first)
    ndim = first.ndim - 1
    if ndim == 0:
        return None
    lifted = [a if b else xp.broadcast_to(a, (n, *a.shape)) for a, b in zip(arrays, batched)]
    return PRIMITIVES["concatenate"].rule(*lifted, _member_axis(axis, ndim))


def _cross_entropy(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    logits, _, labels, *options = args
    if not batched[0] or logits.ndim != 3:
        return None
    xp = namespace(logits)
    if not batched[2]:  # (one array of labels for all: a marked cell's constant)
        labels = xp.broadcast_to(labels, (n, *labels.shape))
    if options:  # (weights shared by the members, or stacked where each has its own array)
        out, weighted = _weighted_cross_entropy(xp, logits, labels, *options)
        return out, (weighted,)
    _, rows, classes = logits.shape
    # The members' labels checked as one (each member's rule checks its own), on the host if they are there.
    labels = xp.reshape(_checked_indices(xp, labels, classes, "labels", "label", "{} classes", logits), labels.shape)
    log_p, _ = PRIMITIVES["log_softmax"].rule(logits, -1)
    picked = xp.take_along_axis(log_p, labels[:, :, None], axis=-1)[..., 0]
    out = -xp.sum(picked, axis=-1) / rows

    def vjp(g: Value) -> Value:
        one_hot = xp.astype(labels[:, :, None] == xp.arange(classes, device=logits.device), logits.dtype)
        return (xp.exp(log_p) - one_hot) * (g[:, None, None] / rows)

    return out, (vjp,)


def _binary_cross_entropy(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    """Each member's mean over its own elements, where the logits are
    stacked, the targets stacked or shared, and the weight of positives
    shared: other combinations (and targets not shaped as a member's logits,
    or a weight of positives that would enlarge its loss, which each member
    refuses with its line) run member by member."""
    a, t, *weight = args
    member = getattr(t, "shape", ())[1:] if batched[1] else getattr(t, "shape", ())
    if not batched[0] or any(batched[2:]) or member != a.shape[1:]:
        return None
    if weight and pos_weight_misfit(a.shape[1:], getattr(weight[0], "shape", ())):
        return None  # (each member refuses it, with its line)
    return binary_cross_entropy_of(a, t, weight[0] if weight else None, tuple(range(1, a.ndim)))


def _reshape(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    """Each member to ``shape``: the stack to ``(n, *shape)`` (a ``-1`` there
    is a member's, and an impossible shape fails as a member's would)."""
    a, shape = args
    if not batched[0]:
        return None
    return PRIMITIVES["reshape"].rule(a, (n, *shape))


def _transpose(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    a, axes = args
    ndim = a.ndim - 1
    if not batched[0] or ndim == 0:
        return None
    members = range(ndim, 0, -1) if axes is None else [_member_axis(axis, ndim) for axis in axes]
    return PRIMITIVES["transpose"].rule(a, (0, *members))


def _roll(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    """Each member rolled along its axis: the stack along the next one."""
    a, shift, axis = args
    if not batched[0] or a.ndim == 1:
        return None
    return PRIMITIVES["roll"].rule(a, shift, _member_axis(axis, a.ndim - 1))


def _stack(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
    """A member's new axis, one further in; shared operands broadcast along the batch."""
    *arrays, axis = args
    if not all(hasattr(a, "ndim") for a in arrays):  # (numbers: stacked as one member stacks them)
        return None
    first = next(a for a, b in zip(arrays, batched) if b)
    xp = namespace(first)
    lifted = [a if b else xp.broadcast_to(a, (n, *a.shape)) for a, b in zip(arrays, batched)]
    return PRIMITIVES["stack"].rule(*lifted, _member_axis(axis, first.ndim))


def _split(name: str) -> BatchRule:
    """``split`` and ``split_part``: the cut along a member's axis."""
    rule = PRIMITIVES[name].rule

    def batch(args: tuple[Any, ...], batched: tuple[bool, ...], n: int) -> BatchResult | None:
        a, sections, axis, *part = args
        if not batched[0] or a.ndim < 2:
            return None
        return rule(a, sections, _member_axis(axis, a.ndim - 1), *part)

    return batch


_add: Final = _elementwise("add")

BATCHING_RULES: Final[dict[str, BatchRule]] = {
    **{
        name: _elementwise(name)
        for name in (
            "add",
            "subtract",
            "multiply",
            "divide",
            "maximum",
            "minimum",
            "where",
            "negative",
            "exp",
            "log",
            "sqrt",
            "abs",
            "sin",
            "cos",
            "tanh",
            "sigmoid",
            "relu",
            "softplus",
            "log_sigmoid",
            "power",
            "stop_gradient",
            "as_layer",
        )
    },
    "reshape": _reshape,
    "transpose": _transpose,
    "roll": _roll,
    "stack": _stack,
    "split": _split("split"),
    "split_part": _split("split_part"),
    "matmul": _matmul,
    "dense": _dense,
    "getitem": batch_getitem,
    **{name: _reduction(name) for name in ("sum", "mean", "max", "logsumexp")},
    **{name: _per_row(name) for name in ("softmax", "log_softmax")},
    "concatenate": _concatenate,
    "embedding": batch_embedding,
    "segment_sum": batch_segment_sum,
    "cross_entropy": _cross_entropy,
    "binary_cross_entropy_with_logits": _binary_cross_entropy,
}
