"""Configuration of the tri-state cache: one validated object shared by code, YAML files and presets.

A config is the unit that calibration writes, lm-eval loads and benchmarks compare, so it is
checked when it is built (a typo must fail before a long run, not in the middle of it) and it
round-trips exactly through YAML (a calibrated file must reproduce the run that produced it).
Checks that need the model (layer/head counts of alpha tables, group sizes vs ``head_dim``)
are in :meth:`TriStateConfig.validate_for_model`, which the cache calls at first use.

The named presets (their values and the papers behind them) are in :mod:`hfkv.presets`; a config as the
key of stored results (sweep rows, calibration studies) in :mod:`hfkv.result_keys`.
"""

from __future__ import annotations

import copy
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml

from hfkv import result_keys
from hfkv.atomic import write_atomic
from hfkv.gates import gates_path, shipped_gates
from hfkv.gates import is_path as gates_is_path
from hfkv.kernels.backend import BACKENDS  # the backends a config may name: the table that runs them
from hfkv.policy.oq import ARKV_TAU
from hfkv.presets import PRESET_VALUES, PRESETS, STREAMING_TOTAL
from hfkv.quant.formats import FORMAT_NAMES, INT_BITS
from hfkv.suggest import did_you_mean  # also imported from here by older callers

INT_FORMATS: tuple[str, ...] = tuple(INT_BITS)  # ("int8", "int4", "int2")

SCORE_REDUCTIONS: tuple[str, ...] = ("max", "mean", "l2")
SCORE_MODES: tuple[str, ...] = ("mean", "sum")
# What a policy run ranks tokens by: the attention they received (the observation window, then every decode step's
# probabilities), or their learned retention (TRIM-KV: a gate read once per token, decayed with age; hfkv.gates).
SCORE_SOURCES: tuple[str, ...] = ("attention", "retention")
TIER_FIELDS: tuple[str, ...] = ("original", "mid", "quantized")  # the storage tiers, most precise first
# "tokens": the budget counts tokens per KV head (ARKV, paper-faithful); "fp_tokens": it caps the bytes a
# head holds at `budget` full-precision tokens' worth (K + V in the model dtype, what DynamicCache holds per
# token), so quantized tokens cost what they weigh; "bytes": the same cap given directly in bytes.
BUDGET_UNITS: tuple[str, ...] = ("tokens", "fp_tokens", "bytes")
# What `budget` counts under each unit, in the words error messages use (docs/generate.md, "Budgets").
BUDGET_UNIT_TEXT: dict[str, str] = {
    "tokens": "an integer number of tokens per KV head (budget_unit='tokens': tokens kept, whatever their tier)",
    "fp_tokens": (
        "an integer memory budget in full-precision-token equivalents per KV head (budget_unit='fp_tokens': "
        "at most the bytes of that many tokens' keys + values in the model dtype)"
    ),
    "bytes": "an integer number of bytes per KV head (budget_unit='bytes': a memory budget in bytes)",
}

Alpha = float | list[float] | list[list[float]]


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _fail(where: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{where}={value!r} must be {allowed}")


def _check_tier(where: str, key: Any, value: Any, group_size: Any) -> None:
    for part, fmt in (("key", key), ("value", value)):
        if not isinstance(fmt, str) or fmt not in FORMAT_NAMES:
            raise _fail(f"{where}.{part}", fmt, f"one of {FORMAT_NAMES}")
    if not _is_int(group_size) or group_size <= 0 or group_size & (group_size - 1):
        raise _fail(f"{where}.group_size", group_size, "a positive power of two")


@dataclass(frozen=True)
class TierFormat:
    """Storage format of one tier; keys and values are separate because keys tolerate
    quantisation worse than values (DiffKV section 3.1: K8V4 is lossless, K4V8 is not)."""

    key: str = "model"
    value: str = "model"
    group_size: int = 32

    def __post_init__(self) -> None:
        _check_tier("TierFormat", self.key, self.value, self.group_size)

    def __str__(self) -> str:
        return f"{self.key}/{self.value}"

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "group_size": int(self.group_size)}


_TIER_KEYS = tuple(f.name for f in fields(TierFormat))
_DEFAULT_TIERS = {
    "original": TierFormat("model", "model", 32),
    "mid": TierFormat("int8", "int4", 32),
    "quantized": TierFormat("int4", "int2", 32),
}


