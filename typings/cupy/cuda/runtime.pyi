from typing import Any

def getDeviceCount() -> int: ...  # noqa: N802 - CUDA's name
def deviceSynchronize() -> None: ...  # noqa: N802
def getDeviceProperties(device: int) -> dict[str, Any]: ...  # noqa: N802
