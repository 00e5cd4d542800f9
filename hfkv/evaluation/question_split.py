"""Where a long-context prompt's question starts, so its context can be compressed before the question is read.

Why: with the question in the prompt, a cache scores the context with the question's own queries in view; a
document compressed once and asked many questions has no such help (docs/generate.md, "Compress once, ask many").
lm-eval's RULER prompts put the context first and the question after it, each template with a line of its own that
opens the question (``QUESTION_MARKERS``); the prompt is split at the last such line, in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

# The line that opens the question in each of lm-eval's RULER templates (niah_*: "What is" where one needle is
# asked for, "What are all" otherwise; ruler_vt, ruler_cwe, ruler_fwe, ruler_qa_*): the split is at the last one.
QUESTION_MARKERS: tuple[str, ...] = (
    "\nWhat is the special magic",
    "\nWhat are all the special magic",
    "\nQuestion:",
)


def question_start(tokenizer, ids: Sequence[int], markers: Sequence[str] = QUESTION_MARKERS) -> int:
    """The number of tokens of ``ids`` before its question: the longest prefix whose text ends at or before the
    last marker (a token that straddles it goes with the question). Raises ValueError where no marker is found."""
    text = tokenizer.decode(list(ids))
    at = max(text.rfind(m) for m in markers)
    if at <= 0:
        raise ValueError(
            f"question_agnostic: no question found in the prompt (looked for the last of {list(markers)!r}); it "
            "splits prompts that put the context first and the question after it, as RULER's do"
        )
    head = text[:at]
    lo, hi = 0, len(ids)  # the largest n whose decoded prefix is a prefix of the text before the question
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if head.startswith(tokenizer.decode(list(ids[:mid]))):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise ValueError("question_agnostic: the prompt has no context before its question")
    return lo
