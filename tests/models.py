"""Tiny random decoder-only models of the families hfkv must support (built from configs, offline)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=1024,
    pad_token_id=0,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v bias
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),  # q/k norm
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),  # fused qkv
}
# Sliding-window family: not in FAMILIES (its sliding layers stay uncompressed, tested on their own).
SLIDING_FAMILIES = {"gemma2": (Gemma2Config, Gemma2ForCausalLM, {"head_dim": 32, "sliding_window": 16})}


def tiny_model(family: str = "llama", seed: int = 0, dtype=torch.float32, **overrides):
    cfg_cls, model_cls, extra = {**FAMILIES, **SLIDING_FAMILIES}[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**COMMON, **extra, **overrides})
    model = model_cls(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early, compare full lengths
    return model


def left_padded_batch(vocab: int = 128, lengths=(30, 24, 17), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, t - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, t - n :] = 1
    return ids, mask
