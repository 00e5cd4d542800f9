"""A random-weight Llama for memory and speed figures (``eval/cpu_cache_figures.py``).

Its outputs say nothing about accuracy (that is what the trained testbed is for), but byte counts
and step times depend only on shapes, so any size can be measured without a checkpoint.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


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
