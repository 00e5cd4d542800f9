"""Method specs: one string names a cache everywhere (``hfkv bench``, the sweeps, lm-eval's ``hfkv_config``).

A benchmark row, a sweep row and an lm-eval run must mean the same cache when they carry the same
label, so they all go through this one parser. Grammar::

    dynamic | static                          transformers DynamicCache / StaticCache
    quanto-int4 | quanto-int2 | hqq-int<n>    transformers QuantizedCache(backend, nbits); ':key=val' passes
                                              axis_key, axis_value, q_group_size, residual_length
    <preset>[@<budget>][:key=val,...]         TriStateConfig.from_preset(preset, budget=..., **overrides)
    <file.yaml>[@<budget>][:key=val,...]      TriStateConfig.from_yaml(file) plus the same overrides

``@none`` sets ``budget=None`` explicitly (``quant@none``: quantize, never evict). Override values are
YAML scalars or flow lists (``alpha_h=0.8``, ``alpha_h=[1,0.5]``, ``alpha_h=.inf``); tier fields take a
dotted key (``quantized.key=fp8``, ``original.group_size=64``).
"""

from __future__ import annotations

import copy
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

import hfkv
from hfkv.cli_args import validated
from hfkv.config import TIER_FIELDS, TierFormat, TriStateConfig, did_you_mean
from hfkv.model_shape import ModelShape
from hfkv.presets import PRESETS
from hfkv.storage.memory import cache_bytes, dense_kv_bytes

DYNAMIC = "dynamic"
STATIC = "static"
QUANTIZED_BACKENDS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
QUANTIZED_OPTIONS = ("axis_key", "axis_value", "q_group_size", "residual_length")

_SPEC = re.compile(r"^(?P<name>[^@:]+)(?:@(?P<budget>[^:]*))?(?::(?P<overrides>.*))?$")
_QUANTIZED = re.compile(r"^(?P<backend>[a-z]+)-int(?P<bits>\d+)$")
_UNSET: Any = object()


def _is_yaml_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml"))


def baseline_names() -> list[str]:
    """Every baseline name the parser accepts (for help texts and error messages)."""
    out = [DYNAMIC, STATIC]
    out += [f"{b}-int{n}" for b, bits in QUANTIZED_BACKENDS.items() for n in bits]
    return out


def unknown_name(name: str) -> str:
    """Why ``name`` names no method: the presets and baselines, and the closest of them."""
    known = [*PRESETS, *baseline_names()]
    return (
        f"{name!r} is not a preset{did_you_mean(name, known)}; presets: {', '.join(PRESETS)}; "
        f"baselines: {', '.join(baseline_names())}; or a .yaml path"
    )


def config_fields() -> list[str]:
    """The TriStateConfig fields an override may name (tier fields also take a dotted key)."""
    return [f.name for f in fields(TriStateConfig)]


def check_override_keys(keys: Iterable[str]) -> None:
    """Refuse override keys that name no TriStateConfig field (``bugdet``) or tier key (``quantized.kye``)."""
    names = config_fields()
    tier_keys = [f.name for f in fields(TierFormat)]
    for key in keys:
        if "." in key:
            tier, sub = key.split(".", 1)
            if tier not in TIER_FIELDS:
                raise ValueError(
                    f"override {key!r}: dotted keys are only for the tier fields {TIER_FIELDS}"
                    f"{did_you_mean(tier, TIER_FIELDS)} (e.g. quantized.key=fp8, original.group_size=64)"
                )
            if sub not in tier_keys:
                raise ValueError(f"override {key!r}: a tier has the keys {tier_keys}{did_you_mean(sub, tier_keys)}")
        elif key not in names:
            raise ValueError(
                f"unknown override {key!r}{did_you_mean(key, names)}; TriStateConfig fields: {', '.join(names)} "
                "(tier fields also as <tier>.key / .value / .group_size)"
            )


def check_spec(spec: str) -> None:
    """Check a spec's shape, name, budget and override keys (ValueError naming the part at fault).

    A baseline or a spec with an explicit ``@budget`` is built in full (its values are checked too); a
    preset or YAML spec without one is only checked this far, because a sweep crosses it with budgets
    and its values may be valid only at those (``hfkv:window=2000`` at ``--budgets 4096``).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method spec {spec!r} must be a non-empty string")
    m = _SPEC.match(spec.strip())
    if not m:
        raise ValueError(f"method spec {spec!r} must look like <name>[@<budget>][:key=val,...]")
    name = m["name"].strip()
    if name in (DYNAMIC, STATIC) or _QUANTIZED.match(name) or m["budget"] is not None:
        parse_method(spec)
        return
    check_override_keys(parse_overrides(m["overrides"]))
    if _is_yaml_path(name):
        if not os.path.isfile(name):
            raise ValueError(f"config file {name!r} not found (a method spec ending in .yaml is a path)")
    elif name not in PRESETS:
        raise ValueError(unknown_name(name))


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets, braces and quotes (override values may be lists)."""
    parts, buf, depth, quote = [], [], 0, None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(buf))
            buf = []
            continue
        buf.append(ch)
    parts.append("".join(buf))
    return [p.strip() for p in parts if p.strip()]


