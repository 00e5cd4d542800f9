"""Final answers of MATH-style solutions: the last ``\\boxed{}`` and math-aware equivalence.

Extraction is ours (it has to mirror how MATH marks answers: the *last* box, nested braces,
escaped braces); deciding that ``0.5`` equals ``\\frac12`` or ``5\\text{ cm}`` equals ``5`` is
math-verify's job, a maintained library built for exactly this.
"""

from __future__ import annotations

import threading

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``); None if there is none
    or it is unterminated. Braces escaped as ``\\{`` ``\\}`` do not count as grouping."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if i < len(text) and text[i] == " ":  # "\boxed 5": the argument runs to the next space or $
        rest = text[i + 1 :]
        arg = rest.split("$", 1)[0].split()[0] if rest.strip() else ""
        return arg or None
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
        j += 1
    return None


def _parse(answer: str):
    from math_verify import parse  # optional: math-verify, the [calibrate] extra

    timeout = 5 if threading.current_thread() is threading.main_thread() else None  # signal.alarm: main only
    return parse(f"${answer}$", parsing_timeout=timeout)


def answers_match(predicted: str | None, gold: str) -> bool:
    """Whether a predicted final answer equals the gold one mathematically (math-verify)."""
    if predicted is None or not predicted.strip():
        return False
    from math_verify import verify  # optional: math-verify, the [calibrate] extra

    g, p = _parse(gold), _parse(predicted)
    if not g or not p:
        return predicted.strip() == gold.strip()
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return bool(verify(g, p, timeout_seconds=timeout))


def solution_answer(solution: str) -> str:
    """The gold answer of a MATH solution (its last box); a row without one cannot be scored."""
    ans = last_boxed(solution)
    if ans is None:
        raise ValueError(f"solution has no \\boxed{{}} answer: {solution[-120:]!r}")
    return ans
