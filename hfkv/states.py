"""Token states shared by policy, storage and cache.

The numeric order is the direction of allowed transitions: a token may only move to a larger
value (original -> mid -> quantized -> evicted), so ``torch.maximum(old, proposed)`` applies the
"no promotion" rule in one vectorised step. Tier indices of the paged storage are the same
numbers, so a state is also the index of the tier that stores the token.

``MID`` is a second, more precise quantized format (DiffKV's K8V4 beside K4V2). Only memory budgets
use it; a token in it counts as quantized wherever the three states (exact, quantized, evicted)
are reported.
"""

ORIGINAL = 0
MID = 1
QUANTIZED = 2
EVICTED = 3
# Only in state maps (``TriStateCache.token_states``): still in the dense window, not yet classified.
# It sorts below ORIGINAL because the window is where every token starts.
WINDOW = -1

TIER_NAMES = ("original", "mid", "quantized")
STATE_NAMES = ("original", "mid", "quantized", "evicted")
# How statistics, frames and figures name the states, and their order there (window first).
STATE_LABELS: dict[int, str] = {
    WINDOW: "window",
    ORIGINAL: "original",
    MID: "mid",
    QUANTIZED: "quantized",
    EVICTED: "evicted",
}
STATE_ORDER: tuple[str, ...] = ("window", *STATE_NAMES)
