"""dmattn as a Hugging Face transformers attention backend, on a small random Llama built in code."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dmattn  # noqa: E402


def seeded_model(cfg, attn):
    """A random model of cfg with seed 0's weights (the same for every attention implementation)."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def tiny_llama(attn, head_dim=32):
    return seeded_model(transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=head_dim, max_position_embeddings=512), attn)


def test_logits_match_sdpa_at_all_high_bf16_and_dma_runs():
    name = dmattn.register_transformers()
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(1))
    sdpa_model = tiny_llama("sdpa")
    ours_model = tiny_llama(name)
    ours_model.load_state_dict(sdpa_model.state_dict())
    with torch.no_grad():
        ref = sdpa_model(ids).logits
        old = dmattn.hf_policy
        try:
            dmattn.hf_policy = dmattn.Policy(high="bf16", low="bf16")
            high = ours_model(ids).logits
            dmattn.hf_policy = dmattn.Policy()
            dma = ours_model(ids).logits
        finally:
            dmattn.hf_policy = old
    rel = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    assert rel(high) < 1e-2, rel(high)  # bf16 Q/K/P against fp32 SDPA
    assert rel(high) < rel(dma) < 0.2, (rel(high), rel(dma))


def issue_llama(attn):
    """The padded-batch reproduction's model: 2 layers, GQA 4/2, head dim 64."""
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def padding_mask(n, side, pad):
    """[2, n] attention mask: row 0 whole, row 1 with `pad` padding tokens on its `side`."""
    mask = torch.ones(2, n, dtype=torch.long)
    if side == "left":
        mask[1, :pad] = 0
    else:
        mask[1, n - pad:] = 0
    return mask


@pytest.fixture
def bf16_policy():
    old = dmattn.hf_policy
    dmattn.hf_policy = dmattn.Policy(high="bf16", low="bf16")
    yield
    dmattn.hf_policy = old


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_sdpa_on_valid_tokens(side, bf16_policy):
    name = dmattn.register_transformers()
    ids = torch.randint(0, 100, (2, 300), generator=torch.Generator().manual_seed(2))
    mask = padding_mask(300, side, 150)
    ref_model, ours = issue_llama("sdpa"), issue_llama(name)
    ours.load_state_dict(ref_model.state_dict())
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers padded rows
    with torch.no_grad():
        ref = ref_model(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask, position_ids=pos).logits
        # The padded row computed alone, without padding, is what its valid tokens must give.
        valid = mask[1].bool()
        alone = ours(ids[1:2, valid]).logits[0]
    keep = mask.bool()
    rel = lambda x, y: ((x - y).norm() / y.norm()).item()  # noqa: E731
    assert rel(got[keep], ref[keep]) < 1e-2
    assert rel(got[1][valid], alone) < 1e-5


def test_padded_greedy_generate_matches_sdpa(bf16_policy):
    name = dmattn.register_transformers()
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :25] = 0  # left padding, as generation pads
    ids[1, :25] = 0
    ref_model, ours = issue_llama("sdpa"), issue_llama(name)
    ours.load_state_dict(ref_model.state_dict())
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = ref_model.generate(ids, **kw)
        got = ours.generate(ids, **kw)
        alone = ours.generate(ids[1:2, 25:], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, ref)
    assert torch.equal(got[1, 40:], alone[0, 15:])


def tiny_mistral(attn, window=64):
    return seeded_model(transformers.MistralConfig(vocab_size=100, hidden_size=128, intermediate_size=256,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   sliding_window=window, max_position_embeddings=1024), attn)


def test_sliding_window_layers_match_sdpa(bf16_policy):
    name = dmattn.register_transformers()
    ref_model, ours = tiny_mistral("sdpa"), tiny_mistral(name)
    ours.load_state_dict(ref_model.state_dict())
    ids = torch.randint(0, 100, (2, 200), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref, got = ref_model(ids).logits, ours(ids).logits
        # the window is applied: without it the logits move far more than bf16 rounding
        ours.config.sliding_window = None
        for layer in ours.model.layers:
            layer.self_attn.sliding_window = None
        plain = ours(ids).logits
    rel = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    assert rel(got) < 1e-2, rel(got)
    assert rel(plain) > 5 * rel(got), (rel(plain), rel(got))
    # greedy generation through the window (prefill, then one token a step) as SDPA's
    short = ids[:1, :100].clamp(min=1)  # no pad token (0): generate() would infer padding
    with torch.no_grad():
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(tiny_mistral(name).generate(short, **kw), tiny_mistral("sdpa").generate(short, **kw))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_through_a_sliding_window_matches_sdpa(side, bf16_policy):
    name = dmattn.register_transformers()
    ref_model, ours = tiny_mistral("sdpa"), tiny_mistral(name)
    ours.load_state_dict(ref_model.state_dict())
    ids = torch.randint(1, 100, (2, 200), generator=torch.Generator().manual_seed(6))
    mask = padding_mask(200, side, 70)
    with torch.no_grad():
        ref = ref_model(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert ((got[keep] - ref[keep]).norm() / ref[keep].norm()).item() < 1e-2


def test_masks_dmattn_cannot_compute_raise(bf16_policy):
    name = dmattn.register_transformers()
    model = tiny_mistral(name)
    ids = torch.randint(1, 100, (2, 200), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, 50:60] = 0  # a hole inside the window: the window counts cache slots
    with torch.no_grad(), pytest.raises(NotImplementedError, match="sliding window"):
        model(ids, attention_mask=mask)
    with torch.no_grad():  # a window longer than the sequence is plain causal attention, holes included
        tiny_mistral(name, window=512)(ids, attention_mask=mask)


def test_training_mode_gradients_are_refused():
    name = dmattn.register_transformers()
    model = issue_llama(name)
    ids = torch.randint(0, 100, (1, 64), generator=torch.Generator().manual_seed(5))
    with pytest.raises(dmattn.DmattnError, match="inference"):
        model(ids)


@pytest.mark.parametrize("side", ["none", "left"])
def test_paged_cache_generates_as_the_dynamic_cache(side):
    """generate() with dmattn.hf.PagedCache: the prompt through dmattn's prefill, every later token
    through dmattn's decode over the paged MX cache (the host KVCache for a CPU model, PagedKVCache on
    a GPU). Decode over the cache returns prefill's last rows bit for bit, so greedy tokens equal the
    default cache's (where each step recomputes attention over all the keys), padded batch included."""
    from dmattn import hf
    name = dmattn.register_transformers()
    model = tiny_llama(name)
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids) if side == "none" else padding_mask(150, "left", 37)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             past_key_values=hf.PagedCache(model))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="dmattn's attention"):
        hf.PagedCache(tiny_llama("sdpa"))


