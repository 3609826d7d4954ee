"""`Weight`: a trainable variable, its optimizer and the optimizer's state.

What its commits share with the evaluations running now: `monadl.layers._commits`;
what its refusals say: `monadl.layers._weight_messages`.
"""

from __future__ import annotations

import weakref
from math import prod
from threading import get_ident
from typing import TYPE_CHECKING, Any, Final, NoReturn, SupportsIndex, TypeAlias, TypeVar, final, overload

import numpy as np

from monadl._namespace import is_array, namespace
from monadl._state_file import STATE_RULE, unstorable
from monadl.errors import OperandError
from monadl.layers._arrays import NumPyScalar
from monadl.layers._commits import COMMIT_LOCK, pin_for_readers
from monadl.layers._layer import Array, DeviceArray, Expr, Layer
from monadl.layers._operands import dtype_name
from monadl.layers._replace import replace_data, replace_state
from monadl.layers._site import Site, caller_site, site_text
from monadl.layers._traced_now import TRACING
from monadl.layers._weight_messages import another_optimizer, copier_site, not_frozen, shape_text

if TYPE_CHECKING:
    from monadl.optim import GradientTransformation

__all__ = ["ArrayWeight", "ScalarWeight", "Weight", "weight_sites"]

D = TypeVar("D")
G = TypeVar("G")


