"""dmattn as a Hugging Face transformers attention backend, on a small random Llama built in code."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dmattn  # noqa: E402


def tiny_llama(attn):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


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
