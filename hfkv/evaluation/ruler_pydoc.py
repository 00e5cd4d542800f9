"""RULER's essay-haystack tasks, their haystack built at run time from human-written text on this machine.

Five of RULER's needle tasks (``niah_single_2``, ``niah_single_3``, ``niah_multikey_1``, ``niah_multivalue``,
``niah_multiquery``) hide their needles in Paul Graham's essays, which lm-eval downloads. A needle in prose is
harder than one in a repeated sentence (``niah_single_1``): the text around it is varied, so no cache can keep the
needle just because it is the odd one out. With no download allowed, the essays are replaced by the prose of the
Python language reference as ``pydoc`` serves it (``pydoc_data.topics``, written by people and shipped with every
CPython): its unindented paragraphs, without grammar rules, headings or code, whitespace-normalised and split into
words as RULER splits the essays. Everything else is RULER's, called from lm-eval's own code: the template,
needles, insertion depths, the haystack sized to each length with the model's tokenizer, and the scoring.
RULER places needles between sentences found by NLTK's Punkt model for English (``punkt_tab``), a download; Punkt
is unsupervised, so here it is trained on the haystack itself (NLTK's ``PunktSentenceTokenizer(text)``), which
needs no data and gives every machine the same sentences.

Nothing is copied into the repository: the tasks are lm-eval task files named ``<ruler task>_pydoc`` in
``eval/tasks/ruler_pydoc/`` whose datasets come from the functions here, and every document carries the SHA-256
of the haystack text, so results from a Python whose reference differs are told apart instead of compared.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
from collections.abc import Callable, Iterator
from typing import Any

HAYSTACK_SOURCE = "pydoc_data.topics"
SUFFIX = "_pydoc"
# RULER's settings of each task (lm_eval/tasks/ruler/niah_utils.py) beyond the shared ones below.
TASKS: dict[str, dict[str, Any]] = {
    "niah_single_2": {"type_needle_v": "numbers"},
    "niah_single_3": {"type_needle_v": "uuids"},
    "niah_multikey_1": {"type_needle_v": "numbers", "num_needle_k": 4},
    "niah_multivalue": {"type_needle_v": "numbers", "num_needle_v": 4},
    "niah_multiquery": {"type_needle_v": "numbers", "num_needle_q": 4},
}
TASK_NAMES: tuple[str, ...] = tuple(name + SUFFIX for name in TASKS)
_HEADING_RULE = set("=*-^~")

__all__ = ["HAYSTACK_SOURCE", "TASK_NAMES", "TASKS", "haystack_text", "prose_paragraphs", "task_dataset"]


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of a reference topic that are running prose: unindented (code and lists are indented),
    not headings, no grammar rule (``::=``), ending a sentence and at least eight words long."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.split("\n")
        if any(line.startswith((" ", "\t")) for line in lines):
            continue
        if len(lines) > 1 and set(lines[-1].strip()) <= _HEADING_RULE:
            continue
        joined = " ".join(line.strip() for line in lines)
        if "::=" in joined or not joined.endswith(".") or len(joined.split()) < 8:
            continue
        out.append(joined)
    return out


@functools.cache
def haystack_text() -> tuple[str, str]:
    """``(text, sha256)``: the prose of every reference topic in pydoc's order, whitespace-normalised."""
    from pydoc_data.topics import topics

    text = " ".join(p for body in topics.values() for p in prose_paragraphs(body))
    text = re.sub(r"\s+", " ", text).strip()
    return text, hashlib.sha256(text.encode("utf-8")).hexdigest()


@functools.cache
def sentence_splitter() -> Callable[[str], list[str]]:
    """Punkt trained on the haystack (unsupervised: it learns the abbreviations that do not end a sentence)."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return functools.lru_cache(maxsize=64)(PunktSentenceTokenizer(haystack_text()[0]).tokenize)


@contextlib.contextmanager
def _sentences_from_haystack_punkt() -> Iterator[None]:
    """lm-eval's RULER splits sentences with the downloaded ``punkt_tab`` through ``cached_sent_tokenize``: use
    :func:`sentence_splitter` there while these tasks build their documents, and restore it after."""
    from lm_eval.tasks.ruler import prepare_niah

    saved = prepare_niah.cached_sent_tokenize
    prepare_niah.cached_sent_tokenize = sentence_splitter()
    try:
        yield
    finally:
        prepare_niah.cached_sent_tokenize = saved


def task_dataset(task: str, **kwargs: Any) -> dict[str, Any]:
    """The test split of ``<task>_pydoc`` as lm-eval's ``custom_dataset`` hook builds it (``max_seq_lengths`` and
    the tokenizer arrive in ``kwargs`` from ``--metadata`` / ``--model_args``), one entry per length."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: the pydoc-haystack tasks are {sorted(TASKS)}")
    # deferred: lm-eval's RULER modules need the [eval] extra (nltk, wonderwords)
    from lm_eval.tasks.ruler.common_utils import DEFAULT_SEQ_LENGTHS, get_tokenizer, resolve_tokenizer_name
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE, download_dataset
    from lm_eval.tasks.ruler.prepare_niah import generate_samples

    lengths = kwargs.pop("max_seq_lengths", DEFAULT_SEQ_LENGTHS)
    tokenizer = get_tokenizer(resolve_tokenizer_name(kwargs))
    text, digest = haystack_text()
    words = text.split(" ")

    def with_source(samples: list[dict]) -> list[dict]:
        return [{**s, "haystack": HAYSTACK_SOURCE, "haystack_sha256": digest} for s in samples]

    spec = {"type_haystack": "essay", "type_needle_k": "words", "template": TEMPLATE, "num_samples": 500}
    with _sentences_from_haystack_punkt():
        per_length = [
            with_source(generate_samples(words, max_seq_length=int(n), TOKENIZER=tokenizer, **spec, **TASKS[task]))
            for n in lengths
        ]
    return download_dataset(per_length)
