"""Shapes of real architectures, for random-weight models that benchmark memory and speed at true size.

Byte counts and step times depend only on shapes, so ``hfkv bench --random-like llama-3.1-8b`` measures
what a real Llama-3.1-8B would cost without downloading it. Values are those of the public
``config.json`` files (hidden size, MLP width, layers, query / KV heads, head_dim, vocabulary, RoPE base).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None
    rope_theta: float = 10000.0

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes a DynamicCache holds per token (all layers, keys and values)."""
        return 2 * self.layers * self.kv_heads * self.dim * torch.empty((), dtype=dtype).element_size()


SHAPES: dict[str, Shape] = {
    # the random Llama of eval/cpu_cache_figures.py (hfkv.random_model): CPU-sized, head_dim 64
    "cpu-small": Shape("llama", 512, 512 * 43 // 16, 8, 8, 2, 1024),
    "smollm2-135m": Shape("llama", 576, 1536, 30, 9, 3, 49152, rope_theta=100000.0),
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 128256, 64, 500000.0),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128256, 128, 500000.0),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, 128, 500000.0),
    "llama-3.1-70b": Shape("llama", 8192, 28672, 80, 64, 8, 128256, 128, 500000.0),
    "mistral-7b": Shape("mistral", 4096, 14336, 32, 32, 8, 32768, 128, 1000000.0),
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, 128, 1000000.0),
    "qwen3-8b": Shape("qwen3", 4096, 12288, 36, 32, 8, 151936, 128, 1000000.0),
}


def get_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"--random-like={name!r} must be one of {sorted(SHAPES)}")
    return SHAPES[name]


def config_for(name: str, layers: int | None = None, max_positions: int = 131072):
    """The transformers config of architecture ``name`` (optionally with fewer ``layers``), random-init ready."""
    from transformers import AutoConfig  # deferred: keeps hfkv bench --help from importing transformers

    shape = get_shape(name)
    if layers is not None and layers < 1:
        raise ValueError(f"--random-layers={layers} must be >= 1")
    kwargs = dict(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers or shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=max_positions,
        initializer_range=0.1,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=False,
    )
    if shape.head_dim is not None:
        kwargs["head_dim"] = shape.head_dim
    if shape.model_type in ("mistral", "qwen2", "qwen3"):
        kwargs["sliding_window"] = None
    return AutoConfig.for_model(shape.model_type, **kwargs)


def build_random_like(
    name: str,
    layers: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_positions: int = 131072,
    seed: int = 0,
):
    """A random-weight model of architecture ``name`` (optionally with fewer ``layers``), built on ``device``.

    Weights are drawn with std 0.1 (peaked attention, closer to a trained model than the 0.02 default;
    as ``hfkv.random_model``). The model never stops early (no EOS). Memory: the full model is allocated
    on ``device`` in ``dtype`` (llama-3.1-8b in bf16: 16 GB); on a CPU the random init of a large
    vocabulary alone takes minutes.
    """
    from transformers import AutoModelForCausalLM  # deferred: keeps hfkv bench --help from importing transformers

    shape = get_shape(name)
    if layers is not None and layers < 1:
        raise ValueError(f"--random-layers={layers} must be >= 1")
    if name == "cpu-small":  # exactly the model of eval/cpu_cache_figures.py
        from hfkv.random_model import build_random_model  # deferred: random_model imports transformers

        model = build_random_model(
            layers=layers or shape.layers,
            hidden=shape.hidden,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            vocab=shape.vocab,
            max_positions=max_positions,
            seed=seed,
        )
        return model.to(device=device, dtype=dtype or torch.float32)
    cfg = config_for(name, layers, max_positions)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    return model
