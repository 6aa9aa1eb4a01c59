# Stub of the compiled module fastln._output_cache (src/fastln/_output_cache.pyx).
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import numpy.typing as npt

MAX_BLOCKS: int
MIN_BYTES: int

def empty_output(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]: ...
def installed() -> AbstractContextManager[None]: ...
def set_max_bytes(max_bytes: int) -> None: ...
def stats() -> dict[str, int]: ...
