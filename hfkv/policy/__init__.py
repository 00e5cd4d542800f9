"""Token policy: significance scores, ARKV OQ ratios and the unified tri-state classifier."""

from hfkv.policy.oq import ARKV_TAU, oq_ratios, oq_score, oq_score_from_mass
from hfkv.policy.scores import (
    GQA_REDUCTIONS,
    observation_counts,
    observation_probs,
    reduce_gqa,
    score_means,
    smooth_scores,
    token_scores,
)
from hfkv.policy.unified import budget_target, classify, expected_held_bound, oq_cap

__all__ = [
    "ARKV_TAU",
    "GQA_REDUCTIONS",
    "budget_target",
    "classify",
    "expected_held_bound",
    "observation_counts",
    "observation_probs",
    "oq_cap",
    "oq_ratios",
    "oq_score",
    "oq_score_from_mass",
    "reduce_gqa",
    "score_means",
    "smooth_scores",
    "token_scores",
]
