def getDeviceCount() -> int: ...  # noqa: N802 - CUDA's name
def deviceSynchronize() -> None: ...  # noqa: N802
