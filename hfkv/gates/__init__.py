"""Gates files: the learned retention gates of one model (hfkv.policy.retention), shipped by name or at a path.

Why a package of its own, beside the config: a config names its gates (``TriStateConfig.gates``: ``"smollm2"``,
``"testbed"`` or a ``.safetensors`` path) and must reject a misspelt name when it is built, before a long run; the
cache loads them once for all its layers. A gates file holds every layer's weights and says which model they were
trained for (its name, layers, KV heads and head size) and how (the data, steps and time of the training run), so
gates used with another model fail with one error naming both instead of ranking tokens at random.

The shipped files are made by ``hfkv train-gates`` (hfkv.calibration.gates_train; the commands in
docs/retention.md, "Training: `hfkv train-gates`").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from hfkv.atomic import write_atomic
from hfkv.policy.retention import KINDS, GateWeights, feature_count
from hfkv.suggest import did_you_mean

__all__ = ["FORMAT", "Gates", "gates_path", "load_gates", "shipped_gates"]

FORMAT = "hfkv-gates/1"
_HERE = Path(__file__).resolve().parent
_PARTS = ("w1", "b1", "w2", "b2")


def shipped_gates() -> tuple[str, ...]:
    """The names of the gates files the package ships (a model name of ``hfkv.loading`` each)."""
    return tuple(sorted(p.stem for p in _HERE.glob("*.safetensors")))


def is_path(name: str) -> bool:
    return name.endswith(".safetensors") or os.sep in name or "/" in name


def gates_path(name: str) -> Path:
    """The file a config's ``gates`` names: a shipped name, or a path to a ``.safetensors`` file."""
    if is_path(name):
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"TriStateConfig.gates={name!r}: no such file")
        return path
    if name not in shipped_gates():
        raise ValueError(
            f"TriStateConfig.gates={name!r} must be one of the shipped gates {shipped_gates()} or a path to a "
            f".safetensors gates file{did_you_mean(name, shipped_gates())}"
        )
    return _HERE / f"{name}.safetensors"


@dataclass
class Gates:
    """Every layer's gates and what they were trained for: ``model`` (name, layers, kv_heads, head_dim) and
    ``training`` (data, steps, time: what ``hfkv train-gates`` records)."""

    layers: list[GateWeights]
    model: dict[str, Any]
    training: dict[str, Any] = field(default_factory=dict)
    kind: str = "retention"  # what the gates predict (hfkv.policy.retention.KINDS)

    def check(self, where: str, layers: int | None, kv_heads: int, head_dim: int, model_name: str = "a model") -> None:
        """Raise one ValueError naming both models where the gates were trained for another shape."""
        m = self.model
        theirs = (m["layers"], m["kv_heads"], m["head_dim"])
        if (layers is not None and layers != theirs[0]) or (kv_heads, head_dim) != theirs[1:]:
            seen = f"{layers} layers, " if layers is not None else ""
            raise ValueError(
                f"{where}: these retention gates were trained for {m['name']!r} ({theirs[0]} layers, {theirs[1]} KV "
                f"heads, head dim {theirs[2]}) and are used with {model_name} ({seen}{kv_heads} KV heads, head dim "
                f"{head_dim}): gates are per layer and head of one model; train gates for this one with "
                "`hfkv train-gates --model ...` and pass their file as TriStateConfig.gates"
            )

    def save(self, path: str | os.PathLike[str]) -> Path:
        tensors = {
            f"layers.{i}.{part}": getattr(g, part).detach().float().cpu().contiguous()
            for i, g in enumerate(self.layers)
            for part in _PARTS
        }
        meta = {"format": FORMAT, "kind": self.kind, "model": self.model, "training": self.training}
        return write_atomic(path, safetensors_bytes(tensors, metadata={"hfkv": json.dumps(meta)}))


def load_gates(name: str) -> Gates:
    """The gates a config names (``gates_path``), checked whole: every layer's four tensors, shaped alike."""
    path = gates_path(name)
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("hfkv", "{}"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not an hfkv gates file (format {meta.get('format')!r}, expected {FORMAT!r})")
        model = meta["model"]
        layers = [GateWeights(*(f.get_tensor(f"layers.{i}.{p}") for p in _PARTS)) for i in range(model["layers"])]
    kind = meta.get("kind", "retention")
    if kind not in KINDS:
        raise ValueError(f"{path}: gates of kind {kind!r}, expected one of {KINDS}")
    width = feature_count(model["head_dim"])
    for i, g in enumerate(layers):
        if g.heads != model["kv_heads"] or g.features != width:
            raise ValueError(f"{path}: layer {i}'s gates are {tuple(g.w1.shape)}, expected ({model['kv_heads']}, "
                             f"{width}, hidden) for the model the file names")  # fmt: skip
    return Gates(layers, model, meta.get("training", {}), kind)


def initial_gates(layers: int, kv_heads: int, head_dim: int, hidden: int = 16, seed: int = 0) -> list[GateWeights]:
    """Untrained gates that keep every token (``beta`` ~ 0.9995 for any input): where training starts, as TRIM-KV's
    does, so a gate learns what to let go rather than what to keep."""
    g = torch.Generator().manual_seed(seed)
    width = feature_count(head_dim)
    out = []
    for _ in range(layers):
        w1 = torch.randn(kv_heads, width, hidden, generator=g) / width**0.5
        w2 = torch.randn(kv_heads, hidden, generator=g) * 0.01
        out.append(GateWeights(w1, torch.zeros(kv_heads, hidden), w2, torch.full((kv_heads,), 7.6)))
    return out
