"""The iterative interpreter of `Do` computations and layer graphs.

`evaluate` is a generator with explicit continuation stacks, so neither a
chain of 100,000 operations nor a chain of 100,000 ``bind``s grows the Python
stack. It yields to its driver (`monadl.runtime.drive`) only at real
asynchronous effects, at the event loop's turns (`CHECKPOINT`) and at forks.

**Fibers.** The branches of a parallel applicative (``Do.zip``/``gather``, a
direct-style ``await values(a, b)``) are *fibers*: each has its own
continuation stack. A fiber runs until it finishes or must wait for something
asynchronous; then another runs. While one fiber is alive (or the others wait
for its branches), its awaits go straight to the driver (no task, no cost);
with several, each await becomes a
task of the driver's task group (`Spawn`), the direct-style coroutine steps
they ask for share one (`Steps`), and when no fiber can run the
interpreter asks the driver for the next completion (`NEXT`). So independent
effects overlap, and a failure anywhere fails the evaluation, which cancels
the rest. A shared ``Do`` or a layer built from a ``Do`` that one fiber is
computing is waited for, never computed twice (`Evaluation.pending`).

Layer graphs (a ``forward()`` of a layer not yet evaluated) are collected and
handed to the scheduler that fits them (`monadl.runtime.graphs`). With several fibers, a
fiber that reaches a graph of primitives *parks* there while others can run;
when none can, the parked graphs run as one (`monadl.runtime.schedule.fibers`):
batching across the fibers' data-dependent control flow.
"""

from __future__ import annotations

import contextvars
from collections import deque
from collections.abc import Generator
from time import perf_counter
from typing import Any, Final

from monadl.direct import AwaitLayers, Passthrough, cancel_scope, read_only
from monadl.do import BIND, DIRECT, EFFECT, FORWARD, MAP, PURE, SHARED, ZIP, Do
from monadl.layers._layer import Expr
from monadl.layers._weight import Weight
from monadl.runtime import frames as F
from monadl.runtime import graphs
from monadl.runtime.evaluation import Evaluation, Shared, UserRelease
from monadl.runtime.requests import CHECKPOINT, NEXT, Spawn, Steps
from monadl.runtime.schedule import fibers
from monadl.runtime.stepping import direct_next, step_direct

__all__ = ["evaluate"]

Machine = Generator[Any, Any, Any]

_START: Final = object()  # what a direct frame receives first: no awaited values yet
_STEPPING: Final = object()  # a fiber waits for its coroutine's step, which is in `steps`
_UNREAD: Final = object()  # (the driver's cancel scope, not read yet)


