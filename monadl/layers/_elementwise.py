"""The elementwise rules: binary (``add`` to ``minimum``), unary (``negative``
to ``relu``, ``sin`` and ``cos`` among them, and ``softplus`` and
``log_sigmoid``, which never overflow),
``stop_gradient``, which passes its operand through with no delta, and
``as_layer``, which passes it through with its delta.

The value of an elementwise rule has the broadcast shape of its operands, and
each delta comes back in that shape (the table marks them ``elementwise``):
undoing broadcasting is the runtime's work, not a rule's. The hot rules
have fast paths beside the portable one: on NumPy, sigmoid in four passes
(`_logistic`) and, from `_IN_PLACE` elements on, the deltas of tanh and
sigmoid in one fresh array (`_tanh_delta`, `_sigmoid_delta`); on CuPy, a
rule of several steps as one fused kernel (`_fused`), since a GPU is
launch-bound on small arrays.

`_mask` (a boolean as 0/1 in an array's dtype) and `_identity` (the delta
rule that passes the delta on) are used by the other rule modules as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np

from monadl._namespace import namespace
from monadl.layers._operands import one_float_dtype

Value = Any  # an ndarray or a NumPy scalar
Vjp = Callable[[Value], Value]


def _either(a: Value, b: Value) -> Any:
    """The namespace of a binary operation (one operand may be a plain number)."""
    xp = namespace(a)
    return namespace(b) if xp is np else xp


def _mask(xp: Any, condition: Value, like: Value) -> Value:
    """A boolean array as 0/1 in the dtype of ``like`` (the standard has no bool arithmetic)."""
    if type(condition) is bool:  # (two plain numbers compared: inside a cell, its float arguments)
        condition = xp.asarray(condition)
    return xp.astype(condition, like.dtype)


# ---- elementwise, binary ----------------------------------------------------
def _add(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return a + b, _PASS_BOTH


def _sub(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return a - b, _PASS_AND_NEGATE


def _mul(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return a * b, (lambda g: g * b, lambda g: g * a)


def _div(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = a / b
    return out, (lambda g: g / b, lambda g: -g * out / b)


def _pow(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = a**b

    def vjp_b(g: Value) -> Value:
        # d(a**b)/db = a**b * log(a); where a == 0, PyTorch's: 0 for b >= 0 (the limit for b > 0),
        # and inf * log(0) = -inf for b < 0.
        xp = namespace(out)
        # (a plain number in the value's dtype: a float64 array would make a float32 delta float64)
        base = (
            xp.asarray(a, dtype=out.dtype) if type(a) in (int, float, bool) and hasattr(out, "dtype") else xp.asarray(a)
        )
        with np.errstate(divide="ignore", invalid="ignore"):  # (log(0), and a negative base's NaN, as PyTorch's)
            d = out * xp.log(base)
        return g * xp.where((base == 0) & (xp.asarray(b) >= 0), xp.zeros_like(d), d)

    def vjp_a(g: Value) -> Value:
        # d(a**b)/da = b * a**(b - 1); 0 where b == 0 (a**0 is 1 everywhere: at a == 0, 0 * inf was NaN).
        if isinstance(b, (int, float)) and b == 0:
            return g * 0.0 * out
        if isinstance(b, (int, float)):
            return g * b * a ** (b - 1)
        with np.errstate(divide="ignore", invalid="ignore"):  # (0 ** -1 and 0 * inf where b == 0: masked below)
            grad = g * b * a ** (b - 1)
        xp = namespace(grad)
        return xp.where(xp.asarray(b) == 0, xp.zeros_like(grad), grad)

    return out, (vjp_a, vjp_b)


def _maximum(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    xp = _either(a, b)
    out = xp.maximum(a, b)
    return out, _picked(xp, a < b, a > b, a == b, out)


def _minimum(a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    xp = _either(a, b)
    out = xp.minimum(a, b)
    return out, _picked(xp, a > b, a < b, a == b, out)


def _picked(xp: Any, first_lost: Value, second_lost: Value, tie: Value, out: Value) -> tuple[Vjp, Vjp]:
    """The deltas of a choice between two operands: all of it to the one
    chosen, half to each at a tie (so the rule is symmetric and sums to g).
    An operand gets the delta unless it lost the comparison, as PyTorch's: a
    NaN loses none, so a NaN, which the value carries, passes its delta to
    both operands."""
    half = 0.5 * _mask(xp, tie, out)
    take_first, take_second = 1 - _mask(xp, first_lost, out) - half, 1 - _mask(xp, second_lost, out) - half
    return (
        lambda g: _chosen(xp, g, take_first, lambda: xp.where(first_lost, xp.zeros_like(g), xp.where(tie, 0.5 * g, g))),
        lambda g: _chosen(
            xp, g, take_second, lambda: xp.where(second_lost, xp.zeros_like(g), xp.where(tie, 0.5 * g, g))
        ),
    )


def _chosen(xp: Any, g: Value, factor: Value, by_where: Callable[[], Value]) -> Value:
    """``g`` where chosen, 0 elsewhere: ``g * factor`` (a 0/1 factor, 0.5 at
    ties), but ``by_where()`` where the delta is not finite (inf * 0 is NaN,
    for an operand not chosen). NumPy checks the delta first (its ``where``
    is up to ten times slower than the product); other libraries take
    ``where``, which reads no value back to the host."""
    if xp is not np:
        return by_where()
    return g * factor if np.isfinite(g).all() else by_where()


# ---- elementwise, unary -----------------------------------------------------
def _neg(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return -a, _NEGATE


def _exp(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = namespace(a).exp(a)
    return out, (lambda g: g * out,)


def _log(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return namespace(a).log(a), (lambda g: g / a,)


def _sqrt(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    out = namespace(a).sqrt(a)

    def vjp(g: Value) -> Value:
        # At 0 an infinity (0/0 where g is 0), as PyTorch's, which a relu or a mask before it takes out:
        # without a warning (a new user's sqrt(relu(w)) warned, and failed under -W error, its gradient right).
        with np.errstate(divide="ignore", invalid="ignore"):
            return g * 0.5 / out

    return out, (vjp,)


def _abs(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    xp = namespace(a)
    return xp.abs(a), (lambda g: g * xp.sign(a),)


def _sin(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    xp = namespace(a)
    return xp.sin(a), (lambda g: g * xp.cos(a),)


def _cos(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    xp = namespace(a)
    return xp.cos(a), (lambda g: -g * xp.sin(a),)


def _tanh(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) is np.ndarray:  # the hot path: no namespace lookup, no kernel lookup
        out = np.tanh(a)
        if out.size < _IN_PLACE:  # (a small array: the call would cost more than the two arrays it saves)
            return out, (lambda g: g * (1 - out * out),)
        return out, (lambda g: _tanh_delta(g, out),)
    xp = namespace(a)
    out = xp.tanh(a)
    fused = None if xp is np else _fused(xp, "tanh_backward")
    if fused is not None:
        return out, (lambda g: fused(g, out),)
    return out, (lambda g: g * (1 - out * out),)


_IN_PLACE: Final = 4096
"""Elements from which an elementwise delta is computed in one fresh array: below,
the call and its keyword arguments cost more instructions than the arrays saved
(a chain of 16 x 64 tanh layers ran 0.9% more instructions)."""


def _tanh_delta(g: Value, out: np.ndarray[Any, Any]) -> Value:
    """``g * (1 - out**2)`` in one fresh array: 20-50% faster than three."""
    d = out * out
    if type(d) is not np.ndarray or type(g) is not np.ndarray or g.shape != d.shape or g.dtype != d.dtype:
        return g * (1 - d)  # (a 0-d array's square is a scalar; a broadcast or other dtype: as NumPy gives it)
    np.subtract(1, d, out=d)
    return np.multiply(g, d, out=d)


def _sigmoid(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    if type(a) is np.ndarray and a.ndim and a.dtype.kind == "f":
        out = _logistic(a)
        if out.size < _IN_PLACE:
            return out, (lambda g: g * out * (1 - out),)
        return out, (lambda g: _sigmoid_delta(g, out),)
    xp = namespace(a)
    fused = None if xp is np else _fused(xp, "sigmoid")
    if fused is not None:
        out = fused(a)
        backward = _fused(xp, "sigmoid_backward")
        assert backward is not None
        return out, (lambda g: backward(g, out),)
    out = _scalar(xp, _stable_logistic(xp, a))  # (its where gives a 0-d array for a scalar: NumPy's scalar)
    return out, (lambda g: g * out * (1 - out),)


def _logistic(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``1 / (1 + exp(-a))`` in four passes, in one fresh array: 2.3x faster
    than the stable formula's seven on a Tree-LSTM's gate slices (exp is
    NumPy's costliest pass here, and the stable formula takes two). Where
    ``exp(-a)`` overflows (some ``a`` below -88 in float32, -709 in float64)
    the stable formula computes the whole array instead, so the far negative
    tail keeps its subnormal values (PyTorch's gives 0 there). Within 4 ulps
    of the exact logistic function (the stable formula: within 3.4)."""
    out: np.ndarray[Any, Any] = np.negative(a)
    with np.errstate(over="raise"):
        try:
            np.exp(out, out=out)
        except FloatingPointError:
            stable: np.ndarray[Any, Any] = _stable_logistic(np, a)
            return stable
    out += 1
    np.reciprocal(out, out=out)
    return out


