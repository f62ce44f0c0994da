"""dmattn on PyTorch CPU tensors: same results as numpy, SDPA's signature and semantics."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import dmattn  # noqa: E402
from conftest import llm_like  # noqa: E402


def qkv(seed, B=2, Hq=4, Hkv=2, N=256, d=64, dtype=torch.float32):
    rng = np.random.default_rng(seed)
    mk = lambda h: torch.from_numpy(llm_like(rng, (B, h, N, d))).to(dtype)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_equals_numpy(dtype):
    q, k, v = qkv(1, dtype=dtype)
    out = dmattn.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == q.shape
    if dtype == torch.bfloat16:  # numpy has no bfloat16: compare through float32 inputs that are bf16 values
        ref = dmattn.attention(q.float().numpy(), k.float().numpy(), v.float().numpy(), causal=True)
        assert torch.equal(out, torch.from_numpy(ref).to(torch.bfloat16))
    else:
        ref = dmattn.attention(q.numpy(), k.numpy(), v.numpy(), causal=True)
        assert np.array_equal(out.numpy(), ref)


def test_strided_views_are_not_copied_into_different_results():
    q, k, v = qkv(2)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert torch.equal(dmattn.attention(qt, k, v), dmattn.attention(q, k, v))


def test_return_lse():
    q, k, v = qkv(3)
    out, lse = dmattn.attention(q, k, v, causal=True, return_lse=True, high="bf16", low="bf16", smooth_k=False,
                                rotate=False)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    # bf16 tiles round Q and K to bf16; the reference does the same, then only fp32 sums differ.
    qb, kb = q.bfloat16().float(), k.bfloat16().float()
    s = (qb @ kb.repeat_interleave(2, 1).transpose(-1, -2)) / 8.0
    s = s.masked_fill(torch.ones(256, 256, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), rtol=1e-5, atol=1e-4)


def test_sdpa_matches_torch_at_all_high_bf16():
    q, k, v = qkv(4)
    ours = dmattn.sdpa(q, k, v, is_causal=True, enable_gqa=True, high="bf16", low="bf16")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (ours - ref).norm() / ref.norm() < 1e-2  # bf16 Q, K and P
    dma = dmattn.sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert (ours - ref).norm() < (dma - ref).norm() < ref.norm()


def test_sdpa_refuses_what_it_does_not_compute():
    q, k, v = qkv(5)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        dmattn.sdpa(q, k, v, attn_mask=torch.ones(256, 256, dtype=torch.bool), enable_gqa=True)
    with pytest.raises(NotImplementedError, match="dropout"):
        dmattn.sdpa(q, k, v, dropout_p=0.1, enable_gqa=True)
    with pytest.raises(NotImplementedError, match="top-left"):
        dmattn.sdpa(q[:, :, :100], k, v, is_causal=True, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        dmattn.sdpa(q, k, v)
    with pytest.raises(TypeError, match="all be numpy arrays or all be torch"):
        dmattn.attention(q, k.numpy(), v)


def test_tensors_that_need_gradients_are_refused():
    q, k, v = qkv(seed=11)
    q.requires_grad_(True)
    with pytest.raises(dmattn.DmattnError, match="inference-only"):
        dmattn.attention(q, k, v, causal=True)
    with torch.no_grad():
        out = dmattn.attention(q, k, v, causal=True)
    assert not out.requires_grad


def _packed(seed, lq, lk, Hq=4, Hkv=2, d=64, dtype=torch.bfloat16, device="cpu"):
    """Packed [total, H, d] q, k, v of sequences with lq queries and lk keys, and their offsets."""
    rng = np.random.default_rng(seed)
    mk = lambda n, h: torch.from_numpy(llm_like(rng, (1, n, h, d))[0]).to(dtype).to(device)  # noqa: E731
    cq = torch.tensor(np.cumsum([0] + lq), dtype=torch.int32)
    ck = torch.tensor(np.cumsum([0] + lk), dtype=torch.int32)
    return mk(sum(lq), Hq), mk(sum(lk), Hkv), mk(sum(lk), Hkv), cq, ck


def test_varlen_equals_each_sequence_alone():
    """flash-attn's varlen convention: packed [total, H, d] tensors, int32 offsets, lse [Hq, total_q];
    each sequence equals attention() over it alone (bottom-right causal within it), bit for bit."""
    lq, lk = [7, 0, 200, 1], [7, 3, 260, 129]
    q, k, v, cq, ck = _packed(4, lq, lk)
    out, lse = dmattn.attention(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=200,
                                max_seqlen_k=260, return_lse=True, window=(150, -1))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (4, sum(lq))
    for i in range(len(lq)):
        if lq[i] == 0:
            continue
        qi, ki, vi = (t[a:b].transpose(0, 1)[None] for t, a, b in
                      ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1])))
        want, want_lse = dmattn.attention(qi, ki, vi, causal=True, return_lse=True, window=(150, -1))
        assert torch.equal(out[cq[i]:cq[i + 1]], want[0].transpose(0, 1))
        assert torch.equal(lse[:, cq[i]:cq[i + 1]], want_lse[0])


def test_varlen_says_what_is_wrong():
    q, k, v, cq, ck = _packed(5, [4, 6], [4, 6])
    with pytest.raises(dmattn.DmattnError, match="cu_seqlens_k"):
        dmattn.attention(q, k, v, cu_seqlens_q=cq)
    with pytest.raises(dmattn.DmattnError, match="max_seqlen"):
        dmattn.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=5)
    with pytest.raises(dmattn.DmattnError, match="total, heads, d"):
        dmattn.attention(q[None], k[None], v[None], cu_seqlens_q=cq, cu_seqlens_k=ck)
    with pytest.raises(dmattn.DmattnError, match="from 0 to"):
        dmattn.attention(q, k, v, cu_seqlens_q=[0, 4, 9], cu_seqlens_k=ck)
    with pytest.raises(dmattn.DmattnError, match="no keys"):
        dmattn.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=[0, 0, 10])
