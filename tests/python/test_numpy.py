"""dmattn on numpy arrays: agreement with the C++ CLI bit for bit, layouts, LSE, errors."""
import numpy as np
import pytest

import dmattn
from conftest import llm_like


def qkv(seed=0, B=1, Hq=4, Hkv=2, Nq=300, Nk=300, d=64, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (llm_like(rng, (B, Hq, Nq, d), dtype), llm_like(rng, (B, Hkv, Nk, d), dtype),
            llm_like(rng, (B, Hkv, Nk, d), dtype))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("policy", [[], ["--diag-tiles", "2", "--sink-tiles", "1"], ["--low", "nvfp4"]])
def test_matches_cli_bit_for_bit(tmp_path, cli, causal, policy):
    q, k, v = qkv(seed=1 + causal, Nq=200, Nk=333)
    for name, a in (("q", q), ("k", k), ("v", v)):
        np.save(tmp_path / f"{name}.npy", a)
    args = ["run", "--q", tmp_path / "q.npy", "--k", tmp_path / "k.npy", "--v", tmp_path / "v.npy",
            "--out", tmp_path / "o.npy", "--lse", tmp_path / "lse.npy", *policy] + (["--causal"] if causal else [])
    cli(*args)
    kw = dict(zip([p.lstrip("-").replace("-", "_") for p in policy[::2]], policy[1::2]))
    kw = {key: (int(val) if key.endswith("tiles") else val) for key, val in kw.items()}
    out, lse = dmattn.attention(q, k, v, causal=causal, return_lse=True, **kw)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert np.array_equal(out, np.load(tmp_path / "o.npy"))
    assert np.array_equal(lse, np.load(tmp_path / "lse.npy"))


def test_bnhd_layout_is_a_view_of_the_same_problem():
    q, k, v = qkv(seed=3)
    want = dmattn.attention(q, k, v, causal=True)
    t = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3))  # noqa: E731
    got = dmattn.attention(t(q), t(k), t(v), causal=True, layout="bnhd")
    assert got.shape == t(q).shape
    assert np.array_equal(got.transpose(0, 2, 1, 3), want)
    # Strided (non-contiguous) inputs are read in place: a transposed view equals its copy.
    got2 = dmattn.attention(t(q).transpose(0, 2, 1, 3), k, v, causal=True)
    assert np.array_equal(got2, want)


def test_half_precision_inputs_give_outputs_of_their_dtype():
    q, k, v = qkv(seed=4, dtype=np.float16)
    out = dmattn.attention(q, k, v)
    assert out.dtype == np.float16
    ref = dmattn.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    assert np.array_equal(out, ref.astype(np.float16))


def test_dma_sits_between_all_high_and_all_low():
    q, k, v = qkv(seed=5, Nq=512, Nk=512)
    exact = dmattn.attention(q, k, v, causal=True, high="bf16", low="bf16")
    err = lambda o: np.linalg.norm(o - exact) / np.linalg.norm(exact)  # noqa: E731
    plain = dict(diag_tiles=1, sink_tiles=0, smooth_k=False, rotate=False)  # dmattn.Policy.plain()
    hi = err(dmattn.attention(q, k, v, causal=True, low="mxfp8-e4m3", **plain))
    lo = err(dmattn.attention(q, k, v, causal=True, high="mxfp4", **plain))
    dma = err(dmattn.attention(q, k, v, causal=True, **plain))
    assert hi < dma < lo
    # The default (eight diagonal tiles, the sink tile, smooth_k, the rotation) below plain DMA.
    assert err(dmattn.attention(q, k, v, causal=True)) < dma


def test_policy_value_type():
    p = dmattn.Policy()
    assert repr(p).startswith("Policy(high='mxfp8-e4m3', low='mxfp4', diag_tiles=8, sink_tiles=1, ")
    assert p.smooth_k and p.rotate and not p.smooth_q and p.sink_keys == 0
    plain = dmattn.Policy.plain()
    assert (plain.diag_tiles, plain.sink_tiles, plain.smooth_k, plain.rotate) == (1, 0, False, False)
    assert eval(repr(p), {"Policy": dmattn.Policy}) == p
    p2 = dmattn.Policy(low="nvfp4", sink_tiles=2)
    assert p2 != p and p2.low == "nvfp4" and p2.sink_tiles == 2
    p2.low = "mxfp4"
    p2.sink_tiles = 1
    assert p2 == p
    with pytest.raises(ValueError, match="format"):
        dmattn.Policy(high="fp7")
    with pytest.raises(ValueError):
        dmattn.Policy(diag_tiles=-1)
    q, k, v = qkv(seed=6)
    assert np.array_equal(dmattn.attention(q, k, v, policy=dmattn.Policy(diag_tiles=3)),
                          dmattn.attention(q, k, v, diag_tiles=3))