def split_specs(items: str | Iterable[str]) -> list[str]:
    """Method specs from a command-line value: ``"dynamic,hfkv@80:alpha_h=0.8,window=16,evict"``.

    Specs are separated by commas or spaces; a comma-separated piece of the form ``key=val`` belongs
    to the overrides of the spec before it (method names never contain ``=``).
    """
    if isinstance(items, str):
        items = [items]
    specs: list[str] = []
    for item in items:
        for piece in split_top_level(item):
            head = re.split(r"[@:]", piece, maxsplit=1)[0]
            if "=" in head:
                if not specs or ":" not in specs[-1]:
                    raise ValueError(
                        f"method spec piece {piece!r} is an override with no method before it; "
                        "write overrides after a colon: <preset>[@<budget>]:key=val,key=val"
                    )
                specs[-1] += "," + piece
            else:
                specs.append(piece)
    return specs


def check_specs(text: str) -> None:
    """Check one command-line word of method specs (ValueError naming the spec at fault): every spec of it as
    :func:`check_spec` does. A word of overrides only belongs to the spec in the word before it
    (``--methods hfkv:alpha_h=1 window=8``) and is left to the command's own check."""
    pieces = split_top_level(text)
    while pieces and "=" in re.split(r"[@:]", pieces[0], maxsplit=1)[0]:
        pieces.pop(0)  # overrides of the spec in the previous word (--methods hfkv:alpha_h=1 window=8)
    for spec in split_specs(",".join(pieces)):
        check_spec(spec)


#: ``type=`` for method specs on a command line (``dynamic,hfkv@80:alpha_h=0.8,evict``): names, budgets and
#: override keys are checked (did-you-mean on presets and TriStateConfig fields); the text is kept for the
#: command's own check.
method_specs = validated(check_specs, "method specs")


def parse_value(text: str) -> Any:
    """An override value: YAML scalar or flow collection; ``inf`` / ``-inf`` / ``none`` accepted as such."""
    low = text.strip().lower()
    if low in ("inf", "+inf", "infinity"):
        return math.inf
    if low in ("-inf", "-infinity"):
        return -math.inf
    if low in ("none", "null", "~"):
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"override value {text!r} is not a YAML scalar or list: {exc}") from exc
    if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            return float(value)
        except ValueError:
            return value
    return value


def nest_overrides(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"quantized.key": "fp8"}`` -> ``{"quantized": {"key": "fp8"}}`` (tier fields only)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if "." in key:
            tier, sub = key.split(".", 1)
            if tier not in TIER_FIELDS:
                raise ValueError(
                    f"override {key!r}: dotted keys are only for the tier fields {TIER_FIELDS} "
                    "(e.g. quantized.key=fp8, original.group_size=64)"
                )
            if not isinstance(out.get(tier, {}), dict):
                raise ValueError(f"override {key!r} conflicts with a whole-tier override of {tier!r}")
            out.setdefault(tier, {})[sub] = value
        else:
            if key in TIER_FIELDS and isinstance(out.get(key), dict):
                raise ValueError(f"override {key!r} conflicts with dotted overrides of {key!r}")
            out[key] = value
    return out


def parse_overrides(text: str | None) -> dict[str, Any]:
    """``"alpha_h=0.8,quantized.key=fp8"`` -> ``{"alpha_h": 0.8, "quantized.key": "fp8"}`` (flat, ordered)."""
    out: dict[str, Any] = {}
    for piece in split_top_level(text or ""):
        if "=" not in piece:
            raise ValueError(f"override {piece!r} must be key=value")
        key, value = piece.split("=", 1)
        key = key.strip()
        if not key:
            raise ValueError(f"override {piece!r} has an empty key")
        if key in out:
            raise ValueError(f"override key {key!r} is given twice")
        out[key] = parse_value(value)
    return out


def parse_budget(text: str | int | None) -> int | None:
    """``"80"`` -> 80, ``"none"`` -> None; anything else is an error naming the value."""
    if text is None or isinstance(text, int) and not isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("none", "null"):
        return None
    if not re.fullmatch(r"\d+", low):
        raise ValueError(
            f"budget {text!r} must be a positive integer per KV head in the preset's budget unit "
            "(tokens for evict / quant / streaming / arkv / diffkv, full-precision-token equivalents for hfkv, "
            "bytes with budget_unit=bytes) or 'none'"
        )
    return int(low)