def evaluate(ev: Evaluation, root: Do[Any]) -> Machine:
    """Acquire ``root`` in ``ev``; returns ``(value, release token)``."""
    records = ev.records
    main = fiber = F.Fiber(root, None, 0)
    runnable: deque[F.Fiber] = deque()
    # Fibers that may still run: not finished, and not waiting at a join for their branches (a
    # batch's root while its examples run). One alone (a batch's last example, the others done)
    # steps and awaits in this task, as a single fiber does: a task per step cost it 1.6x.
    live = 1
    parked = fibers.Parked()  # fibers waiting at their graphs for one merged run
    stepping = 0  # fibers whose direct-style coroutine step is asked for (held or in a task): soon back, to park too
    outstanding = 0  # completions the driver owes (spawned awaits, asked steps): none, and no fiber can run, is a cycle
    # The driver task's innermost cancel scope, read at the first direct-style step run here (one
    # read, not one a step); the driver opens its task group, a scope, when first asked to Spawn or Steps.
    scope: Any = _UNREAD
    away: set[F.Fiber] = set()  # those whose step awaits something foreign: the parked graphs do not wait for them
    steps: list[
        tuple[F.Fiber, Any, Any, contextvars.Context]
    ] = []  # those steps not handed to the driver yet (`Steps`)
    stack = fiber.stack
    cur: Any = root
    val: Any = None
    tok: Any = None
    descending = True
    while True:
        block: Any = None  # set to make this fiber wait: an awaitable, or a pending list to join
        if descending:
            kind = cur._kind
            if kind == FORWARD:
                node = cur._a
                rec = records[node] if node in records.places else records.get(node)  # (a member's: made now)
                if rec is None and type(node) is Weight:
                    rec = ev.weight_record(node)
                if rec is None:
                    stack.append(F.Root(node))
                    stack.append(F.Graph([node]))
                    descending = False
                    continue
                rec.refcount += 1
                val, tok = rec.tape(), rec
                descending = False
            elif kind == MAP:
                stack.append(F.Map(cur._b))
                cur = cur._a
            elif kind == BIND:
                stack.append(F.Bind(cur._b))
                cur = cur._a
            elif kind == PURE:
                val, tok = cur._a, None
                descending = False
            elif kind == ZIP:
                dos = cur._a
                if not dos:
                    val, tok = (), None
                    descending = False
                elif len(dos) > 1 and all(d._kind == FORWARD for d in dos):
                    # Independent forwards: one graph, so a scheduler may run its branches together.
                    stack.append(F.Roots(dos))
                    roots = []
                    for d in dos:
                        if records.computed(d._a):
                            continue
                        if type(d._a) is Weight:
                            ev.weight_record(d._a)
                        else:
                            roots.append(d._a)
                    stack.append(F.Graph(roots))
                    descending = False
                else:  # a fiber per branch; this one waits for them all
                    join = F.Join(fiber, len(dos))
                    children = [F.Fiber(d, join, i) for i, d in enumerate(dos)]
                    live += len(children) - 1
                    runnable.extendleft(reversed(children[1:]))
                    fiber.save(stack, cur, val, tok, False)
                    fiber = children[0]
                    stack, cur, descending = fiber.stack, fiber.cur, True
            elif kind == SHARED:
                entry = ev.shared.get(cur)
                if entry is not None:
                    entry.count += 1
                    val, tok = entry.value, entry
                    descending = False
                elif cur in ev.pending:  # another fiber is computing it: wait, then look again
                    block = ev.pending[cur]
                else:
                    ev.effects = True
                    ev.pending[cur] = []
                    stack.append(F.SharedDone(cur))
                    cur = cur._a
            elif kind == DIRECT:
                ev.effects = True
                made = F.Direct(cur._a())
                ev.coroutines.append(made)
                stack.append(made)
                val, tok = _START, None
                descending = False
            else:  # EFFECT
                assert kind == EFFECT
                ev.effects = True
                awaitable = cur._a()
                if live == 1:
                    val = yield awaitable
                    tok = _opened(ev, cur._b, val)
                    descending = False
                else:  # the task notes a resource as soon as it is acquired: a failure elsewhere releases it
                    stack.append(F.Opened())
                    block = _acquire(ev, awaitable, cur._b)
            if block is None:
                continue
        elif stack:
            frame = stack.pop()
            t = type(frame)
            verdict: bool | int = False  # (with other fibers: `fibers.parks`)
            if t is F.Graph and (runnable or parked or stepping):
                verdict = fibers.parks(ev, frame)
            if verdict is True:
                parked.add(fiber, frame)  # other fibers may reach graphs too: computed together
                block = fibers.PARKED
            elif t is F.Graph:
                if verdict is not False:  # its layers built from a Do first; it parks after them
                    outcome = graphs.dos(ev, frame, stack, verdict)
                else:
                    if steps:  # a computation may take turns of the event loop: the steps asked for start first
                        outstanding += len(steps)
                        yield Steps(steps)
                        steps, scope = [], _UNREAD
                    outcome = yield from graphs.run(ev, frame, stack)
                if outcome is not None:
                    kind_of, thing = outcome
                    if kind_of == "do":  # a layer built from a Do: evaluate it first
                        cur, descending = thing, True
                        continue
                    if kind_of == "fork":  # several: a fiber each, the graph resumes after them
                        join = F.Join(fiber, len(thing), frame)
                        children = []
                        for i, node in enumerate(thing):
                            child = F.Fiber(node._do, join, i)
                            child.stack.append(F.FromDo(node))
                            children.append(child)
                        live += len(children) - 1
                        runnable.extendleft(reversed(children[1:]))
                        fiber.save(stack, None, None, None, False)
                        fiber = children[0]
                        stack, cur, descending = fiber.stack, fiber.cur, True
                        continue
                    block = thing  # an awaitable (the pool) or a pending list (another fiber's Do layer)
                    if type(block) is not list and live == 1:
                        yield block
                        block = None
                if block is None:
                    continue
            elif t is F.Direct:
                # Step a direct-style coroutine: it asks for forward values of layers
                # (evaluated here, in this evaluation), awaits something foreign (handed to
                # the event loop), or returns its layer.
                if val is _START:
                    sending: Any = None
                else:
                    frame.held.append(tok)
                    sending = read_only(val.data) if frame.single else tuple(read_only(x.data) for x in val)
                if live == 1:
                    failure: BaseException | None = None
                    if scope is _UNREAD:  # (before its foreign awaits: a sleep opens a scope of its own)
                        scope = cancel_scope()
                    while True:
                        try:
                            done, got, _ = frame.context.run(step_direct, frame.coroutine, sending, failure, scope)
                        except Exception as exc:  # (the last example of a batch steps here too)
                            fiber.note_example(exc)
                            raise
                        finally:  # (raised again, its traceback holds this frame: held here, a cycle)
                            failure = None
                        if done or type(got) is AwaitLayers:
                            break
                        try:
                            sending, failure = (yield Passthrough(got)), None
                        except BaseException as exc:  # delivered to the coroutine, as the event loop would
                            sending, failure = None, exc
                    try:
                        cur = direct_next(frame, stack, done, got)
                    except TypeError as exc:  # (it returned no layer: which example, as for its other errors)
                        fiber.note_example(exc)
                        raise
                    descending = True
                    continue
                # Several fibers: the coroutine's foreign awaits must be made in the task
                # that awaits them (trio ties a wait to the task that asked), so a task steps it.
                stack.append(F.Stepped(frame))
                steps.append((fiber, frame.coroutine, sending, frame.context))
                block = _STEPPING
                stepping += 1
            elif t is F.Stepped:
                done, got = val
                try:
                    cur = direct_next(frame.direct, stack, done, got)
                except TypeError as exc:
                    fiber.note_example(exc)
                    raise
                descending = True
                continue
            elif t is F.DirectDone:
                tok = (frame.held, tok)  # the returned layer is released before the awaited ones
                continue
            elif t is F.Roots:
                recs = [records[d._a] for d in frame.dos]
                for rec in recs:
                    rec.refcount += 1
                val, tok = tuple(rec.tape() for rec in recs), tuple(recs)
                continue
            elif t is F.Root:
                rec = records[frame.node]
                rec.refcount += 1
                val, tok = rec.tape(), rec
                continue
            elif t is F.Map:
                try:
                    val = frame.function(val)
                except Exception as exc:
                    fiber.note_example(exc)
                    raise
                continue
            elif t is F.Bind:
                stack.append(F.BindDone(tok))
                try:
                    cur = frame.function(val)
                except Exception as exc:
                    fiber.note_example(exc)
                    raise
                if not isinstance(cur, Do):
                    hint = " (return layer.forward(): the layer's Do)" if isinstance(cur, Expr) else ""
                    raise TypeError(
                        f"the function {_named(frame.function)} given to bind returned {type(cur).__name__}, "
                        f"not a Do{hint}"
                    )
                descending = True
                continue
            elif t is F.BindDone:
                tok = (frame.token, tok)  # released right to left: the inner computation first
                continue
            elif t is F.SharedDone:
                entry = Shared(val, tok)
                ev.shared[frame.do] = entry
                tok = entry
                runnable.extend(ev.pending.pop(frame.do))  # waiters look again
                continue
            elif t is F.Opened:
                val, tok = val
                continue
            else:  # a layer built from a Do has its tape
                assert t is F.FromDo
                graphs.from_do(ev, frame.node, val, tok)
                runnable.extend(ev.pending.pop(frame.node))  # waiters resume their graphs
                continue
        else:  # this fiber is done
            ended = fiber.join
            if ended is None:
                assert fiber is main
                return val, tok
            live -= 1
            ended.values[fiber.slot] = val
            ended.tokens[fiber.slot] = tok
            ended.remaining -= 1
            if not ended.remaining:
                parent = ended.fiber
                parent.save(parent.stack, None, tuple(ended.values), tuple(ended.tokens), False)
                runnable.append(parent)
                live += 1
            fiber = None  # type: ignore[assignment]

        # ---- this fiber waits (or is done): run another -------------------------------------
        if fiber is not None:
            fiber.save(stack, cur, val, tok, descending)
            if type(block) is list:  # another fiber's shared Do or Do layer: woken when it is done
                block.append(fiber)
            elif block is not fibers.PARKED and block is not _STEPPING:
                outstanding += 1
                yield Spawn(fiber, block)
                scope = _UNREAD
        while not runnable:
            if steps:  # before waiting for any completion: the steps asked for, as one
                outstanding += len(steps)
                yield Steps(steps)
                steps, scope = [], _UNREAD
            # With graphs parked, wait only for the coroutine steps that come back
            # with no outside event (which those are is the same every run, whichever
            # task the event loop runs first: so is which graphs run merged).
            if not parked or stepping > len(away):
                if not outstanding:  # (every live fiber waits for another's Do layer, which waits in turn)
                    raise graphs.cycle(ev)
                completion = yield NEXT
            else:  # nothing more can reach a graph now: run the parked ones as one
                runnable.extend((yield from fibers.run(ev, parked)))
                break
            fiber, ok, result = completion
            if ok is None:  # its step awaits something foreign (`step_each`): it completes later
                away.add(fiber)
                continue
            outstanding -= 1
            if not ok:  # (its failure: this frame, which the traceback holds, keeps no hold on it)
                failure, result, completion = result, None, None
                fiber.note_example(failure)
                try:
                    raise failure
                finally:
                    failure = None
            if fiber.stack and type(fiber.stack[-1]) is F.Stepped:
                stepping -= 1
                away.discard(fiber)
            fiber.save(fiber.stack, None, result, None, False)
            runnable.append(fiber)
        if perf_counter() > ev.deadline:  # (many fibers, each a little work: 1,024 held the loop 30-60 ms)
            yield CHECKPOINT
        fiber = runnable.popleft()
        stack, cur, val, tok, descending = fiber.stack, fiber.cur, fiber.val, fiber.tok, fiber.descending


def _opened(ev: Evaluation, release: Any, value: Any) -> Any:
    """The release token of an effect's value: a resource's release, or None."""
    if release is None:
        return None
    token = UserRelease(release, value)
    ev.open.append(token)
    return token


async def _acquire(ev: Evaluation, awaitable: Any, release: Any) -> tuple[Any, Any]:
    """Await an effect in a task of its own; its value and release token."""
    value = await awaitable
    return value, _opened(ev, release, value)


def _named(function: Any) -> str:
    """A function as a message names it: its name and, for Python code, its file and line."""
    name = getattr(function, "__qualname__", None) or repr(function)
    code = getattr(function, "__code__", None)
    return name if code is None else f"{name} ({code.co_filename}:{code.co_firstlineno})"
