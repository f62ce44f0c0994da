# Type stubs for the dmattn package (the public API in python/dmattn/__init__.py).
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

Format = Literal["bf16", "mxfp8-e4m3", "mxfp8-e5m2", "mxfp6-e3m2", "mxfp6-e2m3", "mxfp4", "nvfp4"]

class DmattnError(ValueError): ...

class Policy:
    high: str
    low: str
    diag_tiles: int
    sink_tiles: int
    scale_rule: str
    pv: str
    smooth_k: bool
    def __init__(self, *, high: Format = "mxfp8-e4m3", low: Format = "mxfp4", diag_tiles: int = 1,
                 sink_tiles: int = 0, scale_rule: Literal["ocp", "ceil"] = "ocp",
                 pv: Literal["bf16", "mxfp8"] = "bf16", smooth_k: bool = False) -> None: ...
    def __eq__(self, other: object) -> bool: ...

hf_policy: Policy

def cuda_available() -> bool: ...
def attention(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
              high: Format = "mxfp8-e4m3", low: Format = "mxfp4", diag_tiles: int = 1, sink_tiles: int = 0,
              pv: Literal["bf16", "mxfp8"] = "bf16", scale_rule: Literal["ocp", "ceil"] = "ocp",
              return_lse: bool = False, layout: Literal["bhnd", "bnhd"] = "bhnd",
              policy: Policy | None = None) -> Any: ...
def sdpa(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
         scale: float | None = None, enable_gqa: bool = False, **policy: Any) -> Any: ...
def quantize(x: Any, format: Format = "mxfp4", scale_rule: Literal["ocp", "ceil"] = "ocp"
             ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], float]: ...
def dequantize(codes: npt.ArrayLike, scales: npt.ArrayLike, format: Format, cols: int,
               tensor_scale: float = 1.0) -> npt.NDArray[np.float32]: ...
def register_transformers(name: str = "dmattn") -> str: ...
