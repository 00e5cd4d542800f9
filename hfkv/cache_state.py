"""A cache's whole state, copied (``TriStateCache.fork``) or written to one file and read back (``save`` / ``load``).

Why: a long context compressed once is asked many questions, some in a later process (docs/generate.md, "Compress
once, ask many"). Each layer's state is :mod:`hfkv.layer.state`'s for a compressing layer, keys and values (and a
sliding layer's count) for the layers transformers' own classes hold. The file is safetensors: the tensors by
name, and in its metadata the config, the model it was made for, each layer's plain values and a checksum of the
tensors' bytes, so a file from another model or config, or a damaged one, fails with one error before anything
is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from hfkv.atomic import write_atomic
from hfkv.layer import state as layer_state
from hfkv.layer.layer import TriStateLayer

FORMAT = "hfkv-cache/1"


def capture(cache) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Every layer's tensors (``layers.{i}.{name}``, the cache's own) and plain values, in layer order."""
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            own, values = {}, {}
        elif isinstance(layer, TriStateLayer):
            own, values = layer_state.capture(layer)
        else:  # transformers' DynamicLayer or DynamicSlidingWindowLayer
            own = {"keys": layer.keys, "values": layer.values}
            values = {"dtype": str(layer.dtype).removeprefix("torch.")}
            if hasattr(layer, "cumulative_length"):
                values["cumulative_length"] = int(layer.cumulative_length)
        values = {"initialized": bool(layer.is_initialized), **values}
        tensors.update({f"layers.{i}.{name}": t for name, t in own.items()})
        layers.append(values)
    return tensors, layers


def restore(cache, tensors: dict[str, torch.Tensor], layers: list[dict[str, Any]], device: torch.device) -> None:
    """Make the empty ``cache`` (made for the same model and config) hold what :func:`capture` read; ``tensors``
    are taken as they are (copies of the source's, on ``device``)."""
    while len(cache.layers) < len(layers):  # a cache without a config makes its layers as they are first updated
        cache.layers.append(cache.layer_class_to_replicate())
    for i, (layer, values) in enumerate(zip(cache.layers, layers, strict=False)):
        if not values["initialized"]:
            continue
        prefix = f"layers.{i}."
        own = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}
        if isinstance(layer, TriStateLayer):
            layer_state.restore(layer, own, values, device)
        else:
            layer.lazy_initialization(own["keys"], own["values"])
            layer.keys, layer.values = own["keys"], own["values"]
            if "cumulative_length" in values:
                layer.cumulative_length = values["cumulative_length"]


def model_id(shape, model: torch.nn.Module | None) -> dict[str, Any]:
    """What a file names its model by: the shape (``hfkv.model_shape.ModelShape``) and, where the cache was made
    from the model itself (not its config), the weights' :func:`fingerprint`; :func:`check` compares what the file
    has."""
    out = {}
    if shape is not None:  # None: a cache made without a model or config (the full preset), known by nothing
        out = {"name": shape.name, "layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim}
    if model is not None:
        out["weights"] = fingerprint(model)
    return out


def fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's weights (names, shapes, dtypes and the first 1,024 values of its first, middle and
    last parameter): the same model loaded again matches, another checkpoint or another dtype does not."""
    params = list(model.named_parameters())
    h = hashlib.sha256()
    for name, p in (params[0], params[len(params) // 2], params[-1]) if params else ():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(p.detach().reshape(-1)[:1024].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save(cache, path: str | os.PathLike[str], model_id: dict[str, Any]) -> Path:
    """Write the cache to ``path`` atomically (``model_id``: what :func:`check` compares on load)."""
    tensors, layers = capture(cache)
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    meta = {"format": FORMAT, "model": model_id, "config": cache.config.to_dict(), "layers": layers}
    meta["checksum"] = _checksum(tensors)
    return write_atomic(path, safetensors_bytes(tensors, metadata={"hfkv": json.dumps(meta)}))


def read(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(metadata, tensors on the CPU)`` of a cache file; one ValueError for anything that is not an intact one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"TriStateCache.load: no file at {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["hfkv"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as exc:
        raise ValueError(f"TriStateCache.load: {str(path)!r} is not a readable hfkv cache file ({exc})") from exc
    if meta.get("format") != FORMAT:
        raise ValueError(f"TriStateCache.load: {str(path)!r} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if _checksum(tensors) != meta.get("checksum"):
        raise ValueError(f"TriStateCache.load: {str(path)!r} is damaged (its tensors' checksum does not match)")
    return meta, tensors


def check(meta: dict[str, Any], model_id: dict[str, Any], config, path) -> None:
    """One error naming each difference between the model (and config) the file was made for and these."""
    saved = meta["model"]
    diffs = [f"{k}: file {saved[k]!r}, here {v!r}" for k, v in model_id.items() if k in saved and saved[k] != v]
    if diffs:
        raise ValueError(
            f"TriStateCache.load: {str(path)!r} was made for another model ({'; '.join(diffs)}); a cache holds one "
            "model's keys and values: load it onto that model"
        )
    if config is None:
        return
    # The backend is how the cache runs, not what it holds (every backend writes and reads the same bytes).
    mine, theirs = config.to_dict(), meta["config"]
    fields = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k) and k != "backend")
    if fields:
        raise ValueError(
            f"TriStateCache.load: {str(path)!r} holds a cache of another config (fields {fields} differ: file "
            f"{ {k: theirs.get(k) for k in fields} }, given { {k: mine.get(k) for k in fields} }); leave config out to "
            "use the file's"
        )
