"""The shape of the model a cache was built for, checked when another model first calls it.

A cache's layers, thresholds (one per KV head), record layouts (head size, dtype) and budget bytes are all made
for one model. Handed to another, it used to fail deep inside with whatever broke first: an ``IndexError`` from
transformers' cache code, "alpha must have one value per KV head", a raw torch size mismatch, or nothing at all
(a cache built for a bf16 model took an fp32 one's keys). :meth:`ModelShape.check_call` turns each of those into
one error that names both models, on a layer's first call, before the layer stores anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["ModelShape"]

_ONE_MODEL = "a cache holds one model's keys and values; build one for this model, TriStateCache(model, ...)"


@dataclass(frozen=True)
class ModelShape:
    """What a cache depends on: its model's name, decoder layers, KV heads, head size and dtype."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype | None  # None: not known yet (a cache made from a config; set by its first call)

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        return cls.of_config(model.config, model.dtype, type(model).__name__)

    @classmethod
    def of_config(cls, config: Any, dtype: torch.dtype, fallback_name: str = "a model") -> ModelShape:
        text = config.get_text_config(decoder=True)
        return cls(
            name=getattr(config, "name_or_path", "") or getattr(text, "name_or_path", "") or fallback_name,
            layers=text.num_hidden_layers,
            kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            dtype=dtype,
        )

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "dtype not known yet"
        return f"{self.name!r} ({self.layers} layers, {self.kv_heads} KV heads, head dim {self.head_dim}, {dtype})"

    def check_call(self, layer_idx: int, key_states: torch.Tensor, config: Any = None) -> None:
        """Raise a ValueError naming both models where layer ``layer_idx``'s keys ``[B, H, T, D]`` come from a model
        of another shape; ``config``: the calling model's, where known, which names it and its layer count before
        its first layer stores anything. A model in autocast computes keys in another dtype than its weights: that
        is allowed."""
        heads, dim, dtype = key_states.shape[1], key_states.shape[-1], key_states.dtype
        autocast = torch.is_autocast_enabled(key_states.device.type)
        if config is not None:
            other = ModelShape.of_config(config, dtype)
            if other.dtype != self.dtype and (autocast or self.dtype is None):
                other = replace(other, dtype=self.dtype)
            if replace(other, name=self.name) != self:
                raise ValueError(
                    f"this TriStateCache was built for {self.describe()} and is used with {other.describe()}: "
                    + _ONE_MODEL
                )
        seen = []
        if layer_idx >= self.layers:
            seen.append(f"at least {layer_idx + 1} layers")
        if heads != self.kv_heads:
            seen.append(f"{heads} KV heads")
        if dim != self.head_dim:
            seen.append(f"head dim {dim}")
        if self.dtype is not None and dtype != self.dtype and not autocast:
            seen.append(str(dtype).removeprefix("torch."))
        if seen:
            raise ValueError(
                f"this TriStateCache was built for {self.describe()}, and layer {layer_idx} of the model using it "
                f"has {', '.join(seen)}: " + _ONE_MODEL
            )
