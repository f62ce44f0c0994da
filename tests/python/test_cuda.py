"""dmattn on PyTorch CUDA tensors (marker `cuda`, CTest label gpu): the CUDA backend against the CPU
oracle, the caller's stream, and device errors. Skipped, with the reason, without a device."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import dmattn  # noqa: E402
from conftest import llm_like  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not dmattn.cuda_available(), reason="dmattn built without the CUDA backend"),
]


def qkv(seed, N=1000, d=128, dtype=torch.bfloat16):
    rng = np.random.default_rng(seed)
    mk = lambda h: torch.from_numpy(llm_like(rng, (1, h, N, d))).to(dtype)  # noqa: E731
    return mk(8), mk(2), mk(2)


@pytest.mark.parametrize("policy,d", [({}, 128), ({"high": "mxfp4"}, 128), ({"diag_tiles": 2, "sink_tiles": 1}, 128),
                                      ({"low": "nvfp4"}, 128), ({}, 256), ({"smooth_q": True, "sink_keys": 2}, 256)])
def test_cuda_matches_cpu_oracle(policy, d):
    q, k, v = qkv(1, d=d)
    ref, ref_lse = dmattn.attention(q, k, v, causal=True, return_lse=True, **policy)
    out, lse = dmattn.attention(q.cuda(), k.cuda(), v.cuda(), causal=True, return_lse=True, **policy)
    assert out.is_cuda and out.dtype == torch.bfloat16 and lse.is_cuda
    rel = ((out.cpu().float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 5e-3, rel  # 2e-3 on the same codes (bench/RESULTS.md), plus bf16 output rounding
    # The LSE within the error model of the C++ tests (GpuPrefill.LargeLogitsStayFiniteAndBounded):
    # 2e-3 (1 + |lse|), plus 1e-3 of each row's largest scale * sum_i |q_i k_i| over the keys it sees,
    # since Hopper's FP8 wgmma keeps about 13 bits of its sums (at d = 256 these inputs' logits reach 40).
    qa, ka = q.float().abs()[0], k.float().abs()[0].repeat_interleave(q.shape[1] // k.shape[1], dim=0)
    mag = (qa @ ka.transpose(1, 2) / d ** 0.5).tril().amax(dim=-1)[None]
    err = (lse.cpu() - ref_lse).abs()
    assert (err <= 2e-3 * (1 + ref_lse.abs()) + 1e-3 * mag).all(), err.max().item()


def test_runs_on_the_current_stream():
    q, k, v = (t.cuda() for t in qkv(2))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = dmattn.attention(q, k, v, causal=True)
    # The result is stream-ordered on `side` (as any torch op's): the default stream waits for it before use.
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, dmattn.attention(q, k, v, causal=True))


def test_bnhd_layout_on_cuda():
    q, k, v = (t.cuda() for t in qkv(3))
    t = lambda a: a.transpose(1, 2).contiguous()  # noqa: E731
    got = dmattn.attention(t(q), t(k), t(v), causal=True, layout="bnhd")
    assert torch.equal(got.transpose(1, 2), dmattn.attention(q, k, v, causal=True))


def test_cuda_errors():
    q, k, v = (t.cuda() for t in qkv(4))
    with pytest.raises(dmattn.DmattnError, match="bf16 tiles"):
        dmattn.attention(q, k, v, low="bf16")
    # q_residual runs on the CPU backend and the host KV cache; the CUDA kernels refuse it by name.
    with pytest.raises(dmattn.DmattnError, match="q_residual"):
        dmattn.attention(q, k, v, q_residual=True)
    with pytest.raises(dmattn.DmattnError, match="q_residual"):
        dmattn.PagedKVCache(2, q.shape[-1], q_residual=True)
    with pytest.raises(ValueError, match="one device"):
        dmattn.attention(q, k.cpu(), v)
    bad = q.clone()
    bad[0, 0, 0, 0] = float("inf")
    with pytest.raises(dmattn.DmattnError, match="non-finite"):
        dmattn.attention(bad, k, v)



def test_ring_blocks_on_cuda_match_cpu(tmp_path):
    """One rank, zigzag: the ring's block calls (position offsets, LSE merges) on the GPU against the CPU."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        q, k, v = qkv(6, N=1024, d=64)
        want = dmattn.ring_attention(q, k, v, sink_tiles=1)
        got = dmattn.ring_attention(q.cuda(), k.cuda(), v.cuda(), sink_tiles=1)
        assert got.is_cuda
        rel = ((got.cpu().float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 5e-3, rel  # 2e-3 on the same codes, plus bf16 output rounding
        whole = dmattn.attention(q.cuda(), k.cuda(), v.cuda(), causal=True, sink_tiles=1, smooth_k=False)  # the ring's
        rel = ((got.float() - whole.float()).norm() / whole.float().norm()).item()
        assert rel < 5e-3, rel
    finally:
        dist.destroy_process_group()


def test_decode_on_cuda_matches_cpu():
    rng = np.random.default_rng(7)
    cache = dmattn.KVCache(2, 128, dmattn.Policy(diag_tiles=2, sink_tiles=1))
    seqs = [cache.new_sequence() for _ in range(2)]
    for s, n in zip(seqs, (300, 1000)):
        cache.append(s, llm_like(rng, (1, 2, n, 128)), llm_like(rng, (1, 2, n, 128)))
    q = torch.from_numpy(llm_like(rng, (2, 8, 3, 128)))
    ref, ref_lse = dmattn.decode(cache, seqs, q, splits=2, return_lse=True)
    out, lse = dmattn.decode(cache, seqs, q.cuda(), splits=2, return_lse=True)
    assert out.is_cuda and lse.is_cuda
    rel = ((out.cpu() - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, rel
    assert torch.allclose(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)
    # the cache grows; the next step sees the new tokens (the device copy follows)
    for s in seqs:
        cache.append(s, llm_like(rng, (1, 2, 1, 128)), llm_like(rng, (1, 2, 1, 128)))
    q1 = torch.from_numpy(llm_like(rng, (2, 8, 1, 128))).to(torch.bfloat16)
    ref1 = dmattn.decode(cache, seqs, q1)
    out1 = dmattn.decode(cache, seqs, q1.cuda())
    rel1 = ((out1.cpu().float() - ref1.float()).norm() / ref1.float().norm()).item()
    assert rel1 < 1e-2, rel1  # automatic splits on the GPU (P rounded per split) and bf16 output rounding


def test_unchecked_call_is_stream_ordered():
    """check_finite=False: no read-back, same result; a NaN row comes out NaN instead of raising."""
    q, k, v = (t.cuda() for t in qkv(5))
    want = dmattn.attention(q, k, v, causal=True)
    got = dmattn.attention(q, k, v, causal=True, check_finite=False)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(got, want)
    bad = q.clone()
    bad[0, 3, 600, 9] = float("nan")
    out = dmattn.attention(bad, k, v, causal=True, check_finite=False)
    rows_nan = out.isnan().any(dim=-1)
    assert rows_nan[0, 3, 600] and rows_nan.sum().item() == 1


@pytest.mark.parametrize("window", [(300, -1), (0, -1), (64, 200)])
def test_sliding_window_on_cuda_matches_cpu(window):
    q, k, v = qkv(11)
    causal = window[1] < 0
    ref, ref_lse = dmattn.attention(q, k, v, causal=causal, window=window, return_lse=True)
    out, lse = dmattn.attention(q.cuda(), k.cuda(), v.cuda(), causal=causal, window=window, return_lse=True)
    rel = ((out.cpu().float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 5e-3, rel
    # The FP8 tensor cores accumulate Q.K with fewer bits than fp32: a score's error scales with the sum
    # of its products' magnitudes, not with the score. With window (0, -1) a row's LSE is its one score.
    kk = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    mag = (q.float().abs() @ kk.abs().transpose(-1, -2)).amax(-1) / q.shape[-1] ** 0.5
    assert ((lse.cpu() - ref_lse).abs() <= 2e-3 * (1 + ref_lse.abs()) + 2e-3 * mag).all()
    # and the window matters: without it the rows differ
    assert not torch.allclose(lse.cpu(), dmattn.attention(q, k, v, causal=causal, return_lse=True)[1], atol=1e-2)


def test_decode_sliding_window_on_cuda_matches_cpu():
    rng = np.random.default_rng(8)
    cache = dmattn.KVCache(2, 128)
    seqs = [cache.new_sequence() for _ in range(2)]
    for s, n in zip(seqs, (300, 1000)):
        cache.append(s, llm_like(rng, (1, 2, n, 128)), llm_like(rng, (1, 2, n, 128)))
    q = torch.from_numpy(llm_like(rng, (2, 8, 3, 128)))
    ref, ref_lse = dmattn.decode(cache, seqs, q, splits=2, window=(200, -1), return_lse=True)
    out, lse = dmattn.decode(cache, seqs, q.cuda(), splits=2, window=(200, -1), return_lse=True)
    assert ((out.cpu() - ref).norm() / ref.norm()).item() < 1e-5
    assert torch.allclose(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy,d", [({}, 128), ({"pv": "mxfp4", "diag_tiles": 2, "sink_tiles": 1}, 128), ({"pv": "mxfp8"}, 128),
                                      ({"diag_tiles": 4, "sink_tiles": 1, "rotate": True, "smooth_k": True, "sink_keys": 4}, 128),
                                      ({}, 256), ({"pv": "mxfp4"}, 256)])
def test_paged_cache_decodes_as_the_host_cache(policy, d):
    # A prompt then one-token steps for a batch, appended as a generation loop does (CUDA tensors on
    # the current stream): decode over the GPU cache equals decode over the host cache, bit for bit.
    rng = np.random.default_rng(5)
    host, dev = dmattn.KVCache(2, d, dmattn.Policy(**policy)), dmattn.PagedKVCache(2, d, **policy)
    hs = [host.new_sequence() for _ in range(2)]
    ds = [dev.new_sequence() for _ in range(2)]
    k = torch.from_numpy(llm_like(rng, (2, 2, 400, d))).to(torch.bfloat16)
    v = torch.from_numpy(llm_like(rng, (2, 2, 400, d))).to(torch.bfloat16)
    for i in range(2):
        host.append(hs[i], k[i:i + 1, :, :250], v[i:i + 1, :, :250])
    dev.append(ds, k[:, :, :250].cuda(), v[:, :, :250].cuda())
    for t in range(250, 400):
        for i in range(2):
            host.append(hs[i], k[i:i + 1, :, t:t + 1], v[i:i + 1, :, t:t + 1])
        dev.append(ds, k[:, :, t:t + 1].cuda(), v[:, :, t:t + 1].cuda())
    assert [dev.length(s) for s in ds] == [400, 400]
    q = torch.from_numpy(llm_like(rng, (2, 8, 2, d))).to(torch.bfloat16).cuda()
    want, want_lse = dmattn.decode(host, hs, q, splits=2, return_lse=True)
    got, got_lse = dmattn.decode(dev, ds, q, splits=2, return_lse=True)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    with pytest.raises(dmattn.DmattnError, match="CUDA tensor"):
        dmattn.decode(dev, ds, q.cpu())
    with pytest.raises(dmattn.DmattnError, match="CUDA tensors"):
        dev.append(ds, k[:, :, :1], v[:, :, :1])
    # On a side stream the append and the decode are ordered on that stream, as torch's ops are.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    kn, vn = k[:, :, 399:400].cuda(), v[:, :, 399:400].cuda()
    with torch.cuda.stream(side):
        dev.append(ds, kn, vn)
        got = dmattn.decode(dev, ds, q, splits=2)
    torch.cuda.current_stream().wait_stream(side)
    for i in range(2):
        host.append(hs[i], k[i:i + 1, :, 399:400], v[i:i + 1, :, 399:400])
    assert torch.equal(got, dmattn.decode(host, hs, q, splits=2))


def test_varlen_on_cuda_equals_each_sequence_alone():
    """Packed sequences on the GPU (each sequence one call on the current stream): equal to the CUDA
    attention of each sequence alone, the LSE in [Hq, total_q]."""
    rng = np.random.default_rng(9)
    lq, lk = [300, 1, 0, 700], [300, 129, 5, 1000]
    mk = lambda n, h: torch.from_numpy(llm_like(rng, (1, n, h, 128))[0]).to(torch.bfloat16).cuda()  # noqa: E731
    q, k, v = mk(sum(lq), 8), mk(sum(lk), 2), mk(sum(lk), 2)
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    out, lse = dmattn.attention(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    for i in range(len(lq)):
        if lq[i] == 0:
            continue
        qi, ki, vi = (t[a:b].transpose(0, 1)[None].contiguous() for t, a, b in
                      ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1])))
        want, want_lse = dmattn.attention(qi, ki, vi, causal=True, return_lse=True)
        assert torch.equal(out[cq[i]:cq[i + 1]], want[0].transpose(0, 1))
        assert torch.equal(lse[:, cq[i]:cq[i + 1]], want_lse[0])


@pytest.mark.parametrize("head_dim", [64, 256])
def test_paged_cache_generate_on_cuda(head_dim):
    """generate() with dmattn.hf.PagedCache on the GPU: the layers' caches are PagedKVCache, and each
    generated token's logits agree with the model's logits over the whole sequence (teacher-forced,
    dmattn's prefill), padded batch included."""
    pytest.importorskip("transformers")
    from dmattn import hf
    from test_transformers import padding_mask, tiny_llama
    name = dmattn.register_transformers()
    model = tiny_llama(name, head_dim=head_dim).cuda()
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(4)).cuda()
    mask = padding_mask(150, "left", 37).cuda()
    cache = hf.PagedCache(model)
    with torch.no_grad():
        res = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, past_key_values=cache,
                             return_dict_in_generate=True, output_logits=True)
        seq = res.sequences
        whole = torch.cat([mask, torch.ones_like(seq[:, 150:])], 1)  # positions as generate() gives them
        full = model(seq, attention_mask=whole, position_ids=(whole.cumsum(-1) - 1).clamp(min=0)).logits
    assert isinstance(cache.layers[0].cache, dmattn.PagedKVCache)
    for step, logits in enumerate(res.logits):
        want = full[:, 149 + step]
        assert ((logits - want).norm() / want.norm()).item() < 2e-2, step


def test_paged_cache_graph_replay_equals_eager_steps(monkeypatch):
    """A step (append + decode) captured in a torch CUDA graph and replayed with prepare() before
    each replay gives, bit for bit, what the same steps give run eagerly on a second cache (page
    openings and pages leaving the window included); a replay without prepare() returns NaN."""
    monkeypatch.setenv("DMATTN_DECODE_CTAS", "2")  # one decode instance for both (the graph's reads every table column)
    Hkv, Hq, d, steps, prompts = 2, 8, 128, 140, (600, 1, 300)
    pol = dmattn.Policy(diag_tiles=2, sink_tiles=1, pv="mxfp4", rotate=True, smooth_k=True)
    g = torch.Generator(device="cuda").manual_seed(3)
    kk = [torch.randn(1, Hkv, n + steps + 1, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in prompts]
    vv = [torch.randn(1, Hkv, n + steps + 1, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in prompts]
    qq = torch.randn(steps + 1, len(prompts), Hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    eager, graph = dmattn.PagedKVCache(Hkv, d, pol), dmattn.PagedKVCache(Hkv, d, pol)
    es = [eager.new_sequence() for _ in prompts]
    gs = [graph.new_sequence() for _ in prompts][::-1]  # out of order: the captured decode gathers its tables
    for i, n in enumerate(prompts):
        eager.append([es[i]], kk[i][:, :, :n], vv[i][:, :, :n])
        graph.append([gs[i]], kk[i][:, :, :n], vv[i][:, :, :n])
    graph.reserve(len(prompts), max(prompts) + steps + 1)

    def inputs(step):
        k = torch.cat([kk[i][:, :, n + step:n + step + 1] for i, n in enumerate(prompts)])
        v = torch.cat([vv[i][:, :, n + step:n + step + 1] for i, n in enumerate(prompts)])
        return k, v, qq[step]
    k1, v1, q1 = (x.clone() for x in inputs(0))
    dmattn.decode(graph, gs, q1, splits=2)  # warm-up: lazy set-up happens outside the capture
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        graph.append(gs, k1, v1)
        out = dmattn.decode(graph, gs, q1, splits=2)
    for step in range(steps):
        for dst, src in zip((k1, v1, q1), inputs(step)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.prepare(gs, 1)
        cg.replay()
        eager.append(es, k1, v1)
        want = dmattn.decode(eager, es, q1, splits=2)
        assert torch.equal(out, want), step
    assert [graph.length(s) for s in gs] == [eager.length(s) for s in es]
    cg.replay()  # no prepare(): nothing appended, NaN out
    assert torch.isnan(out).all()
    assert [graph.length(s) for s in gs] == [eager.length(s) for s in es]
    with pytest.raises(dmattn.DmattnError, match="prepare"):  # a prepared sequence takes no eager append
        graph.append(gs, k1, v1)
    with pytest.raises(dmattn.DmattnError, match="reserve"):  # the captured cache's memory stays put
        for _ in range(64):
            graph.append([graph.new_sequence()], kk[0][:, :, :600], vv[0][:, :, :600])
