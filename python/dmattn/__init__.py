"""dmattn: Diagonal-Tiled Mixed-Precision Attention over microscaling (MX) formats.

Attention tiles near the diagonal (and optional sink tiles) are computed in a high format (MXFP8 by
default), every other 128x128 tile in a low one (MXFP4), in one fused flash-attention pass. Works
on numpy arrays and PyTorch tensors (CPU, and CUDA on Hopper GPUs), without copying the inputs.

    import dmattn
    out = dmattn.attention(q, k, v, causal=True)              # q [B, Hq, N, d], k/v [B, Hkv, N, d]
    out = dmattn.sdpa(q, k, v, is_causal=True, enable_gqa=True)   # torch SDPA's signature
    dmattn.register_transformers()                             # attn_implementation="dmattn"
"""
from __future__ import annotations

from ._dmattn import (DmattnError, KVCache, Policy, attention_into, cuda_available, decode_into, dequantize_rows,
                      quantize_rows, varlen_attention_into)
from ._dmattn import AttentionOptions as _AttentionOptions, DecodeOptions as _DecodeOptions
from ._dmattn import PagedKVCache as _PagedKVCache

__all__ = ["attention", "sdpa", "decode", "ring_attention", "KVCache", "PagedKVCache", "quantize", "dequantize", "Policy", "DmattnError",
           "cuda_available", "register_transformers", "hf_policy", "POLICY_FIELDS"]



def _is_torch(x) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch")


def _check_same_kind(q, k, v):
    kinds = {_is_torch(t) for t in (q, k, v)}
    if len(kinds) != 1:
        raise TypeError("q, k and v must all be numpy arrays or all be torch tensors")
    if _is_torch(q):
        devs = {t.device for t in (q, k, v)}
        if len(devs) != 1:
            raise ValueError(f"q, k and v must be on one device (got {sorted(map(str, devs))})")
        dts = {t.dtype for t in (q, k, v)}
        if len(dts) != 1:
            raise TypeError(f"q, k and v must have one dtype (got {sorted(map(str, dts))})")
    else:
        dts = {str(t.dtype) for t in (q, k, v)}
        if len(dts) != 1:
            raise TypeError(f"q, k and v must have one dtype (got {sorted(dts)})")


def _check_inputs(tensors, names="qkv"):
    """What the compiled layer cannot say well: autograd, byte order."""
    for name, t in zip(names, tensors):
        if _is_torch(t):
            if t.requires_grad and _torch().is_grad_enabled():
                raise DmattnError("dmattn is inference-only (it has no backward pass): call it under torch.no_grad() "
                                  "or torch.inference_mode(), or pass detached tensors")
            continue
        dt = getattr(t, "dtype", None)
        if dt is None or not hasattr(t, "__array_interface__"):
            raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(t).__name__}")
        if not dt.isnative:
            raise DmattnError(f"{name}: byte order {dt.byteorder!r} is not the machine's; convert with "
                              f"x.astype(x.dtype.newbyteorder('='))")


def _options(cls, **fields):
    """An options struct of the compiled layer (AttentionOptions, DecodeOptions) with these fields set:
    a misspelt field is an AttributeError, not a silently ignored keyword."""
    o = cls()
    for name, value in fields.items():
        if not hasattr(o, name):
            raise AttributeError(f"{cls.__name__} has no field {name!r}")
        setattr(o, name, value)
    return o


def _policy_fields():
    """Policy's keyword-only constructor arguments, read from the binding (the one place they are listed)."""
    import re
    sig = Policy.__init__.__nb_signature__[0][0]
    return tuple(re.findall(r"(\w+): ", sig.split("*,", 1)[1]))


POLICY_FIELDS = _policy_fields()
"""The keywords attention(), sdpa() and ring_attention() take for the Policy (dmattn.Policy's fields)."""


