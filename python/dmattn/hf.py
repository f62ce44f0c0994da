"""dmattn as a Hugging Face transformers attention implementation.

transformers builds each layer's attention mask through a mask function registered per attention
implementation (`AttentionMaskInterface`); an implementation registered without one receives no mask
at all, so a padded batch would be computed as if it had no padding. `register()` therefore installs
both: the attention function and a mask function. The mask function draws the layer's pattern
without padding; where it is the causal pattern, or the causal pattern within a sliding window (a
query sees itself and the `left` keys before it: transformers' sliding_window - 1), it hands the
attention a 2-D padding mask [B, S] (True = a real token) that carries the window, else the full 4-D
boolean mask (packed sequences, bidirectional spans, custom patterns), which the attention accepts
only where it equals the causal mask; every other mask raises NotImplementedError rather than being
ignored.

A padded batch runs each sequence's valid tokens as their own causal problem, all of them packed
into one variable-length call: the keys a padding mask keeps, and the queries among them. That is what the sequence computes alone (its tiles start at
its first real token), and it is exact for left padding (generation), right padding and holes alike;
through a sliding window, which counts cache slots, for left and right padding (the kept tokens are
contiguous) and not for holes, which raise. Query rows of padding tokens come back as zeros.
"""
from __future__ import annotations

import functools

_MASK_NOTE = ("dmattn supports causal (or full) attention with padding, and sliding windows with left or right "
              "padding; this layer's mask differs (packed sequences, a custom pattern, or padding holes inside a "
              "sliding window): use another attn_implementation")


def _allowed(L, S, causal, left=-1, device=None):
    """The keys [L, S] bool that dmattn's mask lets the last L of S positions see: all (or causal),
    from `left` keys before each query on where left >= 0 (row i sits at position S - L + i)."""
    import torch
    want = torch.ones(L, S, dtype=torch.bool, device=device)
    if causal:
        want = want.tril(S - L)
    return want.triu(S - L - left) if left >= 0 else want


def _band(pattern, L, S):
    """-1 where pattern [L, S] (queries at the last L of S positions) is causal, left >= 0 where it is
    causal within a window of the `left` keys before each query, None for anything else."""
    import torch
    if torch.equal(pattern, _allowed(L, S, True)):
        return -1
    first = pattern[-1].nonzero()
    if first.numel() == 0:
        return None
    left = S - 1 - int(first[0])
    return left if torch.equal(pattern, _allowed(L, S, True, left)) else None


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
          **kwargs):
    """transformers mask function for dmattn: None, a 2-D padding mask, or a 4-D boolean mask."""
    import torch
    from transformers import masking_utils as mu
    if mask_function is None or mask_function is mu.causal_mask_function or \
            mask_function is getattr(mu, "bidirectional_mask_function", None):
        if attention_mask is None:
            return None
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return _own(attention_mask.to(torch.bool, copy=True))
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    # The pattern without padding: causal within a sliding window travels as the padding mask + the window.
    pattern = mu.sdpa_mask(batch_size=1, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                           kv_offset=kv_offset, mask_function=mask_function, attention_mask=None,
                           allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)
    left = _band(pattern[0, 0].cpu(), q_length, kv_length)
    if left is not None:
        keep = (attention_mask[:, -kv_length:].to(torch.bool, copy=True) if attention_mask is not None
                else torch.ones(batch_size, kv_length, dtype=torch.bool, device=pattern.device))
        keep.dmattn_window_left = left
        return _own(keep)
    # Any other pattern: the exact boolean mask, which the attention checks (and refuses unless causal).
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


def _policy():
    import dmattn
    return dmattn.hf_policy


def _attend(query, key, value, causal, scaling, left=-1):
    from . import attention
    return attention(query, key, value, causal=causal, scale=scaling, policy=_policy(), window=(left, -1))


def _check_4d(mask, L, S, causal, left=-1):
    """A 4-D mask is accepted only where it is the plain causal (or full) pattern, within the sliding
    window's `left` keys before each query where left >= 0."""
    import torch
    m = mask[..., -L:, -S:]
    allowed = m > torch.finfo(m.dtype).min / 2 if m.dtype.is_floating_point else m.bool()
    if not torch.equal(allowed, _allowed(L, S, causal, left, m.device).expand_as(allowed)):
        raise NotImplementedError(_MASK_NOTE)


