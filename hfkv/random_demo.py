"""The stand-in demo while no trained testbed model is shipped: a tiny random-weight Llama.

A random model's outputs say nothing about accuracy, so this only shows the mechanics: every
preset runs inside ``model.generate``, and the table gives the KV bytes actually held, the
compression ratio against DynamicCache, the tokens per state and the decode speed.
"""

from __future__ import annotations

import time

import torch


def build_random_model(
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    max_positions: int = 4096,
    seed: int = 0,
):
    """A random-weight Llama that never stops early (no EOS), for mechanics and speed, not accuracy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 43 // 16,  # ~2.7x, as Llama
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        initializer_range=0.1,  # peaked attention, closer to a trained model than the 0.02 default
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def dense_bytes(cache) -> int:
    """Bytes a DynamicCache holds, read from its tensors."""
    from hfkv.storage import held_bytes

    return sum(held_bytes([layer.keys, layer.values]) for layer in cache.layers if layer.keys is not None)


def run_random_demo(presets: list[str], budget: int, prompt_len: int = 768, new_tokens: int = 64) -> int:
    from transformers import DynamicCache

    import hfkv

    model = build_random_model()
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    print(
        f"hfkv demo (random-weight Llama, 4 layers, 2 KV heads; no trained testbed shipped yet): "
        f"{prompt_len}-token prompt + {new_tokens} generated tokens, budget {budget}\n"
    )
    header = (
        f"{'cache':<10} {'kv_bytes':>12} {'ratio':>7} {'window':>7} {'original':>9} {'quantized':>10} "
        f"{'evicted':>8} {'tok/s':>7}"
    )
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for name in ["dynamic", *presets]:
            if name == "dynamic":
                cache = DynamicCache(config=model.config)
            else:
                kw = {} if name in ("quant", "diffkv") else {"budget": budget}
                cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset(name, **kw))
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False, past_key_values=cache)
            tps = new_tokens / (time.perf_counter() - t0)
            if name == "dynamic":
                kv = dense_bytes(cache)
                print(f"{name:<10} {kv:>12,} {1.0:>6.2f}x {'-':>7} {'all':>9} {'-':>10} {'-':>8} {tps:>7.1f}")
                continue
            st = cache.stats()
            states = ("window", "original", "quantized", "evicted")
            tot = {k: sum(sum(map(sum, getattr(ls, k))) for ls in st.layers) for k in states}
            print(
                f"{name:<10} {st.kv_bytes:>12,} {st.compression_ratio:>6.2f}x {tot['window']:>7} {tot['original']:>9} "
                f"{tot['quantized']:>10} {tot['evicted']:>8} {tps:>7.1f}"
            )
    print("\n(token counts summed over layers and KV heads; tok/s includes prefill)")
    return 0
