"""Teacher-forced fidelity of a cache: how far its next-token distributions drift from the full cache's.

Needs no labels, so it works on any model and any text: the prompt is prefilled, then the
reference continuation is fed through the cache as ``generate`` would feed it (one token per
forward, or ``chunk`` tokens to trade exactness for speed), and at every position the
compressed model's next-token distribution is compared with the uncompressed one's.
Decode-time compression is what gets measured, because the cache keeps deciding while the
continuation goes through it. Memory is read off the cache at the end (``cache_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from hfkv.model_shape import ModelShape
from hfkv.storage.memory import cache_bytes, dense_kv_bytes


@dataclass
class Fidelity:
    """Mean over the scored positions; ``memory_ratio`` = bytes held / what DynamicCache holds."""

    kl: float
    top1: float
    kv_bytes: int
    dense_bytes: int
    positions: int

    @property
    def memory_ratio(self) -> float:
        return self.kv_bytes / self.dense_bytes if self.dense_bytes else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "memory_ratio": self.memory_ratio}


def _feed(model, ids: torch.Tensor, prompt_len: int, cache, chunk: int) -> torch.Tensor:
    """Log-probs ``[T - prompt_len, V]`` (fp32) of the tokens after the prompt, fed through ``cache``."""
    out = model(input_ids=ids[:, :prompt_len], past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1:].float()]
    for s in range(prompt_len, ids.shape[1] - 1, chunk):
        step = ids[:, s : min(s + chunk, ids.shape[1] - 1)]
        out = model(input_ids=step, past_key_values=cache, use_cache=True)
        logits.append(out.logits.float())
    return torch.log_softmax(torch.cat(logits, 1)[0], -1)


@torch.inference_mode()
def reference_logprobs(model, ids: torch.Tensor, prompt_len: int, chunk: int = 1) -> torch.Tensor:
    """Log-probs of a DynamicCache fed exactly as :func:`teacher_forced` feeds the compressed cache.

    Same forwards, same chunking: the only difference left between the two is the cache, so the
    ``full`` preset (bit-identical to DynamicCache) scores exactly 0 KL and 1.0 agreement.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be [1, T], got shape {tuple(ids.shape)}")
    if not 0 < prompt_len < ids.shape[1]:
        raise ValueError(f"prompt_len={prompt_len} must be in [1, {ids.shape[1] - 1}] for a sequence of {ids.shape[1]}")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    return _feed(model, ids, prompt_len, DynamicCache(config=model.config), chunk)


@torch.inference_mode()
def teacher_forced(
    model,
    ids: torch.Tensor,
    prompt_len: int,
    make_cache: Callable[[], object],
    reference: torch.Tensor | None = None,
    chunk: int = 1,
) -> tuple[Fidelity, torch.Tensor]:
    """Fidelity of ``make_cache()`` on one sequence ``ids [1, T]`` whose first ``prompt_len`` tokens are the prompt.

    Returns the summary and the per-position KL ``[T - prompt_len]`` (for plots and per-position
    analysis). ``reference`` (from :func:`reference_logprobs` with the same ``chunk``) is computed
    when not given; pass it when one sequence is scored against many caches.
    """
    ref = reference_logprobs(model, ids, prompt_len, chunk) if reference is None else reference
    cache = make_cache()
    got = _feed(model, ids, prompt_len, cache, chunk)
    kl = (ref.exp() * (ref - got)).sum(-1).clamp_min(0)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float()
    kv = cache_bytes(cache)
    dense = _dense_bytes(model, cache, ids.shape[1] - 1)
    return Fidelity(float(kl.mean()), float(top1.mean()), kv, dense, int(kl.numel())), kl


def _dense_bytes(model, cache, length: int) -> int:
    """What a DynamicCache holds after ``length`` tokens (from the cache's stats, or by formula)."""
    if hasattr(cache, "stats") and hasattr(cache, "config"):
        return int(cache.stats().dense_bytes)

    shape = ModelShape.of(model)
    return dense_kv_bytes(1, shape.kv_heads, length, shape.head_dim, shape.dtype) * shape.layers


def mean_fidelity(results: list[Fidelity]) -> Fidelity:
    """Position-weighted mean over sequences; bytes summed (ratios stay bytes held / dense)."""
    n = sum(r.positions for r in results)
    return Fidelity(
        kl=sum(r.kl * r.positions for r in results) / n,
        top1=sum(r.top1 * r.positions for r in results) / n,
        kv_bytes=sum(r.kv_bytes for r in results),
        dense_bytes=sum(r.dense_bytes for r in results),
        positions=n,
    )