def build_config(base: str, budget: Any = _UNSET, overrides: Mapping[str, Any] | None = None) -> TriStateConfig:
    """A TriStateConfig from a preset name or YAML path, a budget (``_UNSET``: the base's own) and overrides.

    Overrides may use dotted tier keys. For YAML files that start from a preset (``preset: arkv``),
    everything goes through ``from_preset`` so preset-specific meanings (streaming's budget) hold.
    """
    over = nest_overrides(dict(overrides or {}))
    if budget is not _UNSET:
        if "budget" in over:
            raise ValueError(f"budget given twice: @{budget} and budget={over['budget']!r}")
        over["budget"] = budget
    if _is_yaml_path(base):
        if not os.path.isfile(base):
            raise FileNotFoundError(f"config file {base!r} not found (a method spec ending in .yaml is a path)")
        with open(base, encoding="utf-8") as fh:
            try:
                raw = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"{base}: not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{base}: must be a mapping of TriStateConfig fields, got {type(raw).__name__}")
        merged = dict(raw)
        for key, value in over.items():
            if key in TIER_FIELDS and isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        try:
            return TriStateConfig.from_dict(merged)
        except ValueError as exc:
            raise ValueError(f"{base}: {exc}") from exc
    if base not in PRESETS:
        raise ValueError(unknown_name(base))
    return TriStateConfig.from_preset(base, **over)


def _format_value(v: Any) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, (list, dict)):
        return yaml.safe_dump(v, default_flow_style=True, width=10**6).strip()
    return str(v)


@dataclass(frozen=True)
class Method:
    """A parsed spec. ``make_cache(model)`` builds a fresh cache; ``config`` is set for hfkv caches."""

    label: str
    kind: str  # "dynamic" | "static" | "quantized" | "tristate"
    name: str  # preset / config name, or the baseline's name
    budget: int | None = None
    config: TriStateConfig | None = None
    options: dict[str, Any] = field(default_factory=dict)  # QuantizedCache kwargs

    @property
    def is_baseline(self) -> bool:
        return self.kind != "tristate"

    def make_cache(self, model, max_cache_len: int | None = None):
        """A fresh cache for ``model``; ``max_cache_len`` is required by ``static`` only."""
        from transformers import DynamicCache  # deferred: keeps hfkv bench --help from importing transformers

        if self.kind == "dynamic":
            return DynamicCache(config=model.config)
        if self.kind == "static":
            from transformers import StaticCache  # deferred: keeps hfkv bench --help from importing transformers

            if not max_cache_len:
                raise ValueError(f"method {self.label!r}: StaticCache needs max_cache_len (prompt + new tokens)")
            return StaticCache(config=model.config, max_cache_len=int(max_cache_len))
        if self.kind == "quantized":
            from transformers import QuantizedCache  # deferred: keeps hfkv bench --help from importing transformers

            return QuantizedCache(config=model.config, **self.options)

        return hfkv.TriStateCache(model, copy.deepcopy(self.config))

    def describe(self) -> dict[str, Any]:
        """What a result row records about the method (JSON-safe)."""
        out: dict[str, Any] = {"method": self.label, "kind": self.kind, "preset": self.name, "budget": self.budget}
        if self.config is not None:  # as a key: the resumable sweeps match stored rows by it (ResultFile)
            out["config"] = _json_safe(self.config.key_dict())
        if self.options:
            out["options"] = dict(self.options)
        return out


