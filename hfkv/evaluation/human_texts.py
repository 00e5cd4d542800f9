"""Human-written documents for fidelity, read from files every Python installation ships.

Text a model wrote itself is easier for that model than text people wrote: its continuation is
already the model's most likely one, so a cache that drops what the model would not have looked at
still scores well. Fidelity must also be judged on human-written text. With no dataset download
allowed, the sources are the ones every CPython carries: the language reference as ``pydoc``
serves it (``pydoc_data.topics``: prose full of names and cross-references) and standard-library
modules (code and comments written by people, with identifiers defined early and used later).

Nothing is copied into the repository: a document is a source name; its tokens are cut at run time
with the model's tokenizer, and the source's SHA-256 is recorded with every result row, so a run on
another Python (whose text differs) is told apart instead of silently compared.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from pydoc_data.topics import topics
from typing import Any

from hfkv.evaluation.texts import CONTINUATION_TOKENS, PROMPT_TOKENS

# (kind, name): reference-manual topics first (prose), then modules (code).
SOURCES: tuple[tuple[str, str], ...] = (
    ("pydoc", "compound"),
    ("module", "argparse"),
    ("pydoc", "specialnames"),
    ("module", "dataclasses"),
    ("pydoc", "types"),
    ("module", "functools"),
    ("pydoc", "formatstrings"),
    ("pydoc", "execmodel"),
)
TEXTS_NAME = "human"  # the ``--texts`` value of eval/sweep_fidelity.py that selects these documents


def source_text(kind: str, name: str) -> str:
    """The full text of one source as this Python installation has it."""
    if kind == "pydoc":
        if name not in topics:
            raise ValueError(f"pydoc topic {name!r} not in this Python's pydoc_data.topics")
        return topics[name]
    if kind == "module":
        return inspect.getsource(importlib.import_module(name))
    raise ValueError(f"source kind {kind!r}: expected 'pydoc' or 'module'")


def human_documents(
    tok,
    n_docs: int,
    prompt_tokens: int = PROMPT_TOKENS,
    continuation_tokens: int = CONTINUATION_TOKENS,
) -> list[dict[str, Any]]:
    """The first ``n_docs`` sources as fidelity documents: ``prompt_tokens + continuation_tokens`` ids each.

    Same fields as hfkv.evaluation.texts documents (``id``, ``ids``, ``prompt_len``, ``n_tokens``) plus
    ``source`` and ``sha256`` of the source text.
    """
    if not 1 <= n_docs <= len(SOURCES):
        raise ValueError(f"n_docs={n_docs}: {len(SOURCES)} human-written sources exist (1..{len(SOURCES)})")
    total = prompt_tokens + continuation_tokens
    docs = []
    for i, (kind, name) in enumerate(SOURCES[:n_docs]):
        text = source_text(kind, name)
        ids = [int(t) for t in tok(text)["input_ids"]]
        if len(ids) < total:
            raise ValueError(f"source {kind}:{name} has {len(ids)} tokens with this tokenizer, fewer than {total}")
        docs.append(
            {
                "id": i,
                "source": f"{kind}:{name}",
                "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                "ids": ids[:total],
                "prompt_len": prompt_tokens,
                "n_tokens": total,
            }
        )
    return docs
