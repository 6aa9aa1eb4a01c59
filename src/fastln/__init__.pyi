# Type stub of fastln's public API (the implementation is untyped Python over Cython
# extensions). Checked against the runtime by tests/test_docs.py (mypy.stubtest and a user
# script under mypy). Output dtypes: float16/float32/float64 arrays keep their type; integer and
# bool arrays give float64; anything else (lists, bfloat16, ...) is typed NDArray[Any].
from contextlib import AbstractContextManager
from typing import IO, Any, Literal, TypeVar, overload

import numpy as np
import numpy.typing as npt

__version__: str

__all__ = [
    "BatchNormCache",
    "GroupNormCache",
    "LayerNormCache",
    "RMSNormCache",
    "__version__",
    "add_layer_norm",
    "add_layer_norm_forward",
    "add_rms_norm",
    "add_rms_norm_forward",
    "batch_norm",
    "batch_norm_backward",
    "batch_norm_forward",
    "get_num_threads",
    "group_norm",
    "group_norm_backward",
    "group_norm_forward",
    "instance_norm",
    "instance_norm_backward",
    "instance_norm_forward",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "num_threads",
    "output_cache_info",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "set_num_threads",
    "set_output_cache",
    "show_config",
]

_Float = TypeVar("_Float", np.float16, np.float32, np.float64)
_Array = npt.NDArray[Any]
_Param = npt.ArrayLike | None
_Exact = npt.NDArray[np.integer[Any]] | npt.NDArray[np.bool_]

class LayerNormCache:
    op: Literal["layer_norm"]
    x: _Array
    mean: _Array
    rstd: _Array
    axis: int
    eps: float
    def __init__(self, x: _Array, mean: _Array, rstd: _Array, axis: int, eps: float,
                 dtype: np.dtype[Any] | None = None) -> None: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...

class RMSNormCache:
    op: Literal["rms_norm"]
    x: _Array
    rstd: _Array
    axis: int
    eps: float
    def __init__(self, x: _Array, rstd: _Array, axis: int, eps: float,
                 dtype: np.dtype[Any] | None = None) -> None: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...

class BatchNormCache:
    op: Literal["batch_norm"]
    x: _Array
    mean: npt.NDArray[np.float64]
    rstd: npt.NDArray[np.float64]
    axis: int
    eps: float
    training: bool
    dtype: np.dtype[Any]
    def __init__(self, x: _Array, mean: npt.NDArray[np.float64], rstd: npt.NDArray[np.float64],
                 axis: int, eps: float, training: bool, dtype: np.dtype[Any]) -> None: ...
    @property
    def shape(self) -> tuple[int, ...]: ...

class GroupNormCache:
    op: Literal["group_norm"]
    x: _Array
    mean: _Array
    rstd: _Array
    num_groups: int
    channel_axis: int
    eps: float
    dtype: np.dtype[Any]
    def __init__(self, x: _Array, mean: _Array, rstd: _Array, num_groups: int,
                 channel_axis: int, eps: float, dtype: np.dtype[Any]) -> None: ...
    @property
    def shape(self) -> tuple[int, ...]: ...

# --- GroupNorm and InstanceNorm ----------------------------------------------------------------

@overload
def group_norm(x: npt.NDArray[_Float], num_groups: int, gamma: _Param = None,
               beta: _Param = None, eps: float = 1e-5, *, channel_axis: int = 1,
               out: npt.NDArray[_Float] | None = None,
               num_threads: int | None = None) -> npt.NDArray[_Float]: ...
@overload
def group_norm(x: npt.ArrayLike, num_groups: int, gamma: _Param = None, beta: _Param = None,
               eps: float = 1e-5, *, channel_axis: int = 1, out: _Array | None = None,
               num_threads: int | None = None) -> _Array: ...
@overload
def group_norm_forward(x: npt.NDArray[_Float], num_groups: int, gamma: _Param = None,
                       beta: _Param = None, eps: float = 1e-5, *, channel_axis: int = 1,
                       out: npt.NDArray[_Float] | None = None, num_threads: int | None = None
                       ) -> tuple[npt.NDArray[_Float], GroupNormCache]: ...