def _tier_from(where: str, value: Any, base: TierFormat) -> TierFormat:
    """Accept a TierFormat or a (possibly partial) mapping; missing keys come from ``base``, so
    ``quantized: {group_size: 64}`` over a preset changes only the group size."""
    if isinstance(value, TierFormat):
        return value
    if not isinstance(value, Mapping):
        raise _fail(where, value, f"a TierFormat or a mapping with keys {_TIER_KEYS}")
    unknown = sorted(set(value) - set(_TIER_KEYS), key=str)
    if unknown:
        hint = did_you_mean(unknown[0], _TIER_KEYS)
        raise ValueError(f"{where}: unknown key(s) {unknown}{hint}; allowed: {list(_TIER_KEYS)}")
    merged = {**base.to_dict(), **value}
    _check_tier(where, merged["key"], merged["value"], merged["group_size"])
    return TierFormat(merged["key"], merged["value"], int(merged["group_size"]))


def _normalize_alpha(where: str, v: Any) -> tuple[Alpha, tuple[int, ...]]:
    """Return the alpha as float / list / rectangular list of lists, and its shape."""

    def num(w: str, x: Any) -> float:
        if not _is_real(x) or math.isnan(x) or x < 0:
            raise _fail(w, x, "a number >= 0 (inf allowed)")
        return float(x)

    if _is_real(v):
        return num(where, v), ()
    if not isinstance(v, (list, tuple)) or len(v) == 0:
        raise _fail(where, v, "a number >= 0, a non-empty per-layer list or a [layer][head] table")
    if all(_is_real(x) for x in v):
        return [num(f"{where}[{i}]", x) for i, x in enumerate(v)], (len(v),)
    if not all(isinstance(x, (list, tuple)) for x in v):
        raise _fail(where, v, "either a list of numbers (per layer) or a list of lists (per layer and head), not a mix")
    widths = [len(row) for row in v]
    if widths[0] == 0 or len(set(widths)) != 1:
        raise _fail(where, v, f"a rectangular [layer][head] table (row lengths are {widths})")
    table = []
    for i, row in enumerate(v):
        if not all(_is_real(x) for x in row):
            raise _fail(f"{where}[{i}]", row, "a list of numbers (tables have exactly two levels)")
        table.append([num(f"{where}[{i}][{j}]", x) for j, x in enumerate(row)])
    return table, (len(v), widths[0])


def _alpha_at(v: Alpha, shape: tuple[int, ...], idx: tuple[int, ...]) -> float:
    if not shape:
        return v  # type: ignore[return-value]
    if len(shape) == 1:
        return v[idx[0]]  # type: ignore[index,return-value]
    return v[idx[0]][idx[1]]  # type: ignore[index]


def _check_yaml_safe(where: str, v: Any) -> None:
    if v is None or isinstance(v, (str, bool, int)):
        return
    if isinstance(v, float):
        if math.isnan(v):
            raise _fail(where, v, "YAML-safe metadata without NaN")
        return
    if isinstance(v, list):
        for i, x in enumerate(v):
            _check_yaml_safe(f"{where}[{i}]", x)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise _fail(f"{where} key", k, "a string")
            _check_yaml_safe(f"{where}.{k}", x)
        return
    raise _fail(where, v, "YAML-safe metadata (str, int, float, bool, None, list, dict)")


