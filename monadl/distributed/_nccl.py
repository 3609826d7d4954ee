"""Gradients that live on GPUs, reduced by NCCL (``cupy.cuda.nccl``) where they are.

`NcclCommunicator` sends device arrays (CuPy) through NCCL on a CUDA stream
and everything else (the small host-side statuses and failure messages)
through a host `Communicator` (MPI), so `DataParallel` runs unchanged and
never copies a gradient to the host. NCCL calls only enqueue work on the
stream (the overlap enqueues each bucket as soon as its gradients are final,
so the GPU reduces it while the backward goes on); completion is an event that the event loop polls, with the same
deadline as MPI's collectives.

NCCL's all-gather takes equal counts; sparse rows of unequal counts are
padded to the largest and the padding dropped afterwards.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Final, final

import numpy as np
import numpy.typing as npt

from monadl._namespace import namespace
from monadl.distributed._comm import DEFAULT_TIMEOUT, Communicator, Pending, Polled, mpi_world, poll

__all__ = ["NcclCommunicator", "nccl_world"]

# NCCL's names of the dtypes gradients and indices come in.
_NCCL_DTYPES: Final = {
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "int32": "NCCL_INT32",
    "int64": "NCCL_INT64",
    "uint8": "NCCL_UINT8",
}


def _device_pointer(array: Any) -> int:
    return int(array.data.ptr)


def _is_device(array: Any) -> bool:
    return not isinstance(array, np.ndarray)


@final
class NcclCommunicator(Communicator):
    """Device arrays through NCCL, host arrays through ``host`` (see `nccl_world`).

    Args:
        host: the communicator for host arrays and for setting NCCL up.
        comm: a ``cupy.cuda.nccl.NcclCommunicator`` of the same ranks.
        nccl: the module with NCCL's constants (``cupy.cuda.nccl``); tests pass a fake.
        stream: the CUDA stream the collectives run on (``cupy.cuda.Stream``);
            None for CuPy's current stream.
        is_device: which arrays go through NCCL; pointer: an array's device address;
        ready: a function that marks the stream's work so far and returns a test of its completion.
        timeout: seconds to wait for the other ranks.

    >>> comm = await nccl_world()  # doctest: +SKIP
    """

    __slots__ = ("_comm", "_host", "_is_device", "_nccl", "_pointer", "_ready", "_stream", "timeout")

    def __init__(
        self,
        host: Communicator,
        comm: Any,
        *,
        nccl: Any = None,
        stream: Any = None,
        is_device: Callable[[Any], bool] = _is_device,
        pointer: Callable[[Any], int] = _device_pointer,
        ready: Callable[[Any], Callable[[], bool]] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self._host = host
        self._comm = comm
        self._nccl = importlib.import_module("cupy.cuda.nccl") if nccl is None else nccl
        self._stream = stream
        self._is_device = is_device
        self._pointer = pointer
        self._ready = _event_ready if ready is None else ready
        self.timeout = timeout

    @property
    def rank(self) -> int:
        return self._host.rank

    @property
    def size(self) -> int:
        return self._host.size

    async def allreduce(self, send: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return (await self.allreduce_many([send]))[0]

    async def allreduce_many(self, sends: Sequence[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        if not all(self._is_device(s) for s in sends):
            return await self._host.allreduce_many(sends)
        outs = [self._enqueue_allreduce(send) for send in sends]  # back to back on one stream: pipelined
        await self._wait("all-reduce")
        return outs

    def _enqueue_allreduce(self, send: Any) -> Any:
        out = namespace(send).empty_like(send)
        self._comm.allReduce(
            self._pointer(send),
            self._pointer(out),
            send.size,
            self._dtype(send),
            self._nccl.NCCL_SUM,
            self._stream_pointer(),
        )
        return out

    def start_allreduce(self, send: npt.NDArray[Any]) -> Pending:
        # Enqueued now on the stream, so the GPU reduces while the backward goes on enqueuing.
        if not self._is_device(send):
            return self._host.start_allreduce(send)
        out = self._enqueue_allreduce(send)
        return Polled(self._ready(self._stream), out, self.timeout, "all-reduce", self.rank)

    async def allgather(self, send: npt.NDArray[Any], counts: Sequence[int]) -> npt.NDArray[Any]:
        if not self._is_device(send):
            return await self._host.allgather(send, counts)
        xp = namespace(send)
        most = max(counts)
        padded = xp.zeros((most, *send.shape[1:]), dtype=send.dtype, device=send.device)
        padded[: send.shape[0]] = send
        out = xp.empty((self.size * most, *send.shape[1:]), dtype=send.dtype, device=send.device)
        self._comm.allGather(
            self._pointer(padded), self._pointer(out), padded.size, self._dtype(send), self._stream_pointer()
        )
        await self._wait("all-gather")
        gathered: npt.NDArray[Any] = xp.concat([out[r * most : r * most + c] for r, c in enumerate(counts)])
        return gathered

    async def broadcast(self, buffer: npt.NDArray[Any], root: int = 0) -> npt.NDArray[Any]:
        if not self._is_device(buffer):
            return await self._host.broadcast(buffer, root)
        self._comm.bcast(self._pointer(buffer), buffer.size, self._dtype(buffer), root, self._stream_pointer())
        await self._wait("broadcast")
        return buffer

    def _dtype(self, array: Any) -> int:
        name = str(array.dtype).rsplit(".", 1)[-1]
        if name not in _NCCL_DTYPES:
            raise TypeError(f"NCCL cannot reduce {name} arrays")
        return int(getattr(self._nccl, _NCCL_DTYPES[name]))

    def _stream_pointer(self) -> int:
        if self._stream is None:
            return int(importlib.import_module("cupy").cuda.get_current_stream().ptr)
        return int(self._stream.ptr)

    async def _wait(self, what: str) -> None:
        await poll(self._ready(self._stream), self.timeout, what, self.rank)


def _event_ready(stream: Any) -> Callable[[], bool]:
    cupy = importlib.import_module("cupy")
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return lambda: bool(event.done)


async def nccl_world(host: Communicator | None = None, patience: float = DEFAULT_TIMEOUT) -> NcclCommunicator:
    """A NCCL communicator of the ranks of ``host`` (``MPI.COMM_WORLD`` by default).

    Rank 0 makes NCCL's unique id and ``host`` broadcasts it; ``patience``
    is the seconds a collective waits for the other ranks. Select each
    rank's GPU first (``cupy.cuda.Device(local_rank).use()``).

    >>> comm = await nccl_world()  # doctest: +SKIP
    """
    host = mpi_world(patience) if host is None else host
    nccl = importlib.import_module("cupy.cuda.nccl")
    packed = packed_id(nccl.get_unique_id()) if host.rank == 0 else np.zeros(_ID_LENGTH + 1, np.int64)
    uid = unpacked_id(await host.broadcast(packed))
    comm = nccl.NcclCommunicator(host.size, uid, host.rank)
    return NcclCommunicator(host, comm, nccl=nccl, timeout=patience)


# NCCL's unique id is 128 bytes; CuPy gives it as a tuple of ints (signed
# chars) in older releases and as ``bytes`` from CuPy 14, and takes it back in
# the form it gave. The broadcast array carries the form in its first entry.
_ID_LENGTH: Final = 128
_AS_BYTES: Final = 1


def packed_id(uid: bytes | Sequence[int]) -> npt.NDArray[np.int64]:
    """NCCL's unique id as an int64 array the host communicator can broadcast."""
    form = _AS_BYTES if isinstance(uid, bytes) else 0
    values = list(uid)
    if len(values) != _ID_LENGTH:
        raise ValueError(f"NCCL's unique id has {len(values)} entries, not {_ID_LENGTH}")
    return np.array([form, *values], np.int64)


def unpacked_id(packed: npt.NDArray[np.int64]) -> bytes | tuple[int, ...]:
    """The id `packed_id` packed, in the form CuPy gave it."""
    values = [int(v) for v in packed[1:]]
    return bytes(values) if int(packed[0]) == _AS_BYTES else tuple(values)
