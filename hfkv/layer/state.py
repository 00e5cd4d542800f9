"""A layer's state as named tensors and plain values: what ``cache.fork()`` copies and a cache file holds.

Why a module of its own: a layer's parts each keep some of what a later step reads (the ring, the pages and their
tables, the rows' padding, the dense phase, the policy's step count) beside what they derive from the config and
shapes (record layouts, costs, launch plans). Naming the first kind once, here, is what lets a copy or a file
resume exactly where the layer was: :func:`restore` rebuilds the derived parts as the layer's first tensors would
(``lazy_initialization``, ``build_storage``) and then sets the named fields. A prepared policy run
(``PolicyRunner.ahead``) is dropped: its step runs it instead, to the same result.
"""

from __future__ import annotations

from typing import Any

import torch

# The fields that are state, per part of the layer ("" is the layer itself). Anything else a part holds is made
# from the config and the shapes again. Tensors may be None (a dense phase not used); lists of tensors are kept
# element by element.
FIELDS: dict[str, tuple[str, ...]] = {
    "": ("length", "score_start", "oq"),
    "window": ("_k", "_v", "_pos", "_score", "start", "count"),
    "tiers": ("batch", "counts", "tables", "versions"),
    "tiers.pool": ("data", "free_stack", "n_free"),
    "padding": ("pad_end", "sink_end", "padded", "_pad_max"),
    "dense": ("active", "k", "v", "scores", "key_valid", "queries", "pending", "pending_start", "scaling"),
    "policy": ("steps", "runs", "runs_ahead"),
    "budget": ("tier_peak", "share"),
    "offloaded": ("requested", "on_host"),
}
# What the layer's first tensors told it: enough to make the derived parts again.
SHAPE = ("kv_shape", "dtype", "stored")


def _part(layer, path: str):
    obj = layer
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name)
    return obj


def _name(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def capture(layer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, values)`` of an initialized layer between forwards: its tensors by name (the layer's own, not
    copies) and the plain values (numbers, flags, None) by name, JSON-serializable."""
    if layer._chunk is not None or layer._exits is not None:
        raise RuntimeError(
            f"layer {layer.layer_idx}: its state is read between forwards, not inside one (a chunk is pending)"
        )
    stored = layer.window is not None
    if stored:
        layer.window.flush()  # a pending token into the ring, as any reader of the ring's tensors does
        layer.window.clear_popped()
    layer.policy.ahead = None
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {
        "kv_shape": list(layer.kv_shape),
        "dtype": str(layer.dtype).removeprefix("torch."),
        "stored": stored,
    }
    for path, fields in FIELDS.items():
        if not stored and path.split(".")[0] in ("window", "tiers"):
            continue
        part = _part(layer, path)
        for field in fields:
            value, name = getattr(part, field), _name(path, field)
            if isinstance(value, torch.Tensor):
                tensors[name] = value
            elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                tensors.update({f"{name}.{i}": t for i, t in enumerate(value)})
                values[name] = {"tensors": len(value)}
            else:
                values[name] = list(value) if isinstance(value, tuple | list) else value
    return tensors, values


def restore(layer, tensors: dict[str, torch.Tensor], values: dict[str, Any], device: torch.device) -> None:
    """Make an empty ``layer`` hold what :func:`capture` read (``tensors`` already on ``device`` and the layer's
    own: they are taken, not copied)."""
    dtype = getattr(torch, values["dtype"])
    bsz, heads, dim = values["kv_shape"]
    empty = torch.empty(bsz, heads, 0, dim, dtype=dtype, device=device)
    layer.lazy_initialization(empty, empty)
    if values["stored"]:
        layer.build_storage()
    for path, fields in FIELDS.items():
        if not values["stored"] and path.split(".")[0] in ("window", "tiers"):
            continue
        part = _part(layer, path)
        for field in fields:
            name = _name(path, field)
            value = values.get(name)
            if name in tensors:
                value = tensors[name]
            elif isinstance(value, dict) and "tensors" in value:
                value = [tensors[f"{name}.{i}"] for i in range(value["tensors"])]
            setattr(part, field, value)
    layer.cache.invalidate_rho()