@dataclass
class TriStateConfig:
    """Every knob of the tri-state policy (docs/generate.md, docs/architecture.md); defaults are the ``hfkv`` preset.

    It stays mutable so notebooks can poke at it, but every construction path (including
    ``dataclasses.replace``) re-runs the checks; after editing a field in place, call
    :meth:`validate` yourself.
    """

    name: str = "custom"
    compress: bool = True
    # A short window leaves the memory budget to the policy, which keeps the recent tokens anyway when they
    # matter; on the testbed at 9x compression W=16 keeps kv_recall at 1.0 where W=32 costs 0.1.
    window: int = 16
    sink_tokens: int = 0
    obs_window: int = 32
    score_reduction: str = "max"
    score_mode: str = "mean"
    gamma: float = 0.0
    # Smoothing scores over 5 neighbouring positions (SnapKV/ARKV) keeps the tokens next to a heavy
    # hitter: on the testbed's kv_recall at budget 80, hfkv goes from 0.22 to 0.96 accuracy with it.
    pool_kernel: int = 5
    # Prompt scores flow forward: the token d places after another keeps at least carry**d of its mean score.
    # A question attends to where a needle starts (its key); the model then copies the value token by token,
    # reading each right after the one before (hfkv.policy.scores.carry_forward). 0: off.
    carry: float = 0.8
    oq_ratios: bool = True
    tau: tuple[float, float, float] = ARKV_TAU  # OQ temperatures: ARKV's tuned values (section V-E)
    # Under a memory budget a finite alpha_h makes a token above alpha_h / N exact-or-nothing, which costs
    # coverage: on the testbed at budget 64, alpha_h 4 / 2 take kv_recall from 1.0 to 0.0 (docs/generate.md).
    # Off by default; calibration may turn it on per layer or head.
    alpha_h: Alpha = math.inf
    # No significance floor under a memory budget: DiffKV's alpha_l / N evicts, in every head, the tokens the
    # prompt's last queries did not look at, which on RULER are the digits of the needle the model copies
    # next (niah_single_1 at 4k: 10/24 with the floor, 17/24 without; docs/generate.md).
    alpha_l: Alpha = 0.0
    budget: int | None = 1024
    budget_unit: str = "fp_tokens"
    # Share of the budget a policy run fills: ARKV tailors token budgets to 75% so tailoring is amortised;
    # a memory budget already reserves the window's growth until the next run, so it fills all of it.
    slack: float = 1.0
    # Each head keeps its own share of the budget. Sharing a layer's bytes across heads by score (AdaKV) gives
    # them to the heads whose attention is concentrated and starves the ones that read a needle: on RULER's
    # niah_single_1 at 4k, evict@256 goes from 18/24 to 0/24 with it, hfkv@256 from 19/24 to 7/24.
    head_adaptive: bool = False
    # Layers share the cache's room by score (KVzip ranks across layers as across heads): each compressed layer's room
    # outside the window is its share of a context's highest reconstruction scores, between a quarter and four times
    # an even split's, the total unchanged (hfkv.policy.layer_shares). Only hfkv.compress scores every layer before
    # it places any; a cache whose layers are filled by the model's forward, one at a time, cannot, and raises.
    layer_adaptive: bool = False
    # "retention": tokens are ranked by learned retention gates (hfkv.policy.retention), read once as each token
    # enters, instead of the attention they received; `gates` names the gates file (a shipped model name of
    # hfkv.gates, or a path). The gates' values take the tokens' score fields, which no read adds attention to
    # (docs/retention.md).
    score_source: str = "attention"
    gates: str | None = None
    # Policy runs (and window exits) batched every `interval` decode steps; the budget is still enforced
    # every step. Batching is what keeps the per-step cost of the torch backend low.
    interval: int = 8
    # The i-th compressed layer runs its batched policy at the steps whose length is i modulo `interval`, not every
    # layer at the same step: the same runs per layer, spread over the interval's steps. On a GPU a step that runs
    # 32 layers' policy costs ~13 ms of host (eval/host_overhead.py); spread, ~4 layers' runs a step can hide under
    # the device's work.
    stagger: bool = False
    # A Triton decode step whose next step runs the policy launches that run's classification and move plan after
    # its attention, and the run reads their numbers a step later, when they have long arrived: on a GPU the run's
    # one host read no longer drains the device's queue, and half its launches leave its step. The same decisions
    # and storage either way (tests/test_policy_run_ahead.py); False runs each policy run whole, at its step.
    run_ahead: bool = True
    # While the budget would keep every token exact, a layer holds its sequence as DynamicCache does and attends with
    # the model's own attention, so its outputs are DynamicCache's bit for bit (bf16 too) at ~2% more bytes (a score
    # a token, a buffer of interval steps' queries; hfkv.layer.dense); it moves to the window and tiers when the
    # sequence outgrows the budget. False: the tiers from the first token (tests of their machinery on short ones).
    dense_phase: bool = True
    # Keys and values stored rotated by an orthonormal Walsh-Hadamard matrix (each head vector; the query rotated
    # the same way and the output rotated back around the layer's attention): a key's outlier channels no longer set
    # the step of whole int4 / int2 groups, for the same bytes (hfkv.quant.rotation; docs/formats.md). Exact tokens
    # are stored rotated too, rounded to the model's dtype. Needs a power-of-two head_dim.
    rotate: bool = False
    original: TierFormat = _DEFAULT_TIERS["original"]
    # A second quantized format between original and quantized (DiffKV's high-precision K8V4), used by
    # memory budgets only: refining a K4V2 token to K8V4 buys 5x more fidelity per byte than an exact copy
    # (hfkv.policy.budget), which is what closes the gap to DiffKV at 30% memory on SmolLM2. None: no
    # such tier. Token budgets never use it (a count of tokens cannot tell the two formats apart).
    mid: TierFormat | None = _DEFAULT_TIERS["mid"]
    quantized: TierFormat = _DEFAULT_TIERS["quantized"]
    # Value a token keeps in each tier relative to full precision, for memory budgets (how much
    # significance it is worth per byte): (original, mid, quantized), or (original, quantized) without a
    # mid tier. None: the measured table of hfkv.quant.fidelity.
    fidelity: tuple[float, ...] | None = None
    # Memory budgets: significance every token is credited with on top of its score, in units of uniform
    # attention 1/N. Past attention predicts future attention only roughly, and an evicted token is gone
    # while a quantized one is only blurred: a prior keeps more tokens (quantized) before upgrading any.
    score_prior: float = 16.0
    page_bytes: int | None = None  # None: chosen per layer so every tier's records tile pages exactly
    backend: str = "auto"
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Normalise types (YAML ints -> floats, lists -> tuples) and raise on the first bad field."""
        w = "TriStateConfig"
        if not isinstance(self.name, str) or not self.name:
            raise _fail(f"{w}.name", self.name, "a non-empty string")
        flags = (
            "compress",
            "oq_ratios",
            "head_adaptive",
            "layer_adaptive",
            "stagger",
            "run_ahead",
            "dense_phase",
            "rotate",
        )
        for f in flags:
            if not isinstance(getattr(self, f), bool):
                raise _fail(f"{w}.{f}", getattr(self, f), "true or false")
        for f in ("rotate", "layer_adaptive"):
            if getattr(self, f) and not self.compress:
                raise _fail(f"{w}.{f}", True, "false where compress is false (nothing is stored compressed)")
        for f, lo in (
            ("window", 1),
            ("sink_tokens", 0),
            ("obs_window", 1),
            ("pool_kernel", 1),
            ("interval", 1),
            ("page_bytes", 64),
        ):
            v = getattr(self, f)
            if f == "page_bytes" and v is None:
                continue
            if not _is_int(v) or v < lo:
                raise _fail(f"{w}.{f}", v, f"an integer >= {lo}")
            setattr(self, f, int(v))
        if self.pool_kernel % 2 == 0:
            raise _fail(
                f"{w}.pool_kernel",
                self.pool_kernel,
                "odd (1 = no smoothing), so the smoothing window is centred on the token",
            )
        if self.page_bytes is not None and self.page_bytes % 4:
            raise _fail(f"{w}.page_bytes", self.page_bytes, "a multiple of 4")
        for f, allowed in (
            ("score_reduction", SCORE_REDUCTIONS),
            ("score_mode", SCORE_MODES),
            ("backend", BACKENDS),
            ("budget_unit", BUDGET_UNITS),
            ("score_source", SCORE_SOURCES),
        ):
            v = getattr(self, f)
            if not isinstance(v, str) or v not in allowed:
                raise _fail(f"{w}.{f}", v, f"one of {allowed}")
        if not _is_real(self.gamma) or math.isnan(self.gamma) or self.gamma < 0 or math.isinf(self.gamma):
            raise _fail(f"{w}.gamma", self.gamma, "a finite number >= 0")
        self.gamma = float(self.gamma)
        if not _is_real(self.score_prior) or not math.isfinite(self.score_prior) or self.score_prior < 0:
            raise _fail(f"{w}.score_prior", self.score_prior, "a finite number >= 0")
        self.score_prior = float(self.score_prior)
        if not _is_real(self.carry) or math.isnan(self.carry) or not 0 <= self.carry < 1:
            raise _fail(f"{w}.carry", self.carry, "a decay in [0, 1) (0: prompt scores are not carried forward)")
        self.carry = float(self.carry)
        if not _is_real(self.slack) or math.isnan(self.slack) or not 0 < self.slack <= 1:
            raise _fail(f"{w}.slack", self.slack, "a number in (0, 1]")
        self.slack = float(self.slack)
        tau = self.tau
        if not isinstance(tau, (list, tuple)) or len(tau) != 3:
            raise _fail(f"{w}.tau", tau, "three numbers (entropy, variance, kurtosis temperatures)")
        for i, t in enumerate(tau):
            if not _is_real(t) or not math.isfinite(t) or t <= 0:
                raise _fail(f"{w}.tau[{i}]", t, "a finite number > 0")
        self.tau = tuple(float(t) for t in tau)  # type: ignore[assignment]
        for f in TIER_FIELDS:
            if f == "mid" and self.mid is None:
                continue
            setattr(self, f, _tier_from(f"{w}.{f}", getattr(self, f), _DEFAULT_TIERS[f]))
        if self.fidelity is not None:
            fid = self.fidelity
            names = ("original", "mid", "quantized") if self.mid is not None else ("original", "quantized")
            want = f"None or {len(names)} numbers ({', '.join(names)}; mid={self.mid})"
            if not isinstance(fid, (list, tuple)) or len(fid) != len(names) or not all(_is_real(x) for x in fid):
                raise _fail(f"{w}.fidelity", fid, want)
            if not all(0 <= b <= a <= 1 for a, b in zip(fid, fid[1:], strict=False)) or not 0 <= fid[-1]:
                raise _fail(f"{w}.fidelity", fid, f"{' >= '.join(names)}, each in [0, 1]")
            self.fidelity = tuple(float(x) for x in fid)
        if not isinstance(self.provenance, dict):
            raise _fail(f"{w}.provenance", self.provenance, "a mapping")
        _check_yaml_safe(f"{w}.provenance", self.provenance)
        self._validate_alpha(w)
        self._validate_budget(w)
        self._validate_gates(w)

    def _validate_gates(self, w: str) -> None:
        if self.score_source == "retention":
            if not self.compress:
                raise _fail(f"{w}.score_source", self.score_source, "'attention' where compress is false")
            if not isinstance(self.gates, str) or not self.gates:
                raise _fail(
                    f"{w}.gates",
                    self.gates,
                    f"a gates file where score_source='retention': one of {shipped_gates()} "
                    "or a path to one (`hfkv train-gates`)",
                )
            if not gates_is_path(self.gates):
                gates_path(self.gates)  # a misspelt shipped name fails now, naming the shipped ones
        elif self.gates is not None:
            raise _fail(f"{w}.gates", self.gates, "None where score_source='attention' (only retention reads gates)")

    def _validate_alpha(self, w: str) -> None:
        h, hs = _normalize_alpha(f"{w}.alpha_h", self.alpha_h)
        lo, ls = _normalize_alpha(f"{w}.alpha_l", self.alpha_l)
        self.alpha_h, self.alpha_l = h, lo
        # Compare where the shapes line up without knowing the model; other combinations
        # (e.g. two per-layer lists of different lengths) are caught by resolve_alpha.
        if hs == ls or not hs or not ls or (len(hs) != len(ls) and hs[0] == ls[0]):
            shape = max(hs, ls, key=len)
            for idx in _indices(shape):
                vh = _alpha_at(h, hs, idx[: len(hs)])
                vl = _alpha_at(lo, ls, idx[: len(ls)])
                if vl > vh:
                    sl = "".join(f"[{i}]" for i in idx[: len(ls)])
                    sh = "".join(f"[{i}]" for i in idx[: len(hs)])
                    raise ValueError(
                        f"{w}.alpha_l{sl}={vl!r} must be <= alpha_h{sh}={vh!r} (elementwise): "
                        "a token cannot be evicted for scoring above the full-precision bar"
                    )

    def _validate_budget(self, w: str) -> None:
        b = self.budget
        if b is None:
            for f in ("oq_ratios", "head_adaptive", "layer_adaptive"):
                if getattr(self, f):
                    raise _fail(
                        f"{w}.{f}",
                        True,
                        "false when budget is None (it divides the budget); set a budget or turn it off",
                    )
            return
        if not _is_int(b):
            raise _fail(f"{w}.budget", b, f"{BUDGET_UNIT_TEXT[self.budget_unit]}, or None")
        self.budget = b = int(b)
        if self.layer_adaptive and self.budget_unit == "tokens":
            raise _fail(
                f"{w}.layer_adaptive", True, "false with budget_unit='tokens' (it shares a memory budget's bytes)"
            )
        if self.budget_unit == "bytes":
            # Bytes are checked against the model (record sizes, dtype) when the cache is built.
            if b <= 0:
                raise _fail(f"{w}.budget", b, f"positive: {BUDGET_UNIT_TEXT['bytes']}, or None")
            return
        if self.budget_unit == "fp_tokens":
            # The ring holds up to window + interval full-precision tokens between policy runs.
            ring = self.window + self.interval
            if b <= ring + self.sink_tokens:
                raise _fail(
                    f"{w}.budget",
                    b,
                    f"> window + interval + sink_tokens = {ring + self.sink_tokens} full-precision-token "
                    "equivalents (budget_unit='fp_tokens': a memory budget per KV head; it includes the window, "
                    "which may grow by `interval` tokens between policy runs)",
                )
            if math.floor(self.slack * (b - ring)) < self.sink_tokens:
                raise ValueError(
                    f"{w}.slack={self.slack!r} with budget={b} fp_tokens leaves room for "
                    f"{math.floor(self.slack * (b - ring))} full-precision tokens outside the window, fewer than "
                    f"sink_tokens={self.sink_tokens}; raise slack or budget"
                )
            return
        if b <= self.window + self.sink_tokens:
            raise _fail(
                f"{w}.budget",
                b,
                f"> window + sink_tokens = {self.window + self.sink_tokens} tokens "
                "(budget_unit='tokens': tokens kept per KV head; the budget includes the window)",
            )
        kept = math.floor(self.slack * (b - self.window))
        if kept < self.sink_tokens:
            raise ValueError(
                f"{w}.slack={self.slack!r} with budget={b} and window={self.window} keeps "
                f"floor(slack * (budget - window)) = {kept} tokens, fewer than "
                f"sink_tokens={self.sink_tokens}; raise slack or budget"
            )

    # ------------------------------------------------------------------ model-dependent checks
    def resolve_alpha(self, num_layers: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expand alpha_h / alpha_l to float32 ``[num_layers, num_kv_heads]`` tables."""
        for n, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads)):
            if not _is_int(v) or v < 1:
                raise _fail(n, v, "a positive integer")
        tables = [_alpha_table(f, getattr(self, f), num_layers, num_kv_heads) for f in ("alpha_h", "alpha_l")]
        h, lo = tables
        bad = (lo > h).nonzero()
        if len(bad):
            i, j = (int(x) for x in bad[0])
            raise ValueError(
                f"TriStateConfig.alpha_l={lo[i, j].item()!r} at layer {i}, head {j} must be "
                f"<= alpha_h={h[i, j].item()!r} (elementwise)"
            )
        return h, lo

    def uses_quantized_tier(self) -> bool:
        """Whether any token can ever be quantized: a memory budget, an OQ cap, or a band between the
        thresholds. ``evict`` (alpha 0 / 0) and ``streaming`` (inf / inf) never quantize, so their
        quantized tier is neither validated against the model nor allocated beyond its layout."""
        if not self.compress:
            return False
        if (self.budget is not None and self.budget_unit != "tokens") or (self.oq_ratios and self.budget is not None):
            return True
        h, hs = _normalize_alpha("alpha_h", self.alpha_h)
        lo, ls = _normalize_alpha("alpha_l", self.alpha_l)
        if hs and ls and len(hs) != len(ls) and hs[0] != ls[0]:
            return True  # shapes only line up on a model; assume a band exists
        shape = max(hs, ls, key=len)
        return any(_alpha_at(lo, ls, idx[: len(ls)]) < _alpha_at(h, hs, idx[: len(hs)]) for idx in _indices(shape))

    def uses_mid_tier(self) -> bool:
        """Whether tokens can be kept in the mid tier: it is set and a memory budget decides the tiers."""
        return self.compress and self.mid is not None and self.budget is not None and self.budget_unit != "tokens"

    def group_for(self, tier: str, head_dim: int) -> int:
        """The group size a tier uses on a model: never more than the head dimension (a group is a
        slice of one token's head), and for a tier the config never uses, one that divides it."""
        g = min(getattr(self, tier).group_size, head_dim)
        if (tier == "quantized" and not self.uses_quantized_tier()) or (tier == "mid" and not self.uses_mid_tier()):
            g = math.gcd(g, head_dim)
        return g

    def validate_for_model(
        self, num_layers: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Check what needs the model's shape; returns the resolved alpha tables."""
        tables = self.resolve_alpha(num_layers, num_kv_heads)
        if not _is_int(head_dim) or head_dim < 1:
            raise _fail("head_dim", head_dim, "a positive integer")
        if self.rotate and head_dim & (head_dim - 1):
            why = f"false for head_dim={head_dim} (the rotation needs a power of two)"
            raise _fail("TriStateConfig.rotate", self.rotate, why)
        if self.compress:  # `full` never quantises, so it must run on any head_dim
            for f in ("original", "quantized", *(("mid",) if self.uses_mid_tier() else ())):
                tier: TierFormat = getattr(self, f)
                used = [x for x in (tier.key, tier.value) if x in INT_FORMATS]
                g = self.group_for(f, head_dim)
                if used and head_dim % g:
                    raise ValueError(
                        f"TriStateConfig.{f}.group_size={tier.group_size} must divide "
                        f"head_dim={head_dim} (groups of one token and head, used by {tier})"
                    )
        return tables

    # ------------------------------------------------------------------ (de)serialisation
    def key_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` as a key of stored results (sweep rows, hold-out evaluations, a calibration study's
        base): :func:`hfkv.result_keys.key_dict`."""
        return result_keys.key_dict(self)

    @staticmethod
    def stored_key(stored: Mapping[str, Any]) -> dict[str, Any]:
        """A config key stored by earlier code (:meth:`key_dict`) as today's code writes the same config:
        :func:`hfkv.result_keys.stored_key`."""
        return result_keys.stored_key(stored)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, TierFormat):
                v = v.to_dict()
            elif f.name in ("tau", "fidelity") and v is not None:
                v = list(v)
            else:
                v = copy.deepcopy(v)
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TriStateConfig:
        """Build from a mapping; an optional ``preset: <name>`` key means "start from that preset
        and apply the other keys as overrides", which keeps paper/calibrated files short."""
        if not isinstance(d, Mapping):
            raise _fail("config", d, "a mapping of TriStateConfig fields")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(allowed) - {"preset"}, key=str)
        if unknown:
            hint = did_you_mean(unknown[0], ["preset", *allowed])
            raise ValueError(f"unknown config key(s) {unknown}{hint}; allowed: ['preset'] + {allowed}")
        rest = dict(d)
        preset = rest.pop("preset", None)
        if preset is not None:
            return cls.from_preset(preset, **rest)
        return cls(**rest)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> TriStateConfig:
        with open(path, encoding="utf-8") as fh:
            try:
                data = yaml.safe_load(fh)
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML: {e}") from e
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    def to_yaml(self, path: str | os.PathLike[str], header: str | None = None) -> Path:
        """Write atomically (temp file in the same directory + ``os.replace``) so an interrupted
        calibration never leaves a truncated config behind. ``header`` becomes a comment block."""
        path = Path(path)
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        if header:
            text = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) + text
        return write_atomic(path, text)

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> TriStateConfig:
        """A named preset (:mod:`hfkv.presets`) with field overrides. For ``streaming``, ``budget=`` is the total
        cache size (sinks + window) and sets ``window = budget - sink_tokens``; its stored budget stays None
        because nothing outside the window survives, so there is nothing left to tailor."""
        if name not in PRESET_VALUES:
            raise ValueError(f"preset={name!r} must be one of {PRESETS}{did_you_mean(name, PRESETS)}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            hint = did_you_mean(unknown[0], allowed)
            raise ValueError(f"unknown TriStateConfig field(s) {unknown}{hint}; allowed: {sorted(allowed)}")
        values: dict[str, Any] = {"name": name, **copy.deepcopy(PRESET_VALUES[name])}
        if name == "streaming":
            overrides = dict(overrides)
            sinks = overrides.get("sink_tokens", values["sink_tokens"])
            if "budget" in overrides:
                total = overrides.pop("budget")
                if not _is_int(total) or not _is_int(sinks) or total <= sinks:
                    raise _fail(
                        "TriStateConfig.budget",
                        total,
                        f"an integer number of tokens > sink_tokens={sinks!r} "
                        "(for the streaming preset, budget is the total cache size in tokens per KV head)",
                    )
                if "window" in overrides and overrides["window"] != total - sinks:
                    raise ValueError(
                        f"streaming: window={overrides['window']!r} contradicts budget={total} "
                        f"(window = budget - sink_tokens = {total - sinks}); give one of them"
                    )
                overrides["window"] = total - sinks
            elif "window" not in overrides:
                overrides["window"] = STREAMING_TOTAL - sinks if _is_int(sinks) else values["window"]
        for f in TIER_FIELDS:
            if isinstance(overrides.get(f), Mapping):
                base = values.get(f) or _DEFAULT_TIERS[f]
                if isinstance(base, Mapping):  # a preset's tier is a plain mapping (hfkv.presets)
                    base = _tier_from(f"TriStateConfig.{f}", base, _DEFAULT_TIERS[f])
                overrides[f] = _tier_from(f"TriStateConfig.{f}", overrides[f], base)
        values.update(overrides)
        return cls(**values)

    # ------------------------------------------------------------------ display
    def summary(self) -> str:
        """One line for logs and benchmark tables."""
        if not self.compress:
            return f"{self.name}: uncompressed (DynamicCache-equivalent)"
        parts = [f"{self.name}:", f"W={self.window}"]
        if self.sink_tokens:
            parts.append(f"sinks={self.sink_tokens}")
        unit = "" if self.budget is None or self.budget_unit == "tokens" else f" {self.budget_unit}"
        parts.append(f"budget={self.budget if self.budget is not None else 'none'}{unit}")
        parts += [
            f"alpha_h={_alpha_str(self.alpha_h)}",
            f"alpha_l={_alpha_str(self.alpha_l)}",
            f"orig={self.original}",
            *([f"mid={self.mid}"] if self.uses_mid_tier() else []),
            f"quant={self.quantized}",
            f"oq={'on' if self.oq_ratios else 'off'}",
        ]
        if self.gamma:
            parts.append(f"gamma={self.gamma:g}")
        if self.carry:
            parts.append(f"carry={self.carry:g}")
        if self.head_adaptive:
            parts.append("head_adaptive")
        if self.layer_adaptive:
            parts.append("layer_adaptive")
        if self.stagger:
            parts.append("stagger")
        if not self.run_ahead:
            parts.append("runs whole")
        if not self.dense_phase:
            parts.append("tiered from the start")
        if self.rotate:
            parts.append("rotated")
        return " ".join(parts)


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    if not shape:
        return [()]
    if len(shape) == 1:
        return [(i,) for i in range(shape[0])]
    return [(i, j) for i in range(shape[0]) for j in range(shape[1])]


def _alpha_table(f: str, v: Alpha, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    expected = (
        f"a scalar, a list of {num_layers} values (one per layer) or a "
        f"{num_layers} x {num_kv_heads} table (layers x KV heads)"
    )
    if not isinstance(v, list):
        return torch.full((num_layers, num_kv_heads), float(v), dtype=torch.float32)
    if not isinstance(v[0], list):
        if len(v) != num_layers:
            raise ValueError(
                f"TriStateConfig.{f} has {len(v)} per-layer values but the model has "
                f"{num_layers} layers; expected {expected}"
            )
        return torch.tensor(v, dtype=torch.float32)[:, None].expand(num_layers, num_kv_heads).clone()
    shape = (len(v), len(v[0]))
    if shape != (num_layers, num_kv_heads):
        raise ValueError(
            f"TriStateConfig.{f} is a {shape[0]} x {shape[1]} table but the model has "
            f"{num_layers} layers x {num_kv_heads} KV heads; expected {expected}"
        )
    return torch.tensor(v, dtype=torch.float32)


def _alpha_str(v: Alpha) -> str:
    if not isinstance(v, list):
        return repr(v)
    if not isinstance(v[0], list):
        return f"[{len(v)} layers]"
    return f"[{len(v)}x{len(v[0])} table]"


__all__ = [
    "BACKENDS",
    "TIER_FIELDS",
    "INT_FORMATS",
    "SCORE_MODES",
    "SCORE_REDUCTIONS",
    "TierFormat",
    "TriStateConfig",
]
