"""A prompt entering an empty layer: its attention, its scores and OQ statistics, and the tiers of its tokens.

Why a module of its own: a prompt is attended densely (it is all there, as DynamicCache would hold it), but what it
leaves behind is the layer's whole starting state: the observation window's attention gives every prompt token a
score (on kernels where the backend has them, else from the probabilities), ARKV's OQ statistic for this layer's
ratio, the rows' padding and sinks, the newest ``window`` tokens in the ring, and every older token classified and
written once, straight into the tier it ends in. An evaluation that compares many caches on one prompt fills each
from captured tensors instead of a forward (``ingest``, hfkv.evaluation.shared_prefill), to the same state.
These are functions of the layer, not an object: a prompt leaves nothing of its own behind.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hfkv.policy import observation_probs, oq_score, smooth_scores, token_scores
from hfkv.quant.rotation import rotate
from hfkv.states import EVICTED, ORIGINAL


def attend_prompt(layer, module, query, k: torch.Tensor, v: torch.Tensor, mask, scaling: float) -> torch.Tensor:
    """The prompt's attention (``k, v``: its keys and values as update() stored them), then its admission."""
    if k.device.type == "cpu":
        # The projections leave [B, H, T, D] keys and values as a transposed view; torch's CPU flash attention
        # reads them 7-9% faster in bf16 when contiguous (DynamicCache's concatenation leaves them so), which
        # repays the copy 8 times over at 8k (SmolLM2's shape, 1 and 2 threads; no difference in fp32).
        k, v = k.contiguous(), v.contiguous()
    out = sdpa_attention_forward(module, query, k, v, mask, scaling=scaling)[0]
    admit_prompt(layer, k, v, query, mask, scaling)
    return out


def ingest(
    layer,
    key: torch.Tensor,
    value: torch.Tensor,
    query: torch.Tensor,
    scaling: float,
    scores: torch.Tensor | None = None,
    room_share: float | None = None,
) -> None:
    """Fill an empty ``layer`` from a prompt's tensors (``TriStateLayer.ingest_prefill``, which says what they are)."""
    if layer.is_initialized and layer.length:
        raise ValueError(f"ingest_prefill: layer {layer.layer_idx} already holds {layer.length} tokens")
    if query.shape[2] < min(layer.cfg.obs_window, key.shape[2]):
        raise ValueError(
            f"ingest_prefill: {query.shape[2]} queries given, the observation window needs "
            f"min(obs_window={layer.cfg.obs_window}, T={key.shape[2]})"
        )
    if not layer.is_initialized:
        layer.lazy_initialization(key, value)
    if room_share is not None:
        layer.budget.share = room_share
    if scores is not None and layer.retention.active:
        raise ValueError(
            f"ingest_prefill: layer {layer.layer_idx} ranks by learned retention (score_source='retention'), which "
            "the context's scores would replace: pass no scores"
        )
    layer.begin(key.shape[2])
    layer.retention.read(key, value)
    layer.length = key.shape[2]
    if layer.dense.active:
        layer.dense.ingest(key, value, query, scaling)
        if scores is not None:
            dense = layer.dense
            dense.scores = in_scale(scores, dense.scores, dense.key_valid, per_head=not layer.cfg.head_adaptive)
        return
    if layer.rotation is not None:  # as update() and attend() rotate a prompt's
        key, value, query = (rotate(x, layer.rotation) for x in (key, value, query))
    admit_prompt(layer, key, value, query, None, scaling, scores)