@overload
def group_norm_forward(x: npt.ArrayLike, num_groups: int, gamma: _Param = None,
                       beta: _Param = None, eps: float = 1e-5, *, channel_axis: int = 1,
                       out: _Array | None = None, num_threads: int | None = None
                       ) -> tuple[_Array, GroupNormCache]: ...
@overload
def group_norm_backward(dy: npt.NDArray[_Float], cache: GroupNormCache, gamma: _Param = None,
                        *, out: npt.NDArray[_Float] | None = None, num_threads: int | None = None
                        ) -> tuple[npt.NDArray[_Float], _Array, _Array]: ...
@overload
def group_norm_backward(dy: npt.ArrayLike, cache: GroupNormCache, gamma: _Param = None, *,
                        out: _Array | None = None, num_threads: int | None = None
                        ) -> tuple[_Array, _Array, _Array]: ...
@overload
def instance_norm(x: npt.NDArray[_Float], gamma: _Param = None, beta: _Param = None,
                  eps: float = 1e-5, *, channel_axis: int = 1,
                  out: npt.NDArray[_Float] | None = None,
                  num_threads: int | None = None) -> npt.NDArray[_Float]: ...
@overload
def instance_norm(x: npt.ArrayLike, gamma: _Param = None, beta: _Param = None,
                  eps: float = 1e-5, *, channel_axis: int = 1, out: _Array | None = None,
                  num_threads: int | None = None) -> _Array: ...
@overload
def instance_norm_forward(x: npt.NDArray[_Float], gamma: _Param = None, beta: _Param = None,
                          eps: float = 1e-5, *, channel_axis: int = 1,
                          out: npt.NDArray[_Float] | None = None,
                          num_threads: int | None = None
                          ) -> tuple[npt.NDArray[_Float], GroupNormCache]: ...
@overload
def instance_norm_forward(x: npt.ArrayLike, gamma: _Param = None, beta: _Param = None,
                          eps: float = 1e-5, *, channel_axis: int = 1, out: _Array | None = None,
                          num_threads: int | None = None) -> tuple[_Array, GroupNormCache]: ...
@overload
def instance_norm_backward(dy: npt.NDArray[_Float], cache: GroupNormCache,
                           gamma: _Param = None, *, out: npt.NDArray[_Float] | None = None,
                           num_threads: int | None = None
                           ) -> tuple[npt.NDArray[_Float], _Array, _Array]: ...
@overload
def instance_norm_backward(dy: npt.ArrayLike, cache: GroupNormCache, gamma: _Param = None, *,
                           out: _Array | None = None, num_threads: int | None = None
                           ) -> tuple[_Array, _Array, _Array]: ...

# --- LayerNorm ---------------------------------------------------------------------------------

@overload
def layer_norm(x: npt.NDArray[_Float], gamma: _Param = None, beta: _Param = None,
               eps: float = 1e-5, *, axis: int = -1, out: npt.NDArray[_Float] | None = None,
               num_threads: int | None = None) -> npt.NDArray[_Float]: ...
@overload
def layer_norm(x: _Exact, gamma: _Param = None, beta: _Param = None, eps: float = 1e-5, *,
               axis: int = -1, out: npt.NDArray[np.float64] | None = None,
               num_threads: int | None = None) -> npt.NDArray[np.float64]: ...
@overload
def layer_norm(x: npt.ArrayLike, gamma: _Param = None, beta: _Param = None, eps: float = 1e-5,
               *, axis: int = -1, out: _Array | None = None,
               num_threads: int | None = None) -> _Array: ...
@overload
def layer_norm_forward(x: npt.NDArray[_Float], gamma: _Param = None, beta: _Param = None,
                       eps: float = 1e-5, *, axis: int = -1,
                       out: npt.NDArray[_Float] | None = None, num_threads: int | None = None
                       ) -> tuple[npt.NDArray[_Float], LayerNormCache]: ...
@overload
def layer_norm_forward(x: npt.ArrayLike, gamma: _Param = None, beta: _Param = None,
                       eps: float = 1e-5, *, axis: int = -1, out: _Array | None = None,
                       num_threads: int | None = None) -> tuple[_Array, LayerNormCache]: ...
@overload
def layer_norm_backward(dy: npt.NDArray[_Float], cache: LayerNormCache, gamma: _Param = None,
                        *, out: npt.NDArray[_Float] | None = None, num_threads: int | None = None
                        ) -> tuple[npt.NDArray[_Float], _Array, _Array]: ...
