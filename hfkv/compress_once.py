"""Compress a context before any question is asked: ``hfkv.compress(model, input_ids, config)``.

Why: a long document (a codebase, a contract, a chat history) is compressed once and asked many questions, some not
yet known (docs/generate.md, "Compress once, ask many"). A prefill scores each token by what the prompt's last
queries attend to, and with the question withheld those are the context's own last tokens: they say little about
what a later question will need. The tri-state policy (exact, K8V4, K4V2, evicted) stays as it is; what this module
changes is where a context's scores come from (``scores=``):

- ``"reconstruction"`` (KVzip, Kim et al. 2025): after the context, the model is asked to repeat it, and each context
  token is scored by the most attention any query of the repetition gives it (over the query heads sharing its KV
  head). A token the model needs to reproduce the context is one some question may need. The repetition runs in
  chunks of ``chunk`` tokens, each attending to the whole context (measured: eval/README.md, "What compressing a
  context costs").
- ``"key_norm"``: a key's L2 norm, lower is more important (Devoto et al. 2024); no extra pass.
- ``"observation"``: the prefill's own observation window, what ``model(context, past_key_values=cache)`` gives.

Every source's scores are scaled per row and KV head to the observation window's total (``prefill.in_scale``),
so the thresholds and the budget mean what they mean after a prefill; with ``head_adaptive`` (a layer's heads
share its room by score) per row only, so the heads keep the source's proportions to each other, as KVzip ranks.
The returned cache is the caller's to ``fork()`` per question or ``save()``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedTokenizerBase
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hfkv.attention.interface import attn_configs
from hfkv.cache import TriStateCache
from hfkv.config import TriStateConfig
from hfkv.layer.layer import TriStateLayer
from hfkv.policy.layer_shares import layer_shares

__all__ = ["REPEAT_PROMPT", "SCORE_SOURCES", "compress", "fill", "key_norm_scores", "score_context"]

SCORE_SOURCES = ("reconstruction", "key_norm", "observation")
# KVzip's request to repeat the context, placed after it; the repetition follows it.
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
_NAME = "hfkv_compress_once"
QUERY_ROWS = 64  # the context's last queries kept for the observation window and ARKV's OQ statistic


class _Recorder:
    """What a forward's attention calls leave: per layer the keys, values and last queries (``capture``) or the
    repetition's largest probability on each context key (``score``)."""

    def __init__(self) -> None:
        self.mode, self.context = "capture", 0
        self.captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}
        self.scores: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        i = module.layer_idx
        if self.mode == "capture":
            self.captured[i] = (key, value, query[:, :, -QUERY_ROWS:].clone(), float(scaling))
        elif getattr(module, "sliding_window", None) is None:  # sliding layers are not compressed: no scores
            best = _repetition_scores(query, key, self.context, float(scaling))
            prev = self.scores.get(i)
            self.scores[i] = best if prev is None else torch.maximum(prev, best)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # fmt: skip


def _repetition_scores(query: torch.Tensor, key: torch.Tensor, context: int, scaling: float) -> torch.Tensor:
    """``[B, H, context]``: each context key's largest softmax probability over the repetition's queries ``[B, Hq, q,
    D]`` and the query heads of its group, the softmax over the context and the repetition causally (``key [B, H,
    context + q, D]``)."""
    bsz, hq, q, dim = query.shape
    heads, total = key.shape[1], key.shape[2]
    g = hq // heads
    # The scaling goes on the queries, not on the [.., q, total] logits: a pass over the largest tensor saved (and
    # with a power of two, as 1/sqrt(64) is, the same bits).
    scaled = query.float().mul_(scaling) if query.dtype != torch.float32 else query * scaling
    logits = torch.einsum("bhgqd,bhkd->bhgqk", scaled.view(bsz, heads, g, q, dim), key.float())
    # Causal: only the repetition's own keys (the last q) can come after a query; no context key ever does.
    later = torch.ones(q, q, dtype=torch.bool, device=key.device).triu_(1)
    logits[..., total - q :].masked_fill_(later, float("-inf"))
    probs = logits.softmax(-1)[..., :context]  # [B, H, g, q, context]
    return probs.amax(dim=(2, 3))


@contextlib.contextmanager
def recording(model: torch.nn.Module, recorder: _Recorder) -> Iterator[None]:
    AttentionInterface.register(_NAME, recorder)
    AttentionMaskInterface.register(_NAME, sdpa_mask)
    before = [(c, c._attn_implementation) for c in attn_configs(model)]
    for c, _ in before:
        c._attn_implementation = _NAME
    try:
        yield
    finally:
        for c, name in before:
            c._attn_implementation = name


def _repeat_ids(model, tokenizer: PreTrainedTokenizerBase | None, repeat_prompt: str | torch.Tensor) -> torch.Tensor:
    if isinstance(repeat_prompt, torch.Tensor):
        return repeat_prompt.view(1, -1)
    if tokenizer is None:
        raise ValueError(
            "hfkv.compress: scores='reconstruction' needs the request to repeat the context as tokens: pass "
            "tokenizer= (it encodes repeat_prompt) or repeat_prompt as a tensor of token ids"
        )
    return tokenizer(repeat_prompt, add_special_tokens=False, return_tensors="pt").input_ids


def _alongside(cache: DynamicCache) -> DynamicCache:
    """A cache that continues from ``cache`` and leaves it as it is: its layers' tensors shared, not copied (a
    DynamicLayer's update concatenates into new tensors, a sliding one's slices them)."""
    other = copy.copy(cache)
    other.layers = [copy.copy(layer) for layer in cache.layers]
    return other