def test_pv_modes():
    q, k, v = qkv(seed=7, Nq=256, Nk=256)
    exact = dmattn.attention(q, k, v, causal=True, high="bf16", low="bf16")
    err = lambda o: np.linalg.norm(o - exact) / np.linalg.norm(exact)  # noqa: E731
    e8 = err(dmattn.attention(q, k, v, causal=True, high="bf16", low="bf16", pv="mxfp8"))
    e4 = err(dmattn.attention(q, k, v, causal=True, high="bf16", low="bf16", pv="mxfp4"))
    f8 = err(dmattn.attention(q, k, v, causal=True, high="bf16", low="bf16", pv="fp8"))
    assert 0 < e8 < e4 < 0.2  # V's 4-bit codes cost more than 8-bit ones, and only V is quantized here
    assert 0 < f8 < 2 * e8  # E4M3 like mxfp8, with coarser scales (one per channel, P's fixed)
    assert dmattn.Policy(pv="mxfp4").pv == "mxfp4" and dmattn.Policy(pv="fp8").pv == "fp8"
    with pytest.raises(ValueError, match="pv"):
        dmattn.Policy(pv="mxfp2")


def test_bad_inputs_raise_clear_errors():
    q, k, v = qkv(seed=7)
    with pytest.raises(dmattn.DmattnError, match="4 dimensions"):
        dmattn.attention(q[0], k, v)
    with pytest.raises(TypeError, match="one dtype"):
        dmattn.attention(q, k.astype(np.float16), v)
    with pytest.raises(dmattn.DmattnError, match="dtype"):
        dmattn.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    with pytest.raises(dmattn.DmattnError):
        dmattn.attention(q[:, :3], k, v)  # 3 query heads over 2 KV heads
    with pytest.raises(dmattn.DmattnError):
        dmattn.attention(q[..., :48], k[..., :48], v[..., :48])  # head dim not a multiple of 32
    bad = q.copy()
    bad[0, 1, 2, 3] = np.nan
    with pytest.raises(dmattn.DmattnError, match="non-finite|NaN"):
        dmattn.attention(bad, k, v)
    with pytest.raises(ValueError, match="layout"):
        dmattn.attention(q, k, v, layout="nbhd")


def test_quantize_round_trip_and_cli_agreement(tmp_path, cli):
    rng = np.random.default_rng(8)
    x = llm_like(rng, (5, 96))
    for fmt in ("mxfp4", "mxfp8-e4m3", "nvfp4"):
        codes, scales, ts = dmattn.quantize(x, fmt)
        assert codes.dtype == np.uint8 and codes.shape == (5, 48 if fmt in ("mxfp4", "nvfp4") else 96)
        np.save(tmp_path / "x.npy", x)
        cli("quantize", "--in", tmp_path / "x.npy", "--format", fmt, "--codes", tmp_path / "c.npy",
            "--scales", tmp_path / "s.npy", *(["--tensor-scale", tmp_path / "t.npy"] if fmt == "nvfp4" else []))
        assert np.array_equal(codes, np.load(tmp_path / "c.npy").reshape(codes.shape))
        assert np.array_equal(scales, np.load(tmp_path / "s.npy").reshape(scales.shape))
        y = dmattn.dequantize(codes, scales, fmt, 96, ts)
        assert y.shape == x.shape
        rel = np.linalg.norm(y - x) / np.linalg.norm(x)
        assert rel < (0.05 if fmt == "mxfp8-e4m3" else 0.3)
        if fmt == "nvfp4":  # its tensor scale is recomputed from the new amax
            continue
        # Values already on the grid survive exactly.
        codes2, scales2, ts2 = dmattn.quantize(y, fmt)
        assert np.array_equal(dmattn.dequantize(codes2, scales2, fmt, 96, ts2), y)