@pytest.mark.parametrize("side", ["none", "left"])
def test_paged_cache_sliding_window_keeps_positions(side):
    """Mistral's sliding-window layers through PagedCache: each generated token's logits equal the
    model's over the whole sequence (dmattn's prefill with the window; positions as generate() gives
    them) to fp32 rounding, since the
    cache keeps every token at its own position. (The default cache keeps the last window's keys
    only, so its steps quantize the window's tiles from a shifted origin: ~3e-3 off.) Without
    smooth_k, whose key mean is the prompt's in the cache and the whole sequence's in the full pass."""
    from dmattn import hf
    name = dmattn.register_transformers()
    model = tiny_mistral(name, window=64)
    ids = torch.randint(0, 100, (2, 150), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids) if side == "none" else padding_mask(150, "left", 37)
    old = dmattn.hf_policy
    dmattn.hf_policy = dmattn.Policy(smooth_k=False)
    try:
        with torch.no_grad():
            res = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True, past_key_values=hf.PagedCache(model))
            whole = torch.cat([mask, torch.ones_like(res.sequences[:, 150:])], 1)
            full = model(res.sequences, attention_mask=whole,
                         position_ids=(whole.cumsum(-1) - 1).clamp(min=0)).logits
    finally:
        dmattn.hf_policy = old
    for step, logits in enumerate(res.logits):
        want = full[:, 149 + step]
        assert ((logits - want).norm() / want.norm()).item() < 1e-5, step


def test_padding_is_read_once_a_mask_and_again_when_the_mask_changes():
    """The padded batch's gather comes from one host copy of the mask, kept for the mask's other
    layers; an in-place change of the mask (a new version) or another shape is read afresh."""
    from dmattn import hf
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, :4] = False
    mask[2, 7:] = False
    pk = hf._packing(mask, 10, 10, -1, "cpu")
    assert hf._packing(mask, 10, 10, -1, "cpu") is pk
    assert not pk.all_real and pk.cq == [0, 6, 16, 23] and pk.ck == pk.cq
    assert pk.kb.tolist() == [0] * 6 + [1] * 10 + [2] * 7 and pk.kp[:6].tolist() == list(range(4, 10))
    short = hf._packing(mask, 2, 10, -1, "cpu")  # the last two positions are the queries
    assert short is not pk and short.cq == [0, 2, 4, 4] and short.ql.tolist() == [0, 1, 0, 1]
    mask[0, :4] = True
    again = hf._packing(mask, 10, 10, -1, "cpu")
    assert again is not pk and again.cq == [0, 10, 20, 27]
    mask[2, 7:] = True
    assert hf._packing(mask, 10, 10, -1, "cpu").all_real
    holes = torch.ones(1, 10, dtype=torch.bool)
    holes[0, 5] = False
    hf._packing(holes, 10, 10, -1, "cpu")  # holes are exact without a window
    with pytest.raises(NotImplementedError):
        hf._packing(holes, 10, 10, 3, "cpu")  # and not computable through one


def test_padded_batches_run_under_inference_mode():
    """torch.inference_mode() (whose tensors keep no version counter): a padded batch's forward and
    generate() through PagedCache give what they give under no_grad."""
    from dmattn import hf
    name = dmattn.register_transformers()
    model = tiny_llama(name)
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(4))
    mask = padding_mask(150, "left", 37)
    runs = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            logits = model(ids, attention_mask=mask).logits
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    past_key_values=hf.PagedCache(model))
        runs.append((logits.clone(), tokens.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_a_step_reads_its_mask_once_for_all_layers():
    """A decode step's padding check is read from the mask once and kept for the other layers; an
    in-place change (a new version) is read again; an inference tensor the caller holds (no version to
    tell a change by) is read every time, one the mask function made for the forward once."""
    from dmattn import hf
    reads = []
    mask = torch.ones(2, 10, dtype=torch.bool)
    read = lambda m: lambda: reads.append(1) or bool(m.all())  # noqa: E731
    assert hf._once("t", mask, (8, 10), read(mask)) and hf._once("t", mask, (8, 10), read(mask))
    assert len(reads) == 1
    mask[1, 9] = False
    assert not hf._once("t", mask, (8, 10), read(mask)) and len(reads) == 2
    assert hf._all_real(mask, 0, 9) and not hf._all_real(mask, 8, 10)
    with torch.inference_mode():
        theirs = torch.ones(2, 10, dtype=torch.bool)
        ours = hf._own(torch.ones(2, 10, dtype=torch.bool))
    for _ in range(2):
        hf._once("t", theirs, (8, 10), read(theirs))
    assert len(reads) == 4
    for _ in range(2):
        hf._once("t", ours, (8, 10), read(ours))
    assert len(reads) == 5
