"""Which outputs of an operation's program a delta reaches each operand
from (`feeds`), and each output of an operand that is an earlier operation
node with several (`part_feeds`): a group whose members read different
outputs sends an operand, or one of its outputs, no delta from a member
whose reads do not reach it (`monadl.runtime.schedule.batched_again`)."""

from __future__ import annotations

from monadl.layers._outputs import OUTPUT
from monadl.layers._step import Step

__all__ = ["feeds", "part_feeds"]


def _through(step: Step, steps: tuple[Step, ...], reach: list[int], first: int) -> int:
    """What ``step``'s slot depends on (bits), from ``reach`` of the slots
    before it: its operands' that take a delta (none through
    ``stop_gradient``). An output of a marked cell called inside this one
    (a step whose rule is a program with feeds of its own) depends on the operands of that call
    that its own feeds say reach it, not on all of them."""
    if step.op.name == "stop_gradient":  # (its delta goes nowhere)
        return 0
    refs, grads = step.refs, step.grads
    if step.op is OUTPUT and refs[0] >= first:
        nested = steps[refs[0] - first]
        inner = getattr(nested.op.rule, "feeds", None)  # (a `Program`'s: the cell's own)
        if inner is not None:
            k = step.params[0]
            refs = nested.refs
            grads = tuple([g and (q >= len(inner) or k in inner[q]) for q, g in enumerate(nested.grads)])
    bits = 0
    for r, grad in zip(refs, grads):
        if grad:
            bits |= reach[r]
    return bits


def part_feeds(
    size: int, consts: int, steps: tuple[Step, ...], outputs: tuple[int, ...]
) -> dict[tuple[int, int], tuple[int, ...]]:
    """Per output ``k`` of an operand with several (an operation node's,
    read by its ``output`` views), the outputs a delta reaches it from, as
    `feeds` per operand: a member whose outputs read reach output ``k`` of
    its operand sends that output a delta, the others none (one cell's
    second output, read by the next cell's output that a member leaves
    unread: a zero row sent on, times ``sqrt``'s infinite derivative at 0
    where it was made, was a NaN in a weight's delta)."""
    first = size + consts
    views = {first + j: (s.refs[0], s.params[0]) for j, s in enumerate(steps) if s.op is OUTPUT and s.refs[0] < size}
    if not views:
        return {}
    reach = [0] * first  # per slot, the views it depends on (bits by slot)
    for j, step in enumerate(steps):
        reach.append((1 << first + j if first + j in views else 0) | _through(step, steps, reach, first))
    found: dict[tuple[int, int], set[int]] = {}
    for slot, part in views.items():
        found.setdefault(part, set()).update(k for k, o in enumerate(outputs) if reach[o] >> slot & 1)
    return {part: tuple(sorted(ks)) for part, ks in found.items()}


def feeds(size: int, consts: int, steps: tuple[Step, ...], outputs: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Per operand, the outputs a delta reaches it from (through the steps'
    operands that take one; not through ``stop_gradient``): a group whose members read different outputs
    sends an operand no delta from a member whose outputs read do not
    reach it (its zero row, times an infinite derivative further back, was
    a NaN: `monadl.runtime.schedule.batched_again`)."""
    reach = [1 << p for p in range(size)] + [0] * consts  # per slot, the operands it depends on (bits)
    for step in steps:
        reach.append(_through(step, steps, reach, size + consts))
    return tuple([tuple([k for k, o in enumerate(outputs) if reach[o] >> p & 1]) for p in range(size)])