def _policy(policy, fields, who):
    """The Policy of a call: `policy`, or one built from the policy keywords (not both)."""
    unknown = set(fields) - set(POLICY_FIELDS)
    if unknown:
        raise TypeError(f"{who}() got unexpected keyword arguments {sorted(unknown)} "
                        f"(policy keywords: {', '.join(POLICY_FIELDS)})")
    if policy is not None:
        if fields:
            raise TypeError(f"{who}(): give policy= or policy keywords ({', '.join(sorted(fields))}), not both")
        return policy
    return Policy(**fields)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
              layout: str = "bhnd", policy: Policy | None = None, q_offset: int | None = None,
              k_offset: int | None = None, check_finite: bool = True, window: tuple[int, int] = (-1, -1),
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
              **policy_fields):
    """DMA attention of q, k, v; returns an array of q's kind, dtype and device (and the LSE).

    Args:
      q: queries, [B, Hq, Nq, d] (layout "bhnd") or [B, Nq, Hq, d] ("bnhd"); numpy array or torch
        tensor, float32 / float16 / bfloat16, on the CPU or a CUDA device. Any strides (the head
        dimension unit-stride on CUDA); never copied.
      k, v: keys and values, [B, Hkv, Nk, d] (or [B, Nk, Hkv, d]); Hq a multiple of Hkv (GQA/MQA).
        Same kind, dtype and device as q.
      causal: mask keys after each query, aligned bottom-right (query row r sits at position
        r + Nk - Nq), so prefill, chunked prefill and decode share one definition.
      scale: softmax scale; default 1/sqrt(d).
      return_lse: also return the row log-sum-exp, float32 [B, Hq, Nq] (for merging partial results).
      layout: "bhnd" or "bnhd" (how the four axes of q, k, v and the output are ordered).
      policy: a Policy (default: dmattn.Policy(), the library's default: MXFP8 on eight diagonal
        tiles and the sink tile, MXFP4 elsewhere, smooth_k and the rotation, about +1% perplexity;
        dmattn.Policy.plain(), the diagonal tile alone without transforms, is the fastest, +15%).
      **policy_fields: instead of policy=, its fields by keyword (POLICY_FIELDS; help(dmattn.Policy)):
        high / low: formats of the high and the low tiles: "mxfp8-e4m3", "mxfp8-e5m2",
          "mxfp6-e3m2", "mxfp6-e2m3", "mxfp4", "nvfp4" or "bf16".
        diag_tiles: key tiles nearest the diagonal of each 128-row query tile that run high
          (the diagonal tile included; 0 = none; a large value = all high).
        sink_tiles: leading key tiles (attention sinks) that run high.
        pv: precision of P.V: "bf16" (P rounded to bf16), "mxfp8" (P and V in MXFP8 E4M3), "mxfp4"
          (P in MXFP8, V in MXFP4; CPU only for prefill) or "fp8" (P in E4M3 at scale 2^-8, V in
          E4M3 with one scale per channel: the GPU prefill's FP8 P.V).
        scale_rule: E8M0 block-scale rule, "ceil" (default: no element saturates) or "ocp" (the spec's floor rule).
        smooth_k, smooth_q, rotate, sink_keys: the accuracy transforms (exact in real arithmetic;
          they change only what gets quantized): K's channel mean removed; each head's query mean
          removed and its scores added back exactly (smooth_q=True on every tile, "high" on the
          high tiles alone, which needs high != low); a randomized Hadamard rotation of Q and K
          along d; the first sink_keys keys scored from unquantized q and k.
        q_residual: the high tiles take each query row in two FP8 terms, its codes and its
          residual in E4M3 at the row's scale (needs high != low; the CPU backend and the KV cache).
      q_offset, k_offset: absolute positions of the first query and the first key, to attend a
        block of a longer sequence (mask and tiles use them; k_offset a multiple of 128). Default:
        the queries are the last Nq of the Nk positions.
      window: sliding window (left, right), flash-attn's window_size: a query at position p sees the
        keys at p - left .. p + right; -1 leaves a side unbounded (default: no window).
      cu_seqlens_q, cu_seqlens_k: packed variable-length sequences, as flash-attn's
        flash_attn_varlen_func: q [total_q, Hq, d], k and v [total_k, Hkv, d] hold the sequences one
        after another; sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q and
        cu_seqlens_k[i]:cu_seqlens_k[i+1] of k and v (int sequences or int32 tensors of batch + 1
        offsets from 0; CUDA tensors are read back to the host). Each sequence is attended alone
        (causal aligned bottom-right within it, its own tiles); out is [total_q, Hq, d], lse
        [Hq, total_q]. max_seqlen_q / max_seqlen_k, if given, must be at least the longest
        sequence's. On CUDA tensors the batch is one call (one pre-pass, one kernel) for bf16/fp16
        tensors under the default's tile formats (mxfp8-e4m3, mxfp4), pv="bf16" and the transforms
        rotate and smooth_k; other policies run a call a sequence on the stream, with the same results.
      check_finite: raise on NaN/Inf inputs (default). On CUDA this reads flags back from the GPU,
        so the call waits for its quantize pass (not for its attention kernel: the result is
        stream-ordered like any torch op's either way); False skips the check (and that wait), and
        a NaN/Inf input then shows as NaN in the output rows it reaches.

    dmattn is inference-only: torch tensors that require grad (with grad mode on) raise, since the
    result would carry no gradient.

    Returns: out (and lse when return_lse) on q's device; CUDA work runs on torch's current stream.
    Raises: DmattnError (a ValueError) for bad shapes, dtypes, strides, NaN/Inf inputs or
      unsupported settings; TypeError for mixed array kinds or dtypes.
    """
    _check_inputs((q, k, v))
    _check_same_kind(q, k, v)
    policy = _policy(policy, policy_fields, "attention")
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if q_offset is not None or k_offset is not None:
            raise DmattnError("attention: q_offset and k_offset do not apply to packed sequences")
        return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse,
                       policy, check_finite, window)
    if layout not in ("bhnd", "bnhd"):
        raise ValueError(f"layout must be 'bhnd' or 'bnhd' (got {layout!r})")
    if getattr(q, "ndim", None) != 4:
        raise DmattnError(f"q: expected 4 dimensions, got shape {tuple(q.shape)}")
    B = q.shape[0]
    Hq, Nq = (q.shape[1], q.shape[2]) if layout == "bhnd" else (q.shape[2], q.shape[1])
    return _call(q, (B, Hq, Nq), return_lse, lambda out, lse, stream: attention_into(
        _plain(q), _plain(k), _plain(v), out, lse, layout,
        _attention_options(causal, scale, policy, check_finite, window, stream, q_offset, k_offset)))