def _stable_logistic(xp: Any, a: Value) -> Value:
    """The logistic function by its two branches: ``exp(-|a|)`` never overflows."""
    return _logistic_of(xp, a, xp.exp(-xp.abs(a)))


def _sigmoid_delta(g: Value, out: np.ndarray[Any, Any]) -> Value:
    """``g * out * (1 - out)`` in one fresh array: 15-45% faster than three."""
    if type(g) is not np.ndarray or g.shape != out.shape or g.dtype != out.dtype:
        return g * out * (1 - out)  # (a broadcast or another dtype: as NumPy gives it)
    d = np.subtract(1, out)
    d *= out
    d *= g
    return d


def _softplus(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    # log(1 + e**a) as max(a, 0) + log1p(e**-|a|): e**-|a| never overflows, and log1p keeps the far
    # negative tail's e**a (log(1 + e**a) rounds it to 0). Its delta is sigmoid(a), from the same e.
    xp, e = _tail(a)
    out = _scalar(xp, _clipped(xp, a, xp.maximum) + xp.log1p(e))
    return out, (lambda g: g * _logistic_of(xp, a, e),)


def _log_sigmoid(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    # -softplus(-a), as min(a, 0) - log1p(e**-|a|); its delta is sigmoid(-a), which 1 - sigmoid(a)
    # would round to 0 for a above 37 (float64).
    xp, e = _tail(a)
    out = _scalar(xp, _clipped(xp, a, xp.minimum) - xp.log1p(e))
    return out, (lambda g: g * _logistic_of(xp, -a, e),)


def _tail(a: Value) -> tuple[Any, Value]:
    """The namespace of ``a``, and ``e ** -|a|`` (at most 1: it never overflows)."""
    xp = namespace(a)
    return xp, xp.exp(-xp.abs(a))


def _clipped(xp: Any, a: Value, choose: Callable[[Value, Value], Value]) -> Value:
    """``max(a, 0)`` or ``min(a, 0)`` (a NaN stays NaN); the standard's take two arrays."""
    return choose(a, 0) if xp is np else choose(a, xp.zeros_like(a))


def _logistic_of(xp: Any, a: Value, e: Value) -> Value:
    """``sigmoid(a)`` from ``e = e ** -|a|``: ``1 / (1 + e)`` where ``a >= 0``, ``e / (1 + e)`` elsewhere."""
    return xp.where(a >= 0, 1 / (1 + e), e / (1 + e))


def _where(condition: Value, a: Value, b: Value) -> tuple[Value, tuple[Vjp, ...]]:
    # Each delta where its side was chosen, 0 elsewhere: no product by a mask,
    # so an infinite side (a -inf attention mask) sends no NaN to the other.
    xp = namespace(condition)
    if xp is np:
        xp = _either(a, b)
    a, b = one_float_dtype("where", (a, b), None)  # (as a binary op's: float32 and float64 arrays refused)
    out = _scalar(xp, xp.where(condition, a, b))

    def first(g: Value) -> Value:
        return _scalar(xp, xp.where(condition, g, xp.zeros((), dtype=g.dtype)))

    def second(g: Value) -> Value:
        return _scalar(xp, xp.where(condition, xp.zeros((), dtype=g.dtype), g))

    return out, (_no_delta, first, second)


def _scalar(xp: Any, x: Value) -> Value:
    """NumPy's 0-d array as its scalar, as NumPy's other functions give one
    and a batched group's member is one (else a float32 0-d value beside a
    float64 number made float32, where the batched one made float64)."""
    return x[()] if xp is np and not x.ndim else x


def _no_delta(g: Value) -> None:  # (a condition is data: never asked for its delta)
    return None


def _relu(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    # The delta where the value is not 0, as PyTorch's (its threshold_backward reads the value):
    # where a > 0, and where a is NaN. Where chosen (`_chosen`): an infinite delta times 0 was NaN.
    if type(a) is np.ndarray or namespace(a) is np:
        out = np.maximum(a, 0)
        return out, (lambda g: _chosen(np, g, out != 0, lambda: np.where(out != 0, g, 0)),)
    xp = namespace(a)
    fused = _fused(xp, "relu_backward")
    if fused is not None:
        out = xp.maximum(a, 0)
        return out, (lambda g: fused(g, out),)
    out = xp.maximum(a, xp.zeros_like(a))  # (a NaN stays NaN)
    keep = out != 0
    return out, (lambda g: xp.where(keep, g, xp.zeros_like(g)),)


# On CuPy, a rule of several elementwise steps is one kernel: the GPU is
# launch-bound on small arrays, and each step would be a launch of ~15 us.
_CUPY_KERNELS: Final = {
    "tanh_backward": ("T g, T out", "T r", "r = g * (1 - out * out)"),
    "sigmoid": ("T a", "T r", "T e = exp(-fabs(a)); r = a >= 0 ? 1 / (1 + e) : e / (1 + e)"),
    "sigmoid_backward": ("T g, T out", "T r", "r = g * out * (1 - out)"),
    "relu_backward": ("T g, T y", "T r", "r = y != 0 ? g : (T)0"),  # (y: relu's value, NaN where a is)
}
_FUSED: dict[str, Callable[..., Value]] = {}


def _fused(xp: Any, name: str) -> Callable[..., Value] | None:
    """The fused CuPy kernel ``name`` when ``xp`` is CuPy's namespace, else None
    (callers skip the call for NumPy, the hot path)."""
    if getattr(xp, "__name__", "") != "array_api_compat.cupy":
        return None
    kernel = _FUSED.get(name)
    if kernel is None:
        import cupy

        inputs, outputs, body = _CUPY_KERNELS[name]
        kernel = _FUSED[name] = cupy.ElementwiseKernel(inputs, outputs, body, f"monadl_{name}")
    return kernel


def _stop_gradient(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return a, ()  # no rule: the operand gets no delta


def _as_layer(a: Value) -> tuple[Value, tuple[Vjp, ...]]:
    return a, _PASS


def _identity(g: Value) -> Value:
    return g


def _negative(g: Value) -> Value:
    return -g


# The delta rules of as_layer, add, subtract and negative capture nothing: built once.
_PASS: Final = (_identity,)
_PASS_BOTH: Final = (_identity, _identity)
_PASS_AND_NEGATE: Final = (_identity, _negative)
_NEGATE: Final = (_negative,)
