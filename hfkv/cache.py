"""TriStateCache: a DynamicCache whose full-attention layers keep tokens original, quantized or evicted.

One ``TriStateLayer`` (``hfkv.layer``) per compressed model layer owns a dense window ring and paged tiers (see
``hfkv.storage``); the container only builds layers, resolves per-layer settings and shares the per-layer OQ
ratios, in the spirit of transformers' ``cache_utils`` (one object per layer, a thin container). What a layer needs
of it is ``hfkv.layer.owner.LayerOwner``.

Life of a token: it enters the window; when W newer tokens have arrived it leaves the window
into the original tier; the policy (``hfkv.policy.classify``) then keeps it, demotes it to the
quantized tier or evicts it, and may later demote or evict it further, never back.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
import weakref
from pathlib import Path

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from hfkv import cache_state, export
from hfkv.attention.interface import install
from hfkv.config import TriStateConfig
from hfkv.gates import Gates, load_gates
from hfkv.layer.layer import TriStateLayer
from hfkv.model_shape import ModelShape
from hfkv.policy import oq_ratios
from hfkv.policy.retention import GateWeights
from hfkv.stats import CacheStats, LayerStats
from hfkv.stats_html import cache_html
from hfkv.storage import dense_kv_bytes, held_bytes

__all__ = ["TriStateCache", "TriStateLayer"]  # TriStateLayer: defined in hfkv.layer, imported from here too

_UNCOMPRESSED_TYPES = ("sliding_attention", "chunked_attention")


def _calling_config(own: object) -> object | None:
    """The config of the attention module calling :meth:`TriStateCache.update` (transformers' attention layers call
    ``past_key_values.update(k, v, self.layer_idx, ...)``), or None where the caller is not one, or under
    torch.compile (which does not trace frames). Read on a layer's first call only: the calling model's layer count
    is known before its first layer stores anything."""
    if torch.compiler.is_compiling():
        return None
    caller = sys._getframe(2).f_locals.get("self")  # 0: here, 1: TriStateCache.update, 2: the attention's forward
    config = getattr(caller, "config", None)
    if config is None or config is own or not hasattr(config, "get_text_config"):
        return None
    return config


class TriStateCache(DynamicCache):
    """Drop-in ``past_key_values`` for ``model.generate``: ``TriStateCache(model, cfg)``.

    ``model``: the model, or its config alone (``TriStateCache(model.config, cfg)``: shapes and layer types come
    from it, storage is allocated on the first update, as ``DynamicCache(config=...)`` does), or None (layers made
    as they are first updated, as ``DynamicCache()``; compressing ones take every layer as full attention). ``cfg`` is a
    ``TriStateConfig``, a preset name, or None for the ``hfkv`` preset. ``offloading``: as DynamicCache's (on CUDA, a
    layer's storage goes to host memory after its attention and comes back before its next update). The model keeps
    its attention implementation (hfkv.attention.interface). Use a fresh cache per request (or ``reset()``).
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        export.register(cls, TriStateCache)  # pytree finds nodes by exact type (hfkv.export)

    def __init__(
        self,
        model: torch.nn.Module | PreTrainedConfig | None = None,
        config: TriStateConfig | str | None = None,
        *,
        offloading: bool = False,
        offload_only_non_sliding: bool = True,
        **overrides,
    ) -> None:
        if isinstance(config, PreTrainedConfig):
            raise TypeError(
                "TriStateCache: config is hfkv's TriStateConfig or a preset name, got the model's "
                f"{type(config).__name__}; pass the model's config first: TriStateCache(model.config, cfg)"
            )
        if config is None:
            config = TriStateConfig.from_preset("hfkv", **overrides)
        elif isinstance(config, str):
            config = TriStateConfig.from_preset(config, **overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, TriStateConfig):
            raise TypeError(
                f"TriStateCache: config must be a TriStateConfig or preset name, got {type(config).__name__}"
            )
        self.config = config
        install()
        # The model, where given, for what a saved file names it by (cache_state.fingerprint); not kept alive.
        self._model_ref = weakref.ref(model) if isinstance(model, torch.nn.Module) else None
        if isinstance(model, torch.nn.Module):
            model_config, self.model_shape = model.config, ModelShape.of(model)
        elif isinstance(model, PreTrainedConfig):
            model_config, self.model_shape = model, ModelShape.of_config(model, None)
        elif model is None:
            model_config, self.model_shape = None, None
        else:
            raise TypeError(
                "TriStateCache: model must be a transformers model, its config (PreTrainedConfig) or None, got "
                f"{type(model).__name__}"
            )
        self.model_config = model_config.get_text_config(decoder=True) if model_config is not None else None
        # Whether every layer exists: made from the model's config, or (without one) once a layer is updated again,
        # since a forward reaches every layer before the next forward begins. The OQ ratios wait for it (rho).
        self.layers_known = model_config is not None or not config.compress
        if model_config is None:
            self.alpha_h = self.alpha_l = None
            if config.compress:
                _check_layerless(config)
            Cache.__init__(
                self, layer_class_to_replicate=self._next_layer if config.compress else DynamicLayer,
                offloading=offloading, offload_only_non_sliding=offload_only_non_sliding,
            )  # fmt: skip
        else:
            Cache.__init__(
                self, layers=self._make_layers(), offloading=offloading,
                offload_only_non_sliding=offload_only_non_sliding,
            )  # fmt: skip
        # score_source="retention": the gates file, loaded once for every layer and checked against the model where
        # it is known (a cache made without one checks each layer's first keys: retention_gates)
        self._gates: Gates | None = None
        if config.score_source == "retention" and self.model_shape is not None:
            shape = self.model_shape
            self._load_gates().check("TriStateCache", shape.layers, shape.kv_heads, shape.head_dim, shape.describe())
        self._rho: torch.Tensor | None = None
        self._rho_rows: dict[int, torch.Tensor] = {}  # each layer's row of _rho on its device (rho)

    def _make_layers(self) -> list:
        config, text, shape = self.config, self.model_config, self.model_shape
        config.validate_for_model(shape.layers, shape.kv_heads, shape.head_dim)
        self.alpha_h, self.alpha_l = config.resolve_alpha(shape.layers, shape.kv_heads)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        layers: list = []
        for i, (lt, kw) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            if not config.compress:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[lt](**kw))
            elif lt == "full_attention":
                layers.append(TriStateLayer(self, i))
            elif lt in _UNCOMPRESSED_TYPES:
                layers.append(DynamicSlidingWindowLayer(**kw))
            else:
                raise NotImplementedError(
                    f"hfkv cannot compress layer {i} of type {lt!r} ({shape.name}); supported: "
                    f"'full_attention' (compressed) and {_UNCOMPRESSED_TYPES} (kept uncompressed)"
                )
        if config.compress and not any(isinstance(layer, TriStateLayer) for layer in layers):
            warnings.warn(
                f"TriStateCache: every layer of {shape.describe()} uses sliding-window attention, which "
                f"hfkv keeps uncompressed: preset {config.name!r} compresses nothing here (the cache is "
                "DynamicCache's)",
                UserWarning,
                stacklevel=3,
            )
        return layers

    def _load_gates(self) -> Gates:
        if self._gates is None:
            self._gates = load_gates(self.config.gates)
        return self._gates

    def retention_gates(self, layer_idx: int, kv_heads: int, head_dim: int) -> tuple[GateWeights, str]:
        """Layer ``layer_idx``'s retention gates (``score_source="retention"``) and what they predict, for keys of
        ``kv_heads`` heads of ``head_dim``: one error naming both models where the file was trained for another."""
        gates = self._load_gates()
        layers = self.model_shape.layers if self.model_shape is not None else None
        if layer_idx >= gates.model["layers"]:
            layers = layer_idx + 1
        name = self.model_shape.describe() if self.model_shape is not None else "this model"
        gates.check("TriStateCache", layers, kv_heads, head_dim, name)
        return gates.layers[layer_idx], gates.kind

    def _next_layer(self) -> TriStateLayer:
        """The next layer of a compressing cache made without the model's config (``layer_class_to_replicate``:
        transformers' update appends one per new layer index): every layer is taken as full attention."""
        return TriStateLayer(self, len(self.layers))

    def _grow_thresholds(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Without the model's config, a new layer's thresholds, from its first keys' shape (scalar alphas only:
        _check_layerless)."""
        if self.alpha_h is None or self.alpha_h.shape[0] <= layer_idx:
            _, heads, _, dim = key_states.shape
            self.alpha_h, self.alpha_l = self.config.validate_for_model(layer_idx + 1, heads, dim)
        elif not self.layers_known and layer_idx < len(self.layers) and self.layers[layer_idx].get_seq_length():
            self.layers_known = True  # a layer updated again: the first forward has made every layer
            self.invalidate_rho()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.model_config is None and self.config.compress:
            self._grow_thresholds(layer_idx, key_states)
        # A layer's first call checks that the calling model is the one the cache was built for (after that, its
        # storage is made for these shapes and would fail on others anyway): one error naming both models.
        shape = self.model_shape
        if shape is not None and (layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized):
            shape.check_call(layer_idx, key_states, _calling_config(self.model_config))
            if shape.dtype is None and not torch.is_autocast_enabled(key_states.device.type):
                self.model_shape = dataclasses.replace(shape, dtype=key_states.dtype)
        if self.offloading and key_states.device.type != "cuda":
            # transformers' update orders its copies with CUDA streams; elsewhere the same calls without them
            while len(self.layers) <= layer_idx:  # made as they are first updated (a cache without a config)
                self.layers.append(self.layer_class_to_replicate())
            self.prefetch(layer_idx + 1, self.only_non_sliding)
            keys, values = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
            self.offload(layer_idx, self.only_non_sliding)
            return keys, values
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # ------------------------------------------------------------ compress once, ask many
    def fork(self, repeats: int = 1) -> TriStateCache:
        """An independent copy to continue from (a question after a compressed context), the original untouched for
        the next one; ``repeats`` > 1 repeats each row (several questions, or samples, in one batch).

        It copies what the cache holds (the compressed bytes, not a context's worth of full-precision ones) and
        recomputes nothing. Call it between forwards."""
        tensors, layers = cache_state.capture(self)
        new = self._empty_like()
        device = next((t.device for t in tensors.values()), torch.device("cpu"))
        cache_state.restore(new, {k: t.clone() for k, t in tensors.items()}, layers, device)
        if repeats != 1:
            if not isinstance(repeats, int) or repeats < 1:
                raise ValueError(f"TriStateCache.fork: repeats={repeats!r} must be an int >= 1")
            new.batch_repeat_interleave(repeats)
        return new

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write what the cache holds, its config and the model it was made for to one safetensors file (atomically);
        :meth:`load` reads it onto the same model in a later process. Call it between forwards."""
        model = self._model_ref() if self._model_ref is not None else None
        return cache_state.save(self, path, cache_state.model_id(self.model_shape, model))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        config: TriStateConfig | None = None,
        device: torch.device | str | None = None,
    ) -> TriStateCache:
        """The cache :meth:`save` wrote, for ``model`` (the model it was made for: another one, or the same in
        another dtype, is refused). ``config``: the file's when left out; one given must equal it. ``device``: the
        model's by default."""
        meta, tensors = cache_state.read(path)
        cache_state.check(meta, cache_state.model_id(ModelShape.of(model), model), config, path)
        cache = cls(model, config or TriStateConfig.from_dict(meta["config"]))
        device = torch.device(device) if device is not None else next(model.parameters()).device
        cache_state.restore(cache, {k: t.to(device, copy=True) for k, t in tensors.items()}, meta["layers"], device)
        return cache

    def _empty_like(self) -> TriStateCache:
        """A cache for the same model and config holding nothing (a subclass's own attributes are shared)."""
        new = type(self).__new__(type(self))
        TriStateCache.__init__(
            new, self.model_config, self.config, offloading=self.offloading,
            offload_only_non_sliding=getattr(self, "only_non_sliding", True),
        )  # fmt: skip
        new.model_shape, new._model_ref = self.model_shape, self._model_ref
        new.alpha_h, new.alpha_l, new.layers_known = self.alpha_h, self.alpha_l, self.layers_known  # made so far
        for name, value in vars(self).items():
            if name not in vars(new):
                setattr(new, name, value)
        return new

    def __repr__(self) -> str:
        n = sum(isinstance(layer, TriStateLayer) for layer in self.layers)
        return (
            f"TriStateCache({self.config.summary()}, layers={len(self.layers)}, compressed={n}, "
            f"len={self.get_seq_length()}, backend={self.backend})"
        )

    @property
    def backend(self) -> str:
        """The backend compressed layers run on: ``config.backend`` resolved on the first layer's device
        (``auto`` until a layer has seen a tensor)."""
        for layer in self.compressed_layers():
            if layer.is_initialized:
                return layer.backend
        return self.config.backend if self.config.compress else "torch"

    def _repr_html_(self) -> str:
        return cache_html(self.stats(), self.config.summary(), len(self.layers), self.oq_ratios())

    def compressed_layers(self) -> list[TriStateLayer]:
        """The compressing layers, in model order (``LayerOwner``)."""
        return [layer for layer in self.layers if isinstance(layer, TriStateLayer)]

    def invalidate_rho(self) -> None:
        self._rho = None

    def rho(self, layer_idx: int) -> torch.Tensor | None:
        """OQ ratio of ``layer_idx`` per row, once every compressed layer has its prefill statistics."""
        if not self.config.oq_ratios or not self.layers_known:
            return None
        if self._rho is None:
            layers = self.compressed_layers()
            if any(layer.oq is None for layer in layers):
                return None
            self._rho = oq_ratios(torch.stack([layer.oq.to(layers[0].device) for layer in layers]))
            self._rho_rows = {}
        row = self._rho_rows.get(layer_idx)
        if row is None:  # kept: every policy run of the layer asks (a search of the layers and a copy's check each)
            layers = self.compressed_layers()
            pos = [layer.layer_idx for layer in layers].index(layer_idx)
            row = self._rho_rows[layer_idx] = self._rho[pos].to(layers[pos].device)
        return row

    def token_states(self, layer_idx: int) -> torch.Tensor:
        """``[B, KV heads, logical length]`` int8 map of token states of a compressed layer (``hfkv.states``:
        ORIGINAL 0, MID 1, QUANTIZED 2, EVICTED 3, WINDOW -1): which positions each head keeps, and how."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, TriStateLayer):
            raise ValueError(
                f"layer {layer_idx} is a {type(layer).__name__}, not a compressed TriStateLayer "
                f"(compressed layers: {[lyr.layer_idx for lyr in self.compressed_layers()]})"
            )
        return layer.token_states()

    def token_scores(self, layer_idx: int) -> torch.Tensor:
        """``[B, KV heads, logical length]`` fp32 mean significance of every held token (NaN where evicted),
        the quantity compared with the thresholds ``alpha_h / N`` and ``alpha_l / N``."""
        self.token_states(layer_idx)  # same layer check
        return self.layers[layer_idx].token_scores()

    def thresholds(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(alpha_h / N, alpha_l / N)`` per KV head ``[H]`` of a layer at its current logical length N."""
        n = max(1, self.layers[layer_idx].get_seq_length())
        return self.alpha_h[layer_idx] / n, self.alpha_l[layer_idx] / n

    def oq_ratios(self) -> dict[int, torch.Tensor] | None:
        """ARKV's per-layer OQ ratios ``rho_l`` per batch row (``{layer: [B]}``), or None before they exist
        (OQ off, or the prefill of some layer has not run)."""
        if not self.config.oq_ratios:
            return None
        layers = self.compressed_layers()
        if not layers or self.rho(layers[0].layer_idx) is None:
            return None
        return {layer.layer_idx: self.rho(layer.layer_idx).cpu() for layer in layers}

    def stats(self) -> CacheStats:
        per_layer = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, TriStateLayer):
                per_layer.append(layer.layer_stats())
            elif getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                kb = held_bytes([layer.keys, layer.values])
                b, h, n, d = layer.keys.shape
                ls = LayerStats(i, kb, kb, layer.get_seq_length(), compressed=False)
                ls.window = [[n] * h for _ in range(b)]
                ls.original = ls.mid = ls.quantized = [[0] * h for _ in range(b)]
                # A sliding layer has dropped what left its window: those positions are evicted.
                ls.evicted = [[ls.logical_length - n] * h for _ in range(b)]
                if isinstance(layer, DynamicSlidingWindowLayer):
                    ls.dense_bytes = dense_kv_bytes(b, h, layer.get_seq_length(), d, layer.keys.dtype)
                per_layer.append(ls)
        return CacheStats(
            kv_bytes=sum(ls.kv_bytes for ls in per_layer),
            dense_bytes=sum(ls.dense_bytes for ls in per_layer),
            layers=per_layer,
            backend=self.backend,
            name=self.config.name,
            budget=self.config.budget if self.config.compress else None,
            budget_unit=self.config.budget_unit,
            head_adaptive=self.config.head_adaptive,
        )


def _check_layerless(config: TriStateConfig) -> None:
    """A compressing cache without the model's config makes its layers as they are first updated, so it cannot
    resolve thresholds given per layer (how many layers is not known): one clear error naming the fix."""
    for name in ("alpha_h", "alpha_l"):
        if isinstance(getattr(config, name), list | tuple):
            raise ValueError(
                f"TriStateCache: TriStateConfig.{name} is given per layer, which needs the model's layer count: "
                "make the cache with the model or its config, TriStateCache(model.config, cfg), or give a scalar"
            )


export.register(TriStateCache, TriStateCache)