def _plain(t):
    """t as the compiled layer takes it: a torch tensor that requires grad detached (it exports no
    autograd state); any other array as it is."""
    return t.detach() if getattr(t, "requires_grad", False) else t


def _torch():
    import torch
    return torch


def _stream(index: int) -> int:
    """torch's current stream on CUDA device `index`, as the compiled layer's stream handle. torch's
    raw accessor skips the Stream object that torch.cuda.current_stream() builds on every call."""
    torch = _torch()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def _on_cuda(device, run):
    """run(stream) with `device` current (entered only where it is not already) and torch's current
    stream on it."""
    torch = _torch()
    current = torch.cuda.current_device()
    if device.index is None or device.index == current:
        return run(_stream(current))
    with torch.cuda.device(device):
        return run(_stream(device.index))


def _call(q, lse_shape, return_lse, run):
    """out (q's kind, dtype, device and shape) and, when asked, lse (float32, lse_shape), filled by
    run(out, lse, stream) on q's device and torch's current stream (0 for numpy and CPU tensors)."""
    if _is_torch(q):
        import torch
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
        if q.is_cuda:
            _on_cuda(q.device, lambda stream: run(out, lse, stream))
        else:
            run(out, lse, 0)
    else:
        import numpy as np
        out = np.empty(q.shape, dtype=q.dtype)
        lse = np.empty(lse_shape, dtype=np.float32) if return_lse else None
        run(out, lse, 0)
    return (out, lse) if return_lse else out


