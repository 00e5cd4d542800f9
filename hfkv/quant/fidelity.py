"""How much of a token's worth a tier format keeps: the weights of the memory-budget policy.

The byte-budget allocator (``hfkv.policy.budget``) values a kept token at ``significance * f``
where ``f`` is its tier's fidelity (1 for the model dtype). ``f`` answers "how much of what this
token contributes to attention survives quantization", measured rather than guessed: for a
token ``i`` with attention ``p_i``, evicting it moves the output by about ``p_i |v_i - o|``;
quantizing it moves it by about ``p_i |v^_i - v_i| + p_i |d_i| |v_i - o|`` (value error, plus
the logit error ``d_i = q.(k^_i - k_i) * scale`` reweighting it). Their ratio is the relative
loss ``r``, and ``f = 1 - r``, averaged over the tokens of a real model's prompt (attention
weighted). ``eval/format_fidelity.py`` measures it on SmolLM2-135M and on the testbed
(docs/formats.md).

The table below is not a copy of either measurement. The linearised loss adds absolute errors
that partly cancel inside attention, so it overstates what quantization costs end to end: on
SmolLM2 it rates a K4V2 token at 26% of an exact one, yet a cache holding every old token in
K4V2 (31% of DynamicCache's bytes) has a KL of 0.02 to the full cache, several times lower than
eviction at that memory. The values are therefore the testbed's key losses for int8/int4/fp8,
with int2 and value losses set lower than measured, tuned together with ``score_prior`` on the
testbed's tasks at equal memory. Per model, ``TriStateConfig.fidelity`` overrides them.
Formats not in the table get the sum of their key and value parts' losses.
"""

from __future__ import annotations

# Relative loss of one part (keys or values) per (format, group size); how they were set: module docs.
# Keys: group sizes above the head dimension are clamped to it, so 64 and 128 coincide at head_dim 64.
KEY_LOSS: dict[tuple[str, int], float] = {
    ("model", 0): 0.0,
    ("int8", 32): 0.004,
    ("int8", 64): 0.005,
    ("int8", 128): 0.006,
    ("fp8", 0): 0.03,
    ("int4", 32): 0.06,
    ("int4", 64): 0.08,
    ("int4", 128): 0.09,
    ("int2", 32): 0.35,
    ("int2", 64): 0.45,
    ("int2", 128): 0.5,
}
VALUE_LOSS: dict[tuple[str, int], float] = {
    ("model", 0): 0.0,
    ("int8", 32): 0.004,
    ("int8", 64): 0.005,
    ("int8", 128): 0.006,
    ("fp8", 0): 0.03,
    ("int4", 32): 0.06,
    ("int4", 64): 0.08,
    ("int4", 128): 0.09,
    ("int2", 32): 0.3,
    ("int2", 64): 0.4,
    ("int2", 128): 0.45,
}


def _loss(table: dict[tuple[str, int], float], fmt: str, group: int, head_dim: int) -> float:
    if fmt in ("model", "fp8"):
        return table[(fmt, 0)]
    g = min(group, head_dim)
    known = sorted(k for f, k in table if f == fmt)
    nearest = min(known, key=lambda k: (abs(k - g), k))
    return table[(fmt, nearest)]


def tier_fidelity(key: str, value: str, group_size: int, head_dim: int) -> float:
    """Fidelity in [0, 1] of a tier storing keys in ``key`` and values in ``value`` format."""
    loss = _loss(KEY_LOSS, key, group_size, head_dim) + _loss(VALUE_LOSS, value, group_size, head_dim)
    return max(0.0, 1.0 - loss)