def test_kv_cache_decode_equals_attention_last_rows():
    rng = np.random.default_rng(9)
    L, nq = 300, 4
    q = llm_like(rng, (1, 4, L, 64))
    k, v = llm_like(rng, (1, 2, L, 64)), llm_like(rng, (1, 2, L, 64))
    # (smooth_k off: the cache's key mean is its first append's, here 70 tokens of the 300)
    want, want_lse = dmattn.attention(q, k, v, causal=True, return_lse=True, diag_tiles=2, sink_tiles=1, smooth_k=False)
    cache = dmattn.KVCache(2, 64, dmattn.Policy(diag_tiles=2, sink_tiles=1, smooth_k=False))
    s = cache.new_sequence()
    for t0 in range(0, L, 70):  # appended in chunks, as generation would
        cache.append(s, np.ascontiguousarray(k[:, :, t0:t0 + 70]), np.ascontiguousarray(v[:, :, t0:t0 + 70]))
    assert cache.length(s) == L and len(cache.page_table(s)) == 3
    # 3 pages x 256 rows (2 heads x 128): all high (sink + 2-page window), MXFP8 K = 64 + 2 scale bytes
    # a row, bf16 V = 128 bytes, and the window pages keep fp32 K (256 bytes) for re-encoding.
    assert cache.bytes(s) == 256 * (66 + 128) + 2 * 256 * (66 + 128 + 256)
    out, lse = dmattn.decode(cache, [s], np.ascontiguousarray(q[:, :, -nq:]), return_lse=True)
    assert np.array_equal(out, want[:, :, -nq:])
    assert np.array_equal(lse, want_lse[:, :, -nq:])
    with pytest.raises(dmattn.DmattnError, match="16"):
        dmattn.decode(cache, [s], np.ascontiguousarray(q[:, :, -17:]))
    # A sliding window: decode equals attention's last rows with the same window, bit for bit.
    want_w, want_w_lse = dmattn.attention(q, k, v, causal=True, return_lse=True, diag_tiles=2, sink_tiles=1,
                                          smooth_k=False, window=(100, -1))
    out_w, lse_w = dmattn.decode(cache, [s], np.ascontiguousarray(q[:, :, -nq:]), return_lse=True, window=(100, -1))
    assert np.array_equal(out_w, want_w[:, :, -nq:]) and np.array_equal(lse_w, want_w_lse[:, :, -nq:])
    assert not np.array_equal(lse_w, lse)


def test_read_only_inputs_are_accepted(tmp_path):
    q, k, v = qkv(seed=7, Nq=130, Nk=130)
    want = dmattn.attention(q, k, v, causal=True)
    path = tmp_path / "q.npy"
    np.save(path, q)
    q_map = np.load(path, mmap_mode="r")  # a read-only memory map
    assert not q_map.flags.writeable
    got = dmattn.attention(q_map, k, v, causal=True)
    np.testing.assert_array_equal(got, want)
    # broadcast_to gives a read-only view with a zero stride: one KV head's rows shared by two
    k1 = np.broadcast_to(k[:, :1], k.shape)
    v1 = np.broadcast_to(v[:, :1], v.shape)
    np.testing.assert_array_equal(dmattn.attention(q, k1, v1, causal=True),
                                  dmattn.attention(q, np.ascontiguousarray(k1), np.ascontiguousarray(v1), causal=True))


def test_big_endian_inputs_raise_a_clear_error():
    q, k, v = qkv(seed=8, Nq=64, Nk=64)
    with pytest.raises(dmattn.DmattnError, match="byte order"):
        dmattn.attention(q.astype(">f4"), k, v)


def test_check_finite_off_gives_nan_rows_instead_of_raising():
    q, k, v = qkv(seed=9, Nq=200, Nk=200)
    q[0, 1, 150, 3] = np.nan
    with pytest.raises(dmattn.DmattnError, match="non-finite"):
        dmattn.attention(q, k, v, causal=True)
    out = dmattn.attention(q, k, v, causal=True, check_finite=False)
    assert np.isnan(out[0, 1, 150]).all()
    bad = np.zeros(out.shape[:3], dtype=bool)
    bad[0, 1, 150] = True
    assert np.isfinite(out[~bad]).all()  # other rows are untouched by the NaN


def test_cuda_available_means_a_usable_device():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        assert dmattn.cuda_available() is False


def test_register_transformers_leaves_a_quiet_exit():
    pytest.importorskip("transformers")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import dmattn; dmattn.register_transformers()"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "leaked" not in r.stderr, r.stderr