def _attention_options(causal, scale, policy, check_finite, window, stream=0, q_offset=None, k_offset=None):
    return _options(_AttentionOptions, causal=bool(causal), softmax_scale=scale, policy=policy,
                    check_finite=bool(check_finite), window_left=int(window[0]), window_right=int(window[1]),
                    stream=stream, q_offset=q_offset, k_offset=k_offset)


def _offsets(cu, name, longest):
    """cu_seqlens as a list of ints (a CUDA tensor is read back), checked against max_seqlen."""
    if cu is None:
        raise DmattnError(f"attention: packed sequences need both cu_seqlens_q and cu_seqlens_k ({name} is missing)")
    cu = [int(x) for x in (cu.tolist() if hasattr(cu, "tolist") else cu)]
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if longest is not None and lens and max(lens) > int(longest):
        raise DmattnError(f"attention: a sequence of {max(lens)} tokens exceeds max_seqlen ({longest}) for {name}")
    return cu


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, return_lse, policy, check_finite, window):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if getattr(t, "ndim", None) != 3:
            raise DmattnError(f"{name}: packed sequences are [total, heads, d], got shape {tuple(t.shape)}")
    cu_q, cu_k = _offsets(cu_q, "cu_seqlens_q", max_q), _offsets(cu_k, "cu_seqlens_k", max_k)
    total_q, Hq = q.shape[0], q.shape[1]
    return _call(q, (Hq, total_q), return_lse, lambda out, lse, stream: varlen_attention_into(
        _plain(q)[None], _plain(k)[None], _plain(v)[None], out[None], None if lse is None else lse[None], cu_q, cu_k,
        _attention_options(causal, scale, policy, check_finite, window, stream)))


def sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
         scale: float | None = None, enable_gqa: bool = False, **policy):
    """torch.nn.functional.scaled_dot_product_attention's signature, computed by dmattn.

    query [B, Hq, L, E], key/value [B, Hkv, S, E] torch tensors; `policy` takes attention()'s
    policy keywords (POLICY_FIELDS) or policy=Policy(...). Supported: no mask or
    is_causal with L == S (torch aligns its causal mask top-left, dmattn bottom-right: they agree
    only for square attention), dropout_p == 0, GQA with enable_gqa=True. Anything else raises
    NotImplementedError rather than computing something different.
    """
    if attn_mask is not None:
        raise NotImplementedError("dmattn.sdpa: attn_mask is not supported (use is_causal, or torch's SDPA)")
    if dropout_p != 0.0:
        raise NotImplementedError("dmattn.sdpa: dropout is not supported (dropout_p must be 0)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise NotImplementedError("dmattn.sdpa: 4-D [B, H, L, E] inputs only")
    if is_causal and query.shape[-2] != key.shape[-2]:
        raise NotImplementedError(
            "dmattn.sdpa: is_causal with L != S: torch aligns the causal mask top-left, dmattn bottom-right; "
            "call dmattn.attention(causal=True) for the bottom-right (KV-cache) convention")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"dmattn.sdpa: {query.shape[1]} query heads and {key.shape[1]} key heads need enable_gqa=True")
    return attention(query, key, value, causal=is_causal, scale=scale, **policy)


