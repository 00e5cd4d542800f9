"""The named presets of :class:`hfkv.config.TriStateConfig`: their names, the fields each sets, and the
papers those values come from.

``TriStateConfig.from_preset(name, **overrides)`` builds a config from them; docs/generate.md, "Presets",
says what each one keeps. A field a preset does not list is the dataclass default (= the ``hfkv`` preset).
The values are plain: a tier is a mapping ``{key, value, group_size}`` that the config turns into a
:class:`hfkv.config.TierFormat`, so this module imports nothing of the config's and :mod:`hfkv.config` imports it.

Sources: ARKV = papers/003 (section IV, V-C, V-E, Algorithm 1) and its public artifact
(github.com/Large-scale-Sustainable-Computing-LSC/ARKV, arkv/calculator.py); DiffKV = papers/000
(sections 4 and 7.2).
"""

from __future__ import annotations

import math
from typing import Any

from hfkv.policy.oq import ARKV_TAU

__all__ = ["PRESETS", "PRESET_VALUES", "STREAMING_TOTAL"]

PRESETS: tuple[str, ...] = ("full", "evict", "quant", "streaming", "arkv", "diffkv", "hfkv")

# ARKV's temperatures are hfkv.policy.oq.ARKV_TAU (section V-E); the artifact's configs carry more digits
# (7.77438..., 5.40702..., 5.52770...; 263.8108...).
_ARKV_GAMMA = 263.81
# ARKV scores tokens by mean + gamma * variance over the observing queries, averages the query heads of
# a GQA group and smooths with avg_pool1d(kernel_size=5) ("averaged across heads, smoothed,
# GQA-aligned", Algorithm 1; kernel size from arkv/calculator.py). Its baselines share that scorer.
_ARKV_SCORING: dict[str, Any] = dict(
    score_reduction="mean", score_mode="mean", gamma=_ARKV_GAMMA, pool_kernel=5, window=32, obs_window=32
)
# ARKV's tailor: a hard budget in tokens per head, evicting down to 75% of it when exceeded (IV-F).
# prior and the mid tier: memory budgets only; carry (prompt scores flowing forward) is an hfkv addition.
_TOKEN_BUDGET: dict[str, Any] = dict(budget_unit="tokens", slack=0.75, score_prior=0.0, mid=None, carry=0.0)
#: The ``streaming`` preset's total cache size in tokens per KV head (sinks + window) when no ``budget=`` is given.
STREAMING_TOTAL = 1024

#: Per preset, the TriStateConfig fields it sets (the others are the dataclass defaults).
PRESET_VALUES: dict[str, dict[str, Any]] = {
    # Never compress: the cache must be token-identical to DynamicCache. Policy fields are inert.
    "full": dict(_TOKEN_BUDGET, compress=False, budget=None, oq_ratios=False, head_adaptive=False),
    # ARKV's "origin" baseline (V-C): budgeted heavy-hitter eviction, everything kept in full precision.
    # Deviation from a plain H2O-style evictor: it uses ARKV's scorer (gamma, pool 5, GQA mean) as in ARKV.
    "evict": dict(
        _ARKV_SCORING, **_TOKEN_BUDGET, alpha_h=0.0, alpha_l=0.0, budget=1024, oq_ratios=False, head_adaptive=False
    ),
    # Everything outside the window quantised, nothing evicted unless a budget is given (KIVI-style).
    # With budget=B it is ARKV's "quant" baseline, which the paper runs in fp8 (V-C: "all tokens are in
    # fp8 form"); we keep the K4V2 default tier and document that ARKV's exact baseline is
    # from_preset("quant", budget=B, quantized={"key": "fp8", "value": "fp8"}).
    "quant": dict(
        _ARKV_SCORING, **_TOKEN_BUDGET, alpha_h=math.inf, alpha_l=0.0, budget=None, oq_ratios=False, head_adaptive=False
    ),
    # StreamingLLM: 4 attention sinks + the recent window, everything else evicted (alpha_l = inf).
    # `budget=` passed to from_preset sets the total size (window = budget - sink_tokens).
    # interval 1: without a budget nothing else would stop the ring from holding `interval` extra tokens.
    "streaming": dict(
        _TOKEN_BUDGET,
        sink_tokens=4,
        pool_kernel=1,
        window=STREAMING_TOTAL - 4,
        alpha_h=math.inf,
        alpha_l=math.inf,
        budget=None,
        oq_ratios=False,
        head_adaptive=False,
        interval=1,
    ),
    # Paper-faithful ARKV: thresholds off (alpha 0: every token is a candidate for `original`), hard
    # per-head budget with slack 0.75 (IV-F), per-layer OQ ratios with the tuned tau, fp8 tier
    # (V-H: "fp8 occupied half the memory of bfloat16"), W = observation window = 32 (V-E).
    # Budgets evaluated in the paper: 512, 1024, 2048.
    "arkv": dict(
        _ARKV_SCORING,
        **_TOKEN_BUDGET,
        alpha_h=0.0,
        alpha_l=0.0,
        budget=1024,
        oq_ratios=True,
        tau=ARKV_TAU,
        quantized=dict(key="fp8", value="fp8", group_size=32),
        head_adaptive=False,
    ),
    # Paper-faithful DiffKV (section 4, 7.2): max over the query heads of a GQA group, mean received
    # attention, W = 64, thresholds of Llama3-8B (alpha_h 1, alpha_l 0.02), K8V4 / K4V2 tiers, no budget.
    # Deviation: DiffKV quantises each key/value vector as one group (group = head_dim = 128 for the
    # models it evaluates); we keep group 32 so the preset runs on any head_dim divisible by 32
    # (configs/papers/diffkv/*.yaml use 128).
    "diffkv": dict(
        _TOKEN_BUDGET,
        alpha_h=1.0,
        alpha_l=0.02,
        budget=None,
        oq_ratios=False,
        head_adaptive=False,
        window=64,
        obs_window=64,
        score_reduction="max",
        score_mode="mean",
        pool_kernel=1,
        original=dict(key="int8", value="int4", group_size=32),
        quantized=dict(key="int4", value="int2", group_size=32),
        interval=1,
    ),  # DiffKV re-evaluates significance every step
    # The unified policy: a memory budget (tiers chosen by value per byte), the rest are the dataclass defaults.
    "hfkv": dict(),
}
assert tuple(PRESET_VALUES) == PRESETS
