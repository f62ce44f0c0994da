"""dmattn as a Hugging Face transformers attention implementation.

transformers builds each layer's attention mask through a mask function registered per attention
implementation (`AttentionMaskInterface`); an implementation registered without one receives no mask
at all, so a padded batch would be computed as if it had no padding. `register()` therefore installs
both: the attention function and a mask function. The mask function hands the attention a 2-D
padding mask [B, S] (True = a real token) for the plain causal pattern, and the full 4-D boolean mask
for anything else (packed sequences, sliding windows, bidirectional spans), which the attention
accepts only where it equals the causal mask; every other mask raises NotImplementedError rather than
being ignored.

A padded batch runs each sequence's valid tokens as their own causal problem: the keys a padding
mask keeps, and the queries among them. That is what the sequence computes alone (its tiles start at
its first real token), and it is exact for left padding (generation), right padding and holes alike.
Query rows of padding tokens come back as zeros.
"""
from __future__ import annotations

_MASK_NOTE = ("dmattn supports causal (or full) attention with padding; this layer's mask differs "
              "(sliding window, packed sequences or a custom pattern): use another attn_implementation")


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
          **kwargs):
    """transformers mask function for dmattn: None, a 2-D padding mask, or a 4-D boolean mask."""
    from transformers import masking_utils as mu
    if mask_function is None or mask_function is mu.causal_mask_function or \
            mask_function is getattr(mu, "bidirectional_mask_function", None):
        if attention_mask is None:
            return None
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask.bool()
    # Any other pattern: the exact boolean mask, which the attention checks (and refuses unless causal).
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


def _policy():
    import dmattn
    return dmattn.hf_policy


def _attend(query, key, value, causal, scaling):
    from . import attention
    return attention(query, key, value, causal=causal, scale=scaling, policy=_policy())


def _check_4d(mask, L, S, causal):
    """A 4-D mask is accepted only where it is the plain causal (or full) pattern."""
    import torch
    m = mask[..., -L:, -S:]
    allowed = m > torch.finfo(m.dtype).min / 2 if m.dtype.is_floating_point else m.bool()
    want = torch.ones(L, S, dtype=torch.bool, device=m.device)
    if causal:
        want = want.tril(S - L)
    if not torch.equal(allowed, want.expand_as(allowed)):
        raise NotImplementedError(_MASK_NOTE)


def _padded(query, key, value, keep, causal, scaling):
    """Each batch row over its own valid tokens: keep [B, S] bool, True for a real token."""
    import torch
    B, _, L, _ = query.shape
    S = key.shape[-2]
    out = torch.zeros_like(query)
    for b in range(B):
        kidx = torch.nonzero(keep[b], as_tuple=True)[0]
        if kidx.numel() == 0:
            continue
        qidx = kidx[kidx >= S - L] - (S - L)  # the queries are the last L positions
        if qidx.numel() == 0:
            continue
        k_b, v_b = key[b:b + 1].index_select(2, kidx), value[b:b + 1].index_select(2, kidx)
        q_b = query[b:b + 1].index_select(2, qidx)
        out[b:b + 1].index_copy_(2, qidx, _attend(q_b, k_b, v_b, causal, scaling))
    return out


def attention_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query [B, Hq, L, E], key/value [B, Hkv, S, E] (no repeat_kv)."""
    if dropout not in (0, 0.0) and module.training:
        raise NotImplementedError("dmattn: dropout in training is not supported (dmattn is inference-only)")
    causal = bool(getattr(module, "is_causal", True))
    L, S = query.shape[-2], key.shape[-2]
    window = kwargs.get("sliding_window")
    if window is not None and window < S:
        raise NotImplementedError(_MASK_NOTE)
    if attention_mask is None:
        out = _attend(query, key, value, causal, scaling)
    elif attention_mask.dim() == 2:
        out = _padded(query, key, value, attention_mask.bool(), causal, scaling)
    else:
        _check_4d(attention_mask, L, S, causal)
        out = _attend(query, key, value, causal, scaling)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "dmattn") -> str:
    """Registers dmattn's attention and mask functions with transformers as `name`; returns it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(name, attention_function)
    AttentionMaskInterface.register(name, _mask)
    return name