class PagedKVCache:
    """A paged MX KV cache in GPU memory (the current CUDA device when created).

    The pages equal KVCache's for the same appends (so decode returns what it returns over a
    KVCache), but they are written on the GPU: append() quantizes CUDA tensors of new tokens in
    place, on torch's current stream, and decode() reads the device page tables, so a generation
    step does no host work beyond its launches and waits for the GPU only when the page pool grows.
    NaN or Inf in k or v are not checked (that would need a synchronisation): decode returns NaN for
    the rows that see them. The accuracy transforms run on the GPU as KVCache runs them (smooth_k's
    mean is fixed by each sequence's first append).

    Args:
      kv_heads, head_dim: the KV heads and their dimension (64, 128 or 256).
      policy: a dmattn.Policy (default Policy()); or the policy fields as keywords.
    """

    def __init__(self, kv_heads: int, head_dim: int, policy: Policy | None = None, **fields):
        if policy is not None and fields:
            raise TypeError("PagedKVCache: pass a policy or its fields, not both")
        self._c = _PagedKVCache(int(kv_heads), int(head_dim), policy if policy is not None else Policy(**fields))

    def new_sequence(self) -> int:
        """An empty sequence; returns its id."""
        return self._c.new_sequence()

    def free_sequence(self, seq: int) -> None:
        """Returns the sequence's pages to the pool (no device work)."""
        self._c.free_sequence(int(seq))

    def append(self, seqs, k, v) -> None:
        """Appends k, v: [len(seqs), kv_heads, n, head_dim] CUDA tensors (n new tokens a sequence)."""
        _check_inputs((k, v), ("k", "v"))
        if not (_is_torch(k) and k.is_cuda and _is_torch(v) and v.is_cuda):
            raise DmattnError("PagedKVCache.append: k and v must be CUDA tensors (the cache lives in GPU memory)")
        ids = [int(s) for s in seqs]
        _on_cuda(k.device, lambda stream: self._c.append(ids, _plain(k), _plain(v), stream))

    def reserve(self, sequences: int, tokens: int) -> None:
        """Allocates room for sequences 0 .. sequences-1 of up to `tokens` tokens each.

        Needed before capturing a CUDA graph: a captured cache's device memory never moves, so an
        append that needs more than it holds then raises."""
        self._c.reserve(int(sequences), int(tokens))

    def prepare(self, seqs, n: int = 1) -> None:
        """Plans the next append of n tokens to each of seqs, for a CUDA graph's replay to carry out.

        A captured append carries out a plan made on the host, and the capture itself carries out
        nothing: call prepare() once before every replay, with the sequences and token count the
        graph captured (the plan goes to device memory on torch's current stream). A replay that
        finds no fresh plan (a prepare() missed or doubled) appends nothing, and its decode, like
        every decode until a replay that finds its plan, returns NaN. A sequence once prepared takes
        its appends this way only (an eager append() to it raises). With smooth_k, a graph captured
        over sequences that hold tokens has no key-mean pass, so prepare() refuses an empty sequence:
        append a prompt eagerly first.

            cache.reserve(len(seqs), max_tokens)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                cache.append(seqs, k, v)        # k, v, q: fixed tensors, refilled before each replay
                out = dmattn.decode(cache, seqs, q)
            for _ in range(steps):
                ...                             # the step's k, v, q copied into the captured tensors
                cache.prepare(seqs, 1)
                g.replay()                      # out holds the step's attention
        """
        self._c.prepare([int(s) for s in seqs], int(n), _stream(_torch().cuda.current_device()))

    def length(self, seq: int) -> int:
        return self._c.length(int(seq))

    def page_table(self, seq: int) -> list[int]:
        return self._c.page_table(int(seq))

    page_bytes = property(lambda self: self._c.page_bytes,
                          doc="Device bytes of one 128-token page, all KV heads (K codes, K scales, V).")
    kv_heads = property(lambda self: self._c.kv_heads)
    head_dim = property(lambda self: self._c.head_dim)
    policy = property(lambda self: self._c.policy)


