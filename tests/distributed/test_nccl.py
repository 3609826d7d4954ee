"""The NCCL path: with a fake NCCL on NumPy arrays everywhere, and for real on a GPU if there is one."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import monadl as ml
from monadl.distributed import Communicator, DataParallel, NcclCommunicator, run_local, shard
from tests.distributed.test_data_parallel import Counting, Net, batches, single_process


class FakeNccl:
    """The constants of ``cupy.cuda.nccl`` that NcclCommunicator uses."""

    NCCL_SUM = 0
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
    NCCL_INT32, NCCL_INT64, NCCL_UINT8 = 2, 4, 1


class FakeStream:
    ptr = 1234


class FakeComm:
    """A NCCL communicator of ranks in threads: "device pointers" are NumPy
    arrays' addresses, and each call meets the other ranks at a barrier."""

    def __init__(self, rank: int, shared: dict[Any, Any]) -> None:
        self.rank = rank
        self.shared = shared
        self.arrays: dict[int, npt.NDArray[Any]] = {}
        self.calls: list[tuple[str, int, int]] = []

    def pointer(self, array: npt.NDArray[Any]) -> int:
        self.arrays[array.ctypes.data] = array
        return int(array.ctypes.data)

    def _meet(self, send: npt.NDArray[Any]) -> list[npt.NDArray[Any]]:
        barrier: threading.Barrier = self.shared["barrier"]
        barrier.wait()
        self.shared[self.rank] = send.copy()
        barrier.wait()
        parts = [self.shared[r] for r in range(barrier.parties)]
        barrier.wait()
        return parts

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        assert op == FakeNccl.NCCL_SUM and stream == FakeStream.ptr
        self.calls.append(("allReduce", count, dtype))
        self.arrays[recv][...] = sum(self._meet(self.arrays[send]))

    def allGather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self.calls.append(("allGather", count, dtype))
        self.arrays[recv][...] = np.concatenate(self._meet(self.arrays[send]))

    def bcast(self, buffer: int, count: int, dtype: int, root: int, stream: int) -> None:
        self.calls.append(("bcast", count, dtype))
        self.arrays[buffer][...] = self._meet(self.arrays[buffer])[root]


def fake_nccl(host: Communicator, shared: dict[Any, Any]) -> tuple[NcclCommunicator, FakeComm, Counting]:
    fake, counting = FakeComm(host.rank, shared), Counting(host)
    comm = NcclCommunicator(
        counting,
        fake,
        nccl=FakeNccl,
        stream=FakeStream(),
        is_device=lambda a: a.dtype.kind == "f",  # floats play the device arrays
        pointer=fake.pointer,
        ready=lambda stream: lambda: True,
    )
    return comm, fake, counting


@pytest.mark.parametrize("overlap", [False, True])
def test_gradients_go_through_nccl_and_statuses_through_the_host(overlap: bool) -> None:
    shared: dict[Any, Any] = {"barrier": threading.Barrier(2)}

    async def rank(host: Communicator) -> tuple[dict[Any, Any], list[Any], int]:
        comm, fake, counting = fake_nccl(host, shared)
        net = Net(host.rank)
        dp = DataParallel(net, comm, overlap=overlap)
        await dp.broadcast()
        for x, y, head in batches(5):
            await dp.train(net.loss(shard(x, host.rank, 2), shard(y, host.rank, 2), head))
        return net.weights(), fake.calls, counting.reduced

    (zero, calls, host_reduced), (one, _, _) = run_local(2, rank)
    expected = single_process(5)
    for name in expected:
        np.testing.assert_array_equal(zero[name], one[name])
        np.testing.assert_allclose(zero[name], expected[name], rtol=1e-12)
    one_head, f64 = 4 * 8 + 8 + 8 * 3 + 1, FakeNccl.NCCL_FLOAT64
    if not overlap:
        assert calls == [("allReduce", one_head, f64)] * 5  # one bucket a step
    else:  # step 2 overlaps step 1's weights and reduces head 1 after; from step 3 one bucket of all
        assert calls == [("allReduce", one_head, f64)] * 2 + [("allReduce", 8 * 3, f64)] + [("allReduce", 89, f64)] * 3
    assert host_reduced == 0


def test_sparse_rows_of_unequal_counts_are_padded_for_nccl_and_trimmed() -> None:
    shared: dict[Any, Any] = {"barrier": threading.Barrier(2)}
    table = np.random.default_rng(0).standard_normal((1000, 3)).astype(np.float32)
    ids = [np.array([5, 9, 5]), np.array([999])]

    async def rank(host: Communicator) -> tuple[npt.NDArray[Any], list[Any]]:
        comm, fake, _ = fake_nccl(host, shared)
        weight = ml.Weight(table, optimizer=ml.optim.sgd(1.0))
        await DataParallel(weight, comm).train(ml.sum(ml.embedding(weight, ids[host.rank])))
        return weight.data, fake.calls

    (zero, calls), (one, _) = run_local(2, rank)
    np.testing.assert_array_equal(zero, one)
    expected = table.copy()
    np.add.at(expected, np.concatenate(ids), np.float32(-0.5))
    np.testing.assert_allclose(zero, expected, rtol=1e-6)
    assert calls == [("allGather", 3 * 3, FakeNccl.NCCL_FLOAT32)]  # the rows, padded to 3; indices via the host


def test_nccl_refuses_a_dtype_it_cannot_reduce() -> None:
    async def rank(host: Communicator) -> str:
        fake = FakeComm(0, {"barrier": threading.Barrier(1)})
        comm = NcclCommunicator(
            host, fake, nccl=FakeNccl, stream=FakeStream(), pointer=fake.pointer, is_device=lambda a: True
        )
        with pytest.raises(TypeError, match="NCCL cannot reduce complex128 arrays"):
            await comm.allreduce(np.zeros(1, np.complex128))
        return "refused"

    assert run_local(1, rank) == ["refused"]


def test_nccl_on_one_gpu() -> None:
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA device")
    nccl = pytest.importorskip("cupy.cuda.nccl")
    if not nccl.available:
        pytest.skip("CuPy was built without NCCL")

    async def rank(host: Communicator) -> Any:
        from monadl.distributed import nccl_world

        comm = await nccl_world(host)
        weight = ml.Weight(cupy.ones(3), optimizer=ml.optim.sgd(0.5))
        await DataParallel(weight, comm).train(ml.sum(weight * cupy.arange(3.0)))
        return cupy.asnumpy(weight.data)

    np.testing.assert_allclose(run_local(1, rank)[0], [1.0, 0.5, 0.0])


@pytest.mark.parametrize(
    "uid",
    [bytes(range(128)), bytes([255] * 128), tuple(range(-64, 64)), tuple([-128] * 128)],
    ids=["bytes", "bytes-high", "tuple", "tuple-negative"],
)
def test_the_unique_id_crosses_the_broadcast_in_the_form_cupy_gave(uid: bytes | tuple[int, ...]) -> None:
    """CuPy 14 gives NCCL's id as bytes (older releases as a tuple of signed
    chars) and takes it back in the same form: the other ranks must rebuild it."""
    from monadl.distributed._nccl import packed_id, unpacked_id

    packed = packed_id(uid)
    assert packed.dtype == np.int64
    back = unpacked_id(packed.copy())
    assert type(back) is type(uid)
    assert back == uid


def test_an_id_of_the_wrong_length_is_refused() -> None:
    from monadl.distributed._nccl import packed_id

    with pytest.raises(ValueError, match="127 entries, not 128"):
        packed_id(bytes(127))
