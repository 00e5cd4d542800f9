"""One-token decode steps under ``torch.compile(fullgraph=True)``, with a TriStateCache or any other cache.

Why a wrapper and not ``torch.compile(model)`` alone: a compressing layer's step between policy runs is torch ops over
tensors whose sizes change (traced once, dynamic), but a policy run is host decisions over storage that grows and
shrinks, and a prompt or the chunk that takes a layer out of its dense phase builds storage. Those steps stay eager:
the compiled step is called only where every compressed layer's next step traces (``TriStateLayer.step_traces``),
which a one-token step between policy runs does on the ``torch`` and ``cpu`` backends (the CPU kernel is the operator
``hfkv::paged_attention_cpu`` there) and while a layer is held dense. The Triton launches are not traced yet: with
them, compressed steps run eagerly and ``counts`` says so. Any other cache (DynamicCache, StaticCache, the ``full``
preset) is compiled at every step.

Why ``dynamic=True`` by default: a policy run resizes some layers' pools and page tables and changes budget counters,
each at its own step, and under Dynamo's automatic dynamic shapes every first change of each of those sizes and ints
recompiles the model (seconds each, dozens over a generation on a many-layer model; marking only the tensors dynamic
still left the ints specialised). Traced dynamic from the start, a generation compiles a handful of graphs (the
first steps, the ring's wrap) and then none on the 8-layer ``cpu-small`` Llama; SmolLM2's 30 layers still recompiled
about every 8th step (docs/generate.md, "torch.compile"). Duck sizing is off while tracing: by default two sizes
equal at the trace (two layers' tables, both 41 pages wide) become one symbol, and the step at which they part
recompiles.
Not for ``backend="torch"``: its step is many plain ops over all-symbolic shapes, whose trace slows with every layer
(docs/generate.md, "torch.compile"); pass ``dynamic=None`` for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental import _config as shape_config

from hfkv.cache import TriStateCache

__all__ = ["CompiledDecode"]


class CompiledDecode:
    """``model``'s forward, compiled with ``torch.compile(fullgraph=True, dynamic=True, **options)`` for the steps
    that trace (``options`` may set ``dynamic`` otherwise).

    Call it as the model: ``step(input_ids=tok, past_key_values=cache, position_ids=pos)``. ``counts`` holds how
    many calls ran compiled and eagerly.
    """

    def __init__(self, model: torch.nn.Module, **options: Any) -> None:
        self.model = model
        self.compiled = torch.compile(model, **({"fullgraph": True, "dynamic": True} | options))
        self.counts = {"compiled": 0, "eager": 0}

    def traces(self, cache: Any, query_length: int) -> bool:
        """Whether a step of ``query_length`` tokens into ``cache`` runs compiled."""
        if not isinstance(cache, TriStateCache):
            return True
        return all(layer.step_traces(query_length) for layer in cache.compressed_layers())

    def __call__(self, input_ids: torch.Tensor, past_key_values: Any = None, **kwargs: Any):
        if self.traces(past_key_values, input_ids.shape[1]):
            self.counts["compiled"] += 1
            # No duck sizing (module doc): layers whose tables happen to share a size now would not later
            with shape_config.patch(use_duck_shape=False):
                return self.compiled(input_ids=input_ids, past_key_values=past_key_values, **kwargs)
        self.counts["eager"] += 1
        return self.model(input_ids=input_ids, past_key_values=past_key_values, **kwargs)
