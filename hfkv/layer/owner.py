"""What a compressing layer needs of the cache that holds it, as a protocol.

Why: the layer sits below the cache (docs/architecture.md, "Floors"), so it cannot import ``hfkv.cache``; yet a few
things are the cache's and shared by all its layers: the config, the per-layer thresholds, the OQ ratios that need
every layer's prefill statistics, and the checks of the model calling it. :class:`LayerOwner` names them;
``hfkv.cache.TriStateCache`` is the one implementation.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hfkv.config import TriStateConfig
from hfkv.model_shape import ModelShape


class LayerOwner(Protocol):
    config: TriStateConfig
    alpha_h: torch.Tensor  # [layers, KV heads]: each layer's row is its thresholds (hfkv.policy)
    alpha_l: torch.Tensor
    model_config: Any  # the text config of the model the cache was built for (None: made without one, uncompressed)
    model_shape: ModelShape | None

    def retention_gates(self, layer_idx: int, kv_heads: int, head_dim: int) -> Any:
        """Layer ``layer_idx``'s learned retention gates (``score_source="retention"``: hfkv.policy.retention's
        GateWeights) and their kind, checked against the keys' ``kv_heads`` and ``head_dim``."""
        ...

    def compressed_layers(self) -> list[Any]:
        """The compressing layers, in model order: a layer's rank among them staggers its policy runs."""
        ...

    def rho(self, layer_idx: int) -> torch.Tensor | None:
        """``[B]`` OQ ratio of a layer, the same tensor while the ratios hold; None before they exist."""
        ...

    def invalidate_rho(self) -> None:
        """A layer's prefill statistics or rows changed: the ratios are computed again when next asked."""
        ...