def in_scale(scores: torch.Tensor, sums: torch.Tensor, key_valid: torch.Tensor, per_head: bool = True) -> torch.Tensor:
    """``scores [B, H, T]`` from another source (hfkv.compress), scaled per row and head to the total the observation
    window's ``sums`` give the real tokens: their order is theirs, their size the one the thresholds and the
    budget's policy were set for. ``per_head=False`` (``head_adaptive``, where a layer's heads share its room by
    score): one scale per row, so the heads keep the source's proportions to each other (KVzip ranks its scores
    across heads, giving a head whose repetition reads nothing of the context nothing)."""
    valid = key_valid[:, None, :].to(scores.dtype)
    dims = (-1,) if per_head else (-2, -1)
    want = (sums.float() * valid).sum(dims, keepdim=True)
    have = (scores.float() * valid).sum(dims, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (scores.float() * valid * (want / have)).to(sums.dtype)


def admit_prompt(layer, k, v, query, mask, scaling, scores: torch.Tensor | None = None) -> None:
    """Scores, OQ statistics and tiers of a prompt that filled an empty layer (``query``: its last rows; ``scores``:
    another source's, in place of the window's, scaled to their total: :func:`in_scale`)."""
    sums, key_valid = observe_prompt(layer, k, query, mask, scaling)
    if layer.retention.active:  # the window's sums only set the OQ statistic and padding: the gates' values rank
        sums = layer.retention.take()
    elif scores is not None:
        sums = in_scale(scores, sums, key_valid, per_head=not layer.cfg.head_adaptive)
    place_prompt(layer, k, v, sums, key_valid)


def observe_prompt(layer, k, query, mask, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """What a prompt's observation window says of its tokens: their score sums ``[B, H, T]``, and which keys are
    real ``[B, T]``; it also sets the rows' padding, the first observed position and ARKV's OQ statistic.

    Apart from :func:`place_prompt` because a layer that holds its sequence dense (:mod:`hfkv.layer.dense`)
    observes its prompt now and places it in the window and tiers only when the sequence outgrows the budget."""
    bsz, heads, t, _ = k.shape
    cfg, ops = layer.cfg, layer.ops
    w = min(cfg.obs_window, t)
    probs = mass = None
    observe = ops.observation_scores
    if observe is not None and mask is None and cfg.gamma == 0:  # without the [B, Hq, w, T] probabilities
        sums, mass = observe(query, k, scaling, cfg.obs_window, cfg.score_reduction)
        sums = smooth_scores(sums, w, cfg.pool_kernel, cfg.carry)  # [B, H, T]
    else:
        probs = observation_probs(query, k, scaling, mask, cfg.obs_window)  # [B, Hq, w, T]
        sums = token_scores(probs, heads, cfg.score_reduction, cfg.gamma, cfg.pool_kernel, cfg.carry)
    key_valid = mask[:, 0, -1, :t].to(torch.bool) if mask is not None else torch.ones(bsz, t, dtype=torch.bool)
    key_valid = key_valid.to(layer.device)
    layer.padding.set_prompt(key_valid, unpadded=mask is None, sink_tokens=cfg.sink_tokens)
    layer.score_start = t - w
    if cfg.oq_ratios:
        # the tokens a window of cfg.window leaves to the tiers: what the ratio is about
        considered = key_valid & (torch.arange(t, device=layer.device) < t - min(cfg.window, t))
        if mass is None:
            layer.oq = oq_score(probs, considered, cfg.tau)
        else:
            layer.oq = ops.oq_score_from_mass(mass, considered, cfg.tau)
        layer.cache.invalidate_rho()
    return sums, key_valid


def place_prompt(layer, k, v, sums: torch.Tensor, key_valid: torch.Tensor) -> None:
    """The newest ``window`` of ``T`` tokens into the ring with their score sums, every older one classified and
    written once, straight into the tier it ends in (``key_valid [B, T]``: padding is evicted)."""
    bsz, heads, t, _ = k.shape
    pos = torch.arange(t, device=layer.device)
    nw = min(layer.cfg.window, t)
    rest = t - nw
    layer.window.push(k[:, :, rest:], v[:, :, rest:], pos[rest:])
    layer.window.score[:, :, :nw] = sums[..., rest:]
    if rest > 0:
        p = pos[:rest].view(1, 1, rest).expand(bsz, heads, rest)
        valid = key_valid[:, None, :rest].expand(bsz, heads, rest)
        state = torch.where(valid, ORIGINAL, EVICTED).to(torch.int8)
        sc = sums[..., :rest]
        ranked = layer.policy.ranked(sc, p, valid, t)
        new = layer.policy.classify(ranked, state, p, nw, None)
        layer.moves.admit(k[:, :, :rest], v[:, :, :rest], pos[:rest], sc, new, check_finite=True)
    layer.budget.refresh_peak()
