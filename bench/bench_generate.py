#!/usr/bin/env python3
"""transformers generate() tokens/s from Python, same process: a random Llama (built in code, bf16 on
the GPU) with attn_implementation="sdpa" and its default cache, against dmattn's attention with
dmattn.hf.PagedCache (prefill by dmattn, every later token by dmattn's decode over the paged MX cache).

usage: PAD=n python3 bench/bench_generate.py [B PROMPT NEW [layers]]   (default 16 4096 256, 8 layers:
       Hq=32, Hkv=8, d=128, hidden 4096; a smaller model where the GPU lacks the memory)
       PAD (default 0): every other row's first n tokens are padding (a batch of unequal prompts,
       left-padded as generate() takes them), passed in attention_mask
Prints one markdown row per backend: prefill ms (the first token), decode tokens/s after it.
"""
import os
import sys
import time

import torch
import transformers

import dmattn
from dmattn import hf


def model_for(attn, layers, device, dtype):
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                   head_dim=128, max_position_embeddings=65536)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a CPU initialisation of 1.7B weights takes minutes
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).eval()


def run(model, ids, mask, new, cache):
    """(seconds to the first token, seconds for the other new - 1) of a greedy generate()."""
    def generate(n):
        kw = {} if cache is None else {"past_key_values": cache()}
        if mask is not None:
            kw["attention_mask"] = mask
        sync()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
        sync()
        return time.perf_counter() - t
    first = generate(1)
    return first, generate(new) - first


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    B, prompt, new = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (16, 4096, 256)
    layers = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    name = dmattn.register_transformers()
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    ids = torch.randint(1, 32000, (B, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    pad = int(os.environ.get("PAD", "0"))
    mask = None
    if pad > 0:
        mask = torch.ones_like(ids)
        mask[1::2, :pad] = 0
        ids[1::2, :pad] = 0
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {gpu}, "
          f"B={B} prompt={prompt} new={new} layers={layers} padding={pad}, dmattn.hf_policy = {dmattn.hf_policy}")
    print("| attention | cache | first token ms | later tokens/s |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for attn in ("sdpa", name):
            model = model_for(attn, layers, device, dtype)
            cache = (lambda: hf.PagedCache(model)) if attn == name else None
            warm = min(prompt, max(256, pad + 1))
            run(model, ids[:, :warm], None if mask is None else mask[:, :warm], 2, cache)  # warm-up
            first, rest = run(model, ids, mask, new, cache)
            print(f"| {attn} | {'dmattn.hf.PagedCache' if cache else 'default'} | {1e3 * first:.1f} | "
                  f"{B * (new - 1) / rest:.0f} |", flush=True)
            del model
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
