from typing import Any

import numpy as np
import numpy.typing as npt

class Bunch:
    data: npt.NDArray[np.float64]
    target: npt.NDArray[np.int64]
    images: npt.NDArray[np.float64]
    def __getattr__(self, name: str) -> Any: ...

def load_digits(*, n_class: int = 10, return_X_y: bool = False, as_frame: bool = False) -> Bunch: ...