@overload
def layer_norm_backward(dy: npt.ArrayLike, cache: LayerNormCache, gamma: _Param = None, *,
                        out: _Array | None = None, num_threads: int | None = None
                        ) -> tuple[_Array, _Array, _Array]: ...

# --- RMSNorm -----------------------------------------------------------------------------------

@overload
def rms_norm(x: npt.NDArray[_Float], gamma: _Param = None, eps: float = 1e-5, *, axis: int = -1,
             out: npt.NDArray[_Float] | None = None,
             num_threads: int | None = None) -> npt.NDArray[_Float]: ...
@overload
def rms_norm(x: _Exact, gamma: _Param = None, eps: float = 1e-5, *, axis: int = -1,
             out: npt.NDArray[np.float64] | None = None,
             num_threads: int | None = None) -> npt.NDArray[np.float64]: ...
@overload
def rms_norm(x: npt.ArrayLike, gamma: _Param = None, eps: float = 1e-5, *, axis: int = -1,
             out: _Array | None = None, num_threads: int | None = None) -> _Array: ...
@overload
def rms_norm_forward(x: npt.NDArray[_Float], gamma: _Param = None, eps: float = 1e-5, *,
                     axis: int = -1, out: npt.NDArray[_Float] | None = None,
                     num_threads: int | None = None
                     ) -> tuple[npt.NDArray[_Float], RMSNormCache]: ...
@overload
def rms_norm_forward(x: npt.ArrayLike, gamma: _Param = None, eps: float = 1e-5, *,
                     axis: int = -1, out: _Array | None = None,
                     num_threads: int | None = None) -> tuple[_Array, RMSNormCache]: ...
@overload
def rms_norm_backward(dy: npt.NDArray[_Float], cache: RMSNormCache, gamma: _Param = None, *,
                      out: npt.NDArray[_Float] | None = None, num_threads: int | None = None
                      ) -> tuple[npt.NDArray[_Float], _Array]: ...
@overload
def rms_norm_backward(dy: npt.ArrayLike, cache: RMSNormCache, gamma: _Param = None, *,
                      out: _Array | None = None, num_threads: int | None = None
                      ) -> tuple[_Array, _Array]: ...

# --- Fused residual add + norm -----------------------------------------------------------------

@overload
def add_layer_norm(x: npt.NDArray[_Float], residual: npt.ArrayLike, gamma: _Param = None,
                   beta: _Param = None, eps: float = 1e-5, *, bias: _Param = None,
                   axis: int = -1, out: npt.NDArray[_Float] | None = None,
                   sum_out: npt.NDArray[_Float] | None = None, num_threads: int | None = None
                   ) -> tuple[npt.NDArray[_Float], npt.NDArray[_Float]]: ...
@overload
def add_layer_norm(x: npt.ArrayLike, residual: npt.ArrayLike, gamma: _Param = None,
                   beta: _Param = None, eps: float = 1e-5, *, bias: _Param = None,
                   axis: int = -1, out: _Array | None = None, sum_out: _Array | None = None,
                   num_threads: int | None = None) -> tuple[_Array, _Array]: ...
@overload
def add_layer_norm_forward(x: npt.NDArray[_Float], residual: npt.ArrayLike, gamma: _Param = None,
                           beta: _Param = None, eps: float = 1e-5, *, bias: _Param = None,
                           axis: int = -1, out: npt.NDArray[_Float] | None = None,
                           sum_out: npt.NDArray[_Float] | None = None,
                           num_threads: int | None = None
                           ) -> tuple[npt.NDArray[_Float], npt.NDArray[_Float],
                                      LayerNormCache]: ...
@overload
def add_layer_norm_forward(x: npt.ArrayLike, residual: npt.ArrayLike, gamma: _Param = None,
                           beta: _Param = None, eps: float = 1e-5, *, bias: _Param = None,
                           axis: int = -1, out: _Array | None = None,
                           sum_out: _Array | None = None, num_threads: int | None = None
                           ) -> tuple[_Array, _Array, LayerNormCache]: ...