class _Packing:
    """How a padded batch packs into one variable-length call: the (batch, position) of every real key
    and of every query among them, and the offsets. Read from the mask with one copy to the host and
    kept for the mask's other layers (transformers passes one mask to every layer of a forward)."""

    def __init__(self, mask, L, S, left, device):
        import torch
        keep = mask[:, -S:].bool().cpu()
        self.all_real = bool(keep.all())
        kb, kp, qb, ql, self.cq, self.ck = [], [], [], [], [0], [0]
        for b in range(keep.shape[0]):
            kidx = torch.nonzero(keep[b], as_tuple=True)[0]
            if left >= 0 and kidx.numel() > 0 and int(kidx[-1] - kidx[0]) + 1 != kidx.numel():
                raise NotImplementedError(_MASK_NOTE)  # a window over cache slots: holes would shift it
            qidx = kidx[kidx >= S - L] - (S - L)  # the queries are the last L positions
            kb.append(torch.full_like(kidx, b))
            kp.append(kidx)
            qb.append(torch.full_like(qidx, b))
            ql.append(qidx)
            self.cq.append(self.cq[-1] + qidx.numel())
            self.ck.append(self.ck[-1] + kidx.numel())
        self.kb, self.kp, self.qb, self.ql = (torch.cat(x).to(device) for x in (kb, kp, qb, ql))


def _own(mask):
    """mask, marked as one the mask function made for this forward (a copy no caller holds)."""
    mask.dmattn_own = True
    return mask


_read = {}  # what was read of a mask, by purpose: (weak reference to the mask, key, value)


def _once(purpose, mask, key, read):
    """read(), kept for the mask's other layers: transformers passes one mask to every layer of a
    forward, so a value read from it (a copy to the host) is read once a forward, not once a layer.
    The key holds the mask's version, so an in-place change is read afresh; an inference tensor keeps
    no version, so only a mask the mask function made for this forward (_own) is kept then."""
    import weakref
    inference = mask.is_inference()
    if inference and not getattr(mask, "dmattn_own", False):
        return read()
    key = (None if inference else mask._version,) + key
    last = _read.get(purpose)
    if last is not None and last[0]() is mask and last[1] == key:
        return last[2]
    value = read()
    _read[purpose] = (weakref.ref(mask), key, value)
    return value


def _packing(mask, L, S, left, device):
    return _once("packing", mask, (L, S, left, str(device)), lambda: _Packing(mask, L, S, left, device))


def _all_real(mask, lo, hi):
    """Whether mask[:, lo:hi] (2-D) marks every token real."""
    return _once("real", mask, (lo, hi), lambda: bool(mask[:, lo:hi].bool().all()))


def _padded(query, key, value, pk, causal, scaling, left=-1):
    """Each batch row over its own valid tokens (pk: _packing's gather), packed into one
    variable-length call; rows of padding queries are zeros."""
    from . import attention
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [B, L, Hq, E]
    if pk.cq[-1] == 0:
        return out.transpose(1, 2)
    rows = lambda t, b, p: t.transpose(1, 2)[b, p]  # noqa: E731  [tokens, heads, E]
    packed = attention(rows(query, pk.qb, pk.ql), rows(key, pk.kb, pk.kp), rows(value, pk.kb, pk.kp), causal=causal,
                       scale=scaling, policy=_policy(), window=(left, -1), cu_seqlens_q=pk.cq, cu_seqlens_k=pk.ck)
    out[pk.qb, pk.ql] = packed
    return out.transpose(1, 2)


