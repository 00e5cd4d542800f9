"""``did_you_mean``: the one "did you mean" hint of every hfkv error message.

A module of its own, importing nothing heavy, because both :mod:`hfkv.config` (which imports torch) and
:mod:`hfkv.cli_args` (which must not: a mistyped ``hfkv bnech`` is answered without loading torch) use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` (difflib), or ``""`` when none is close, so a
    message can append it unconditionally."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
