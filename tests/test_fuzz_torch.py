"""Differential fuzz: random programs over every public op, with diamonds and
broadcasting, against PyTorch autograd in float64; and every optimizer's
steps against ``torch.optim``.

Each program starts from a few weights and grows a pool of values by applying
random ops to random members of the pool (members are reused, so diamonds
are common), then sums a random projection of the pool into a loss. monadl's
loss and gradients must match PyTorch's. Skipped where PyTorch is absent (CI):
``pip install torch`` to run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest

import monadl as ml

torch = pytest.importorskip("torch")
F = torch.nn.functional

PROGRAMS = 300
OPS_PER_PROGRAM = 12


@dataclass(frozen=True, slots=True)
class Value:
    """One value of a program, built both ways."""

    ml: Any  # a monadl Layer or Weight
    th: Any  # a torch tensor
    shape: tuple[int, ...]


def positive(v: Value) -> Value:
    """``v * v + 0.5``: a safe operand for log, sqrt, a divisor or a power's base."""
    return Value(v.ml * v.ml + 0.5, v.th * v.th + 0.5, v.shape)


def unary(rng: np.random.Generator, v: Value) -> Value:
    name = rng.choice(["exp", "log", "sqrt", "abs", "tanh", "sigmoid", "relu", "negative", "stop_gradient"])
    if name == "exp":
        return Value(ml.exp(ml.tanh(v.ml)), torch.exp(torch.tanh(v.th)), v.shape)  # bounded: no overflow
    if name in ("log", "sqrt"):
        p = positive(v)
        return Value(getattr(ml, name)(p.ml), getattr(torch, name)(p.th), v.shape)
    if name == "negative":
        return Value(-v.ml, -v.th, v.shape)
    if name == "stop_gradient":
        return Value(ml.stop_gradient(v.ml), v.th.detach(), v.shape)
    return Value(getattr(ml, name)(v.ml), getattr(torch, name)(v.th), v.shape)


def binary(rng: np.random.Generator, a: Value, b: Value) -> Value | None:
    try:
        shape = tuple(np.broadcast_shapes(a.shape, b.shape))
    except ValueError:
        return None
    name = rng.choice(["add", "subtract", "multiply", "divide", "power", "maximum", "minimum", "constant"])
    if name == "add":
        return Value(a.ml + b.ml, a.th + b.th, shape)
    if name == "subtract":
        return Value(a.ml - b.ml, a.th - b.th, shape)
    if name == "multiply":
        return Value(a.ml * b.ml, a.th * b.th, shape)
    if name == "divide":
        p = positive(b)
        return Value(a.ml / p.ml, a.th / p.th, shape)
    if name == "power":
        p, e = positive(a), Value(ml.tanh(b.ml), torch.tanh(b.th), b.shape)  # bounded exponent
        return Value(p.ml**e.ml, p.th**e.th, shape)
    if name in ("maximum", "minimum"):
        if a is b:  # a tie everywhere: both libraries split it, but keep the comparison meaningful
            return None
        return Value(getattr(ml, name)(a.ml, b.ml), getattr(torch, name)(a.th, b.th), shape)
    # an array or a number on either side, broadcasting too
    c = rng.standard_normal(a.shape[-1:] if a.shape and rng.random() < 0.5 else ())
    const: Any = float(c) if c.ndim == 0 and rng.random() < 0.5 else c
    tc = torch.as_tensor(np.asarray(const, dtype=np.float64))
    if rng.random() < 0.5:
        return Value(const * a.ml, tc * a.th, a.shape)
    return Value(a.ml - const, a.th - tc, a.shape)


