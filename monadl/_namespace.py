"""Which array library an operation runs in.

Every rule computes in the namespace of its operands: NumPy for NumPy arrays
and plain numbers, CuPy for CuPy arrays, and ``x.__array_namespace__()`` for
any other array of the Python array API standard (through `array_api_compat`,
which also gives CuPy the standard's names). The rules call only names the
standard defines (NumPy >= 2 has them all in its main namespace), so one
implementation serves every library. Two arrays of different libraries in one
operation are refused with `DeviceError`: monadl never copies between host and
device behind the user's back.

>>> import numpy as np
>>> namespace(np.ones(2)) is np, namespace(1.5) is np
(True, True)
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from monadl.errors import DeviceError, OperandError

__all__ = [
    "all_finite",
    "common_namespace",
    "host_scalars_to_python",
    "index_for",
    "is_array",
    "library_name",
    "namespace",
]

Namespace = Any  # a module (or module-like object) of array functions

# Types whose namespace is NumPy without asking: the hot path is one set lookup.
_HOST: Final[frozenset[type]] = frozenset(
    {np.ndarray, float, int, bool, np.float64, np.float32, np.float16, np.int64, np.int32, np.bool_}
)
_BY_TYPE: dict[type, Namespace] = {}


def namespace(x: object) -> Namespace:
    """The array namespace of one value (NumPy for plain numbers)."""
    kind = type(x)
    if kind in _HOST:
        return np
    found = _BY_TYPE.get(kind)
    if found is None:
        found = _BY_TYPE[kind] = _lookup(x)
    return found


def _lookup(x: object) -> Namespace:
    if isinstance(x, (np.ndarray, np.generic, float, int)):
        return np
    import array_api_compat

    try:
        return array_api_compat.array_namespace(x)
    except TypeError:
        raise OperandError(
            f"{type(x).__module__}.{type(x).__name__} is not an array of a known array library"
        ) from None


def index_for(data: Any, index: Any) -> Any:
    """``index`` (a slice, or host row numbers or a host mask) as an index of
    ``data``: for another library's array, a copy in it, on its device
    (queued on the stream like a kernel)."""
    if type(data) is np.ndarray or type(index) is slice:
        return index
    return namespace(data).asarray(index, device=data.device)


def is_array(x: object) -> bool:
    """Whether ``x`` is an array of any library (NumPy's included), not a scalar.

    CuPy's arrays (up to 14 at least) have no ``__array_namespace__``:
    `array_api_compat` knows them, and the other libraries it wraps, by type.
    """
    if isinstance(x, np.generic):
        return False
    if hasattr(x, "__array_namespace__"):
        return True
    import array_api_compat

    return bool(array_api_compat.is_array_api_obj(x))


def library_name(x: object) -> str:
    """``numpy``, ``cupy``, ``array_api_strict`` ...: the library an array comes from."""
    return type(x).__module__.split(".")[0]


def common_namespace(values: tuple[Any, ...], op: str) -> Namespace:
    """The one namespace of ``values`` (scalars fit any); `DeviceError` if two libraries meet."""
    found: Namespace = None
    first: Any = None
    for v in values:
        if isinstance(v, (float, int, np.generic)):
            continue  # a scalar goes along with any array
        xp = namespace(v)
        if found is None:
            found, first = xp, v
        elif xp is not found:
            raise DeviceError(
                f"{op}: operands mix an array of {_where(first)} and an array of {_where(v)}; monadl never copies "
                "between libraries or devices by itself: move one explicitly (xp.asarray(x) with the other's "
                "namespace xp; for CuPy: cupy.asarray(x) to the device, x.get() to the host)"
            )
    return np if found is None else found


def host_scalars_to_python(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """NumPy scalars as Python numbers, so that strict array libraries accept them."""
    return tuple(v.item() if isinstance(v, np.generic) else v for v in values)


def _where(x: Any) -> str:
    name = library_name(x)
    return f"{name} (host)" if name == "numpy" else f"{name} ({getattr(x, 'device', 'device')})"


def all_finite(x: object) -> bool:
    """Whether an array (of any library) or a number holds no NaN and no infinity.

    >>> all_finite(np.array([1.0, np.inf]))
    False
    """
    xp = namespace(x)
    return bool(xp.all(xp.isfinite(x)))