def decode(cache: KVCache | PagedKVCache, seqs, q, *, scale: float | None = None, splits: int = 0, return_lse: bool = False,
           window: tuple[int, int] = (-1, -1)):
    """Decode attention of new queries over a KVCache.

    Args:
      cache: the KVCache or PagedKVCache holding each sequence's keys and values (including the
        new tokens'). Over a PagedKVCache q must be a CUDA tensor, and the call does not wait for
        the GPU (q is not checked for NaN/Inf).
      seqs: the sequence ids, one per row of q's first axis.
      q: [len(seqs), Hq, Nq, d] numpy array or torch tensor, 1 <= Nq <= 16; the queries of each
        sequence's last Nq positions (causal, bottom-right). A CUDA tensor runs the GPU decode
        (d 64/128, every pv mode) over a device copy of the cache's pages that follows the cache
        (only pages changed since the last call are uploaded); torch's current stream.
      scale: softmax scale; default 1/sqrt(d).
      splits: split-KV ranges per sequence, merged by LSE. 0 = automatic (1 on the CPU, which
        reproduces prefill bit for bit; enough to fill the GPU on CUDA).
      return_lse: also return the row log-sum-exp [len(seqs), Hq, Nq], float32.
      window: sliding window (left, right) as in attention(): a query at position p sees the keys
        in [p - left, p]; -1 = unbounded. Decode is causal, so right has no effect (flash-attn's
        window_size with causal=True).
    """
    seqs = [int(s) for s in seqs]
    left = int(window[0])
    if isinstance(cache, PagedKVCache):
        if not (_is_torch(q) and q.is_cuda):
            raise DmattnError("decode: a PagedKVCache lives in GPU memory; q must be a CUDA tensor")
        cache = cache._c
    _check_inputs((q,), ("q",))
    return _call(q, tuple(q.shape[:3]), return_lse, lambda out, lse, stream: decode_into(
        cache, seqs, _plain(q), out, lse, _decode_options(scale, int(splits), left, stream)))


_DECODE_OPTIONS: dict = {}


def _decode_options(scale, splits, left, stream):
    """The DecodeOptions of a decode call, made once per distinct set of values (a generation step
    repeats them on every layer and step; the compiled layer only reads them)."""
    key = (scale, splits, left, stream)
    o = _DECODE_OPTIONS.get(key)
    if o is None:
        if len(_DECODE_OPTIONS) >= 64:
            _DECODE_OPTIONS.clear()
        o = _DECODE_OPTIONS[key] = _options(_DecodeOptions, softmax_scale=scale, splits=splits, window_left=left,
                                            stream=stream)
    return o


def _rows(x):
    """Any array-like -> (float32 numpy [rows, cols], original shape)."""
    import numpy as np
    if _is_torch(x):
        x = x.detach().to("cpu").float().numpy()
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if a.ndim == 0:
        raise ValueError("quantize: need at least one dimension")
    return a.reshape(-1, a.shape[-1]), a.shape


def quantize(x, format: str = "mxfp4", scale_rule: str = "ocp"):
    """Quantizes x along its last axis (blocks of 32, 16 for NVFP4) with the CPU codec.

    Returns (codes, scales, tensor_scale): uint8 numpy arrays [rows, code_cols] and [rows, blocks]
    (rows = all leading axes flattened; E2M1 codes packed two per byte, low nibble first) and the
    NVFP4 tensor scale (1.0 for MX formats). Bit-identical to `dmattn quantize` and the C++ API.
    """
    rows, _ = _rows(x)
    return quantize_rows(rows, format, scale_rule)


def dequantize(codes, scales, format: str, cols: int, tensor_scale: float = 1.0):
    """Values of quantize()'s output: float32 numpy [rows, cols]."""
    import numpy as np
    return dequantize_rows(np.ascontiguousarray(codes, dtype=np.uint8), np.ascontiguousarray(scales, dtype=np.uint8),
                           format, cols, tensor_scale)


hf_policy = Policy()
"""The Policy that attn_implementation="dmattn" uses (assign a new Policy to change it)."""


def register_transformers(name: str = "dmattn") -> str:
    """Registers dmattn with transformers' AttentionInterface as `name`; returns the name.

    Then `AutoModelForCausalLM.from_config(cfg, attn_implementation="dmattn")` (or
    `model.set_attn_implementation("dmattn")`) runs every attention layer through dmattn with
    `dmattn.hf_policy`. Padded batches (a 2-D attention_mask) are honoured: each sequence runs over
    its own tokens; sliding-window layers (Mistral, Gemma) run with dmattn's window. Masks dmattn
    cannot compute (a padded batch through a sliding window, packed sequences, custom patterns) raise
    NotImplementedError.
    """
    from .hf import register
    return register(name)



def __getattr__(name):
    """dmattn.ring_attention loads on first use (it needs torch.distributed; numpy users need not import torch)."""
    if name == "ring_attention":
        from .ring import ring_attention
        return ring_attention
    raise AttributeError(f"module 'dmattn' has no attribute {name!r}")