def reduction(rng: np.random.Generator, v: Value) -> Value:
    name = rng.choice(["sum", "mean", "max", "logsumexp", "softmax", "log_softmax"])
    if not v.shape or (name in ("sum", "mean", "max", "logsumexp") and rng.random() < 0.3):
        flat = v.th.reshape(-1)
        if name in ("softmax", "log_softmax"):  # a scalar has no axis for them
            name = "sum"
        th = {"sum": flat.sum(), "mean": flat.mean(), "max": flat.amax(), "logsumexp": torch.logsumexp(flat, 0)}[name]
        return Value(getattr(ml, name)(v.ml), th, ())
    axis = int(rng.integers(-len(v.shape), len(v.shape)))
    if name in ("softmax", "log_softmax"):
        return Value(getattr(ml, name)(v.ml, axis=axis), getattr(torch, name)(v.th, dim=axis), v.shape)
    keep = bool(rng.random() < 0.3)
    shape = list(v.shape)
    shape[axis] = 1
    if not keep:
        del shape[axis]
    th = {
        "sum": lambda: v.th.sum(dim=axis, keepdim=keep),
        "mean": lambda: v.th.mean(dim=axis, keepdim=keep),
        "max": lambda: v.th.amax(dim=axis, keepdim=keep),
        "logsumexp": lambda: torch.logsumexp(v.th, dim=axis, keepdim=keep),
    }[name]()
    return Value(getattr(ml, name)(v.ml, axis=axis, keepdims=keep), th, tuple(shape))


def shaping(rng: np.random.Generator, v: Value, pool: list[Value]) -> Value | None:
    if not v.shape:  # a number first or second
        two = torch.tensor(2.0, dtype=torch.float64)
        if rng.random() < 0.5:
            return Value(ml.stack([2.0, v.ml]), torch.stack([two, v.th]), (2,))
        return Value(ml.stack([v.ml, 2.0]), torch.stack([v.th, two]), (2,))
    name = rng.choice(["reshape", "transpose", "slice", "index", "concatenate", "stack", "split", "matmul"])
    if name == "reshape":
        return Value(ml.reshape(v.ml, (-1,)), v.th.reshape(-1), (int(np.prod(v.shape)),))
    if name == "transpose":
        return Value(v.ml.T, v.th.permute(*reversed(range(len(v.shape)))), v.shape[::-1])
    if name == "slice":
        return Value(v.ml[..., 1:], v.th[..., 1:], (*v.shape[:-1], v.shape[-1] - 1)) if v.shape[-1] > 1 else None
    if name == "index":
        picks = rng.integers(0, v.shape[0], size=4)  # fancy, with repeats
        return Value(v.ml[picks], v.th[torch.as_tensor(picks)], (4, *v.shape[1:]))
    same = [p for p in pool if p.shape == v.shape]
    other = same[int(rng.integers(len(same)))]
    if name == "concatenate":
        shape = (v.shape[0] + other.shape[0], *v.shape[1:])
        return Value(ml.concatenate([v.ml, other.ml], axis=0), torch.cat([v.th, other.th], 0), shape)
    if name == "stack":
        return Value(ml.stack([v.ml, other.ml], axis=-1), torch.stack([v.th, other.th], -1), (*v.shape, 2))
    if name == "split":
        n = v.shape[-1]
        if n < 2:
            return None
        sizes = [1, n - 1]
        k = int(rng.integers(2))
        shape = (*v.shape[:-1], sizes[k])
        return Value(ml.split(v.ml, sizes)[k], torch.split(v.th, sizes, dim=-1)[k], shape)
    partners = [p for p in pool if p.shape and p.shape[0] == v.shape[-1] and len(p.shape) <= 2]
    if not partners:
        return None
    p = partners[int(rng.integers(len(partners)))]
    out_shape = np.shape(np.zeros(v.shape) @ np.zeros(p.shape))
    return Value(v.ml @ p.ml, v.th @ p.th, out_shape)