@final
class Weight(Expr[D, G]):
    """A trainable variable: its data, its optimizer and the optimizer's state.

    Each ``train()`` that reaches a weight sums every use's delta and then
    takes exactly one optimizer step, after the whole backward pass succeeded.

    Args:
        data: the initial value: a float (a scalar weight) or a float array,
            copied: a step never writes into the array given, and two
            weights made from one array are two weights that train apart
            (unlike PyTorch's ``nn.Parameter(t)``, which shares ``t``'s
            storage). To share a weight, use the one `Weight` in both places;
            its uses' gradients add up to one step.
        optimizer: how to turn a gradient into an update. Left out, or
            None (as a wrapper's own ``optimizer=None`` passes it on), the
            weight gets `monadl.optim.default_optimizer()`, plain
            ``sgd(0.0005)`` unless `monadl.optim.using_default` says
            otherwise: None does not freeze the weight, it trains. To
            freeze one (PyTorch's ``requires_grad_(False)``), read it through
            `monadl.stop_gradient` where the model uses it: it then takes no
            step and its optimizer state stays as it is.

    >>> import numpy as np, monadl as ml
    >>> w = ml.Weight(np.zeros(2), optimizer=ml.optim.sgd(0.5))
    >>> w.data
    array([0., 0.])
    """

    __slots__ = ("__weakref__", "_bound", "_data", "_layer", "_optimizer", "_site", "_state")

    _data: Any
    _bound: tuple[Any, float] | None  # (data, a bound on its norm) the commit proved; see `monadl.optim.apply`
    _optimizer: GradientTransformation
    _state: Any
    _site: Site
    _layer: weakref.ref[Layer[Any, Any]] | None  # its node, `ml.as_layer(w)` (`_functions.weight_layer`)

    @overload
    def __init__(  # (a NumPy scalar too: a float32 one stays float32, as a float32 array's sum, also typed float)
        self: Weight[float, float], data: float | NumPyScalar, *, optimizer: GradientTransformation | None = None
    ) -> None: ...
    @overload
    def __init__(
        self: Weight[Array, Array], data: Array, *, optimizer: GradientTransformation | None = None
    ) -> None: ...
    @overload
    def __init__(
        self: Weight[Any, Any], data: DeviceArray, *, optimizer: GradientTransformation | None = None
    ) -> None: ...
    def __init__(self, data: Any, *, optimizer: GradientTransformation | None = None) -> None:
        from monadl import optim

        if TRACING:
            _refuse_made_in_a_trace()
        if isinstance(data, Expr):
            raise OperandError("Weight(...) takes plain data, not a Layer or a Weight")
        foreign = is_array(data) and not isinstance(data, np.ndarray)
        if not foreign and (
            isinstance(data, (bool, np.bool_)) or not isinstance(data, (float, int, np.number, np.ndarray))
        ):
            raise OperandError(f"Weight(...) takes a float or a float array, got {type(data).__name__}")
        if foreign:  # CuPy or another array API library: the weight lives where its data does
            xp = namespace(data)
            if not xp.isdtype(data.dtype, "real floating"):
                raise OperandError(f"Weight(...) takes a float array, got dtype {data.dtype}")
            data = xp.asarray(data, copy=True)
        elif isinstance(data, np.ndarray):
            if data.dtype.kind != "f":
                raise OperandError(f"Weight(...) takes a float array, got dtype {data.dtype}")
            # (in native byte order: a big-endian array read from a file steps, saves and loads as any other;
            # NumPy's own dtype object, not an equal copy ``newbyteorder`` makes: the runtime checks dtypes by
            # identity first, and an equal copy cost every node reading the weight a full check until its first step)
            data = data.astype(np.dtype(data.dtype.char), order="C")
        elif not isinstance(data, np.floating):
            data = np.float64(data)
        if optimizer is None:
            optimizer = optim.default_optimizer()
        elif not isinstance(optimizer, optim.GradientTransformation):
            raise OperandError(
                f"Weight(...): {optim.transforms.refusal(optimizer, 'optimizer')}{not_frozen(optimizer)}"
            )
        self._data = data
        self._bound = None
        self._optimizer = optimizer
        self._site = caller_site()
        self._layer = None
        self._state = self._initial_state(optimizer, "Weight(...)")

    @property
    def data(self) -> D:
        """The current value. A step never changes an array that you hold (it
        writes only into one that nothing but the weight refers to).

        Treat the array as read-only: assign ``data`` to change a weight.
        Read or assigned in an `monadl.operation` cell while it is traced,
        it is refused (`OperandError`): the trace would keep the first
        call's; the cell uses the weight itself, read at each call.
        """
        if TRACING and get_ident() in TRACING:
            self._refuse_in_trace("read .data of")
        with COMMIT_LOCK:
            return self._data  # type: ignore[no-any-return]

    # The setters (for checkpoints, surgery, tests) sit right after their getters, as
    # mypy requires. Use them outside train(): a step in flight commits over them.

    @data.setter
    def data(self, value: D) -> None:
        """Replace the value with a copy of ``value``: same shape, dtype and
        array library (a Python number takes the weight's dtype), else
        `ShapeError`, `DTypeError` or `DeviceError`. The weight keeps its
        type in memory (a NumPy scalar stays one); the optimizer state stays.
        An evaluation running meanwhile goes on with the value it began with
        (even one that assigned it: its model is the one it began with).

        >>> import numpy as np, monadl as ml
        >>> w = ml.Weight(np.zeros(2))
        >>> w.data = np.array([1.0, 2.0])
        >>> w.data
        array([1., 2.])
        """
        if TRACING and get_ident() in TRACING:
            self._refuse_in_trace("assigned .data of", assigned=True)
        data = replace_data(self._data, value, "Weight.data")
        with COMMIT_LOCK:
            pin_for_readers((self,))
            self._data = data

    # Shape and dtype never change (the setter, a step and a checkpoint keep them), and
    # an in-place step leaves them alone: read without `COMMIT_LOCK`.

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the data: ``()`` for a scalar weight.

        >>> import numpy as np, monadl as ml
        >>> ml.Weight(np.zeros((2, 3))).shape, ml.Weight(1.0).shape
        ((2, 3), ())
        """
        return tuple(self._data.shape)

    @property
    def ndim(self) -> int:
        """The number of axes of the data: 0 for a scalar weight."""
        return len(self._data.shape)

    @property
    def size(self) -> int:
        """The number of elements of the data: 1 for a scalar weight."""
        return prod(self._data.shape)  # (not the data's ``size``: PyTorch's is a method)

    @property
    def dtype(self) -> Any:
        """The dtype of the data: a NumPy dtype for NumPy data (``float64``,
        ``float32`` ...), the array library's own for another library's.

        >>> import numpy as np, monadl as ml
        >>> ml.Weight(np.zeros(2, np.float32)).dtype
        dtype('float32')
        """
        return self._data.dtype

    @property
    def optimizer(self) -> GradientTransformation:
        """The optimizer that steps this weight."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: GradientTransformation) -> None:
        """Step with ``optimizer`` from now on, from its fresh state (``init``).

        To change a learning rate and keep the state (Adam's moments and step
        count), set it back after: ``state = w.state``, ``w.optimizer =
        ml.optim.adam(1e-4)``, ``w.state = state``. Another kind of
        optimizer has a state of other parts (a chain's holds one per
        transformation): put the old parts in the fresh state's places, as
        ``w.state = (state[0], *w.state[1:])`` from Adam to AdamW.

        >>> import numpy as np, monadl as ml
        >>> w = ml.Weight(np.zeros(2))
        >>> w.optimizer = ml.optim.adam(1e-3)
        >>> w.state[0].step
        0
        """
        from monadl import optim

        if TRACING and get_ident() in TRACING:
            self._refuse_in_trace("assigned .optimizer of", assigned=True)
        if not isinstance(optimizer, optim.GradientTransformation):
            raise OperandError(
                f"Weight.optimizer: {optim.transforms.refusal(optimizer, 'the optimizer')}{not_frozen(optimizer)}"
            )
        state = self._initial_state(optimizer, "Weight.optimizer")
        self._optimizer = optimizer
        self._state = state

    def _initial_state(self, optimizer: GradientTransformation, what: str) -> Any:
        """``optimizer.init``'s state for this weight, refused where a
        checkpoint could not store it (a dict, a list, a dataclass): found
        here, not at the first ``ml.save`` after a long run."""
        state = optimizer.init(self._data)
        found = unstorable(state, "state")
        if found is not None:
            raise TypeError(
                f"{what}: the optimizer's init made a state that a checkpoint cannot store ({found}), for the weight "
                f"built at {site_text(self._site)}: {STATE_RULE}"
            )
        return state

    @property
    def state(self) -> Any:
        """The optimizer's state for this weight (Adam's step count and
        moments ...), as ``optimizer.init`` made it and each step replaced it.

        Settable to a state of the same structure: the same tuples and
        NamedTuples, numbers where it has numbers, arrays of the same shape,
        dtype and library where it has arrays (copied), else an error naming
        the first difference.

        >>> import numpy as np, monadl as ml
        >>> w = ml.Weight(np.zeros(2), optimizer=ml.optim.momentum(0.1))
        >>> w.state = (np.ones(2), None)
        >>> w.state
        (array([1., 1.]), None)
        """
        if TRACING and get_ident() in TRACING:
            self._refuse_in_trace("read .state of")
        with COMMIT_LOCK:  # (a sparse step may write rows into state arrays nobody holds, as into data)
            return self._state

    @state.setter
    def state(self, value: Any) -> None:
        if TRACING and get_ident() in TRACING:
            self._refuse_in_trace("assigned .state of", assigned=True)
        state = replace_state(self._state, value, "Weight.state", another_optimizer(self._optimizer))
        with COMMIT_LOCK:
            self._state = state

    def __repr__(self) -> str:
        data = self._data
        size = self.size  # (not data.size: PyTorch's is a method)
        if size <= _SHOWN:
            return f"Weight({data!r})"
        # (a large one's values fill a screen: its dtype, shape and line, as an error names it)
        return f"Weight({dtype_name(data.dtype)}{list(data.shape)}, built at {site_text(self._site)})"

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """As Python's own (``copy.copy``, ``copy.deepcopy`` and pickle call
        it), but refused while a cell is traced on this thread: the copy
        would hold the weight's value then, at every later call."""
        if TRACING and get_ident() in TRACING:
            self._refuse_in_trace("copied", site=copier_site())
        return super().__reduce_ex__(protocol)

    def _refuse_in_trace(self, what: str, *, assigned: bool = False, site: Site | None = None) -> NoReturn:
        """Refuse to read, assign or copy this weight's data or state
        (``what`` the cell did, at ``site``: the caller's by default) while
        an operation is traced on this thread (`monadl.layers._traced_now`)."""
        if assigned:
            why, instead = (
                "a trace runs once per signature, not at each call, so later calls would not assign it",
                "assign it outside the cell (before or after the call, or after predict() or train())",
            )
        else:
            why, instead = (
                "the trace would keep that value for every later call, and an assignment to the weight after it "
                "would change nothing",
                "use the weight itself in the cell (h - w, read at each call; ml.stop_gradient(w) where no gradient "
                "may reach it), or pass the value as an argument (cell(h, w.data): data, read at each call)",
            )
        raise OperandError(
            f"operation {TRACING[get_ident()]}: the cell {what} the weight {shape_text(self._data)}built at "
            f"{site_text(self._site)} (at {site_text(caller_site() if site is None else site)}) while it was traced; "
            f"{why}: {instead}"
        )

    def _unread(self, what: str) -> NoReturn:
        raise OperandError(
            f"a weight is not read as {what}: its value now is w.data (a model that reads it there does not "
            "learn it; compute with the weight itself)"
        )