def attention_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query [B, Hq, L, E], key/value [B, Hkv, S, E] (no repeat_kv)."""
    if dropout not in (0, 0.0) and module.training:
        raise NotImplementedError("dmattn: dropout in training is not supported (dmattn is inference-only)")
    causal = bool(getattr(module, "is_causal", True))
    window = kwargs.get("sliding_window")
    layer = getattr(key, "dmattn_layer", None)  # a PagedCache layer: key and value are this step's tokens
    if layer is not None and not layer.take(key, value, attention_mask, causal):
        return layer.decode(query, attention_mask, scaling, window)  # a step after the prompt
    L, S = query.shape[-2], key.shape[-2]
    left = int(window) - 1 if window is not None and window < S else -1
    if attention_mask is None:
        out = _attend(query, key, value, causal, scaling, left)
    elif attention_mask.dim() == 2:
        # The window the mask function drew (_mask) is the layer's; the module's sliding_window must agree.
        drawn = getattr(attention_mask, "dmattn_window_left", left)
        if window is not None and drawn != left:
            raise NotImplementedError(_MASK_NOTE)
        pk = _packing(attention_mask, L, S, drawn, query.device)
        if pk.all_real:
            out = _attend(query, key, value, causal, scaling, drawn)
        else:
            out = _padded(query, key, value, pk, causal, scaling, drawn)
    else:
        _check_4d(attention_mask, L, S, causal, left)
        out = _attend(query, key, value, causal, scaling, left)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _cache_layer():
    """PagedCache's layer class, built once on first use (transformers is imported only then)."""
    from transformers.cache_utils import CacheLayerMixin

    class Layer(CacheLayerMixin):
        """One model layer's keys and values in a dmattn cache: dmattn.PagedKVCache for CUDA tensors,
        dmattn.KVCache for CPU ones, one sequence per batch row holding that row's real tokens only
        (padding never enters it). update() hands the step's own tokens to the attention function,
        tagged with the layer, which appends them and runs prefill (the first step) or decode."""
        is_sliding = False

        def __init__(self, **kwargs):
            super().__init__()
            self.length = 0  # tokens transformers has passed, padding included (its positions)
            self.cache, self.seqs = None, None

        def lazy_initialization(self, key_states, value_states):
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.length += key_states.shape[-2]
            key_states.dmattn_layer = self
            return key_states, value_states

        def get_seq_length(self):
            return self.length

        def get_mask_sizes(self, query_length):
            return self.length + query_length, 0

        def get_max_length(self):
            return -1

        def reset(self):
            self.length, self.cache, self.seqs = 0, None, None
            self.is_initialized = False

        def reorder_cache(self, beam_idx):
            raise NotImplementedError("dmattn.hf.PagedCache: beam search (reordering the cache) is not supported")

        def crop(self, tokens_to_remove):
            raise NotImplementedError("dmattn.hf.PagedCache: cropping the cache is not supported")

        def take(self, key, value, attention_mask, causal):
            """Appends the step's real tokens to the rows' sequences; True for the prompt (the first
            step), whose attention then runs over its own tokens as without a cache."""
            from . import KVCache, PagedKVCache
            if not causal:
                raise NotImplementedError("dmattn.hf.PagedCache holds causal (decoder) layers only")
            first = self.cache is None
            if first:
                Hkv, E = key.shape[1], key.shape[-1]
                self.cache = (PagedKVCache if key.is_cuda else KVCache)(Hkv, E, _policy())
                self.seqs = [self.cache.new_sequence() for _ in range(key.shape[0])]
            self._append(key, value, self._new(attention_mask, key.shape[-2]))
            return first

        def _new(self, attention_mask, L):
            """Which of the step's L tokens are real, [B, L] bool, or None for all of them (read once a
            step for all layers: _all_real)."""
            if attention_mask is None:
                return None
            if attention_mask.dim() != 2:
                raise NotImplementedError(_MASK_NOTE)
            lo, hi = self.length - L, self.length
            return None if _all_real(attention_mask, lo, hi) else attention_mask.bool()[:, lo:hi]

        def decode(self, query, attention_mask, scaling, window):
            from . import decode
            new = self._new(attention_mask, query.shape[-2])
            if query.shape[-2] > 16 or new is not None:
                raise NotImplementedError("dmattn.hf.PagedCache: a step after the prompt takes 1 to 16 real tokens "
                                          "a sequence (chunked prefill and padding after the prompt are not supported)")
            left = int(window) - 1 if window is not None else -1
            out = decode(self.cache, self.seqs, query.contiguous(), scale=scaling, window=(left, -1))
            return out.transpose(1, 2).contiguous(), None

        def _append(self, key, value, new):
            """The step's real tokens into each row's sequence (all rows at once where they are whole)."""
            from . import PagedKVCache
            if isinstance(self.cache, PagedKVCache) and new is None:
                self.cache.append(self.seqs, key.contiguous(), value.contiguous())
                return
            for b, seq in enumerate(self.seqs):
                idx = slice(None) if new is None else new[b].nonzero(as_tuple=True)[0]
                k, v = key[b:b + 1, :, idx], value[b:b + 1, :, idx]
                if k.shape[2] == 0:
                    continue
                if isinstance(self.cache, PagedKVCache):
                    self.cache.append([seq], k.contiguous(), v.contiguous())
                else:
                    self.cache.append(seq, k.contiguous(), v.contiguous())

    return Layer


def PagedCache(model):
    """A transformers Cache whose layers keep their keys and values in dmattn's paged MX cache (in GPU
    memory for a model on the GPU): model.generate(..., past_key_values=dmattn.hf.PagedCache(model))
    for a model loaded with dmattn's attention (register_transformers()). The prompt runs dmattn's
    prefill and every later step dmattn's decode over the cache, under dmattn.hf_policy; padded
    batches keep each sequence's real tokens only. Steps after the prompt take 1 to 16 tokens; beam
    search and cache cropping raise NotImplementedError.

    The model is checked, not kept: another attention implementation would read only each step's
    own tokens from this cache, so it is refused here."""
    from transformers.cache_utils import Cache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if ALL_ATTENTION_FUNCTIONS.get(impl) is not attention_function:
        raise ValueError(f"dmattn.hf.PagedCache needs a model with dmattn's attention (attn_implementation="
                         f"dmattn.register_transformers()); this one uses {impl!r}")
    return Cache(layer_class_to_replicate=_cache_layer())


def register(name: str = "dmattn") -> str:
    """Registers dmattn's attention and mask functions with transformers as `name`; returns it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(name, attention_function)
    AttentionMaskInterface.register(name, _mask)
    return name