def test_policy_keywords_are_stated_once_and_the_stubs_follow():
    import ast
    import inspect
    import pathlib
    p = dmattn.Policy()
    assert all(hasattr(p, f) for f in dmattn.POLICY_FIELDS)
    kw = dict(high="mxfp8-e4m3", low="mxfp4", diag_tiles=2, sink_tiles=1, scale_rule="ceil", pv="mxfp8", smooth_k=True,
              smooth_q=True, rotate=True, sink_keys=2, q_residual=True)
    assert set(kw) == set(dmattn.POLICY_FIELDS)
    built = dmattn.Policy(**kw)
    assert all(getattr(built, f) == v for f, v in kw.items())
    q, k, v = qkv(seed=12, Nq=140, Nk=140)
    np.testing.assert_array_equal(dmattn.attention(q, k, v, causal=True, **kw),
                                  dmattn.attention(q, k, v, causal=True, policy=built))
    with pytest.raises(TypeError, match="unexpected keyword"):
        dmattn.attention(q, k, v, diag_tile=2)
    with pytest.raises(TypeError, match="not both"):
        dmattn.attention(q, k, v, policy=built, diag_tiles=2)
    stub = ast.parse(pathlib.Path(inspect.getfile(dmattn)).with_suffix(".pyi").read_text())
    funcs = {n.name: n for n in ast.walk(stub) if isinstance(n, ast.FunctionDef)}
    policy_init = next(n for c in stub.body if isinstance(c, ast.ClassDef) and c.name == "Policy"
                       for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert [a.arg for a in policy_init.args.kwonlyargs] == list(dmattn.POLICY_FIELDS)
    assert all(hasattr(dmattn.Policy(), f) for f in dmattn.POLICY_FIELDS)  # each keyword is a field too
    assert set(dmattn.POLICY_FIELDS) <= {a.arg for a in funcs["attention"].args.kwonlyargs}
    sig = inspect.signature(dmattn.attention)
    stub_rest = {a.arg for a in funcs["attention"].args.kwonlyargs} - set(dmattn.POLICY_FIELDS)
    assert stub_rest == {n for n, prm in sig.parameters.items() if prm.kind == prm.KEYWORD_ONLY}


@pytest.mark.parametrize("window", [(100, -1), (0, -1), (50, 20)])
def test_sliding_window_equals_a_masked_reference(window):
    q, k, v = qkv(seed=9, Nq=300, Nk=300)
    left, right = window
    causal = right < 0
    got = dmattn.attention(q, k, v, causal=causal, window=window, high="bf16", low="bf16")
    # fp64 reference with the window as an explicit mask (GQA: head h reads KV head h // 2).
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), np.repeat(k, 2, axis=1).astype(np.float64)) / 8.0
    p, n = np.arange(300)[:, None], np.arange(300)[None, :]
    keep = (n >= p - left) & ((n <= p) if causal else (n <= p + right))
    s = np.where(keep, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bhkd->bhqd", w / w.sum(-1, keepdims=True), np.repeat(v, 2, axis=1).astype(np.float64))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # bf16 tiles and P
    # A window wider than the sequence is no window (bit for bit); this one does change the result.
    plain = dmattn.attention(q, k, v, causal=causal, high="bf16", low="bf16")
    assert np.array_equal(dmattn.attention(q, k, v, causal=causal, window=(1000, 1000), high="bf16", low="bf16"), plain)
    assert not np.allclose(plain, got)


@pytest.mark.skipif(dmattn.cuda_available(), reason="a CUDA device is present (test_cuda.py tests the GPU cache)")
def test_paged_cache_says_it_needs_a_gpu():
    with pytest.raises(dmattn.DmattnError, match="GPU memory|no CUDA device"):
        dmattn.PagedKVCache(2, 64)


def test_options_are_set_by_name():
    """The compiled layer takes one options struct per operation, its fields set by name: a misspelt
    field raises instead of being dropped, and the defaults are the C++ structs' own."""
    o = dmattn._AttentionOptions()
    assert (o.causal, o.softmax_scale, o.check_finite, o.q_offset, o.window_left, o.window_right) == \
        (False, None, True, None, -1, -1)
    d = dmattn._DecodeOptions()
    assert (d.softmax_scale, d.splits, d.window_left, d.stream) == (None, 0, -1, 0)
    with pytest.raises(AttributeError, match="casual"):
        dmattn._options(dmattn._AttentionOptions, casual=True)
    assert dmattn._options(dmattn._AttentionOptions, causal=True, softmax_scale=0.5).softmax_scale == 0.5
