from typing import Any

import numpy.typing as npt

def train_test_split(
    *arrays: npt.NDArray[Any],
    test_size: float | int | None = None,
    train_size: float | int | None = None,
    random_state: int | None = None,
    shuffle: bool = True,
    stratify: npt.NDArray[Any] | None = None,
) -> list[npt.NDArray[Any]]: ...