def special(rng: np.random.Generator, weights: list[tuple[Any, Any]]) -> Value:
    """The ops with their own inputs: cross_entropy, embedding, dense, conv2d, max_pool2d."""
    name = rng.choice(["cross_entropy", "embedding", "dense", "conv2d", "max_pool2d"])

    def weight(*shape: int) -> tuple[Any, Any]:
        data = rng.standard_normal(shape)
        pair = (ml.Weight(data.copy()), torch.tensor(data, requires_grad=True))
        weights.append(pair)
        return pair

    if name == "cross_entropy":
        w, t = weight(4, 5)
        labels = rng.integers(0, 5, size=4)
        return Value(ml.cross_entropy(w * 2.0, labels), F.cross_entropy(t * 2.0, torch.as_tensor(labels)), ())
    if name == "embedding":
        w, t = weight(5, 3)
        idx = rng.integers(0, 5, size=(2, 3))
        return Value(ml.embedding(w, idx), F.embedding(torch.as_tensor(idx), t), (2, 3, 3))
    if name == "dense":
        (x, tx), (w, tw), (b, tb) = weight(4, 3), weight(3, 2), weight(2)
        return Value(ml.dense(x, w, b), tx @ tw + tb, (4, 2))
    (x, tx), (k, tk) = weight(2, 2, 6, 6), weight(3, 2, 3, 3)
    stride, padding = int(rng.integers(1, 3)), int(rng.integers(0, 2))
    out = Value(ml.conv2d(x, k, stride, padding), F.conv2d(tx, tk, stride=stride, padding=padding), ())
    if name == "max_pool2d":
        out = Value(ml.max_pool2d(out.ml, 2), F.max_pool2d(out.th, 2), ())
    return out


def program(seed: int) -> tuple[Any, Any, list[tuple[Any, Any]]]:
    """A random program: (monadl loss, torch loss, [(weight, tensor)])."""
    rng = np.random.default_rng(seed)
    weights: list[tuple[Any, Any]] = []
    pool: list[Value] = []
    for shape in [(3,), (2, 3), (3, 3), ()][: int(rng.integers(2, 5))]:
        data = rng.standard_normal(shape)
        w, t = ml.Weight(data.copy() if shape else float(data)), torch.tensor(data, requires_grad=True)
        weights.append((w, t))
        pool.append(Value(w, t, shape))
    extra: list[Value] = []
    for _ in range(OPS_PER_PROGRAM):
        kind = rng.random()
        v = pool[int(rng.integers(len(pool)))]
        made: Value | None
        if kind < 0.25:
            made = unary(rng, v)
        elif kind < 0.55:
            made = binary(rng, v, pool[int(rng.integers(len(pool)))])
        elif kind < 0.7:
            made = reduction(rng, v)
        elif kind < 0.93:
            made = shaping(rng, v, pool)
        else:
            extra.append(special(rng, weights))
            made = None
        if made is not None:
            pool.append(made)
    ml_loss: Any = 0.0
    th_loss: Any = 0.0
    for v in pool[len(weights) :] + extra or pool:
        projection = rng.standard_normal(tuple(v.th.shape))
        ml_loss = ml_loss + ml.sum(v.ml * projection)
        th_loss = th_loss + (v.th * torch.as_tensor(projection)).sum()
    return ml_loss, th_loss, weights


@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_random_program_matches_torch(seed: int) -> None:
    ml_loss, th_loss, weights = program(seed)
    got_loss, grads = anyio.run(_loss_and_gradients, ml_loss, [w for w, _ in weights])
    th_loss.backward()
    np.testing.assert_allclose(float(got_loss), th_loss.item(), rtol=1e-9, atol=1e-12)
    for (w, t), g in zip(weights, grads):
        want = np.zeros(t.shape) if t.grad is None else t.grad.numpy()
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-8, atol=1e-10, err_msg=f"weight {w!r}")


async def _loss_and_gradients(loss: Any, weights: list[Any]) -> tuple[Any, list[Any]]:
    return await loss.predict(), await ml.gradients(loss, weights)


OPTIMIZERS: list[tuple[str, Callable[[], ml.optim.GradientTransformation], Callable[[Any], Any]]] = [
    ("sgd", lambda: ml.optim.sgd(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    ("momentum", lambda: ml.optim.momentum(0.1), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    (
        "nesterov",
        lambda: ml.optim.nesterov(0.1),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    ),
    (
        "adagrad",
        lambda: ml.optim.adagrad(0.1),
        lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, eps=1e-7),
    ),
    ("rmsprop", lambda: ml.optim.rmsprop(0.01), lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9, eps=1e-8)),
    ("adam", lambda: ml.optim.adam(0.01), lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-8)),
    (  # (the tour's recipe)
        "adamw",
        lambda: ml.optim.chain(
            ml.optim.scale_by_adam(), ml.optim.add_decayed_weights(0.05), ml.optim.scale_by_learning_rate(0.01)
        ),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05, eps=1e-8),
    ),
    (
        "adamw()",
        lambda: ml.optim.adamw(0.01, weight_decay=0.05),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05, eps=1e-8),
    ),
]