def stored_row_as_today(row: dict[str, Any]) -> dict[str, Any]:
    """A sweep row's recorded method config as today's code records the same config (``TriStateConfig.stored_key``):
    ``ResultFile(..., normalize=stored_row_as_today)`` keeps rows written before a config field existed done where
    the method still runs as they did."""
    config = row.get("config")
    if not isinstance(config, dict):
        return row
    return {**row, "config": TriStateConfig.stored_key(config)}


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def parse_method(spec: str, extra_overrides: Mapping[str, Any] | None = None) -> Method:
    """One spec -> :class:`Method`; ``extra_overrides`` (lm-eval ``model_args``) are applied after the spec's."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method spec {spec!r} must be a non-empty string")
    spec = spec.strip()
    m = _SPEC.match(spec)
    if not m:
        raise ValueError(f"method spec {spec!r} must look like <name>[@<budget>][:key=val,...]")
    name = m["name"].strip()
    has_budget = m["budget"] is not None
    flat = parse_overrides(m["overrides"])
    for key, value in (extra_overrides or {}).items():
        if key in flat:
            raise ValueError(f"override {key!r} is given both in the spec {spec!r} and separately")
        flat[key] = value
    suffix = ""
    if flat:
        suffix = ":" + ",".join(f"{k}={_format_value(v)}" for k, v in flat.items())

    if name in (DYNAMIC, STATIC) or _QUANTIZED.match(name):
        if has_budget:
            raise ValueError(f"method {spec!r}: baselines take no @budget (only hfkv presets and YAML configs do)")
        if name in (DYNAMIC, STATIC):
            if flat:
                raise ValueError(f"method {spec!r}: {name} takes no options")
            return Method(label=name, kind=name, name=name)
        q = _QUANTIZED.match(name)
        backend, bits = q["backend"], int(q["bits"])
        if backend not in QUANTIZED_BACKENDS or bits not in QUANTIZED_BACKENDS[backend]:
            raise ValueError(
                f"method {spec!r}: QuantizedCache supports "
                + ", ".join(f"{b}-int{{{','.join(map(str, n))}}}" for b, n in QUANTIZED_BACKENDS.items())
            )
        bad = sorted(set(flat) - set(QUANTIZED_OPTIONS))
        if bad:
            raise ValueError(f"method {spec!r}: unknown QuantizedCache option(s) {bad}; allowed: {QUANTIZED_OPTIONS}")
        for k, v in flat.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"method {spec!r}: {k}={v!r} must be an integer")
        options = {"backend": backend, "nbits": bits, **flat}
        return Method(label=name + suffix, kind="quantized", name=name, options=options)

    budget = parse_budget(m["budget"]) if has_budget else _UNSET
    try:
        cfg = build_config(name, budget, flat)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"method {spec!r}: {exc}") from exc
    if has_budget:
        shown = budget
    elif cfg.name == "streaming" and cfg.budget is None:
        shown = cfg.window + cfg.sink_tokens  # streaming's budget is its total size
    else:
        shown = cfg.budget
    label = name + (f"@{'none' if budget is None else budget}" if has_budget else "") + suffix
    return Method(label=label, kind="tristate", name=cfg.name, budget=shown, config=cfg)


def expand_methods(
    specs: str | Iterable[str], budgets: Iterable[int | str | None] = ()
) -> tuple[list[Method], list[tuple[str, str]]]:
    """Methods for a sweep: every preset/YAML spec without ``@`` is crossed with ``budgets``.

    Returns ``(methods, skipped)``; ``skipped`` holds ``(spec, reason)`` for crossed combinations the
    config rejects (``diffkv@48``: the budget must exceed its 64-token window). A spec written
    explicitly that is invalid raises instead. Duplicate labels are dropped (first kept).
    """
    budgets = [parse_budget(b) for b in budgets]
    methods: list[Method] = []
    skipped: list[tuple[str, str]] = []
    for spec in split_specs(specs):
        m = _SPEC.match(spec.strip())
        name = m["name"].strip() if m else spec
        crossable = m and m["budget"] is None and (name in PRESETS and name != "full" or _is_yaml_path(name))
        if not crossable or not budgets:
            methods.append(parse_method(spec))
            continue
        rest = f":{m['overrides']}" if m["overrides"] is not None else ""
        for b in budgets:
            crossed = f"{name}@{'none' if b is None else b}{rest}"
            try:
                methods.append(parse_method(crossed))
            except ValueError as exc:
                skipped.append((crossed, str(exc)))
    seen: set[str] = set()
    unique = []
    for meth in methods:
        if meth.label not in seen:
            seen.add(meth.label)
            unique.append(meth)
    return unique, skipped


def kv_and_dense_bytes(model, cache, batch: int) -> tuple[int, int]:
    """``(bytes the cache holds, bytes a DynamicCache holds for the same tokens)``, both for the whole batch.

    Held bytes come from the cache's tensors (``hfkv.storage.cache_bytes``); the dense figure is the
    cache's own ``dense_bytes`` for hfkv caches, the held bytes for a DynamicCache, and otherwise
    ``2 * batch * kv_heads * length * head_dim * itemsize`` per layer at the cache's logical length
    (padding included, as a DynamicCache holds it).
    """
    from transformers import DynamicCache  # deferred: keeps hfkv bench --help from importing transformers

    kv = int(cache_bytes(cache))
    if hasattr(cache, "stats") and hasattr(cache, "config"):
        return kv, int(cache.stats().dense_bytes)
    if type(cache) is DynamicCache:
        return kv, kv

    shape = ModelShape.of(model)
    length = int(cache.get_seq_length())
    return kv, dense_kv_bytes(batch, shape.kv_heads, length, shape.head_dim, shape.dtype) * shape.layers