@torch.no_grad()
def compress(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    config: TriStateConfig | str | None = None,
    *,
    scores: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    repeat_prompt: str | torch.Tensor = REPEAT_PROMPT,
    chunk: int = 512,
    **overrides,
) -> TriStateCache:
    """A TriStateCache holding ``input_ids [B, T]`` (a context, no question; rows unpadded) compressed by ``config``
    (a TriStateConfig, a preset name, or None for ``hfkv``; ``overrides`` as TriStateCache takes them), its tokens
    scored by ``scores`` (module docstring; None: ``"reconstruction"``, or for a config that ranks by learned retention,
    ``score_source="retention"``, its gates, read as a forward fills the cache). Continue it with ``cache.fork()`` and
    a question."""
    if scores is not None and scores not in SCORE_SOURCES:
        raise ValueError(f"hfkv.compress: scores={scores!r} is not one of {SCORE_SOURCES}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"hfkv.compress: input_ids must be [B, T] token ids, got shape {tuple(input_ids.shape)}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"hfkv.compress: chunk={chunk!r} must be an int >= 1")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    cache = TriStateCache(model, config, **overrides)
    learned = cache.config.score_source == "retention"
    if learned and scores is not None:
        raise ValueError(
            f"hfkv.compress: scores={scores!r} with score_source='retention', which ranks by its gates: pass no scores"
        )
    scores = scores or ("observation" if learned else "reconstruction")
    if cache.config.layer_adaptive and scores != "reconstruction":
        raise ValueError(
            f"hfkv.compress: layer_adaptive=True shares the room by reconstruction scores (a probability each, on "
            f"one scale in every layer); scores={scores!r} has no such scale: use scores='reconstruction'"
        )
    if scores == "observation" or not cache.config.compress:
        model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache
    repeat = _repeat_ids(model, tokenizer, repeat_prompt).to(device) if scores == "reconstruction" else None
    captured, own = score_context(model, input_ids, scores, repeat, chunk)
    return fill(cache, captured, own)


def fill(cache: DynamicCache, captured: dict[int, tuple], scores: dict[int, torch.Tensor],
         dtype: torch.dtype | None = None) -> DynamicCache:  # fmt: skip
    """``cache`` (empty: a TriStateCache, or any cache a forward would fill) filled from :func:`score_context`'s
    ``captured`` tensors (cast to ``dtype`` if given), each compressed layer's tokens scored by ``scores`` (none: the
    observation window's) and, with ``layer_adaptive``, its room shared by them (:func:`hfkv.policy.layer_shares`)."""
    shares: dict[int, float] = {}
    if isinstance(cache, TriStateCache) and cache.config.layer_adaptive:
        stored = [i for i, layer in enumerate(cache.layers) if isinstance(layer, TriStateLayer)]
        missing = [i for i in stored if i not in scores]
        if missing:
            raise ValueError(f"layer_adaptive: layers {missing} have no scores to share the room by")
        kept = _even_exact_tokens(cache.config, captured[stored[0]][0], dtype)
        shares = dict(zip(stored, layer_shares([scores[i] for i in stored], kept), strict=True))
    for i, layer in enumerate(cache.layers):
        key, value, query, scaling = captured[i]
        if dtype is not None:
            key, value, query = key.to(dtype), value.to(dtype), query.to(dtype)
        if isinstance(layer, TriStateLayer):
            layer.ingest_prefill(key, value, query, scaling, scores=scores.get(i), room_share=shares.get(i))
        else:
            cache.update(key, value, i)
    return cache


def _even_exact_tokens(cfg: TriStateConfig, key: torch.Tensor, dtype: torch.dtype | None) -> int:
    """The full-precision tokens a KV head's budget buys (what an even split keeps exact, the window included)."""
    if cfg.budget_unit == "fp_tokens":
        return cfg.budget
    token_bytes = 2 * key.shape[-1] * (dtype or key.dtype).itemsize
    return max(1, cfg.budget // token_bytes)


@torch.no_grad()
def score_context(
    model: torch.nn.Module, input_ids: torch.Tensor, scores: str, repeat: torch.Tensor | None = None, chunk: int = 512
) -> tuple[dict[int, tuple], dict[int, torch.Tensor]]:
    """One forward over the context (and, for ``reconstruction``, the repetition after ``repeat`` in chunks):
    ``(captured, scores)``, per layer its ``(keys, values, last queries, scaling)`` and, for every layer that is not
    sliding, its ``[B, H, T]`` scores from ``scores``."""
    recorder, context = _Recorder(), DynamicCache(config=model.config)
    with recording(model, recorder):
        model(input_ids=input_ids, past_key_values=context, use_cache=True, logits_to_keep=1)
        if scores == "reconstruction":
            recorder.mode, recorder.context = "score", input_ids.shape[1]
            bsz, t = input_ids.shape
            for start in range(0, t, chunk):  # KVzip's chunks: each attends to the whole context, not to the others
                part = torch.cat([repeat.view(1, -1).expand(bsz, -1), input_ids[:, start : start + chunk]], 1)
                model(input_ids=part, past_key_values=_alongside(context), use_cache=True, logits_to_keep=1)
            return recorder.captured, recorder.scores
    if scores == "key_norm":
        return recorder.captured, key_norm_scores(recorder.captured)
    return recorder.captured, {}


def key_norm_scores(captured: dict[int, tuple]) -> dict[int, torch.Tensor]:
    """``[B, H, T]`` per layer from :func:`score_context`'s captured keys: lower norm is more important, so each
    token scores the largest norm of its row and head less its own."""
    norms = {i: c[0].float().norm(dim=-1) for i, c in captured.items()}
    return {i: n.amax(-1, keepdim=True) - n for i, n in norms.items()}