@pytest.mark.parametrize(("name", "ours", "theirs"), OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "embedding"])
def test_optimizer_steps_match_torch(
    name: str,
    ours: Callable[[], ml.optim.GradientTransformation],
    theirs: Callable[[Any], Any],
    sparse: bool,
) -> None:
    rng = np.random.default_rng(7)
    table, x, idx = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), np.array([0, 2, 2, 3])
    w = ml.Weight(table.copy(), optimizer=ours())
    t = torch.tensor(table, requires_grad=True)
    step = theirs([t])
    if sparse:  # every row looked up: the lazy sparse step is then the dense one
        idx = np.array([0, 2, 1, 2, 3])
    for _ in range(5):
        if sparse:
            loss: Any = ml.sum(ml.tanh(ml.embedding(w, idx)) * x)
            th_loss = (torch.tanh(F.embedding(torch.as_tensor(idx), t)) * torch.as_tensor(x)).sum()
        else:
            loss = ml.sum(ml.tanh(x @ w.T) ** 2.0)
            th_loss = (torch.tanh(torch.as_tensor(x) @ t.T) ** 2.0).sum()
        anyio.run(loss.train)
        step.zero_grad()
        th_loss.backward()
        step.step()
    np.testing.assert_allclose(w.data, t.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_a_torch_tensor_weight_trains_with_adam_and_shows_itself() -> None:
    # A tensor's size is a method: the commit's count of stateful elements, the
    # factored-product check and the repr read it as a number and raised TypeError.
    w = ml.Weight(torch.zeros((3, 4), dtype=torch.float64), optimizer=ml.optim.adam(0.1))
    assert repr(w).startswith("Weight(tensor(")
    anyio.run(ml.sum(w * torch.ones((3, 4), dtype=torch.float64)).train)
    np.testing.assert_allclose(w.data.numpy(), -0.1)


@pytest.mark.parametrize("broadcast", [True, False])
def test_torch_weights_train_data_parallel_and_differing_ones_are_refused(broadcast: bool) -> None:
    # The first step's checksum of the weights' values viewed them as NumPy's
    # view("u8") does: a tensor's view takes a torch dtype, and every step raised.
    from monadl.distributed import Communicator, DataParallel, RankFailure, run_local

    async def rank(comm: Communicator) -> Any:
        w = ml.Weight(torch.full((3,), float(comm.rank), dtype=torch.float64), optimizer=ml.optim.sgd(0.1))
        dp = DataParallel(w, comm)
        if broadcast:
            await dp.broadcast()
        try:
            await dp.train(ml.sum(w * torch.arange(3.0, dtype=torch.float64)))
        except RankFailure as failure:
            return "different values" in str(failure) or str(failure)
        return w.data.tolist()

    assert run_local(2, rank) == ([[0.0, -0.1, -0.2]] * 2 if broadcast else [True, True])


def test_a_clipped_step_of_ones_own_matches_torchs_clip_grad_norm() -> None:
    rng = np.random.default_rng(11)
    start, x = rng.standard_normal((4, 3)), rng.standard_normal((5, 4))
    w = ml.Weight(start.copy(), optimizer=ml.optim.adam(0.05))
    t = torch.tensor(start, requires_grad=True)
    adam = torch.optim.Adam([t], lr=0.05, eps=1e-8)
    for _ in range(4):
        _, grads = anyio.run(ml.value_and_gradients, ml.sum(ml.tanh(x @ w) ** 2.0) * 10.0)
        ml.optim.apply_gradients(ml.optim.clip_by_global_norm(grads, 0.5))
        adam.zero_grad()
        ((torch.tanh(torch.as_tensor(x) @ t) ** 2.0).sum() * 10.0).backward()
        torch.nn.utils.clip_grad_norm_([t], 0.5)
        adam.step()
    np.testing.assert_allclose(w.data, t.detach().numpy(), rtol=1e-12, atol=1e-14)
