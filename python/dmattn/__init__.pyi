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
    smooth_q: bool
    rotate: bool
    sink_keys: int
    def __init__(self, *, high: Format = "mxfp8-e4m3", low: Format = "mxfp4", diag_tiles: int = 1,
                 sink_tiles: int = 0, scale_rule: Literal["ocp", "ceil"] = "ceil",
                 pv: Literal["bf16", "mxfp8", "mxfp4", "fp8"] = "bf16", smooth_k: bool = False,
                 smooth_q: bool = False, rotate: bool = False, sink_keys: int = 0) -> None: ...
    def __eq__(self, other: object) -> bool: ...

class KVCache:
    kv_heads: int
    head_dim: int
    policy: Policy
    def __init__(self, kv_heads: int, head_dim: int, policy: Policy = ...) -> None: ...
    def new_sequence(self) -> int: ...
    def free_sequence(self, seq: int) -> None: ...
    def append(self, seq: int, k: Any, v: Any) -> None: ...
    def length(self, seq: int) -> int: ...
    def bytes(self, seq: int) -> int: ...
    def page_table(self, seq: int) -> list[int]: ...

hf_policy: Policy

def decode(cache: KVCache, seqs: list[int], q: Any, *, scale: float | None = None, splits: int = 0,
           return_lse: bool = False, window: tuple[int, int] = (-1, -1)) -> Any: ...

def cuda_available() -> bool: ...
POLICY_FIELDS: tuple[str, ...]

def attention(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None,
              return_lse: bool = False, layout: Literal["bhnd", "bnhd"] = "bhnd",
              policy: Policy | None = None, q_offset: int | None = None, k_offset: int | None = None,
              check_finite: bool = True, window: tuple[int, int] = (-1, -1), high: Format = ...,
              low: Format = ..., diag_tiles: int = ...,
              sink_tiles: int = ..., scale_rule: Literal["ocp", "ceil"] = ...,
              pv: Literal["bf16", "mxfp8", "mxfp4", "fp8"] = ..., smooth_k: bool = ..., smooth_q: bool = ...,
              rotate: bool = ..., sink_keys: int = ...) -> Any: ...
def sdpa(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
         scale: float | None = None, enable_gqa: bool = False, **policy: Any) -> Any: ...
def quantize(x: Any, format: Format = "mxfp4", scale_rule: Literal["ocp", "ceil"] = "ocp"
             ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], float]: ...
def dequantize(codes: npt.ArrayLike, scales: npt.ArrayLike, format: Format, cols: int,
               tensor_scale: float = 1.0) -> npt.NDArray[np.float32]: ...
def register_transformers(name: str = "dmattn") -> str: ...
def ring_attention(q: Any, k: Any, v: Any, *, group: Any = None, causal: bool = True,
                   sharding: Literal["zigzag", "contiguous"] = "zigzag", return_lse: bool = False,
                   **policy: Any) -> Any: ...
