"""Token states shared by policy, storage and cache.

The numeric order is the direction of allowed transitions: a token may only move to a larger
value (original -> quantized -> evicted), so ``torch.maximum(old, proposed)`` applies the
"no promotion" rule in one vectorised step. Tier indices of the paged storage are the same
numbers, so a state is also the index of the tier that stores the token.
"""

ORIGINAL = 0
QUANTIZED = 1
EVICTED = 2
# Only in state maps (``TriStateCache.token_states``): still in the dense window, not yet classified.
# It sorts below ORIGINAL because the window is where every token starts.
WINDOW = -1

TIER_NAMES = ("original", "quantized")
STATE_NAMES = ("original", "quantized", "evicted")