@overload
def add_rms_norm(x: npt.NDArray[_Float], residual: npt.ArrayLike, gamma: _Param = None,
                 eps: float = 1e-5, *, bias: _Param = None, axis: int = -1,
                 out: npt.NDArray[_Float] | None = None,
                 sum_out: npt.NDArray[_Float] | None = None, num_threads: int | None = None
                 ) -> tuple[npt.NDArray[_Float], npt.NDArray[_Float]]: ...
@overload
def add_rms_norm(x: npt.ArrayLike, residual: npt.ArrayLike, gamma: _Param = None,
                 eps: float = 1e-5, *, bias: _Param = None, axis: int = -1,
                 out: _Array | None = None, sum_out: _Array | None = None,
                 num_threads: int | None = None) -> tuple[_Array, _Array]: ...
@overload
def add_rms_norm_forward(x: npt.NDArray[_Float], residual: npt.ArrayLike, gamma: _Param = None,
                         eps: float = 1e-5, *, bias: _Param = None, axis: int = -1,
                         out: npt.NDArray[_Float] | None = None,
                         sum_out: npt.NDArray[_Float] | None = None,
                         num_threads: int | None = None
                         ) -> tuple[npt.NDArray[_Float], npt.NDArray[_Float], RMSNormCache]: ...
@overload
def add_rms_norm_forward(x: npt.ArrayLike, residual: npt.ArrayLike, gamma: _Param = None,
                         eps: float = 1e-5, *, bias: _Param = None, axis: int = -1,
                         out: _Array | None = None, sum_out: _Array | None = None,
                         num_threads: int | None = None
                         ) -> tuple[_Array, _Array, RMSNormCache]: ...

# --- BatchNorm -----------------------------------------------------------------------------------


@overload
def batch_norm(x: npt.NDArray[_Float], gamma: _Param = None, beta: _Param = None,
               running_mean: _Array | None = None, running_var: _Array | None = None, *,
               training: bool = False, momentum: float = 0.9, eps: float = 1e-5,
               axis: int = -1, out: npt.NDArray[_Float] | None = None,
               num_threads: int | None = None) -> npt.NDArray[_Float]: ...
@overload
def batch_norm(x: npt.ArrayLike, gamma: _Param = None, beta: _Param = None,
               running_mean: npt.ArrayLike | None = None,
               running_var: npt.ArrayLike | None = None, *, training: bool = False,
               momentum: float = 0.9, eps: float = 1e-5, axis: int = -1,
               out: _Array | None = None, num_threads: int | None = None) -> _Array: ...
@overload
def batch_norm_forward(x: npt.NDArray[_Float], gamma: _Param = None, beta: _Param = None,
                       running_mean: _Array | None = None, running_var: _Array | None = None,
                       *, training: bool = False, momentum: float = 0.9, eps: float = 1e-5,
                       axis: int = -1, out: npt.NDArray[_Float] | None = None,
                       num_threads: int | None = None
                       ) -> tuple[npt.NDArray[_Float], BatchNormCache]: ...
@overload
def batch_norm_forward(x: npt.ArrayLike, gamma: _Param = None, beta: _Param = None,
                       running_mean: npt.ArrayLike | None = None,
                       running_var: npt.ArrayLike | None = None, *, training: bool = False,
                       momentum: float = 0.9, eps: float = 1e-5, axis: int = -1,
                       out: _Array | None = None, num_threads: int | None = None
                       ) -> tuple[_Array, BatchNormCache]: ...
@overload
def batch_norm_backward(dy: npt.NDArray[_Float], cache: BatchNormCache,
                        gamma: _Param = None, *, out: npt.NDArray[_Float] | None = None,
                        num_threads: int | None = None
                        ) -> tuple[npt.NDArray[_Float], _Array, _Array]: ...
@overload
def batch_norm_backward(dy: npt.ArrayLike, cache: BatchNormCache, gamma: _Param = None, *,
                        out: _Array | None = None, num_threads: int | None = None
                        ) -> tuple[_Array, _Array, _Array]: ...

# --- Threads and configuration -----------------------------------------------------------------

def get_num_threads() -> int: ...
def set_num_threads(n: int) -> None: ...
def num_threads(n: int) -> AbstractContextManager[int]: ...
def set_output_cache(max_bytes: int | None) -> None: ...
def output_cache_info() -> dict[str, int]: ...
def show_config(file: IO[str] | None = None) -> None: ...