_SHOWN: Final = 16
"""Elements of a weight whose repr shows its values (more: its dtype and shape)."""

ScalarWeight: TypeAlias = Weight[float, float]
"""A weight holding one float (a bias of no dimensions)."""
ArrayWeight: TypeAlias = Weight[Array, Array]
"""A weight holding a NumPy array."""


def weight_sites(inputs: tuple[Any, ...]) -> str:
    """Where the weights among an operation's operands were built, for its
    error message (``; operand 1 is the weight float64[2] built at f.py:16``): a helper
    shared by every layer of a model names only its own line, not which
    weight does not fit. Only read when a message is made.

    >>> import numpy as np
    >>> weight_sites((np.ones(2), Weight(np.ones(2)))).startswith("; operand 1 is the weight float64[2] built at ")
    True
    """
    sites = [
        f"; operand {i} is the weight {shape_text(w._data)}built at {site_text(w._site)}"
        for i, w in enumerate(inputs)
        if type(w) is Weight
    ]
    return "".join(sites[:3]) + (f"; and {len(sites) - 3} more weights" if len(sites) > 3 else "")


def _refuse_made_in_a_trace() -> None:
    """Refuse a weight made while this thread traces an operation: the trace
    runs once per signature, so each trace would keep one hidden weight of
    its own, which steps but which no model holds (``ml.save`` misses it),
    where the unmarked function makes a fresh one per call."""
    name = TRACING.get(get_ident())
    if name is not None:
        raise OperandError(
            f"operation {name}: the cell made an ml.Weight while it was traced; a cell is traced once per "
            "signature and later calls replay the trace, so that weight would be one hidden weight per trace, "
            "not one per call, and no model would hold it (ml.save would miss it): make the weight outside the "
            "cell (in your model's __init__) and close over it, or pass it as an argument"
        )
